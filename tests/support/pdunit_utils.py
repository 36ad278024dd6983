"""Small helpers shared by the unit tests (no vLLM import)."""

from __future__ import annotations

import time
from collections.abc import Callable

# Reserved across processes (xdist workers), below the ephemeral range.
from vllm_pd_ext.tools.ports import free_port

__all__ = ["FakeClock", "free_port"]


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


def wait_for(cond: Callable[[], object], timeout: float = 30.0, interval: float = 0.005) -> bool:
    """Poll ``cond`` until truthy or ``timeout``; returns its last truthiness.

    30 s by default: most waits here are for a side-channel crossing, which a
    loaded CI host has taken 5 s to make; only a failing test waits it out."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
