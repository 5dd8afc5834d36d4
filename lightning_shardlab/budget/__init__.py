"""The budget: what each rank holds and what moves between ranks, predicted from the layout and measured.

predict.py       the ZeRO table applied to the real layout (or a parameter count): bytes and traffic per rank
measure.py       the bytes this rank holds right now, read from its tensors (traffic: comm/ledger.py)
tiers.py         offload: the bytes in each tier (device, host, disk) and what moves between them per step
whole_tensor.py  whole-tensor optimizers (Muon, Adafactor): owned state and the owners' exchanges, predicted
activations.py   what autograd saves for backward in a training step, by unit, measured
activation_prediction.py  the same for the run, predicted: its first batch traced through a meta copy
activation_trace.py  the same, predicted: one micro-batch traced under fake tensors, with and without checkpointing
report.py        one rank's figures at the end of a run, measured beside predicted
tables.py        rank 0's tables of every rank's report
bars.py          every rank's memory as a stacked bar, activations on top (shardlab_budget.png)
step_peak.py     one step's peak of tensor memory by phase: the allocator (GPU), or live state + allocations (CPU)
step_timeline.py the step's live bytes moment by moment: a fake forward and backward on the engine's own schedule
optimizer_peak.py  the optimizer step's temporaries: the run's own optimizers stepped on fakes of its masters
step_peak_prediction.py  the same peak predicted for the run: its layout's state + its first batch's timeline
callback.py      ``ShardLabBudget``: measures each step (Trainer hooks, or a Fabric loop) and reports at the end
plan.py          the same prediction for a run that has not happened: from a parameter count or a model's layout
plan_whole.py    the plan of a whole-tensor optimizer: owners' state per rank (Muon beside AdamW), exchanges
fits.py          the step's peak (state + the timeline's busiest moment): does it fit, and the cheapest change if not
plan_command.py  ``shardlab plan``: its inputs (an import path, a LightningCLI YAML), its tables, its options
local_link.py    ``--interconnect local``: this machine's link, timed by comm/link_probe.py
"""
