"""The measured side of the budget: figures read off the run itself, never estimated.

memory.py        the bytes this rank holds right now, read from its tensors (traffic: comm/ledger.py)
option_error.py  the error each fewer-bytes option brings, per unit: gathered weights, sampled reductions
tiers.py         offload: the bytes in each tier (device, host, disk) and what moves between them per step
activations.py   what autograd saves for backward in a training step, by unit
step_peak.py     one step's peak of tensor memory by phase: the allocator (GPU), or live state + allocations (CPU)
local_link.py    ``--interconnect local``: this machine's link, timed by comm/link_probe.py
step_time.py     where each rank's time goes per step (forward, backward, optimizer, data, communication exposed,
                 waiting for other ranks, hidden), by unit: the step clock (comm/step_clock.py), exchanged
stragglers.py    a rank persistently slower than the others, named with where the others wait for it
kernel_overlap.py  on a GPU: each collective kind's kernel time under compute kernels, from a profiler trace
"""
