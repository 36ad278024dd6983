"""``tools/ports.free_port``: no two processes are handed one port."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
from pathlib import Path

import pytest

from vllm_pd_ext.tools import ports

#: A narrow range: 80 ports, two processes taking 30 each with the same
#: random sequence, so without reservations they would collide every time.
NARROW = (30000, 30080)


def _take(directory: str, n: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    rng = random.Random(7)  # the same sequence in both processes
    out.put([ports.free_port(rng, Path(directory), NARROW) for _ in range(n)])


def test_two_processes_with_one_random_sequence_get_disjoint_ports(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=_take, args=(str(tmp_path), 30, out)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    a, b = (set(x) for x in got)
    assert len(a) == len(b) == 30
    assert not a & b, f"ports handed to both processes: {sorted(a & b)}"
    assert all(NARROW[0] <= port < NARROW[1] for port in a | b)


def test_a_reservation_holds_until_it_is_stale(tmp_path: Path) -> None:
    port = ports.free_port(random.Random(1), tmp_path, (31000, 31001))
    assert port == 31000
    with pytest.raises(RuntimeError, match="no free, unreserved port in 31000-31001"):
        ports.free_port(random.Random(1), tmp_path, (31000, 31001))
    old = (tmp_path / "31000").stat().st_mtime - ports.RESERVE_S - 1
    os.utime(tmp_path / "31000", (old, old))
    assert ports.free_port(random.Random(1), tmp_path, (31000, 31001)) == 31000


def test_a_bound_port_is_not_handed_out(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        taken = s.getsockname()[1]
        with pytest.raises(RuntimeError, match="no free"):
            ports.free_port(random.Random(1), tmp_path, (taken, taken + 1))


def test_the_default_range_is_below_the_ephemeral_one() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert ports.PORT_RANGE[1] <= low
    assert ports.PORT_RANGE[0] <= ports.free_port() < ports.PORT_RANGE[1]
