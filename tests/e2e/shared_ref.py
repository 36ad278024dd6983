"""One reference engine for every e2e lane of a run.

The reference (``ref``: a collocated engine without a connector, the
oracle) answers every lane's requests the same way, so a run whose lanes
go to pytest-xdist workers (``tests/run.sh``) starts one: the controller
starts it at configure time (tests/conftest.py), beside collection, and
names it to the workers in ``SHARED_REF_ENV``; each worker's session then
uses a ``SharedEngine`` handle instead of starting its own. One engine
start (about 40 s of CPU under the suite's load) and 1.5 GiB fewer. A run
in one process starts its ``ref`` itself, as before (tests/e2e/conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.e2e.conformance import SERVE_ARGS
from vllm_pd_ext import QUIET_SPIN_ENV
from vllm_pd_ext.testing.engines import Engine

#: ``<port>|<log path>`` of the run's shared reference engine.
SHARED_REF_ENV = "PD_EXT_SHARED_REF"


def make_ref(model: str, logs: Path) -> Engine:
    """The reference engine. SERVE_ARGS: what the request-parity cases need
    (test_conformance.py). Quiet: a plain engine's queue readers spin 1 s
    after every message, about a CPU-second per reference answer on 2 cores."""
    return Engine("ref", model, logs, connector=None, cpu_bind="0", extra_args=SERVE_ARGS,
                  env={QUIET_SPIN_ENV: "1"})


class SharedEngine(Engine):
    """A worker's handle on the engine the controller started: it never
    starts or stops it, and tells whether it is up by asking it."""

    def start(self, append: bool = False) -> Engine:
        return self

    def wait_ready(self, timeout: float = 240.0, retries: int = 2) -> Engine:
        # The controller's engine: its health stands for a process of ours.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.alive():
                return self
            time.sleep(0.5)
        raise TimeoutError(f"shared engine {self.name} not ready in {timeout:.0f} s:\n"
                           + self.log_tail())

    def alive(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False


def shared_ref(model: str, logs: Path) -> Engine | None:
    """This worker's handle on the run's shared reference, if there is one."""
    named = os.environ.get(SHARED_REF_ENV)
    if not named:
        return None
    port, _, log_path = named.partition("|")
    e = SharedEngine("ref", model, logs, connector=None, port=int(port))
    e.log_path = Path(log_path)
    return e


@contextlib.contextmanager
def serve_shared_ref() -> Iterator[Engine]:
    """The controller's side: start the reference (within the engine
    budget), name it to the workers about to be spawned, stop it at the end."""
    from tests.e2e.engine_set import started
    from tests.e2e.helpers import build_model, log_dir

    e = make_ref(build_model("tiny"), log_dir("session-shared"))
    with started(e):
        os.environ[SHARED_REF_ENV] = f"{e.port}|{e.log_path}"
        try:
            yield e
        finally:
            os.environ.pop(SHARED_REF_ENV, None)
