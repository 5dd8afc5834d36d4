"""The ``shardlab`` command run as a user runs it, in this process: ``cli.main(argv)``, its exit status and output
(``shardlab_on_rank``: one rank of a multi-rank ``shardlab fit``).

``every_tool`` takes one checkpoint of any kind the project writes (a Trainer's or a Fabric's, sharded or
full, with or without optimizer state) through ``inspect``, ``consolidate`` (sharded ones; then ``inspect``
of the file it wrote) and ``export``, and returns what each printed and wrote, for the test to compare.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from lightning_shardlab import cli
from lightning_shardlab.checkpoint.format import shards_of


def shardlab(*argv: str) -> tuple[int, str]:
    """``shardlab ARGV``: the exit status (a message to ``sys.exit`` is status 1, as the shell sees it) and
    everything printed."""
    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            cli.main(list(argv))
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
            if isinstance(exit.code, str):  # what the shell would have printed
                out.write(exit.code)
    return code, out.getvalue()


def shardlab_on_rank(argv: list[str], cwd: str) -> tuple[int, str]:
    """One rank of ``shardlab ARGV`` run in ``cwd``, launched as torchrun launches it (a ``run_ranks`` job: the
    ranks' environment names the world, so Lightning's launcher starts no process); 160 columns for rich."""
    os.chdir(cwd)
    os.environ["COLUMNS"] = "160"
    return shardlab(*argv)


def every_tool(checkpoint: Path, work: Path) -> dict[str, Any]:
    """Each tool on ``checkpoint``: exit status and output per tool; the consolidated file's tensors (sharded
    input) and the exported safetensors' tensors."""
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"inspect": shardlab("inspect", str(checkpoint), "--verify")}
    full = checkpoint
    if checkpoint.is_dir() or shards_of(checkpoint) is not None:
        full = work / "consolidated.ckpt"
        out["consolidate"] = shardlab("consolidate", str(checkpoint), str(full), "--trust-pickle")
        out["inspect_consolidated"] = shardlab("inspect", str(full))
        out["consolidated"] = torch.load(full, weights_only=False) if full.exists() else {}
    out["export"] = shardlab("export", str(checkpoint), str(work / "hf"), "--trust-pickle")
    exported = work / "hf" / "model.safetensors"
    out["exported"] = load_file(str(exported)) if exported.exists() else {}
    return out
