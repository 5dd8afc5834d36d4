"""Launchers that are not ours: Lightning's own (the single-box proxy) and torchrun across two nodes (hybrid
sharding: each node shards the model, ``shard_group_size="node"``, the nodes are replicas).

Both run ``python -m tests.test_launchers MODE OUT``: Lightning's launcher re-runs that command for
its other ranks, torchrun starts it on every rank; rank 0 writes its parity report to OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.helpers.launch import free_port, run_commands


def main(mode: str, out: str) -> None:
    from tests.test_trainer import gpt_parity

    torch.set_num_threads(1)
    if mode == "proxy":  # a world of 4 ranks on one CPU device
        report = gpt_parity(4, steps=6, devices=1, ranks_per_device=4)
    elif mode == "proxy_cuda":  # 2 ranks sharing one GPU: their collectives go through gloo
        report = gpt_parity(2, steps=6, accelerator="cuda", devices=1, ranks_per_device=2)
    else:  # two torchrun nodes of 2 ranks, each node one shard group
        report = gpt_parity(4, steps=6, devices=2, num_nodes=2, shard_group_size="node")
    if report:
        Path(out).write_text(json.dumps(report))
    # leave together: a rank still tearing down when rank 0's store goes away would abort
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_proxy_world_of_four_on_one_device_passes_stage3_parity(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    run_commands(
        [[sys.executable, "-m", "tests.test_launchers", "proxy", str(out)]],
        timeout=300,
        env={"MASTER_PORT": str(free_port())},
    )
    report = json.loads(out.read_text())
    assert report["world_size"] == 4 and len(report["losses"]) == 6


def test_two_torchrun_nodes_shard_within_the_node_and_pass_stage3_parity(tmp_path: Path) -> None:
    out, port = tmp_path / "report.json", free_port()
    node = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
    ]
    run_commands(
        [node + ["--node_rank", str(k), "-m", "tests.test_launchers", "nodes", str(out)] for k in (0, 1)], timeout=300
    )
    report = json.loads(out.read_text())
    assert report["world_size"] == 4 and len(report["losses"]) == 6
    assert report["shard_group"] == [0, 1] and report["replicas"] == 2  # rank 0's node


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
