"""Our proxy in front of real PDConnector engines (pull mode)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.helpers import (
    EXTERNAL,
    KV_BYTES,
    assert_same_as_reference,
    completion_body,
    delta,
    log_dir,
    stream_text,
    token_prompt,
)
from vllm_pd_ext.testing.engines import Engine, Proxy
from vllm_pd_ext.testing.oracle import stream_output

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def proxy(p: Engine, d: Engine) -> Iterator[Proxy]:
    px = Proxy([p.url], [d.url], log_dir("proxy")).start()
    try:
        yield px.wait_ready()
    finally:
        px.stop()


def test_completion_through_proxy(ref: Engine, d: Engine, proxy: Proxy, model: str) -> None:
    body = completion_body(model, token_prompt(250, seed=21), max_tokens=10)
    _, want = ref.post("/v1/completions", body)
    before = d.metrics()
    status, got = proxy.post("/v1/completions", body)
    after = d.metrics()
    assert status == 200, got
    assert_same_as_reference(ref, got, want)
    assert delta(before, after, EXTERNAL) == 250
    assert delta(before, after, KV_BYTES) > 0


def test_streaming_completion_through_proxy(ref: Engine, d: Engine, proxy: Proxy,
                                            model: str) -> None:
    body = completion_body(model, token_prompt(180, seed=22), max_tokens=10)
    _, want = ref.post("/v1/completions", body)
    before = d.metrics()
    text, events = stream_text(proxy.url + "/v1/completions", body)
    after = d.metrics()
    assert events[-1] == "[DONE]"
    got = stream_output(events)
    assert got.text == text
    assert_same_as_reference(ref, got, want)
    assert delta(before, after, EXTERNAL) == 180


def test_chat_completion_through_proxy(ref: Engine, d: Engine, proxy: Proxy, model: str
                                       ) -> None:
    body = {"model": model, "temperature": 0, "max_tokens": 10, "return_token_ids": True,
            "messages": [{"role": "user", "content": "Write a function that sorts a list. " * 8}]}
    _, want = ref.post("/v1/chat/completions", body)
    before = d.metrics()
    status, got = proxy.post("/v1/chat/completions", body)
    after = d.metrics()
    assert status == 200, got
    assert_same_as_reference(ref, got, want)
    assert delta(before, after, EXTERNAL) == got["usage"]["prompt_tokens"] > 0


def test_prompt_longer_than_context_returns_backend_4xx(proxy: Proxy, p: Engine, model: str
                                                        ) -> None:
    body = completion_body(model, token_prompt(2100, seed=23), max_tokens=4)
    direct_status, _ = p.post("/v1/completions", body)
    status, got = proxy.post("/v1/completions", body)
    assert 400 <= direct_status < 500
    assert status == direct_status, got
    assert "error" in got and "2100" in str(got), got


def test_client_disconnect_aborts_the_decode_leg(d: Engine, proxy: Proxy, model: str) -> None:
    """Closing the client connection mid-stream makes D abort the request and
    free its blocks (it would otherwise generate 1500 more tokens)."""
    import http.client
    import json
    import time

    body = completion_body(model, token_prompt(200, seed=24), max_tokens=1500,
                           ignore_eos=True, stream=True)
    before = d.metrics()
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data:")  # generation under way on D
    assert d.metrics()["vllm:num_requests_running"] == 1
    conn.close()  # the client goes away
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = d.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0:
            break
        time.sleep(0.2)
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    # Aborted early, not run to completion.
    assert m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 1500
