"""Real vLLM engines for the end-to-end tests, and the order the tests run in.

The session set, started together once and stopped by PID at the end:
``ref`` a collocated engine without a connector (the oracle), ``p`` a
PDConnector producer, ``d`` a consumer with ``kv_load_failure_policy=fail``
(and ``transfer_telemetry_in_response``). ``p2``, a second producer, starts
when a test first needs it (``test_isolation.py`` freezes it and
``test_drain.py`` drains it, late in the run), so that it never runs beside
the largest module sets: 8 engines at once is the most a 23 GiB machine
holds (the multi-turn module's 5 and the session's 3). Modules whose engines
need another configuration start their own set (``engine_set.py``), and stop
it when the module ends.

Order (``pytest_collection_modifyitems``): the e2e tests run after every
other tier, modules in ``E2E_ORDER``. ``test_isolation.py`` runs late, when
the engine-free tiers (run beside it by ``tests/run.sh``) are done, since it
times handoffs. ``test_drain.py`` runs last: its tests drain ``p2`` and then
``d`` (SIGTERM: they exit), so no test after them could use those engines.
Under pytest-xdist one worker runs every e2e test (tests/conftest.py), in
this order, on one session set.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conformance import SERVE_ARGS
from tests.e2e.engine_set import engine_set
from tests.e2e.helpers import build_model, log_dir
from vllm_pd_ext.testing.engines import Engine

pytestmark = pytest.mark.engine

E2E_DIR = Path(__file__).parent
#: Session-set modules first, then those with sets of their own, then the
#: two that must come last (see the module docstring). Unlisted: before these.
E2E_ORDER = [
    "test_pull.py", "test_proxy_e2e.py", "test_conformance.py", "test_d_variants.py",
    "test_oracle.py", "test_concurrency.py",
    "test_sizing_e2e.py", "test_slo_bench_e2e.py",
    "test_auth_e2e.py", "test_failures.py", "test_intree_nixl.py", "test_push.py",
    "test_multiturn.py", "test_multihost.py",
    "test_isolation.py", "test_drain.py",
]


def _is_e2e(item: pytest.Item) -> bool:
    return E2E_DIR in Path(item.path).parents


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every other tier first, in collection order; then the e2e modules in
    ``E2E_ORDER``, each module's tests in file order (a stable sort)."""
    rank = {name: i for i, name in enumerate(E2E_ORDER)}

    def key(item: pytest.Item) -> tuple[int, int]:
        if not _is_e2e(item):
            return (0, 0)
        return (1, rank.get(Path(item.path).name, -1))

    items.sort(key=key)


@pytest.fixture(scope="session")
def model() -> str:
    return build_model("tiny")


@pytest.fixture(scope="session")
def engines(model: str) -> Iterator[dict[str, Engine]]:
    logs = log_dir("session")
    engs = {
        # SERVE_ARGS: what the request-parity cases need (test_conformance.py).
        "ref": Engine("ref", model, logs, connector=None, cpu_bind="0", extra_args=SERVE_ARGS),
        "p": Engine("p", model, logs, role="kv_producer", cpu_bind="0", extra_args=SERVE_ARGS),
        # transfer_telemetry_in_response: D's answers carry its transfer record
        # (tests/e2e/test_proxy_e2e.py::test_transfer_telemetry_through_proxy).
        # drain_timeout bounds test_drain.py's drain of this D.
        "d": Engine("d", model, logs, role="kv_consumer", cpu_bind="1", failure_policy="fail",
                    extra_args=SERVE_ARGS,
                    extra_config={"transfer_telemetry_in_response": True,
                                  "drain_timeout": 60.0}),
    }
    with engine_set(*engs.values()):
        yield engs


@pytest.fixture(scope="session")
def ref(engines: dict[str, Engine]) -> Engine:
    return engines["ref"]


@pytest.fixture(scope="session")
def p(engines: dict[str, Engine]) -> Engine:
    return engines["p"]


@pytest.fixture(scope="session")
def d(engines: dict[str, Engine]) -> Engine:
    return engines["d"]


@pytest.fixture(scope="session")
def p2(model: str) -> Iterator[Engine]:
    """A second producer (default lease), frozen by test_isolation.py and
    drained, for good, by test_drain.py."""
    eng = Engine("p2", model, log_dir("session"), role="kv_producer", cpu_bind="0",
                 extra_config={"drain_timeout": 60.0})
    with engine_set(eng):
        yield eng
