"""Suite-wide setup: loopback-only UCX and vLLM, no Hub access, shared helpers.

The suite is laid out by weight (tests/README.md): ``pure/`` (no threads,
sockets or vLLM), ``component/`` (real ZMQ, threads, the fake transport),
``scheduler/`` (real vLLM ``Scheduler``s), ``transport/`` (real NIXL),
``proxy/`` (real HTTP, fake engines) and ``e2e/`` (real engines). Helpers
shared across them live in ``support/``, put on ``sys.path`` here.

Parallel tiers: ``tests/run.sh`` with no arguments runs pytest-xdist with
three workers and ``--dist loadgroup``, scheduled here as one work unit per
e2e lane (tests/e2e/lanes.py; each lane's tests in the order
tests/e2e/conftest.py sets, on that worker's session engines) and one for
every engine-free tier (``pytest_xdist_make_scheduler``), each unit on a
worker of its own.

Skips: a test that cannot run here (no NIXL, no namespaces, one core) skips
with its reason, and ``tests/run.sh`` lists every reason at the end (``-rs``).
CI installs everything, so there a skip means a tier silently tested
nothing: with ``PD_EXT_NO_SKIP=1`` (set by ``.ci/run``) every skipped test,
and every module skipped at collection, is reported as a failure naming the
reason.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

# Must precede any NIXL/UCX import (vLLM may import NIXL lazily).
os.environ["UCX_NET_DEVICES"] = "lo"
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

sys.path.insert(0, str(Path(__file__).parent / "support"))

import pytest
from pdunit_utils import FakeClock, free_port

#: Set by .ci/run: a skip is a failure (CI has NIXL, vLLM, root and 2 cores).
NO_SKIP_ENV = "PD_EXT_NO_SKIP"
E2E_PREFIX = "tests/e2e/"
#: The engine-free tiers of the first of their two work units under ``--dist
#: loadgroup`` (summed test time under CI's load: 925 s against 696 s).
FREE_TIERS_A = ("component", "transport")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist loadgroup``: a work unit per e2e lane and two for the
    rest (``FREE_TIERS_A`` and the others), each on one worker (xdist's own
    groups, by ``xdist_group`` marks, do not take with pytest 9's node ids,
    and no test here uses them)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    from tests.e2e import lanes

    class TierScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            if not nodeid.startswith(E2E_PREFIX):
                # Two units: the engine-free tiers wait on sleeps, timeouts and
                # child processes too, and on one worker they took as long as
                # an e2e lane under CI's load (27 of 30 min).
                tier = nodeid.split("/", 2)[1] if nodeid.count("/") >= 2 else ""
                return "no-engines-" + ("a" if tier in FREE_TIERS_A else "b")
            return "engines-" + lanes.lane_of(nodeid.split("::", 1)[0])

    return TierScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    """The xdist controller of a full run (``tests/run.sh``: ``--dist
    loadgroup``) starts the e2e lanes' one shared reference engine
    (tests/e2e/shared_ref.py) before it spawns the workers."""
    if (config.getvalue("dist") == "loadgroup" and not hasattr(config, "workerinput")
            and "not engine" not in (config.getoption("markexpr") or "")):
        from tests.e2e.shared_ref import serve_shared_ref

        stack = contextlib.ExitStack()
        stack.enter_context(serve_shared_ref())
        config.add_cleanup(stack.close)


def _no_skip() -> bool:
    return os.environ.get(NO_SKIP_ENV, "") not in ("", "0")


def _fail_skip(report: Any, what: str) -> None:
    """Turn a skipped report into a failed one that names the skip's reason."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr
    report.outcome = "failed"
    report.longrepr = (f"{what} was skipped, and {NO_SKIP_ENV}=1 (CI) allows no skip: "
                       f"{reason}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, Any, Any]:
    report = yield
    if _no_skip() and report.skipped and not hasattr(report, "wasxfail"):
        _fail_skip(report, item.nodeid)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, Any]:
    report = yield
    if _no_skip() and report.skipped:
        _fail_skip(report, collector.nodeid)
    return report


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def port() -> int:
    return free_port()
