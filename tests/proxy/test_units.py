"""Pure pieces: config validation, token estimates, prefix LRU, SSE splitting, legs."""

from __future__ import annotations

import pytest
from vllm_pd_proxy.backends import PrefillIdentity
from vllm_pd_proxy.config import ConfigError, ProxyConfig, normalize_url
from vllm_pd_proxy.legs import decode_body, prefill_body, push_decode_params
from vllm_pd_proxy.prompt import PrefixLRU, estimate_tokens, prefix_key
from vllm_pd_proxy.relay import split_events


def test_config_validation():
    cfg = ProxyConfig(prefill=("127.0.0.1:8100/",), decode=("http://127.0.0.1:8200",))
    assert cfg.validated().prefill == ("http://127.0.0.1:8100",)
    bad = [
        ProxyConfig(prefill=(), decode=("http://a:1",)),
        ProxyConfig(prefill=("http://a:1",), decode=()),
        ProxyConfig(prefill=("http://a:1", "http://a:1"), decode=("http://b:1",)),
        ProxyConfig(prefill=("http://a:1",), decode=("http://b:1",), prefill_timeout=0),
        ProxyConfig(prefill=("http://a:1",), decode=("http://b:1",), prefix_aware_len=10),
        ProxyConfig(prefill=("ftp://a:1",), decode=("http://b:1",)),
        ProxyConfig(prefill=("http://a:1/v1",), decode=("http://b:1",)),
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


def test_prefix_key():
    a = prefix_key({"prompt": "abc" * 100}, False, 30)
    b = prefix_key({"prompt": "abc" * 200}, False, 30)
    c = prefix_key({"prompt": "xyz" * 100}, False, 30)
    assert a is not None and b is not None and c is not None
    assert a[0] == b[0] != c[0]
    assert a[1] == 30 // 4
    assert prefix_key({"prompt": "short"}, False, 30) is None
    ids = prefix_key({"prompt": list(range(100))}, False, 10)
    assert ids is not None and ids[1] == 10


def test_prefix_lru_evicts_least_recent():
    lru = PrefixLRU(2)
    assert lru.touch("a") is False
    assert lru.touch("b") is False
    assert lru.touch("a") is True  # a is now most recent
    lru.touch("c")  # evicts b
    assert "a" in lru and "c" in lru and "b" not in lru
    assert len(lru) == 2


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
