"""The budget: what each rank holds, what moves between ranks and where the time goes, predicted and measured.

The ledger has two sides, and the folders show them: ``measured/`` reads the run (its tensors, its collectives,
its clocks), ``predicted/`` derives the same figures from the layout and the plan, before or beside the run.
What shows them sits here:

callback.py   ``ShardLabBudget``: measures each step (Trainer hooks, or a Fabric loop) and reports at the end
report.py     one rank's figures at the end of a run, measured beside predicted
tables.py     rank 0's tables of every rank's report
bars.py       every rank's memory as a stacked bar, activations on top (shardlab_budget.png)
timeline_picture.py  one steady step of every rank on one clock, compute and comm (shardlab_timeline.png, .trace.json)
"""
