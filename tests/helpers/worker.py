"""One rank of a ``tests.helpers.launch.run_ranks`` run: ``python -m tests.helpers.worker module:function OUT_DIR``."""

from __future__ import annotations

import importlib
import json
import os
import sys
import warnings
from pathlib import Path

import torch


def main() -> None:
    target, out = sys.argv[1], Path(sys.argv[2])
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    module_name, _, fn_name = target.partition(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    result = fn(**json.loads((out / "kwargs.json").read_text()))
    torch.save(result, out / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
