"""Engine sets for the e2e fixtures: started together, stopped together.

An engine's start is mostly Python imports in three processes (API server,
EngineCore, worker), one after the other, and its stop waits for vLLM's
shutdown (longer where a lease or a kept turn makes it drain). Starting every
engine of a set before waiting for any, and stopping them all at once, makes
a set cost its slowest engine rather than the sum; on 2 cores that is most
of what the e2e tier's time goes to (docs/testing.md, "Suite timings").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from vllm_pd_ext.testing.engines import Engine


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
def engine_set(*engines: Engine) -> Iterator[None]:
    """Start every engine, wait until all serve, yield; stop them all on exit
    (together), whatever happened, the ones that never came up included."""
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
        yield
    finally:
        stop_together(engines)
