"""Our proxy drives vLLM's in-tree NixlConnector engines unchanged (wire compatibility)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.engine_set import engine_set
from tests.e2e.helpers import (
    EXTERNAL,
    assert_same_as_reference,
    completion_body,
    delta,
    log_dir,
    token_prompt,
)
from vllm_pd_ext.testing.engines import Engine, Proxy

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def nixl_pd(model: str) -> Iterator[tuple[Engine, Engine, Proxy]]:
    logs = log_dir("intree-nixl")
    p = Engine("nixl-p", model, logs, connector="NixlConnector", role="kv_producer",
               cpu_bind="0")
    d = Engine("nixl-d", model, logs, connector="NixlConnector", role="kv_consumer",
               cpu_bind="1")
    with engine_set(p, d):
        proxy = Proxy([p.url], [d.url], logs).start()
        try:
            yield p, d, proxy.wait_ready()
        finally:
            proxy.stop()


def test_intree_nixl_connector_behind_our_proxy(ref: Engine, nixl_pd: tuple[Engine, Engine, Proxy],
                                                model: str) -> None:
    _, d, proxy = nixl_pd
    for seed, n in ((41, 150), (42, 300)):
        body = completion_body(model, token_prompt(n, seed=seed), max_tokens=8)
        _, want = ref.post("/v1/completions", body)
        before = d.metrics()
        status, got = proxy.post("/v1/completions", body, timeout=180)
        if status == 500 and seed == 41:
            # vLLM's in-tree connector once timed out its first D -> P handshake
            # in a full suite run (handshake_setup_failed, zmq.Again after 30 s;
            # not our code). Its next request handshakes again: one retry, and
            # only for the first request, so a persistent failure still fails.
            print(f"in-tree NIXL: first request failed ({got}); retrying once")
            before = d.metrics()
            status, got = proxy.post("/v1/completions", body, timeout=180)
        after = d.metrics()
        assert status == 200, got
        assert_same_as_reference(ref, got, want)
        assert delta(before, after, EXTERNAL) == n
