"""Pure pieces: config validation, token estimates, prefix chunk memory, SSE splitting, legs,
body budget, request-id sanitizing, the outcome labels."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from vllm_pd_proxy.backends import PrefillIdentity
from vllm_pd_proxy.body import BodyBudget
from vllm_pd_proxy.config import ConfigError, ProxyConfig, normalize_url
from vllm_pd_proxy.context import log_safe, sanitize_request_id
from vllm_pd_proxy.errors import Outcome, ProxyError
from vllm_pd_proxy.legs import decode_body, prefill_body, push_decode_params
from vllm_pd_proxy.prompt import PrefixChunks, chunk_keys, estimate_tokens, inspect_prompt
from vllm_pd_proxy.relay import OversizedEvent, read_events, split_events


def test_config_validation():
    cfg = ProxyConfig(prefill=("127.0.0.1:8100/",), decode=("http://127.0.0.1:8200",))
    assert cfg.validated().prefill == ("http://127.0.0.1:8100",)
    bad = [
        ProxyConfig(prefill=(), decode=("http://a:1",)),
        ProxyConfig(prefill=("http://a:1",), decode=()),
        ProxyConfig(prefill=("http://a:1", "http://a:1"), decode=("http://b:1",)),
        ProxyConfig(prefill=("http://a:1",), decode=("http://b:1",), prefill_timeout=0),
        ProxyConfig(
            prefill=("http://a:1",), decode=("http://b:1",), max_prefill_queue=2,
            local_prefill_threshold=0,
        ),
        ProxyConfig(prefill=("http://a:1",), decode=("http://b:1",), prefix_chunk_tokens=0),
        ProxyConfig(prefill=("ftp://a:1",), decode=("http://b:1",)),
        ProxyConfig(prefill=("http://a:1/v1",), decode=("http://b:1",)),
        ProxyConfig(
            prefill=("http://a:1",),
            decode=("http://b:1",),
            max_request_bytes=4096,
            max_total_body_bytes=4095,
        ),
        ProxyConfig(prefill=("http://a:1",), decode=("http://b:1",), max_sse_event_bytes=10),
    ]
    for config in bad:
        with pytest.raises(ConfigError):
            config.validated()
    assert normalize_url("https://h:9") == "https://h:9"


def test_estimate_tokens():
    assert estimate_tokens({"prompt": "x" * 400}, chat=False) == 100
    assert estimate_tokens({"prompt": [1, 2, 3]}, chat=False) == 3
    assert estimate_tokens({"prompt": [[1, 2], [3]]}, chat=False) == 3
    assert estimate_tokens({"prompt": ["x" * 40, "y" * 40]}, chat=False) == 20
    assert estimate_tokens({}, chat=False) == 0
    msgs = [
        {"role": "system", "content": "s" * 100},
        {"role": "user", "content": [{"type": "text", "text": "u" * 100}, {"type": "image"}]},
    ]
    assert 50 <= estimate_tokens({"messages": msgs}, chat=True) <= 55


def test_chunk_keys_chain_like_block_hashes():
    a = chunk_keys({"prompt": "abcd" * 100}, False, 8)  # 400 chars = 100 tokens
    assert len(a) == 100 // 8  # the partial last chunk has no key
    longer = chunk_keys({"prompt": "abcd" * 100 + "z" * 64}, False, 8)
    assert longer[: len(a)] == a and len(longer) == len(a) + 2
    # A change early on changes every key after it (a chain, not per-chunk hashes).
    edited = chunk_keys({"prompt": "X" + ("abcd" * 100)[1:]}, False, 8)
    assert not set(edited) & set(a)
    assert chunk_keys({"prompt": list(range(20))}, False, 8) == chunk_keys(
        {"prompt": [*range(16), 99, 98]}, False, 8
    )
    assert len(chunk_keys({"prompt": list(range(20))}, False, 8)) == 2
    assert chunk_keys({"prompt": "short"}, False, 8) == ()
    # A hostile id list (unhashable items) ends the chain there, without raising.
    hostile = [*range(8), {"x": 1}, *range(20)]
    assert chunk_keys({"prompt": hostile}, False, 8) == chunk_keys(
        {"prompt": list(range(8))}, False, 8
    )
    assert inspect_prompt({"prompt": hostile}, False, 8) == (29, chunk_keys(
        {"prompt": list(range(8))}, False, 8
    ))
    assert inspect_prompt({"prompt": "abcd" * 100}, False, None) == (100, ())
    chat = {"messages": [{"role": "user", "content": "q" * 300}]}
    assert len(chunk_keys(chat, True, 8)) == (len("user") + 2 + 300) // 32


def test_prefix_chunks_count_the_leading_run_and_evict_least_recent():
    cache = PrefixChunks(4)
    cache.add((1, 2, 3))
    assert cache.cached_chunks((1, 2, 3, 4)) == 3
    assert cache.cached_chunks((1, 9, 3)) == 1  # stops at the first miss
    assert cache.cached_chunks((9, 1)) == 0
    cache.add((5, 6))  # 1 is least recently used: evicted
    assert len(cache) == 4 and cache.cached_chunks((1,)) == 0
    cache.add((2,))  # refreshes 2; the next add evicts 3 first
    cache.add((7,))
    assert cache.cached_chunks((2,)) == 1 and cache.cached_chunks((3,)) == 0


def test_split_events():
    assert split_events(b"data: 1\n\ndata: 2\n\n") == (b"data: 1\n\ndata: 2\n\n", b"")
    assert split_events(b"data: 1\n\ndata: 2") == (b"data: 1\n\n", b"data: 2")
    assert split_events(b"data: par") == (b"", b"data: par")
    assert split_events(b"data: 1\r\n\r\ndata") == (b"data: 1\r\n\r\n", b"data")


def test_leg_builders_do_not_mutate_the_client_body():
    body = {"prompt": "p", "max_tokens": 5, "stream": True, "stream_options": {}, "min_tokens": 1}
    snapshot = dict(body)
    p = prefill_body(body, {"k": 1})
    assert p == {"prompt": "p", "max_tokens": 1, "stream": False, "kv_transfer_params": {"k": 1}}
    d = decode_body(body, {"k": 2})
    assert d == {**snapshot, "kv_transfer_params": {"k": 2}}
    assert decode_body({**body, "kv_transfer_params": 1}, None) == snapshot
    assert body == snapshot
    ident = PrefillIdentity("e", "h", 1, 4, "push", 0.0)
    params = push_decode_params(ident, "rid")
    assert params["tp_size"] == 4 and params["remote_request_id"] == "rid"


def test_backend_api_key_is_not_in_repr():
    cfg = ProxyConfig(prefill=("http://a:1",), decode=("http://b:1",), backend_api_key="k-123")
    assert "k-123" not in repr(cfg.validated())
    assert cfg.validated().backend_api_key == "k-123"
    assert (
        ProxyConfig(prefill=("a:1",), decode=("b:1",), backend_api_key="")
        .validated()
        .backend_api_key
        is None
    )


def test_body_budget_reservations():
    budget = BodyBudget(100)
    a, b = budget.reservation(), budget.reservation()
    a.grow_to(60)
    a.grow_to(40)  # never shrinks while the request lives
    assert budget.used == 60
    with pytest.raises(ProxyError) as exc:
        b.grow_to(41)
    assert exc.value.status == 503 and "--max-total-body-bytes 100" in exc.value.message
    assert budget.used == 60 and b.size == 0
    b.grow_to(40)
    a.release()
    a.release()  # idempotent
    assert budget.used == 40
    b.release()
    assert budget.used == 0


def test_sanitize_request_id():
    assert sanitize_request_id(None) is None and sanitize_request_id("") is None
    assert sanitize_request_id("abc-123_x.y:z/w+v@u~") == "abc-123_x.y:z/w+v@u~"
    assert sanitize_request_id('a\nb\rc\x1bd\x00e f=g"h') == "a_b_c_d_e_f_g_h"
    assert sanitize_request_id("\u00e9\udce9") == "__"
    assert sanitize_request_id("x" * 1000) == "x" * 128
    assert json.loads(log_safe('a"\n\x1b\udce9')) == 'a"\n\x1b\udce9'
    assert "\n" not in log_safe("a\nb") and log_safe("a\nb").startswith('"')


class _Chunks:
    """Stands in for an aiohttp response: ``content.readany()`` yields ``chunks``."""

    def __init__(self, *chunks: bytes) -> None:
        self.content = self
        self._chunks = list(chunks)

    async def readany(self) -> bytes:
        return self._chunks.pop(0) if self._chunks else b""


async def test_read_events_boundaries_across_chunks():
    resp = _Chunks(b"data: 1\n", b"\ndata: 2")
    assert await read_events(resp, b"", 1024) == (b"data: 1\n\n", b"data: 2", False)
    resp = _Chunks(b"\r\n", b"\r", b"\ndata: 3\n\n")
    assert await read_events(resp, b"data: 2", 1024) == (
        b"data: 2\r\n\r\ndata: 3\n\n",
        b"",
        False,
    )
    resp = _Chunks(b"data: 1\n\nda", b"ta: 2\n\n")
    assert await read_events(resp, b"", 1024) == (b"data: 1\n\n", b"da", False)
    assert await read_events(_Chunks(), b"tail", 1024) == (b"tail", b"", True)


async def test_read_events_caps_the_partial_event():
    resp = _Chunks(*([b"x" * 400] * 10))
    with pytest.raises(OversizedEvent, match="limit --max-sse-event-bytes 1024"):
        await read_events(resp, b"", 1024)
    assert len(resp._chunks) == 7  # stopped at the first read past the cap


def test_outcomes_are_the_documented_labels():
    """``Outcome`` holds exactly the access log's and the metric's outcome
    words that docs/proxy.md lists, and renders as the bare word."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "proxy.md").read_text()
    listed = docs.split("`outcome` is ", 1)[1].split(". A failed request", 1)[0]
    words = [w for w in re.findall(r"`([a-z_0-9]+)`", listed) if not w.startswith("max_")]
    assert sorted(words) == sorted(o.value for o in Outcome)
    assert f"{Outcome.UPSTREAM_5XX}" == "upstream_5xx" == str(Outcome.UPSTREAM_5XX)
    record = logging.LogRecord("t", logging.INFO, "", 0, "outcome=%s", (Outcome.CANCELLED,), None)
    assert record.getMessage() == "outcome=cancelled" and json.dumps(Outcome.OK) == '"ok"'
