"""What Lightning's loop costs a step beside the model's own work: the part of a step the time model leaves out.

    python -m benchmarks.lightning_loop            # prints the table

One CPU process, one thread, no strategy of ours: a 4 -> 4 Linear trained with SGD by ``Trainer.fit`` (no logger, no
checkpoint, no progress bar), a step timed from ``on_train_batch_start`` to ``on_train_batch_end``, against the same
forward, backward, ``step`` and ``zero_grad`` called in a plain loop. The model is so small that the difference is
the loop: the closure, the hooks of the callbacks, ``training_step``'s call, and each ``self.log`` of a tensor.
Each variant runs ``--repeats`` times in fresh trainers, interleaved; a sample is the median of the steps after
``WARM_UP``; the table gives the median over repeats.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

import torch

from benchmarks.ranks import timing_trainer

WARM_UP = 20  # steps left out of each sample
LOGS = (0, 1, 4)  # self.log calls per training_step


def _lightning(logs: int, steps: int) -> tuple[float, float]:
    """(median seconds of a Lightning step with ``logs`` self.log calls, of the same work in a plain loop)."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.linear, self.times, self.began = torch.nn.Linear(4, 4), [], 0.0

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.linear(batch).sum()
            for i in range(logs):
                self.log(f"loss_{i}", loss)
            return loss

        def on_train_batch_start(self, *args: Any) -> None:
            self.began = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.times.append(time.perf_counter() - self.began)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    module = Module()
    data = torch.utils.data.DataLoader(torch.randn(2 * steps, 4), batch_size=2)
    timing_trainer(accelerator="cpu", devices=1, max_steps=steps).fit(module, data)
    x, optimizer = torch.randn(2, 4), torch.optim.SGD(module.parameters(), lr=0.01)
    plain = []
    for _ in range(steps):
        began = time.perf_counter()
        module.linear(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        plain.append(time.perf_counter() - began)
    return statistics.median(module.times[WARM_UP:]), statistics.median(plain[WARM_UP:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    samples: dict[int, list[tuple[float, float]]] = {n: [] for n in LOGS}
    for _ in range(args.repeats):
        for n in LOGS:
            samples[n].append(_lightning(n, args.steps))
    print("| self.log calls | Lightning step ms | the same work, plain ms | the loop ms |")
    print("| --- | --- | --- | --- |")
    for n, pairs in samples.items():
        step, plain = (statistics.median(s[i] for s in pairs) * 1e3 for i in (0, 1))
        print(f"| {n} | {step:.3f} | {plain:.3f} | {step - plain:.3f} |")


if __name__ == "__main__":
    main()
