"""Real vLLM engines for the end-to-end tests (started once per session).

``ref`` is a collocated engine without a connector (the oracle), ``p`` a
PDConnector producer and ``d`` a consumer with ``kv_load_failure_policy=fail``
(and ``transfer_telemetry_in_response``).
They are started together and stopped by PID at the end.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.helpers import build_model, log_dir
from vllm_pd_ext.testing.engines import Engine, running

pytestmark = pytest.mark.engine


@pytest.fixture(scope="session")
def model() -> str:
    return build_model("tiny")


@pytest.fixture(scope="session")
def engines(model: str) -> Iterator[dict[str, Engine]]:
    logs = log_dir("session")
    engs = {
        "ref": Engine("ref", model, logs, connector=None, cpu_bind="0"),
        "p": Engine("p", model, logs, role="kv_producer", cpu_bind="0"),
        # transfer_telemetry_in_response: D's answers carry its transfer record
        # (tests/e2e/test_proxy_e2e.py::test_transfer_telemetry_through_proxy).
        "d": Engine("d", model, logs, role="kv_consumer", cpu_bind="1", failure_policy="fail",
                    extra_config={"transfer_telemetry_in_response": True}),
    }
    with running(*engs.values()):
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
