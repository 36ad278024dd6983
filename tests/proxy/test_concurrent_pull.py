"""Pull with token #1 from P and both legs at once (``--concurrent-dispatch``,
issue 29 item 2), over fake engines.

D's leg leaves with P's, before P's blocks exist: it names P (its probed
identity) and the ``pd_request_id`` both legs share, no blocks; a real D
parks it until P names its blocks and token #1, then reads the KV. The fake
D, like a real one, continues after the token P samples (token_engine.py).
The client's answer is P's token #1, then D's; an answer that cannot seed D
is served again by the sequential pull with a *new* P answer; a P answer
from another engine than probed fails P's leg; without
``--concurrent-dispatch`` the pull is today's sequential one, never probed.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from pdproxy_helpers import parse_sse, wait_for
from test_first_token_flow import CHAT, PROMPT, first_token_counts, reference, text
from token_engine import Faults, TokenEngine, stream_text, tokenize
from vllm_pd_proxy.app import MONITOR, PREFILL
from vllm_pd_proxy.config import ProxyConfig

N = 6


async def pair(engines, proxy, p_engine: TokenEngine | None = None, d_engines=(None,),
               engine_id: str = "engine-a", **config: Any):
    """One P (a vllm_pd_ext pull engine: its identity says ``pull``) and Ds."""
    p = await engines("prefill", override=p_engine or TokenEngine(), engine_id=engine_id,
                      probe_transfer_mode="pull")
    ds = [await engines("decode", override=e or TokenEngine()) for e in d_engines]
    config.setdefault("first_token_from_prefill", True)
    client = await proxy([p], ds, transfer_mode="pull", **config)
    return p, ds, client


def request(chat: bool, stream: bool, **more: Any) -> tuple[str, dict[str, Any]]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": "m", "max_tokens": N, "stream": stream}
    body.update({"messages": CHAT} if chat else {"prompt": PROMPT})
    body.update(more)
    return path, body


def p_params(pd_id: str) -> dict[str, Any]:
    """The concurrent pull P leg's params: vLLM's toy proxy's, token #1
    asked for, and the id D's leg asks P for the blocks under."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
            "pd_first_token": True, "pd_request_id": pd_id}


def d_params(engine_id: str, pd_id: str) -> dict[str, Any]:
    """The concurrent pull D leg's params: the fake P's probed identity."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": engine_id, "remote_host": "127.0.0.1", "remote_port": 5600,
            "tp_size": 2, "remote_request_id": pd_id, "pd_request_id": pd_id,
            "transfer_mode": "pull", "pd_seed_pending": True, "pd_bidirectional": False}


async def answer_text(resp: Any, chat: bool, stream: bool) -> str:
    if stream:
        return stream_text(parse_sse(await resp.read()), chat=chat)
    choice = (await resp.json())["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


async def test_d_leg_leaves_before_p_answers_and_token_one_comes_first(engines, proxy):
    """P answers late, D at once: D's leg went out before P's answer was
    released, and the client still reads P's token #1 first, then D's."""
    # P answers 1 s late; D's leg must arrive in the first half of it (a
    # stall of the event loop on a loaded host could break a shorter margin).
    p_engine = TokenEngine(answer_delay=1.0)
    p, (d,), client = await pair(engines, proxy, p_engine)
    path, body = request(False, True, return_token_ids=True,
                         stream_options={"include_usage": True})
    resp = await client.post(path, json=body, headers={"X-Request-Id": "r1"})
    events = parse_sse(await resp.read())
    ref = reference(path, body, N)
    assert stream_text(events) == text(ref)
    ids = [t for e in events[:-1] if e["choices"] for t in e["choices"][0]["token_ids"]]
    assert ids == ref  # token #1 (P's) first, once; D's after it
    assert events[-2]["usage"]["completion_tokens"] == N
    (d_seen,) = d.legs()
    assert d_seen.at < p_engine.answered_at[0] - 0.5  # beside P's leg, not after it
    (p_seen,) = p.legs()
    pd_id = p_seen.body["kv_transfer_params"]["pd_request_id"]
    assert re.fullmatch(r"r1-[0-9a-f]{8}", pd_id)  # fresh per dispatch
    assert p_seen.body["kv_transfer_params"] == p_params(pd_id)
    assert d_seen.body["kv_transfer_params"] == d_params("engine-a", pd_id)
    assert len(p.probes()) >= 1  # the identity D's leg names was probed
    assert first_token_counts(client) == {("seeded", "concurrent"): 1}


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
async def test_legs_and_answer(engines, proxy, chat, stream):
    """Both legs' params exactly (one pd_request_id on both); D gets the
    client's own request, one token shorter; the client's answer is the
    uninterrupted run's, P's token #1 then D's."""
    p, (d,), client = await pair(engines, proxy)
    path, body = request(chat, stream)
    resp = await client.post(path, json=body)
    assert resp.status == 200
    ref = reference(path, body, N)
    assert await answer_text(resp, chat, stream) == text(ref)
    (p_leg,) = p.override.bodies
    (d_leg,) = d.override.bodies
    pd_id = p_leg["kv_transfer_params"]["pd_request_id"]
    assert p_leg["kv_transfer_params"] == p_params(pd_id)  # no transfer_mode: push
    assert p_leg["max_tokens"] == 1 and p_leg["return_token_ids"] is True
    assert d_leg["kv_transfer_params"] == d_params("engine-a", pd_id)
    assert d_leg["messages" if chat else "prompt"] == (CHAT if chat else PROMPT)
    assert d_leg["max_tokens"] == N - 1 and d_leg["stream"] is stream
    assert d.legs()[0].path == path
    assert first_token_counts(client) == {("seeded", "concurrent"): 1}


class _NewLeaseEachLeg(TokenEngine):
    """A P whose every answer names other blocks: a new lease per P leg."""

    async def __call__(self, engine, request, body):
        engine.kv_params = {**engine.kv_params, "remote_block_ids": [[100 + self.legs]]}
        return await super().__call__(engine, request, body)


@pytest.mark.parametrize("stream", [False, True])
async def test_unseeded_answer_is_served_by_a_sequential_pull_with_a_new_p_answer(
        engines, proxy, stream):
    """P's token #1 ends inside a character: D's concurrent leg is cancelled
    and the request goes again as today's unseeded pull: P's leg again
    (no token #1 asked), then D's with the *second* answer's params, never
    the first's (the cancelled D may hold or have released that lease)."""
    p, (d,), client = await pair(engines, proxy, _NewLeaseEachLeg(partial_first=True))
    path, body = request(False, stream)
    resp = await client.post(path, json=body)
    assert resp.status == 200
    assert await answer_text(resp, False, stream) == text(reference(path, body, N))
    first_p, second_p = (b["kv_transfer_params"] for b in p.override.bodies)
    assert first_p["pd_first_token"] is True and "pd_request_id" in first_p
    assert "pd_first_token" not in second_p and "pd_request_id" not in second_p
    assert "return_token_ids" not in p.override.bodies[1]
    waiting, sequential = d.override.bodies
    assert waiting["kv_transfer_params"]["pd_seed_pending"] is True
    params = sequential["kv_transfer_params"]
    assert params["remote_block_ids"] == [[101]]  # the second P answer's lease
    assert "pd_seed_pending" not in params and "pd_seeded_tokens" not in params
    assert sequential["prompt"] == PROMPT and sequential["max_tokens"] == N  # D computes #1
    assert first_token_counts(client) == {("fallback", "incomplete_text"): 1}


async def test_without_concurrent_dispatch_the_pull_is_sequential_and_never_probes(
        engines, proxy):
    p, (d,), client = await pair(engines, proxy, concurrent_dispatch=False)
    await wait_for(lambda: bool(p.health_checks()))  # the first round ran
    path, body = request(False, True)
    resp = await client.post(path, json=body)
    assert stream_text(parse_sse(await resp.read())) == text(reference(path, body, N))
    (p_leg,) = p.override.bodies
    assert "pd_request_id" not in p_leg["kv_transfer_params"]
    (d_leg,) = d.override.bodies
    params = d_leg["kv_transfer_params"]
    assert params["remote_block_ids"] == [1, 2, 3]  # P's answer, verbatim
    assert params["pd_seeded_tokens"] == 1 and "pd_seed_pending" not in params
    await asyncio.sleep(0.1)
    assert p.probes() == []  # no forward step on P for an identity nothing needs
    health = await (await client.get("/health")).json()
    assert "identity" not in health["prefill"][0]
    assert first_token_counts(client) == {("seeded", ""): 1}


async def test_health_rounds_probe_no_pull_identity_the_first_concurrent_request_does(
        engines, proxy):
    """A pull proxy's rounds put no forward step on P: the identity is
    probed once, by the first request that can go concurrently, then
    confirmed by P's answers."""
    p, (d,), client = await pair(engines, proxy, health_interval=0.05)
    await wait_for(lambda: len(p.health_checks()) >= 8)  # eight rounds and more
    assert p.probes() == []
    for stream in (False, True):
        path, body = request(False, stream)
        resp = await client.post(path, json=body)
        assert resp.status == 200
        await resp.read()
    checks = len(p.health_checks())
    await wait_for(lambda: len(p.health_checks()) >= checks + 8)
    assert len(p.probes()) == 1
    assert [leg["kv_transfer_params"].get("pd_seed_pending") for leg in d.override.bodies] == [
        True, True]


def test_identity_is_probed_in_pull_only_with_concurrent_dispatch():
    assert ProxyConfig(transfer_mode="pull").probes_identity
    assert not ProxyConfig(transfer_mode="pull", concurrent_dispatch=False).probes_identity
    assert not ProxyConfig(transfer_mode="pull", first_token_from_prefill=False).probes_identity
    assert ProxyConfig(transfer_mode="push", concurrent_dispatch=False).probes_identity


async def test_answer_from_a_restarted_prefill_fails_its_leg_and_refreshes_the_identity(
        engines, proxy):
    """P probed as engine-a restarts as engine-b (no health round between):
    the D leg named engine-a, so P's answer fails P's leg (D's cancelled),
    and the next request's D leg names engine-b, learnt from that answer."""
    gate = asyncio.Event()
    gate.set()
    p, (d,), client = await pair(engines, proxy, d_engines=(TokenEngine(gate=gate),))
    path, body = request(False, True)
    assert (await client.post(path, json=body)).status == 200
    p.restart("engine-b")
    probes = len(p.probes())
    gate.clear()  # D waits for P's blocks, which never come under engine-a
    resp = await asyncio.wait_for(client.post(path, json=body), 5)
    assert resp.status == 502
    message = (await resp.json())["error"]["message"]
    assert "identity changed" in message and "engine-a" in message and "engine-b" in message
    assert d.override.bodies[-1]["kv_transfer_params"]["remote_engine_id"] == "engine-a"
    await wait_for(lambda: d.cancelled.is_set())  # the doomed D leg is aborted
    assert len(p.legs()) == 2  # not retried
    gate.set()
    resp = await client.post(path, json=body)
    assert stream_text(parse_sse(await resp.read())) == text(reference(path, body, N))
    assert d.override.bodies[-1]["kv_transfer_params"]["remote_engine_id"] == "engine-b"
    assert len(p.probes()) == probes  # taken from P's answer, no probe needed


async def test_a_prefill_answering_push_is_refused_clearly(engines, proxy):
    p = await engines("prefill", override=TokenEngine(), probe_transfer_mode="push")
    d = await engines("decode", override=TokenEngine())
    client = await proxy([p], [d], transfer_mode="pull", first_token_from_prefill=True,
                         prefill_retries=0)
    resp = await client.post("/v1/completions", json=request(False, False)[1])
    assert resp.status == 502
    message = (await resp.json())["error"]["message"]
    assert "transfer_mode='push', not 'pull'" in message
    assert d.legs() == [] and p.legs() == []


@pytest.mark.parametrize("which", ["prefill", "decode"])
async def test_an_engine_refusing_its_leg_unrun_sends_the_pair_again_elsewhere(
        engines, proxy, which):
    """Draining: the pair goes again under a new pd_request_id, avoiding it."""
    ps = [await engines("prefill", override=TokenEngine(answer_delay=0.05), engine_id=f"p{i}",
                        probe_transfer_mode="pull") for i in range(2)]
    ds = [await engines("decode", override=TokenEngine()) for _ in range(2)]
    client = await proxy(ps, ds, transfer_mode="pull", first_token_from_prefill=True,
                         routing="round-robin")
    drained = ps[0] if which == "prefill" else ds[0]
    health = await (await client.get("/health")).json()
    assert all(b["state"] == "healthy" for b in health[which])
    # Identities known before the drain (a pull round probes none: the
    # first concurrent request to each P would).
    monitor = client.server.app[MONITOR]
    for backend in client.server.app[PREFILL].backends:
        await monitor.ensure_identity(backend)
    assert all(len(e.probes()) == 1 for e in ps)
    drained.draining = True
    path, body = request(False, True)
    for _ in range(2):
        resp = await client.post(path, json=body)
        assert stream_text(parse_sse(await resp.read())) == text(reference(path, body, N))
    assert len(drained.legs()) == 1  # refused once, then out of rotation
    p_ids = [s.body["kv_transfer_params"]["pd_request_id"] for e in ps for s in e.legs()]
    d_ids = [s.body["kv_transfer_params"]["pd_request_id"] for e in ds for s in e.legs()]
    # Each request served once by a pair sharing one pd_request_id, the one
    # sent again under a new id: the refused leg's is none of theirs.
    refused = drained.legs()[0].body["kv_transfer_params"]["pd_request_id"]
    other = (ps if which == "prefill" else ds)[1]
    served = [s.body["kv_transfer_params"]["pd_request_id"] for s in other.legs()]
    assert len(set(served)) == 2 and refused not in served
    assert set(served) <= set(p_ids) & set(d_ids)


async def test_d_failing_after_token_one_continues_on_another_d(engines, proxy):
    _p, (d0, d1), client = await pair(engines, proxy,
                                       d_engines=(TokenEngine(Faults(error_after=1)), None),
                                       max_migrations=2, routing="round-robin")
    path, body = request(False, True, return_token_ids=True)
    events = parse_sse(await (await client.post(path, json=body)).read())
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    ref = reference(path, body, N)
    ids = [t for e in events[:-1] if e["choices"] for t in e["choices"][0]["token_ids"]]
    assert ids == ref  # none twice, none missing
    (waiting,) = d0.override.bodies
    assert waiting["kv_transfer_params"]["pd_seed_pending"] is True  # beside P's leg
    (cont,) = d1.override.bodies
    assert cont["prompt"] == [*tokenize(path, body), *ref[:2]]  # token #1 and D's one token
    assert "kv_transfer_params" not in cont


async def test_p_failing_cancels_the_waiting_d_leg(engines, proxy):
    gate = asyncio.Event()  # D holds its leg open, as a D parked for P's blocks does
    _p, (d,), client = await pair(engines, proxy, TokenEngine(Faults(status=500)),
                                  (TokenEngine(gate=gate),), prefill_retries=0)
    resp = await client.post("/v1/completions", json=request(False, True)[1])
    assert resp.status >= 500
    await asyncio.wait_for(d.cancelled.wait(), 5)  # D's connection closed: it aborts
    assert len(d.legs()) == 1

