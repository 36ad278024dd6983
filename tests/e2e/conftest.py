"""Real vLLM engines for the end-to-end tests, and the order the tests run in.

The session engines, started on first need and stopped by PID at the end:
``ref`` a collocated engine without a connector (the oracle), ``p`` a
PDConnector producer, ``d`` a consumer with ``kv_load_failure_policy=fail``
(and ``transfer_telemetry_in_response``), and ``p2``, a second producer
(``test_isolation.py`` freezes it and ``test_drain.py`` drains it, late in
the ``session`` lane). Each lane (tests/e2e/lanes.py) says which of them
its modules use, and a module's first use starts those together; under
``tests/run.sh`` each lane runs in a process of its own, and every lane
uses the one ``ref`` the run's controller started (``shared_ref.py``). Modules whose engines
need another configuration start their own set (``engine_set.py``, within
the engine budget every process shares), and stop it when the module ends.

Order (``pytest_collection_modifyitems``): the e2e tests run after every
other tier, lane by lane, each lane's modules in its order, each module's
tests in file order.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from tests.e2e import lanes
from tests.e2e.conformance import SERVE_ARGS
from tests.e2e.engine_set import started
from tests.e2e.helpers import build_model, log_dir
from tests.e2e.shared_ref import SharedEngine, make_ref, shared_ref
from vllm_pd_ext.testing.engines import Engine

pytestmark = pytest.mark.engine

E2E_DIR = Path(__file__).parent


def _is_e2e(item: pytest.Item) -> bool:
    return E2E_DIR in Path(item.path).parents


#: The file names of this run's e2e modules (``lanes.early_engines``).
_COLLECTED_MODULES: set[str] = set()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every other tier first, in collection order; then the e2e modules
    lane by lane (``lanes.order_key``), each module's tests in file order
    (a stable sort)."""

    _COLLECTED_MODULES.update(Path(item.path).name for item in items if _is_e2e(item))

    def key(item: pytest.Item) -> tuple[int, int, int]:
        if not _is_e2e(item):
            return (0, 0, 0)
        return (1, *lanes.order_key(item.path))

    items.sort(key=key)


@pytest.fixture(scope="session")
def model() -> str:
    return build_model("tiny")


class SessionEngines:
    """This process's session engines: each started on first need (with
    the others asked for at the same time, as one set), all stopped at the
    end of the session, together."""

    def __init__(self, model: str) -> None:
        # One log folder per process: two lanes' ``ref`` must not share a log.
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        self.logs = log_dir(f"session-{worker}" if worker else "session")
        self.model = model
        self.engines: dict[str, Engine] = {}
        self._sets = contextlib.ExitStack()

    def _make(self, name: str) -> Engine:
        model, logs = self.model, self.logs
        if name == "ref":
            # The run's shared reference (tests/e2e/shared_ref.py), else our own.
            return shared_ref(model, logs) or make_ref(model, logs)
        if name == "p":
            return Engine("p", model, logs, role="kv_producer", cpu_bind="0",
                          extra_args=SERVE_ARGS)
        if name == "d":
            # transfer_telemetry_in_response: D's answers carry its transfer record
            # (tests/e2e/test_proxy_e2e.py::test_transfer_telemetry_through_proxy).
            # drain_timeout bounds test_drain.py's drain of this D.
            return Engine("d", model, logs, role="kv_consumer", cpu_bind="1",
                          failure_policy="fail", extra_args=SERVE_ARGS,
                          extra_config={"transfer_telemetry_in_response": True,
                                        "drain_timeout": 60.0})
        if name == "p2":
            # A second producer (default lease), frozen by test_isolation.py
            # and drained, for good, by test_drain.py.
            return Engine("p2", model, logs, role="kv_producer", cpu_bind="0",
                          extra_config={"drain_timeout": 60.0})
        raise KeyError(f"no session engine {name!r}")

    def start(self, *names: str) -> None:
        """Start those of ``names`` not started yet, as one set, without
        waiting for them."""
        missing = [n for n in dict.fromkeys(names) if n not in self.engines]
        if missing:
            engines = {n: self._make(n) for n in missing}
            # A shared engine is the controller's to start, stop and count.
            own = [e for e in engines.values() if not isinstance(e, SharedEngine)]
            if own:
                self._sets.enter_context(started(*own))
            self.engines.update(engines)

    def get(self, *names: str) -> dict[str, Engine]:
        """``names``, started if need be, once they serve."""
        self.start(*names)
        return {n: self.engines[n].wait_ready() for n in names}

    def close(self) -> None:
        self._sets.close()


_SESSION: SessionEngines | None = None


def session_engines_of_this_process() -> SessionEngines:
    global _SESSION
    if _SESSION is None:
        _SESSION = SessionEngines(build_model("tiny"))
    return _SESSION


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before an e2e test's fixtures: start its lane's session engines (and
    the extras its collected modules need), so that they start beside the
    module's own set rather than after it."""
    if _is_e2e(item):
        session_engines_of_this_process().start(
            *lanes.early_engines(lanes.lane_of(item.path), _COLLECTED_MODULES))


def pytest_sessionfinish() -> None:
    if _SESSION is not None:
        _SESSION.close()


@pytest.fixture(scope="session")
def session_engines() -> SessionEngines:
    return session_engines_of_this_process()


def _session_engine(request: pytest.FixtureRequest, engines: SessionEngines,
                    name: str) -> Engine:
    """``name``, started (if it is not yet) with the rest of what the
    requesting module's lane uses, so that a lane's engines start as one set."""
    lane = lanes.lane_of(request.path)
    return engines.get(*lanes.SESSION_ENGINES[lane], name)[name]


@pytest.fixture(scope="module")
def ref(request: pytest.FixtureRequest, session_engines: SessionEngines) -> Engine:
    return _session_engine(request, session_engines, "ref")


@pytest.fixture(scope="module")
def p(request: pytest.FixtureRequest, session_engines: SessionEngines) -> Engine:
    return _session_engine(request, session_engines, "p")


@pytest.fixture(scope="module")
def d(request: pytest.FixtureRequest, session_engines: SessionEngines) -> Engine:
    return _session_engine(request, session_engines, "d")


@pytest.fixture(scope="module")
def p2(request: pytest.FixtureRequest, session_engines: SessionEngines) -> Engine:
    return _session_engine(request, session_engines, "p2")
