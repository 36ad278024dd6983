"""Ports for the engines, proxies and side channels our tools start.

Role: hand out a TCP port on 127.0.0.1 that no other process on this host
was handed in the last ``RESERVE_S`` seconds. Stdlib only.

A port that is free when picked is not bound until the child process we
start binds it, seconds later (an engine's side channel binds when its
worker loads the connector, 20 s and more under load). Two test processes
(pytest-xdist workers, a benchmark beside the tests) picking at random
could be handed the same port in that window, and the second engine then
dies with "address already in use". So every port handed out is also
reserved, for ``RESERVE_S``, by a file named after it in a directory per
user; the reservation is taken under one ``flock`` so two processes never
both take one port, and a reservation older than ``RESERVE_S`` is stale
(its owner bound the port long ago, or died) and is taken over.

Ports come from below Linux's ephemeral range (32768+), so the ports that
vLLM, UCX and the kernel hand out by binding port 0 cannot take ours.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

#: Where ports are taken from (below the kernel's ephemeral range).
PORT_RANGE = (20000, 32000)
#: How long a reservation holds: longer than any engine takes to bind.
RESERVE_S = 900.0


def reservation_dir() -> Path:
    """This user's reservation directory (``VLLM_PD_EXT_PORT_DIR`` overrides)."""
    given = os.environ.get("VLLM_PD_EXT_PORT_DIR")
    if given:
        return Path(given)
    return Path(tempfile.gettempdir()) / f"vllm-pd-ext-ports-{os.getuid()}"


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _reserve(directory: Path, port: int, now: float) -> bool:
    """Take ``port``'s reservation (caller holds the lock); False if held."""
    path = directory / str(port)
    try:
        if now - path.stat().st_mtime < RESERVE_S:
            return False
    except FileNotFoundError:
        pass
    path.write_text(str(os.getpid()))
    os.utime(path, (now, now))
    return True


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(rng: random.Random | None = None, directory: Path | None = None,
              port_range: tuple[int, int] = PORT_RANGE) -> int:
    """A port in ``port_range`` that is free on 127.0.0.1 now and that no
    process of this user was handed in the last ``RESERVE_S`` seconds."""
    rng = rng or random.Random()
    directory = directory or reservation_dir()
    with _locked(directory):
        for _ in range(500):
            port = rng.randrange(*port_range)
            if _bindable(port) and _reserve(directory, port, time.time()):
                return port
    raise RuntimeError(f"no free, unreserved port in {port_range[0]}-{port_range[1]} "
                       f"(reservations in {directory})")
