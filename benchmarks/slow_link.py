"""A slow link you can run: ranks in network namespaces joined by veth pairs shaped with ``tc``, on one machine.

    python -m benchmarks.slow_link --nodes 2 --link 1gbit                 # set up, probe, tear down
    python -m benchmarks.slow_link --nodes 2 --link 100mbit --delay 0.2ms

Every emulated node is a network namespace with one interface, ``shl0``, whose other end sits on a bridge in a
hub namespace (a switch). Both ends of each pair are shaped with ``tbf`` at the link's rate (the node's egress:
what it sends; the hub's egress: what it receives), so a node's NIC is full duplex at that rate, and with a
``--delay`` the node's egress first passes a ``netem`` delay. Ranks of one node share its namespace and talk over
its own address, which the kernel routes through loopback: fast, as two GPUs of one node are to each other.
gloo binds to ``shl0`` (``GLOO_SOCKET_IFNAME``), rank 0 of node 0 holds the rendezvous store on that node's
address, and every other rank reaches it across the link.

A rank joins its node's namespace before it opens a socket (``enter``: ``setns(2)``, so a process forked from a
preloaded server joins in a millisecond), so the same helper serves the benchmarks (spawned ranks,
``run_ranks``) and the tests (ranks forked by tests/helpers/zygote.py, told by ``SHARDLAB_NETNS``).

Cleanup is not optional: the namespaces are deleted (and with them every veth and qdisc in them) when the
``with`` block ends, however it ends, at interpreter exit, on SIGTERM, and namespaces whose creating process is
gone (a ``kill -9``) are swept by the next ``EmulatedLink``. Where namespaces cannot be made (not root, no
``ip``/``tc``, a container without CAP_NET_ADMIN) ``unavailable()`` says why, and the tests skip with that reason.
The kernel here has no ``netem`` qdisc: a ``--delay`` is refused with that named, before anything is made.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable
from functools import cache
from typing import Any

PREFIX = "shl"  # every namespace this helper makes: shl<pid>n<i> (nodes), shl<pid>hub (the switch)
IFNAME = "shl0"  # the node's end of its link, in every node namespace (names are per namespace)
SUBNET = "10.213.0"  # node i is SUBNET.(i+1)/24
CLONE_NEWNET = 0x40000000
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def rate_bits(rate: str) -> float:
    """``"1gbit"`` -> 1e9: a ``tc`` rate in bits per second. Raises ``ValueError`` naming the option."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?bit)", rate.strip().lower())
    if not match:
        raise ValueError(f"`--link {rate!r}` is invalid. HINT: a tc rate such as 100mbit, 1gbit or 10gbit.")
    return float(match.group(1)) * UNITS[match.group(2)]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _tc(ns: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True)


def _existing() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@cache
def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can): checked once, by making one."""
    if os.geteuid() != 0:
        return "emulated links need root (ip netns, veth, tc); this process is not root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"emulated links need {' and '.join(missing)} (iproute2), not found on PATH"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as error:
        return f"network namespaces are not permitted here (`ip netns add` said: {error.stderr.strip()})"
    _ip("netns", "del", probe)
    return None


def netem_missing() -> str | None:
    """Why a delay cannot be added (the kernel's ``netem`` qdisc absent), or None."""
    ns = f"{PREFIX}{os.getpid()}netem"
    _ip("netns", "add", ns)
    try:
        said = _tc(ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
        return None if said.returncode == 0 else f"this kernel has no netem qdisc (tc said: {said.stderr.strip()})"
    finally:
        _ip("netns", "del", ns)


def sweep_stale() -> list[str]:
    """Delete the namespaces of emulated links whose creating process is gone; returns their names."""
    swept = []
    for name in _existing():
        match = re.fullmatch(rf"{PREFIX}(\d+)(?:n\d+|hub|probe|netem)", name)
        if match and not _alive(int(match.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            swept.append(name)
    return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def enter(namespace: str) -> None:
    """Move this thread (and every thread it starts after) into ``namespace``: before any socket is opened."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {namespace!r} failed")
    finally:
        os.close(fd)


class EmulatedLink:
    """``nodes`` network namespaces on a switch, each joined to it by a link of ``rate`` (a tc rate, e.g.
    ``"1gbit"``) and one-way ``delay`` (a tc time, e.g. ``"0.2ms"``; needs netem). A context manager: made on
    entry, deleted on exit, at interpreter exit and on SIGTERM, whichever comes first."""

    def __init__(self, nodes: int = 2, rate: str = "1gbit", delay: str | None = None) -> None:
        if nodes < 2:
            raise ValueError(f"`--nodes {nodes}` is invalid. HINT: at least 2 nodes make a link between them.")
        self.nodes, self.rate, self.delay = nodes, rate, delay
        self.bits = rate_bits(rate)
        self.tag = f"{PREFIX}{os.getpid()}"
        self.names = [f"{self.tag}n{i}" for i in range(nodes)]
        self.hub = f"{self.tag}hub"
        self.made: list[str] = []

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def __enter__(self) -> EmulatedLink:
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(f"cannot emulate a link: {reason}. HINT: run as root where `ip netns add` works.")
        if self.delay and (reason := netem_missing()):
            raise RuntimeError(f"`--delay {self.delay}` needs the netem qdisc: {reason}. HINT: --delay 0 (none).")
        sweep_stale()
        atexit.register(self.close)
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.close()
        raise SystemExit(128 + signum)

    def _namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self.made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _make(self) -> None:
        self._namespace(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            self._namespace(name)
            port = f"h{i}"
            _ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", name)
            _ip("-n", self.hub, "link", "set", port, "master", "br0")
            _ip("-n", self.hub, "link", "set", port, "up")
            _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME)
            _ip("-n", name, "link", "set", IFNAME, "up")
            self._shape(name, IFNAME, self.delay)  # what the node sends
            self._shape(self.hub, port, None)  # what it receives

    def _shape(self, ns: str, dev: str, delay: str | None) -> None:
        """A token bucket at the link's rate (a burst of 1 ms of it, at least 64 KiB), behind a netem delay."""
        burst = max(int(self.bits / 8 / 1000), 64 << 10)
        tbf = ["tbf", "rate", self.rate, "burst", str(burst), "latency", "100ms"]
        steps = [["root", "handle", "1:", "netem", "delay", delay], ["parent", "1:1", "handle", "10:", *tbf]]
        for step in steps if delay else [["root", "handle", "10:", *tbf]]:
            said = _tc(ns, "qdisc", "add", "dev", dev, *step)
            if said.returncode != 0:
                raise RuntimeError(f"tc refused {' '.join(step)} on {dev}: {said.stderr.strip()}")

    def close(self) -> None:
        """Delete every namespace this link made (their veths and qdiscs go with them). Safe to call twice."""
        while self.made:
            subprocess.run(["ip", "netns", "del", self.made.pop()], capture_output=True)
        atexit.unregister(self.close)
        previous = getattr(self, "_previous", None)
        if previous is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, previous)

    def rank_env(self, rank: int, world_size: int, ranks_per_node: int) -> dict[str, str]:
        """What rank ``rank`` of ``world_size`` (``ranks_per_node`` on each node, in order) is told: its node's
        namespace (``SHARDLAB_NETNS``), the interface gloo binds to, and torchrun's variables."""
        node = rank // ranks_per_node
        return {
            "SHARDLAB_NETNS": self.names[node],
            "GLOO_SOCKET_IFNAME": IFNAME,
            "MASTER_ADDR": self.address(0),
            "WORLD_SIZE": str(world_size),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % ranks_per_node),
            "NODE_RANK": str(node),
        }


def enter_from_env() -> None:
    """In a rank: join the namespace ``SHARDLAB_NETNS`` names, if any (before torch opens a socket)."""
    namespace = os.environ.get("SHARDLAB_NETNS")
    if namespace:
        enter(namespace)


def _rank(rank: int, fn: Callable[..., Any], envs: list[dict[str, str]], port: int, kwargs: dict, out: Any) -> None:
    os.environ.update(envs[rank], MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    enter_from_env()
    import torch

    torch.set_num_threads(1)
    out[rank] = fn(**kwargs)


def run_ranks(link: EmulatedLink, fn: Callable[..., Any], ranks_per_node: int, kwargs: dict | None = None) -> list:
    """``fn(**kwargs)`` on ``ranks_per_node`` ranks in each node of ``link``; each rank's return value."""
    import torch.multiprocessing as mp

    from benchmarks.ranks import free_port

    world = link.nodes * ranks_per_node
    envs = [link.rank_env(r, world, ranks_per_node) for r in range(world)]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(fn, envs, free_port(), kwargs or {}, out), nprocs=world, join=True)
        return [out[r] for r in range(world)]


def probe_link(sizes: tuple[int, int] = (256 << 10, 2 << 20), repeats: int = 3, comm: Any = None) -> dict:
    """A rank of the probe: the run's own link probe (budget/measured/local_link.py) over ``comm`` (None: the
    world, joined here and left after), the slowest rank's medians deciding."""
    import torch
    import torch.distributed as dist

    from lightning_shardlab.budget.measured.local_link import CALLS, fit_link
    from lightning_shardlab.comm import collectives
    from lightning_shardlab.comm.collectives import Comm

    own = comm is None
    if own:
        dist.init_process_group("gloo")
        comm = Comm(rank=dist.get_rank(), world_size=dist.get_world_size(), device=torch.device("cpu"))
    from lightning_shardlab.comm.link_probe import time_gather_batches

    times = time_gather_batches(comm, sizes, CALLS, repeats, aligned=True)
    slowest = collectives.all_reduce(
        torch.tensor(times.batches, dtype=torch.float64), comm, op="max", label="link probe"
    )
    link = fit_link("emulated link, probed", slowest.tolist(), comm.world_size, sizes)
    if own:
        dist.destroy_process_group()
    return {"bandwidth": link.bandwidth, "latency": link.latency}


def check_probe(bandwidth: float, bits: float) -> str:
    """The probe's verdict: the shaped rate caps what it may read (bytes/s against the link's bits/s)."""
    shaped = bits / 8
    ratio = bandwidth / shaped
    verdict = "ok" if 0.5 <= ratio <= 1.1 else "OFF"
    return (
        f"probe read {bandwidth / 1e6:.1f} MB/s on a link shaped at {shaped / 1e6:.1f} MB/s ({ratio:.2f}x): {verdict}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--link", default="1gbit", help="tc rate of each node's link: 100mbit, 1gbit, 10gbit")
    parser.add_argument("--delay", default=None, help="one-way delay each node adds (tc time, e.g. 0.2ms): netem")
    args = parser.parse_args(argv)
    with EmulatedLink(args.nodes, args.link, args.delay if args.delay not in (None, "0") else None) as link:
        probed = run_ranks(link, probe_link, 1)[0]
        print(check_probe(probed["bandwidth"], link.bits), f"latency {probed['latency'] * 1e6:.0f} us")
    left = [name for name in _existing() if name.startswith(link.tag)]
    print("cleaned up" if not left else f"LEFT BEHIND: {left}")


if __name__ == "__main__":
    main()
