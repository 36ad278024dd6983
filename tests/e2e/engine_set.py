"""Engine sets for the e2e fixtures: started together, stopped together,
within a memory budget shared by every test process of the checkout.

An engine's start is mostly Python imports in three processes (API server,
EngineCore, worker), one after the other, and its stop waits for vLLM's
shutdown (longer where a lease or a kept turn makes it drain). Starting every
engine of a set before waiting for any, and stopping them all at once, makes
a set cost its slowest engine rather than the sum; on 2 cores that is most
of what the e2e tier's time goes to (docs/testing.md, "Suite timings").

The e2e lanes (tests/e2e/lanes.py) run in parallel processes, each starting
its own sets; an engine takes about 1.5 GiB, so the processes share one
budget of engines running at once (``EngineBudget``): a set that would
exceed it waits until another set has stopped.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_pd_ext.testing.engines import REPO, Engine
from vllm_pd_ext.testing.netns import pid_alive

#: Memory one tiny-model engine takes (its three processes), with a margin:
#: a full run on a 24 GiB machine peaked at 18.1 GiB used with 10 engines,
#: 13.7 with 7, 5.6 with none (the engine-free tiers running).
ENGINE_GIB = 1.6
#: Kept for everything else: the test processes, the engine-free tiers, the OS.
RESERVED_GIB = 5.5
#: Overrides the budget (engines running at once).
MAX_ENGINES_ENV = "PD_EXT_MAX_ENGINES"


def default_cap() -> int:
    """Engines that fit in this machine's memory (at least 4: the largest
    single set is 5 with the session's ref, and a set larger than the
    budget still starts once nothing else runs)."""
    if os.environ.get(MAX_ENGINES_ENV):
        return int(os.environ[MAX_ENGINES_ENV])
    total_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(4, int((total_gib - RESERVED_GIB) / ENGINE_GIB))


class EngineBudget:
    """Engines running at once, across processes: a JSON file ``{pid:
    engines}`` changed under an exclusive ``flock``. Entries of dead
    processes (a killed test run) are dropped on every read, so a crash
    never leaks budget."""

    def __init__(self, path: Path, cap: int) -> None:
        self.path = path
        self.cap = cap

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[int, int]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            try:
                raw = json.loads(f.read() or "{}")
                held = {int(k): int(v) for k, v in raw.items()}
            except (ValueError, TypeError, AttributeError):
                held = {}
            held = {pid: n for pid, n in held.items() if n > 0 and pid_alive(pid)}
            yield held
            f.seek(0)
            f.truncate()
            f.write(json.dumps(held))
            f.flush()

    def held(self) -> int:
        with self._locked() as held:
            return sum(held.values())

    def acquire(self, n: int, what: str, timeout: float = 1800.0) -> None:
        """Wait until ``n`` more engines fit (or nothing else runs), then
        count them as this process's. Past ``timeout``, go ahead and say so:
        a slow run beats a hung one."""
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            with self._locked() as held:
                total = sum(held.values())
                elsewhere = total - held.get(os.getpid(), 0)
                late = time.monotonic() > deadline
                # Alone on the machine, a set starts even above the budget:
                # waiting could never help.
                if total + n <= self.cap or elsewhere == 0 or late:
                    if late:
                        print(f"engine budget: {what} starts over the budget "
                              f"({total} + {n} > {self.cap}) after {timeout:.0f} s",
                              file=sys.stderr)
                    held[os.getpid()] = held.get(os.getpid(), 0) + n
                    return
            if not waited:
                print(f"engine budget: {what} waits for {n} of {self.cap} engine slots "
                      f"({total} running)", file=sys.stderr)
                waited = True
            time.sleep(1.0)

    def release(self, n: int) -> None:
        with self._locked() as held:
            held[os.getpid()] = max(0, held.get(os.getpid(), 0) - n)


#: One budget per checkout: every test run in it shares the machine.
BUDGET = EngineBudget(REPO / ".runs" / "engine-budget.json", default_cap())


def stop_together(engines: list[Engine] | tuple[Engine, ...]) -> None:
    """``Engine.stop`` on every engine at once (each by its own PID, each
    SIGTERM, then SIGKILL after its timeout, as ``stop`` does alone); returns
    when all have stopped, re-raising the first error."""
    if not engines:
        return
    with ThreadPoolExecutor(len(engines)) as pool:
        for future in [pool.submit(e.stop) for e in engines]:
            future.result()


@contextlib.contextmanager
def started(*engines: Engine) -> Iterator[None]:
    """Take budget for every engine and start them all (without waiting
    for any); on exit stop them all (together), whatever happened, the ones
    that never came up included, and give the budget back."""
    BUDGET.acquire(len(engines), ", ".join(e.name for e in engines))
    try:
        for e in engines:
            e.start()
        yield
    finally:
        try:
            stop_together(engines)
        finally:
            BUDGET.release(len(engines))


@contextlib.contextmanager
def engine_set(*engines: Engine) -> Iterator[None]:
    """``started``, then wait until every engine serves, then yield."""
    with started(*engines):
        for e in engines:
            e.wait_ready()
        yield
