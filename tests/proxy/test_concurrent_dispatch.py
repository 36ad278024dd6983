"""Push with token #1 from P and both legs at once (``--concurrent-dispatch``,
issue 29 item 2), over fake engines.

D's leg leaves with P's, before token #1 exists; the fake D, like a real
one, continues after the token P samples (token_engine.py). The client's
stream must start with P's token #1 even when D is faster than P, and the
cases P's answer cannot seed (its token ends the answer or a character, P
fails) must cancel D's leg and answer as the sequential path would.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from pdproxy_helpers import parse_sse
from test_first_token_flow import PROMPT, first_token_counts, reference, text
from token_engine import Faults, TokenEngine, stream_text, tokenize

from vllm_pd_ext.wire.auth import Keyring, verify_leg

N = 6


async def pair(engines, proxy, p_engine: TokenEngine, d_faults=(None,), **config):
    p = await engines("prefill", override=p_engine)
    ds = [await engines("decode", override=TokenEngine(f)) for f in d_faults]
    config.setdefault("first_token_from_prefill", True)
    client = await proxy([p], ds, transfer_mode="push", **config)
    return p, ds, client


def body(stream: bool = True, **more: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": stream}
    out.update(more)
    return out


async def test_d_leg_leaves_before_p_answers_and_token_one_still_comes_first(engines, proxy):
    """D answers at once, P a while later: D's leg went out before P's
    answer, and nothing of D's reached the client before token #1."""
    # P answers 1 s late; D's leg must arrive in the first half of it (a
    # stall of the event loop on a loaded host could break a shorter margin).
    p_engine = TokenEngine(answer_delay=1.0)
    _p, (d,), client = await pair(engines, proxy, p_engine)
    req = body(return_token_ids=True, stream_options={"include_usage": True})
    events = parse_sse(await (await client.post("/v1/completions", json=req)).read())
    ref = reference("/v1/completions", req, N)
    assert stream_text(events) == text(ref)
    ids = [t for e in events[:-1] if e["choices"] for t in e["choices"][0]["token_ids"]]
    assert ids == ref  # token #1 (P's) first, once; D's after it
    prompt_len = len(tokenize("/v1/completions", req))
    assert events[-2]["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": N,
                                   "total_tokens": prompt_len + N}
    (d_seen,) = d.legs()
    assert d_seen.at < p_engine.answered_at[0] - 0.5  # beside P's leg, not after it
    assert d_seen.body["kv_transfer_params"]["pd_seed_pending"] is True
    assert first_token_counts(client) == {("seeded", "concurrent"): 1}


async def test_p_failing_cancels_the_waiting_d_leg(engines, proxy):
    p = await engines("prefill", override=TokenEngine(Faults(status=500)))
    gate = asyncio.Event()  # D holds its leg open, as a D waiting for the KV does
    d = await engines("decode", override=TokenEngine(gate=gate))
    client = await proxy([p], [d], transfer_mode="push", first_token_from_prefill=True,
                         prefill_retries=0)
    resp = await client.post("/v1/completions", json=body())
    assert resp.status >= 500
    await asyncio.wait_for(d.cancelled.wait(), 5)  # D's connection closed: it aborts
    assert len(d.legs()) == 1


async def test_token_one_inside_a_character_sends_the_pair_again_unseeded(engines, proxy):
    """P's token #1 ends inside a character: D's text for token #2 would miss
    its first bytes, so D's concurrent leg is cancelled and the pair goes
    again unseeded (P's prefix cache holds the prompt; D computes token #1
    from the KV P pushes), never as D's own prefill of the whole prompt."""
    p, (d,), client = await pair(engines, proxy, TokenEngine(partial_first=True))
    for stream in (True, False):
        resp = await client.post("/v1/completions", json=body(stream))
        if stream:
            got = stream_text(parse_sse(await resp.read()))
        else:
            got = (await resp.json())["choices"][0]["text"]
        assert got == text(reference("/v1/completions", body(), N))
    d_legs = [b.get("kv_transfer_params") or {} for b in d.override.bodies]
    # Each request: the seeded leg (cancelled), then an unseeded push leg
    # under a new pd_request_id, never one without kv_transfer_params.
    assert [leg.get("pd_seed_pending") for leg in d_legs] == [True, None, True, None]
    assert all(leg.get("do_remote_prefill") for leg in d_legs), d_legs
    assert d_legs[0]["pd_request_id"] != d_legs[1]["pd_request_id"]
    assert d.override.bodies[1]["max_tokens"] == N  # the whole answer: D computes #1
    p_legs = [b["kv_transfer_params"] for b in p.override.bodies]
    assert len(p_legs) == 4  # P twice per request: seeded, then not
    assert [leg["pd_request_id"] for leg in p_legs[:2]] == [d_legs[0]["pd_request_id"],
                                                          d_legs[1]["pd_request_id"]]
    assert first_token_counts(client) == {("fallback", "incomplete_text"): 2}


async def test_d_failing_after_token_one_continues_on_another_d(engines, proxy):
    _p, (_d0, d1), client = await pair(engines, proxy, TokenEngine(),
                                       [Faults(error_after=1), None], max_migrations=2,
                                       routing="round-robin")
    req = body(return_token_ids=True)
    events = parse_sse(await (await client.post("/v1/completions", json=req)).read())
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    ref = reference("/v1/completions", req, N)
    ids = [t for e in events[:-1] if e["choices"] for t in e["choices"][0]["token_ids"]]
    assert ids == ref  # none twice, none missing
    (cont,) = d1.override.bodies
    prompt_ids = tokenize("/v1/completions", req)
    assert cont["prompt"] == [*prompt_ids, *ref[:2]]  # token #1 and D's one token
    assert "kv_transfer_params" not in cont


async def test_off_sends_d_leg_after_p(engines, proxy):
    _p, (d,), client = await pair(engines, proxy, TokenEngine(), concurrent_dispatch=False)
    events = parse_sse(await (await client.post("/v1/completions", json=body())).read())
    assert stream_text(events) == text(reference("/v1/completions", body(), N))
    (d_leg,) = d.override.bodies
    assert d_leg["kv_transfer_params"]["pd_seeded_tokens"] == 1
    assert first_token_counts(client) == {("seeded", ""): 1}


async def test_a_completion_without_max_tokens_gets_vllms_default_count(engines, proxy):
    """vLLM answers a completions request that names no ``max_tokens`` with
    16 tokens; D's leg after P's token #1 must stop one short of its own
    default, in both push flows (and pull's continuation)."""
    for mode, concurrent in (("push", True), ("push", False), ("pull", False)):
        p = await engines("prefill", override=TokenEngine())
        d = await engines("decode", override=TokenEngine())
        client = await proxy([p], [d], transfer_mode=mode, first_token_from_prefill=True,
                             concurrent_dispatch=concurrent)
        req = {"model": "m", "prompt": PROMPT, "stream": True, "return_token_ids": True}
        events = parse_sse(await (await client.post("/v1/completions", json=req)).read())
        ids = [t for e in events[:-1] if e["choices"] for t in e["choices"][0]["token_ids"]]
        assert ids == reference("/v1/completions", req, 16), (mode, concurrent)
        assert d.override.bodies[0]["max_tokens"] == 15


async def test_token_one_goes_out_when_p_answers_even_while_d_is_silent(engines, proxy):
    """D holds its answer (its KV not ready, or its API server slow): the
    client still gets P's token #1 the moment P answers, then D's rest."""
    gate = asyncio.Event()
    p = await engines("prefill", override=TokenEngine())
    d = await engines("decode", override=TokenEngine(gate=gate))
    client = await proxy([p], [d], transfer_mode="push", first_token_from_prefill=True)
    resp = await client.post("/v1/completions", json=body())
    assert resp.status == 200
    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
    assert not gate.is_set() and len(d.legs()) == 1  # D's leg is out, silent
    ref = reference("/v1/completions", body(), N)
    assert json.loads(first[len(b"data: "):])["choices"][0]["text"] == text([ref[0]])
    gate.set()
    rest = parse_sse(first + await resp.read())
    assert stream_text(rest) == text(ref)
    assert first_token_counts(client) == {("seeded", "concurrent"): 1}


async def test_the_concurrent_d_leg_is_signed_over_its_own_body(engines, proxy):
    keyring = Keyring.parse("s" * 32, "test")
    _p, (d,), client = await pair(engines, proxy, TokenEngine(), auth=keyring)
    resp = await client.post("/v1/completions", json=body(), headers={"X-Request-Id": "r7"})
    assert stream_text(parse_sse(await resp.read())) == text(reference("/v1/completions",
                                                                      body(), N))
    (d_leg,) = d.override.bodies
    assert d_leg["kv_transfer_params"]["pd_seed_pending"] is True
    # What D's API server checks: the signature binds D's own leg.
    verify_leg(keyring, d_leg["kv_transfer_params"], request_id="r7", body=d_leg)


async def test_max_tokens_null_stays_no_limit_on_d(engines, proxy):
    """``"max_tokens": null`` means no limit but the model's length (not
    vLLM's default 16): D's leg says so too, in both push flows and pull."""
    for mode, concurrent in (("push", True), ("push", False), ("pull", False)):
        p = await engines("prefill", override=TokenEngine())
        d = await engines("decode", override=TokenEngine())
        client = await proxy([p], [d], transfer_mode=mode, first_token_from_prefill=True,
                             concurrent_dispatch=concurrent)
        req = {"model": "m", "prompt": PROMPT, "max_tokens": None}
        resp = await client.post("/v1/completions", json=req)
        assert resp.status == 200
        (d_leg,) = d.override.bodies
        assert "max_tokens" in d_leg and d_leg["max_tokens"] is None, (mode, concurrent)
