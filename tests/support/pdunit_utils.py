"""Small helpers shared by the unit tests (no vLLM import)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


def wait_for(cond: Callable[[], object], timeout: float = 5.0, interval: float = 0.005) -> bool:
    """Poll ``cond`` until truthy or ``timeout``; returns its last truthiness."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
