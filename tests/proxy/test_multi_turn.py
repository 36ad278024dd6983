"""Multi-turn (--multi-turn): D's kept turn is taken out of its answer, filed
by conversation, handed to the next turn's P leg, and the next turn stays on
that D; every way a turn cannot reuse the history is counted."""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web
from pdproxy_helpers import FakeEngine, chunk, completion, parse_sse, sse

KEPT = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": "engine-d",
    "remote_host": "127.0.0.1",
    "remote_port": 5700,
    "remote_block_ids": [[7, 8]],
    "remote_request_id": "d-req-1",
    "remote_block_hashes": ["0123456789abcdef", "fedcba9876543210"],
    "remote_num_tokens": 32,
    "tp_size": 1,
}


def keeping_decode(kept: dict[str, Any] | None = None, unasked: bool = False):
    """A D override that answers like a bidirectional engine: its params in
    the body, or in the stream's finishing chunk. ``unasked``: what it does
    for a leg without ``pd_bidirectional`` (a real engine without a shared
    secret keeps the turn then: its bidirectional_kv_xfer decides)."""

    async def handler(eng: FakeEngine, request: web.Request, body: dict[str, Any]):
        params = dict(kept or KEPT, remote_blocks_expiry_time=time.time() + 300,
                      remote_request_id=f"d-{len(eng.legs())}")
        asked = (body.get("kv_transfer_params") or {}).get("pd_bidirectional")
        if not (unasked if asked is None else asked):
            params = None
        if not body.get("stream"):
            answer = completion(request.path, body, "ok")
            if params:
                answer["kv_transfer_params"] = params
            return web.json_response(answer)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(sse(chunk(request.path, "o")))
        last = chunk(request.path, "k")
        last["choices"][0]["finish_reason"] = "length"
        if params:
            last["kv_transfer_params"] = params
        await out.write(sse(last) + b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    return handler


async def _metric(client, name: str, label: str) -> float:
    text = await (await client.get("/metrics")).text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


async def test_kept_turn_goes_to_the_next_p_leg_and_the_same_d(engines, proxy):
    p = await engines("prefill")
    d0 = await engines("decode", override=keeping_decode())
    d1 = await engines("decode", override=keeping_decode())
    client = await proxy([p], [d0, d1], multi_turn=True)
    session = {"X-Session-Id": "conv-1"}
    body = {"model": "m", "prompt": "hello", "max_tokens": 5}
    for turn in range(3):
        stream = turn == 1
        resp = await client.post("/v1/completions", json=dict(body, stream=stream),
                                 headers=session)
        assert resp.status == 200
        raw = await resp.read()
        assert b"kv_transfer_params" not in raw  # engine addresses stay inside
        if stream:
            assert parse_sse(raw)[-1] == "[DONE]"
        p_leg = p.legs()[-1].body["kv_transfer_params"]
        d_served = d0 if d0.legs() and len(d0.legs()) + len(d1.legs()) == turn + 1 and \
            d0.legs()[-1].at >= max([s.at for s in d1.legs()] or [0]) else d1
        d_leg = d_served.legs()[-1].body["kv_transfer_params"]
        assert d_leg["pd_bidirectional"] is True
        if turn == 0:
            assert "remote_block_hashes" not in p_leg
            first = d_served
        else:
            # P reads the previous turn back: D's kept blocks, verbatim.
            assert p_leg["remote_block_hashes"] == KEPT["remote_block_hashes"]
            assert p_leg["remote_request_id"] == f"d-{len(first.legs()) - 1}"
            assert p_leg["do_remote_decode"] is True and p_leg["do_remote_prefill"] is False
            assert d_served is first  # affinity: the D that holds the history
    assert await _metric(client, "pd_proxy_multi_turn_total", 'outcome="hit"') == 2
    assert await _metric(client, "pd_proxy_multi_turn_total", 'outcome="miss"') == 1
    assert await _metric(client, "pd_proxy_multi_turn_decode_total", 'placement="same"') == 2


async def test_without_multi_turn_d_keeps_nothing_and_clients_see_no_params(engines, proxy):
    """Issue 27 item 8: a proxy without --multi-turn in front of engines with
    bidirectional_kv_xfer. Every D leg says pd_bidirectional: false, so D
    keeps no turn for 480 s that nobody reads; and whatever D answers in
    kv_transfer_params (engine host, port, block ids) never reaches the
    client, streamed or not."""
    p = await engines("prefill")
    d = await engines("decode", override=keeping_decode(unasked=True))
    client = await proxy([p], [d])
    for stream in (False, True, False):
        resp = await client.post("/v1/completions",
                                 json={"model": "m", "prompt": "x", "stream": stream},
                                 headers={"X-Session-Id": "s"})
        assert resp.status == 200
        assert b"kv_transfer_params" not in await resp.read()
    assert all(leg.body["kv_transfer_params"]["pd_bidirectional"] is False for leg in d.legs())
    assert all("remote_block_hashes" not in leg.body["kv_transfer_params"] for leg in p.legs())


async def test_d_params_never_reach_a_client(engines, proxy):
    """A D that answers kv_transfer_params although not asked (an upstream
    engine, a bug): the proxy takes them out of every answer, with or
    without --multi-turn, streamed or not, in pull and push mode."""

    async def always_keeps(eng: FakeEngine, request: web.Request, body: dict[str, Any]):
        return await keeping_decode(unasked=True)(
            eng, request, dict(body, kv_transfer_params={"pd_bidirectional": True}))

    for multi_turn, mode in ((False, "pull"), (False, "push"), (True, "pull")):
        p = await engines("prefill")
        d = await engines("decode", override=always_keeps)
        client = await proxy([p], [d], multi_turn=multi_turn, transfer_mode=mode)
        for stream in (False, True):
            # n=2: with --multi-turn too, this turn keeps nothing (no capture).
            resp = await client.post("/v1/completions", json={
                "model": "m", "prompt": "x", "stream": stream, "n": 2, "temperature": 1.0})
            assert resp.status == 200
            raw = await resp.read()
            assert b"kv_transfer_params" not in raw and b"remote_host" not in raw, raw


async def test_conversation_id_and_opening_keys(engines, proxy):
    p = await engines("prefill")
    d = await engines("decode", override=keeping_decode())
    client = await proxy([p], [d], multi_turn=True)
    # vLLM's multi-turn demo proxy key: taken out before the engines see it.
    for _ in range(2):
        resp = await client.post("/v1/completions",
                                 json={"model": "m", "prompt": "a", "conversation_id": "c9"})
        assert resp.status == 200
    assert all("conversation_id" not in leg.body for leg in p.legs() + d.legs())
    assert "remote_block_hashes" in p.legs()[-1].body["kv_transfer_params"]
    # No key at all: chat turns of one conversation share their opening.
    opening = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}]
    later = [*opening, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    for messages in (opening, later):
        resp = await client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
        assert resp.status == 200
    assert "remote_block_hashes" in p.legs()[-1].body["kv_transfer_params"]


async def test_unhealthy_d_and_expired_turn_fall_back(engines, proxy):
    p = await engines("prefill")
    d = await engines("decode", override=keeping_decode())
    client = await proxy([p], [d], multi_turn=True, multi_turn_ttl=0.3)
    body = {"model": "m", "prompt": "hello"}
    hdr = {"X-Session-Id": "e"}
    assert (await client.post("/v1/completions", json=body, headers=hdr)).status == 200
    time.sleep(0.4)
    assert (await client.post("/v1/completions", json=body, headers=hdr)).status == 200
    assert "remote_block_hashes" not in p.legs()[-1].body["kv_transfer_params"]
    assert await _metric(client, "pd_proxy_multi_turn_total", 'outcome="expired"') == 1


async def test_failed_readback_is_retried_without_it(engines, proxy):
    async def p_fails_readback(eng: FakeEngine, request: web.Request, body: dict[str, Any]):
        if "remote_block_hashes" in body["kv_transfer_params"]:
            return web.json_response({"error": "KV load failed"}, status=500)
        answer = completion(request.path, body, "x")
        answer["kv_transfer_params"] = dict(eng.kv_params or {})
        return web.json_response(answer)

    p = await engines("prefill", override=p_fails_readback)
    d = await engines("decode", override=keeping_decode())
    client = await proxy([p], [d], multi_turn=True)
    hdr = {"X-Session-Id": "f"}
    for _ in range(2):
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "q"},
                                 headers=hdr)
        assert resp.status == 200, await resp.text()
    assert [("remote_block_hashes" in s.body["kv_transfer_params"]) for s in p.legs()] == [
        False, True, False]
    assert await _metric(client, "pd_proxy_multi_turn_total", 'outcome="readback_failed"') == 1


def test_extract_kv_params_leaves_other_events_alone():
    from vllm_pd_proxy.conversations import extract_kv_params

    events = (b'data: {"choices":[{"text":"a"}]}\n\n'
              b'data: {"choices":[{"text":"b"}],"kv_transfer_params":{"x":1}}\n\n')
    out, params = extract_kv_params(events, sse=True)
    assert params == {"x": 1}
    assert out == (b'data: {"choices":[{"text":"a"}]}\n\n'
                   b'data: {"choices":[{"text":"b"}]}\n\n')
    body, params = extract_kv_params(json.dumps({"a": 1}).encode(), sse=False)
    assert params is None and json.loads(body) == {"a": 1}


async def test_a_kept_turn_is_read_back_even_under_the_local_prefill_threshold(engines, proxy):
    """With conditional disaggregation, a conversation's next turn still goes
    through P (its read-back releases the blocks D kept) and to the D that
    kept it; a first turn under the threshold is prefilled on D, which keeps it."""
    p = await engines("prefill")
    d0 = await engines("decode", override=keeping_decode())
    d1 = await engines("decode", override=keeping_decode())
    client = await proxy([p], [d0, d1], multi_turn=True, local_prefill_threshold=100_000)
    session = {"X-Session-Id": "conv-local"}
    body = {"model": "m", "prompt": "hello", "max_tokens": 5}
    assert (await client.post("/v1/completions", json=body, headers=session)).status == 200
    assert p.legs() == []  # turn 1: short, prefilled on D (which kept it)
    first_d = d0 if d0.legs() else d1
    assert (await client.post("/v1/completions", json=body, headers=session)).status == 200
    assert len(p.legs()) == 1  # turn 2: through P, with D's kept blocks
    assert p.legs()[0].body["kv_transfer_params"]["remote_block_hashes"] == KEPT[
        "remote_block_hashes"]
    assert len(first_d.legs()) == 2
    assert await _metric(client, "pd_proxy_prefill_decisions_total", 'reason="multi_turn"') == 1


async def test_tenants_with_the_same_opening_never_share_a_turn(engines, proxy):
    """Issue 27 item 7: two tenants (cache_salt) open a conversation alike;
    neither's next turn takes the other's kept turn (whose P would read it,
    or tell D to free it), keyed by the opening or by the same session id."""
    p = await engines("prefill")
    d = await engines("decode", override=keeping_decode())
    client = await proxy([p], [d], multi_turn=True)
    for headers in ({}, {"X-Session-Id": "shared-name"}):
        ids: dict[str, str] = {}
        for tenant in ("tenant-a", "tenant-b", "tenant-a", "tenant-b"):
            body = {"model": "m", "cache_salt": tenant,
                    "messages": [{"role": "user", "content": "the same opening"}]}
            resp = await client.post("/v1/chat/completions", json=body, headers=headers)
            assert resp.status == 200
            p_leg = p.legs()[-1].body["kv_transfer_params"]
            assert p.legs()[-1].body["cache_salt"] == tenant
            if tenant not in ids:
                assert "remote_request_id" not in p_leg, (tenant, p_leg)  # a first turn
            else:
                assert p_leg["remote_request_id"] == ids[tenant]  # its own kept turn
            ids[tenant] = f"d-{len(d.legs())}"  # (the fake D names its turns so)
