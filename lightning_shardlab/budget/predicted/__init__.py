"""The predicted side of the budget: the same figures derived from the layout, the plan and the first batch.

zero_table.py    the ZeRO table applied to the real layout (or a parameter count): bytes and traffic per rank
whole_tensor.py  whole-tensor optimizers (Muon, Adafactor): owned state and the owners' exchanges, run and planned
first_batch.py   the run's first batch traced through a meta copy: its activations, work and step's peak predicted
fake_step.py     the user's step run under fake tensors: its batch, its loss, fake parameters, the units' hooks
forward_trace.py one micro-batch's forward traced once: what it saves (with and without checkpointing) and does
step_stand_ins.py  what a traced training_step reads besides its batch (trainer, logs, metrics, .item()): stood in for
engine_schedule.py  the engine's decisions on stand-in units (gathered, in flight, waited): the one schedule of both
step_timeline.py the step's live bytes moment by moment: a fake forward and backward on the engine's own schedule
optimizer_peak.py  the optimizer step's temporaries: the run's own optimizers stepped on fakes of its masters
plan.py          the prediction for a run that has not happened: from a parameter count or a model's layout
option_savings.py  the fewer-bytes options planned: each one's bytes per step and the link time it saves
compute_trace.py the work of ops under fake tensors: FLOPs, memory-bound bytes, kernels; the optimizer's step's
compute_rate.py  how fast a device works: given (a named device, --flops) or measured here (short probes, cached)
engine_cost.py   the engine's own work per unit (its hooks), measured on a world of one beside the same blocks unsharded
clocks.py        one compute stream and first-in-first-out links: the clocks a step is played on
step_time.py     seconds per optimizer step: the engine's schedule played on one compute stream and its links
run_time.py      the time predicted for a run: its layout, mesh and first batch (what ShardLabBudget calls)
setting.py       a model planned under changes to its options: its plan, its step's peak and its time, each the same way
changes.py       the cheapest single change: one that fits the step in device memory, or hides its communication
"""
