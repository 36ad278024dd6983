"""Our proxy in front of real PDConnector engines (pull mode)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.helpers import (
    EXTERNAL,
    KV_BYTES,
    completion_body,
    delta,
    generated,
    log_dir,
    stream_text,
    token_prompt,
)
from vllm_pd_ext.testing.engines import Engine, Proxy

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
    assert generated(got) == generated(want)
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
    assert text == generated(want)[0]
    assert delta(before, after, EXTERNAL) == 180


def test_chat_completion_through_proxy(ref: Engine, d: Engine, proxy: Proxy, model: str
                                       ) -> None:
    body = {"model": model, "temperature": 0, "max_tokens": 10,
            "messages": [{"role": "user", "content": "Write a function that sorts a list. " * 8}]}
    _, want = ref.post("/v1/chat/completions", body)
    before = d.metrics()
    status, got = proxy.post("/v1/chat/completions", body)
    after = d.metrics()
    assert status == 200, got
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert delta(before, after, EXTERNAL) == got["usage"]["prompt_tokens"] > 0


def test_prompt_longer_than_context_returns_backend_4xx(proxy: Proxy, p: Engine, model: str
                                                        ) -> None:
    body = completion_body(model, token_prompt(2100, seed=23), max_tokens=4)
    direct_status, _ = p.post("/v1/completions", body)
    status, got = proxy.post("/v1/completions", body)
    assert 400 <= direct_status < 500
    assert status == direct_status, got
    assert "error" in got and "2100" in str(got), got
