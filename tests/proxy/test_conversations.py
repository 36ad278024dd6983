"""conversations.py: the store (LRU, TTL, D's expiry) and the conversation key."""

from __future__ import annotations

import pytest
from vllm_pd_proxy.conversations import (
    EXPIRY_MARGIN_S,
    ConversationStore,
    conversation_key,
    decode_kept_turn,
    readback_params,
)

from vllm_pd_ext.wire.protocol import ParamsError, decode_params

KEPT = {"remote_block_ids": [[1]], "remote_block_hashes": ["a" * 16], "remote_host": "h",
        "remote_port": 1, "remote_request_id": "r", "remote_engine_id": "e", "tp_size": 1}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_store_is_single_use_bounded_and_expires():
    clock = Clock()
    store = ConversationStore(capacity=2, ttl_s=60, clock=clock)
    assert store.put("a", "http://d0", KEPT, wall_now=0)
    assert store.take("a")[1] == "hit" and store.take("a") == (None, "miss")
    for key in ("a", "b", "c"):
        store.put(key, "http://d0", KEPT, wall_now=0)
    assert len(store) == 2 and store.take("a") == (None, "miss")  # LRU went first
    clock.t += 61
    assert store.take("b") == (None, "expired")


def test_store_follows_d_expiry_and_refuses_what_p_cannot_verify():
    clock = Clock()
    store = ConversationStore(capacity=10, ttl_s=600, clock=clock)
    # D keeps it 20 s from now (its wall clock): handed out until 20 - margin.
    assert store.put("k", "u", dict(KEPT, remote_blocks_expiry_time=1020.0), wall_now=1000.0)
    clock.t += 20 - EXPIRY_MARGIN_S - 0.1
    assert store.take("k")[1] == "hit"
    assert not store.put("k", "u", dict(KEPT, remote_blocks_expiry_time=1001.0), wall_now=1000.0)
    assert not store.put("k", "u", {k: v for k, v in KEPT.items()
                                    if k != "remote_block_hashes"}, wall_now=0)
    assert not store.put("k", "u", "garbage", wall_now=0)  # type: ignore[arg-type]
    # Wrong types from a broken or hostile D never reach the next P leg.
    for bad in ({"remote_port": "80"}, {"remote_port": 0}, {"remote_block_ids": [[1, -1]]},
                {"remote_block_ids": [[1], [2]]}, {"remote_block_hashes": ["xyz"]},
                {"remote_block_hashes": ["a" * 16, "b" * 16]}, {"remote_host": 7},
                {"remote_engine_id": None}):
        assert not store.put("k", "u", dict(KEPT, **bad), wall_now=0), bad


def test_readback_params_keep_the_leg_and_add_the_kept_blocks():
    leg = {"do_remote_decode": True, "transfer_mode": "push", "pd_request_id": "x"}
    out = readback_params(dict(KEPT, do_remote_prefill=True, unrelated=1), leg)
    assert out["pd_request_id"] == "x" and out["transfer_mode"] == "push"
    assert out["remote_block_hashes"] == KEPT["remote_block_hashes"]
    assert out["do_remote_decode"] is True and out["do_remote_prefill"] is False
    assert "unrelated" not in out


def test_conversation_key_sources():
    hdr = "X-Session-Id"
    assert conversation_key({hdr: "s1"}, {"prompt": "x"}, False, hdr) == "h:s1"
    body = {"prompt": "x", "conversation_id": "c1"}
    assert conversation_key({}, body, False, hdr) == "c:c1" and "conversation_id" not in body
    assert len(conversation_key({hdr: "z" * 10_000}, {}, False, hdr) or "") < 300
    first = {"model": "m", "messages": [{"role": "system", "content": "s"},
                                        {"role": "user", "content": "u1"}]}
    later = {"model": "m", "messages": first["messages"] + [
        {"role": "assistant", "content": "a"}, {"role": "user", "content": "u2"}]}
    other = {"model": "m", "messages": [{"role": "user", "content": "u9"}]}
    k1, k2 = conversation_key({}, first, True, hdr), conversation_key({}, later, True, hdr)
    assert k1 == k2 and k1 != conversation_key({}, other, True, hdr)
    assert conversation_key({}, dict(first, user="alice"), True, hdr) != k1
    assert conversation_key({}, {"prompt": list(range(100))}, False, hdr) == conversation_key(
        {}, {"prompt": [*list(range(64)), 1]}, False, hdr)
    assert conversation_key({}, {"messages": "bad"}, True, hdr) is None


def test_store_is_bounded_in_bytes_too():
    clock = Clock()
    big = dict(KEPT, remote_block_ids=[list(range(2000))], remote_block_hashes=["a" * 16] * 2000)
    store = ConversationStore(capacity=1000, ttl_s=60, clock=clock, max_bytes=100_000)
    for i in range(10):
        assert store.put(f"k{i}", "http://d0", big, wall_now=0)
    assert store.num_bytes <= 100_000 and len(store) < 10
    assert store.take("k9")[1] == "hit" and store.take("k0") == (None, "miss")  # LRU went
    turn = ConversationStore(10, 60, clock).put("x", "u", dict(KEPT, extra="dropped"), 0)
    assert turn
    tiny = ConversationStore(10, 60, clock, max_bytes=10)
    assert not tiny.put("x", "u", KEPT, wall_now=0) and tiny.num_bytes == 0


def test_filed_params_keep_only_the_readback_fields():
    store = ConversationStore(10, 60, Clock())
    store.put("x", "u", dict(KEPT, secret_field="not forwarded"), wall_now=0)
    turn, _ = store.take("x")
    assert turn is not None and "secret_field" not in turn.params
    assert turn.params["remote_block_hashes"] == KEPT["remote_block_hashes"]
    assert store.num_bytes == 0


def test_kept_turn_is_decoded_as_the_next_p_leg_will_be():
    """D's params go through P's own decoder (strict types): what P would
    refuse on the next turn's P leg is never filed."""
    leg = decode_kept_turn(dict(KEPT, remote_blocks_expiry_time=7))
    assert leg is not None and leg.is_readback and leg.remote_blocks_expiry_time == 7.0
    p_refuses = ({"remote_host": "a b"}, {"tp_size": 0}, {"remote_engine_id": "e" * 257},
                 {"remote_blocks_expiry_time": "soon"}, {"remote_block_ids": [[True]]})
    for bad in p_refuses:
        with pytest.raises(ParamsError):
            decode_params(readback_params(dict(KEPT, **bad), {}))
        assert decode_kept_turn(dict(KEPT, **bad)) is None, bad
    # Not a read-back P could use (it would prefill everything): not filed either.
    for bad in ({"remote_host": ""}, {"remote_request_id": ""}, {"remote_block_ids": [[]]},
                {"remote_block_ids": [1]}):
        assert decode_kept_turn(dict(KEPT, **bad)) is None, bad


def test_conversation_key_is_scoped_by_cache_salt():
    """Issue 27 item 7: two tenants (cache_salt) never share a conversation,
    whether the proxy keys it by its opening or the client names it."""
    hdr = "X-Session-Id"
    chat = {"model": "m", "messages": [{"role": "system", "content": "s"},
                                       {"role": "user", "content": "the same opening"}]}
    cases = (({}, {}, True), ({}, {}, False), ({hdr: "s1"}, {}, False),
             ({}, {"conversation_id": "c1"}, True))
    for headers, named, chat_api in cases:
        base = dict(chat, **named) if chat_api else {"model": "m", "prompt": "x", **named}
        keys = [conversation_key(headers, dict(base, **salt), chat_api, hdr)
                for salt in ({}, {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"},
                             {"cache_salt": "tenant-a"})]
        assert None not in keys
        assert len(set(keys[:3])) == 3 and keys[3] == keys[1], (headers, named, keys)
    # No name, salted or not, spells another salt's key.
    salted = conversation_key({hdr: "s1"}, {"cache_salt": "a"}, False, hdr)
    assert salted is not None
    for name in (salted, salted[2:], salted[3:], "s1"):
        assert conversation_key({hdr: name}, {}, False, hdr) != salted
        assert conversation_key({hdr: name}, {"cache_salt": "b"}, False, hdr) != salted
    assert conversation_key({}, {"conversation_id": "s1", "cache_salt": "a"}, False, hdr) \
        != salted  # a header and a conversation_id never meet either


def test_the_turns_scope_goes_to_the_next_p_leg():
    """D names whose turn it kept (remote_hash_scope); P checks it against its
    own request's, so it is filed and handed over like the hashes."""
    store = ConversationStore(10, 60, Clock())
    assert store.put("x", "u", dict(KEPT, remote_hash_scope="0123456789abcdef"), wall_now=0)
    turn, _ = store.take("x")
    assert turn is not None and turn.params["remote_hash_scope"] == "0123456789abcdef"
    assert readback_params(turn.params, {})["remote_hash_scope"] == "0123456789abcdef"
    assert decode_kept_turn(dict(KEPT, remote_hash_scope="not-a-scope")) is None
