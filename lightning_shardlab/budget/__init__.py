"""The budget: what each rank holds and what moves between ranks, predicted from the layout and measured.

predict.py   the ZeRO table applied to the real layout (or a parameter count): bytes and traffic per rank
measure.py   the bytes this rank holds right now, read from its tensors (traffic: comm/ledger.py)
callback.py  ``ShardLabBudget``: both, side by side, at the end of fit
plan.py      ``shardlab plan``: the same prediction for a run that has not happened
"""
