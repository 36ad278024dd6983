"""Pull mode under concurrent load through the proxy (issue 10), on the
session's P/D pair (P's worker on core 0, D's on core 1): the checks are in
tests/e2e/concurrency.py. The push variant runs on test_push.py's pair."""

from __future__ import annotations

import pytest

from tests.e2e.concurrency import check_concurrent_load
from tests.e2e.helpers import log_dir
from vllm_pd_ext.testing.engines import Engine, Proxy

pytestmark = pytest.mark.engine


def test_concurrent_clients_get_collocated_outputs_and_kv_moves_pull(
        ref: Engine, p: Engine, d: Engine, model: str) -> None:
    proxy = Proxy([p.url], [d.url], log_dir("concurrency-pull")).start()
    try:
        proxy.wait_ready()
        check_concurrent_load("pull", p, d, proxy, ref, model)
    finally:
        proxy.stop()
