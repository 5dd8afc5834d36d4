"""One rank of a ``tests.helpers.launch.run_ranks`` run.

``python -m tests.helpers.worker module:function OUT_DIR`` runs one job and exits (``run_one``, also what a rank
forked by tests/helpers/zygote.py runs);
``python -m tests.helpers.worker --serve DIR`` is one rank of a kept world (tests/helpers/worlds.py): it runs
``DIR/job{n}.json`` for n = 0, 1, ... as they appear, each with that job's port and the environment and
working directory restored afterwards, and leaves when its parent (the test session) is gone.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch


def call(target: str, kwargs: dict[str, Any]) -> Any:
    module_name, _, fn_name = target.partition(":")
    return getattr(importlib.import_module(module_name), fn_name)(**kwargs)


def save(result: Any, path: Path) -> None:
    torch.save(result, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)  # the launcher never reads half a file


def serve(directory: Path) -> None:
    parent, n = os.getppid(), 0
    while True:
        job = directory / f"job{n}.json"
        while not job.exists():
            if os.getppid() != parent:
                return
            time.sleep(0.01)
        spec = json.loads(job.read_text())
        environ, cwd = dict(os.environ), os.getcwd()
        os.environ["MASTER_PORT"] = str(spec["port"])
        print(f"==== job {n}: {spec['target']}", flush=True)
        result = call(spec["target"], spec["kwargs"])
        save(result, directory / f"{n}.rank{os.environ['RANK']}.pt")
        del result
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        gc.collect()
        gc.freeze()  # what is still alive (modules the job imported) stays: later collections skip it
        n += 1


def prepare() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import lightning_shardlab  # noqa: F401  (what every job imports)

    # the imports' objects live as long as the process: a full collection (the strategy's teardown runs one per
    # fit) would walk them all each time, a fifth of a second apiece
    gc.freeze()


def run_one(target: str, out: Path) -> None:
    """One job in this process (a fresh rank): its return value into ``out``."""
    prepare()
    save(call(target, json.loads((out / "kwargs.json").read_text())), out / f"rank{os.environ['RANK']}.pt")


def main(argv: list[str] | None = None) -> None:
    """``argv``: ``module:function OUT_DIR`` or ``--serve DIR`` (the command line's, when None)."""
    args = sys.argv[1:] if argv is None else argv
    if os.environ.get("SHARDLAB_NETNS"):  # a rank of an emulated node: into its namespace before any socket
        from benchmarks.slow_link import enter_from_env

        enter_from_env()
    if args[0] == "--serve":
        prepare()
        serve(Path(args[1]))
        return
    run_one(args[0], Path(args[1]))


if __name__ == "__main__":
    main()
