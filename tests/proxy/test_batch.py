"""Batched prompts through the proxy (with ``n`` too): one P/D handoff per prompt,
the answers merged as one vLLM engine answers the batch, refusals before any
leg, failures that cancel the other prompts.

The reference is a fake engine answering the batch itself, as a collocated
vLLM does (``pdproxy_helpers.vllm_like``); the P/D engines are the same fake,
which fails a batch that carries ``kv_transfer_params`` as vLLM's P/D does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pdproxy_helpers import CREATED, FakeEngine, Seen, parse_sse, sse, vllm_like, wait_for

PROMPTS = ["one", "two words", "three more words"]
RID = "b1"


async def _reference(engines, body: dict[str, Any]) -> Any:
    """What one collocated engine answers (JSON, or the stream's payloads)."""
    ref = await engines("decode", override=vllm_like)
    async with (aiohttp.ClientSession() as session,
                session.post(ref.url + "/v1/completions", json=body,
                             headers={"X-Request-Id": RID}) as resp):
        assert resp.status == 200
        raw = await resp.read()
    return parse_sse(raw) if body.get("stream") else json.loads(raw)


def _by_id(legs: list[Seen]) -> list[Seen]:
    return sorted(legs, key=lambda s: s.headers["X-Request-Id"])


def _per_choice(events: list[Any]) -> dict[int, list[Any]]:
    """Each choice's chunks in order (its choice and usage): the merged stream
    interleaves prompts differently from one engine, but never a choice's own."""
    out: dict[int, list[Any]] = {}
    for event in events:
        if isinstance(event, dict) and event.get("choices"):
            (choice,) = event["choices"]
            out.setdefault(choice["index"], []).append((choice, event.get("usage")))
    return out


async def _metric(client, name: str, label: str = "") -> float:
    text = await (await client.get("/metrics")).text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("n", [1, 2])
async def test_batch_answer_equals_one_engines_answer(engines, proxy, mode, n):
    p = await engines("prefill", override=vllm_like, delay=0.1)
    d = await engines("decode", override=vllm_like)
    client = await proxy([p], [d], transfer_mode=mode)
    body = {"model": "m", "prompt": PROMPTS, "max_tokens": 5, "temperature": 0.7, "n": n}
    resp = await client.post("/v1/completions", json=body, headers={"X-Request-Id": RID})
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Request-Id"] == RID
    got = await resp.json()
    want = await _reference(engines, body)
    # Prompt 0's answer names the batch; everything else is the engine's.
    assert got["id"] == f"cmpl-{RID}-0"
    assert {**got, "id": None} == {**want, "id": None}
    assert [c["index"] for c in got["choices"]] == list(range(3 * n))
    assert [c["text"] for c in got["choices"]] == [
        f"{prompt}#{c}." for prompt in PROMPTS for c in range(n)]
    assert got["usage"]["prompt_tokens"] == 6  # 1 + 2 + 3 words
    assert got["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}  # the last prompt's
    # One handoff per prompt, each under its own id; P prefills once, D fans out.
    p_legs, d_legs = _by_id(p.legs()), _by_id(d.legs())
    assert [(s.headers["X-Request-Id"], s.body["prompt"]) for s in p_legs] == [
        (f"{RID}-{i}", prompt) for i, prompt in enumerate(PROMPTS)]
    assert all("n" not in s.body and s.body["max_tokens"] == 1 for s in p_legs)
    assert p.max_in_flight == 3  # the P legs went out together
    assert [(s.headers["X-Request-Id"], s.body["prompt"], s.body["n"]) for s in d_legs] == [
        (f"{RID}-{i}", prompt, n) for i, prompt in enumerate(PROMPTS)]
    assert all(s.body["kv_transfer_params"]["do_remote_prefill"] for s in d_legs)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("n", "continuous"), [(1, False), (2, False), (2, True)])
async def test_streamed_batch_equals_one_engines_stream(engines, proxy, mode, n, continuous):
    p = await engines("prefill", override=vllm_like)
    d = await engines("decode", override=vllm_like, chunk_delay=0.005)
    client = await proxy([p], [d], transfer_mode=mode)
    body = {"model": "m", "prompt": PROMPTS, "max_tokens": 5, "temperature": 0.7, "n": n,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": continuous}}
    resp = await client.post("/v1/completions", json=body, headers={"X-Request-Id": RID})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = parse_sse(await resp.read())
    want = await _reference(engines, body)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    # Each prompt's usage chunk is held back: one summed chunk ends the stream.
    usage_chunks = [e for e in events[:-1] if e["choices"] == []]
    assert usage_chunks == [events[-2]]
    assert events[-2] == {**want[-2], "id": f"cmpl-{RID}-0"}
    assert events[-2]["usage"]["completion_tokens"] == 3 * n * 3
    assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # the first's
    assert {e["id"] for e in events[:-1]} == {f"cmpl-{RID}-0"}
    assert {e["created"] for e in events[:-1]} == {CREATED}
    assert _per_choice(events) == _per_choice(want)
    assert sorted(_per_choice(events)) == list(range(3 * n))


async def test_batch_of_token_id_prompts_with_echo(engines, proxy):
    p, d = await engines("prefill", override=vllm_like), await engines("decode", override=vllm_like)
    client = await proxy([p], [d])
    body = {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2, "echo": True}
    got = await (await client.post("/v1/completions", json=body)).json()
    assert [c["text"] for c in got["choices"]] == ["ids5#0", "ids8#0"]
    assert got["usage"]["prompt_tokens"] == 5
    assert sorted(s.body["prompt"] for s in d.legs()) == [[5, 6, 7], [8, 9]]
    got = await (await client.post("/v1/completions",
                                   json={"prompt": ["ab", "cd"], "echo": True})).json()
    assert [c["text"] for c in got["choices"]] == ["abab#0.", "cdcd#0."]


@pytest.mark.parametrize("prompt", [["only one"], [1, 2, 3], "text"])
async def test_one_prompt_is_not_a_batch(engines, proxy, prompt):
    p, d = await engines("prefill", override=vllm_like), await engines("decode", override=vllm_like)
    client = await proxy([p], [d])
    resp = await client.post("/v1/completions", json={"prompt": prompt},
                             headers={"X-Request-Id": RID})
    assert resp.status == 200
    assert (await resp.json())["id"] == f"cmpl-{RID}"  # D's answer, verbatim
    (p_leg,), (d_leg,) = p.legs(), d.legs()
    assert p_leg.body["prompt"] == prompt == d_leg.body["prompt"]
    assert p_leg.headers["X-Request-Id"] == RID


async def test_local_prefill_serves_each_prompt_on_d(engines, proxy):
    p, d = await engines("prefill", override=vllm_like), await engines("decode", override=vllm_like)
    client = await proxy([p], [d], local_prefill_threshold=1000)
    body = {"prompt": PROMPTS, "max_tokens": 3}
    got = await (await client.post("/v1/completions", json=body,
                                   headers={"X-Request-Id": RID})).json()
    assert {**got, "id": None} == {**await _reference(engines, body), "id": None}
    assert p.legs() == [] and len(d.legs()) == 3
    assert all("kv_transfer_params" not in s.body for s in d.legs())
    assert await _metric(client, "pd_proxy_prefill_decisions_total", 'reason="short_prompt"') == 3
    assert await _metric(client, "pd_proxy_requests_total", 'mode="local"') == 1


async def test_one_request_in_metrics_and_access_log(engines, proxy, caplog):
    caplog.set_level(logging.INFO, logger="vllm_pd_proxy.access")
    p, d = await engines("prefill", override=vllm_like), await engines("decode", override=vllm_like)
    client = await proxy([p], [d])
    resp = await client.post("/v1/completions", json={"prompt": PROMPTS},
                             headers={"X-Request-Id": RID})
    assert resp.status == 200
    await resp.read()
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm_pd_proxy.access"]
    (line,) = lines
    assert line.startswith(f"request_id={RID} ") and " mode=pull " in line
    assert " status=200 outcome=ok " in line and line.endswith(" prompts=3")
    assert f"decode={d.url}" in line and f"prefill={p.url}" in line
    assert await _metric(client, "pd_proxy_requests_total", 'outcome="ok"') == 1
    assert await _metric(client, "pd_proxy_prefill_decisions_total") == 3
    assert await _metric(client, "pd_proxy_backend_legs_total", 'role="decode"') == 3


def _refusals() -> list[tuple[dict[str, Any], str, str, dict[str, Any]]]:
    """(body, param, words of the message, proxy config)."""
    return [
        ({"prompt": ["a", "b", "c"]}, "prompt", "--max-batch-prompts", {"max_batch_prompts": 2}),
        ({"prompt": [[1, 2], []]}, "prompt", "prompt[1] must be a non-empty list", {}),
        ({"prompt": [[1, 2], [3, -1]]}, "prompt", "prompt[1]", {}),
        ({"prompt_embeds": ["AAAA", "BBBB"]}, "prompt_embeds", "one prompt per request", {}),
        ({"prompt": "a", "prompt_embeds": "AAAA"}, "prompt_embeds", "several prompts", {}),
        ({"prompt": ["a", "b"], "n": 0}, "n", "positive integer", {}),
        ({"prompt": ["a", "b"], "n": 2, "temperature": 0.0}, "n", "greedy sampling", {}),
        ({"prompt": ["a", "b"], "n": 2, "temperature": 0}, "n", "greedy sampling",
         {"transfer_mode": "push"}),
    ]


@pytest.mark.parametrize(("body", "param", "words", "config"), _refusals())
async def test_refused_with_400_before_any_leg(engines, proxy, body, param, words, config):
    p, d = await engines("prefill", override=vllm_like), await engines("decode", override=vllm_like)
    client = await proxy([p], [d], **config)
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"]
    assert p.seen == [] and d.seen == []  # not even an identity probe


def _failing_decode(fail_prompt: str, how: str):
    """D: ``fail_prompt`` fails (``how``); the others open their stream at
    once (non-streamed: answer nothing) and then hang for 10 s."""

    async def handler(engine: FakeEngine, request: web.Request, body: dict[str, Any]):
        stream = body.get("stream")
        if body["prompt"] == fail_prompt and how == "status":
            await asyncio.sleep(0.2)  # the other prompts are on their way
            err = {"error": {"message": "bad prompt", "type": "BadRequestError", "code": 400}}
            return web.json_response(err, status=400)
        if not stream:
            await asyncio.sleep(10)
            return web.json_response({})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        first = {"id": "cmpl-x", "created": CREATED,
                 "choices": [{"index": 0, "text": body["prompt"], "finish_reason": None}]}
        await out.write(sse(first))
        if body["prompt"] != fail_prompt:
            await asyncio.sleep(10)
        await asyncio.sleep(0.3)  # every prompt's stream has opened by now
        if how == "dies":
            assert request.transport is not None
            request.transport.close()
            return out
        await out.write(sse({"error": {"message": "engine failed", "code": 500}})
                        + b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    return handler


@pytest.mark.parametrize("stream", [False, True])
async def test_failure_before_the_answer_is_the_batchs_error(engines, proxy, stream):
    p = await engines("prefill", override=vllm_like)
    d = await engines("decode", override=_failing_decode("bad", "status"))
    client = await proxy([p], [d])
    body = {"prompt": ["good", "bad", "good too"], "stream": stream}
    resp = await asyncio.wait_for(client.post("/v1/completions", json=body), 5)
    assert resp.status == 400  # D's own status and body, not a stream
    assert (await resp.json())["error"]["message"] == "bad prompt"
    assert len(d.legs()) == 3
    # The other prompts were cancelled: their D legs closed, long before 10 s.
    await wait_for(lambda: d.in_flight == 0)
    assert d.cancelled.is_set()
    assert await _metric(client, "pd_proxy_requests_total", 'outcome="upstream_4xx"') == 1


async def test_prefill_failure_fails_the_batch_before_its_d_legs(engines, proxy):
    async def prefill(engine: FakeEngine, request: web.Request, body: dict[str, Any]):
        if body["prompt"] == "bad":
            return web.json_response({"error": {"message": "no", "code": 400}}, status=400)
        await asyncio.sleep(10)
        return await vllm_like(engine, request, body)

    p, d = await engines("prefill", override=prefill), await engines("decode")
    client = await proxy([p], [d])
    resp = await asyncio.wait_for(
        client.post("/v1/completions", json={"prompt": ["good", "bad"]}), 5)
    assert resp.status == 400
    await wait_for(lambda: p.in_flight == 0)  # the good prompt's P leg was closed
    assert p.cancelled.is_set() and d.legs() == []


@pytest.mark.parametrize("how", ["dies", "error_event"])
async def test_failure_mid_stream_ends_the_batchs_stream(engines, proxy, how):
    p = await engines("prefill", override=vllm_like)
    d = await engines("decode", override=_failing_decode("boom", how))
    client = await proxy([p], [d])
    body = {"prompt": ["slow", "boom"], "stream": True}
    resp = await client.post("/v1/completions", json=body, headers={"X-Request-Id": RID})
    assert resp.status == 200
    events = parse_sse(await asyncio.wait_for(resp.read(), 5))
    firsts = sorted((e["choices"][0]["index"], e["choices"][0]["text"]) for e in events[:2])
    assert firsts == [(0, "slow"), (1, "boom")]  # re-indexed: prompt 1 is choice 1
    assert "error" in events[2] and events[3:] == ["[DONE]"]
    if how == "dies":
        assert events[2]["error"]["code"] == 502
    else:
        assert events[2]["error"]["message"] == "engine failed"
    await wait_for(lambda: d.in_flight == 0)  # the slow prompt was cancelled
    assert await _metric(client, "pd_proxy_requests_total", 'outcome="stream_error"') == 1


async def test_client_leaving_a_streamed_batch_cancels_every_prompt(engines, proxy):
    p = await engines("prefill", override=vllm_like)
    d = await engines("decode", override=_failing_decode("none", "dies"))
    client = await proxy([p], [d])
    resp = await client.post("/v1/completions",
                             json={"prompt": ["a", "b", "c"], "stream": True})
    assert resp.status == 200
    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 3)
    resp.close()
    await wait_for(lambda: d.in_flight == 0)
    await wait_for(lambda: d.cancelled.is_set())
    metrics = await (await client.get("/metrics")).text()
    assert 'pd_proxy_requests_total{mode="pull",outcome="cancelled"} 1.0' in metrics


async def test_multi_turn_is_off_for_batches(engines, proxy):
    p, d = await engines("prefill", override=vllm_like), await engines("decode", override=vllm_like)
    client = await proxy([p], [d], multi_turn=True)
    headers = {"X-Session-Id": "conv-1"}
    body = {"prompt": ["a", "b"], "conversation_id": "c-1", "max_tokens": 2}
    assert (await client.post("/v1/completions", json=body, headers=headers)).status == 200
    for leg in p.legs() + d.legs():
        assert "conversation_id" not in leg.body
        assert not leg.body["kv_transfer_params"].get("pd_bidirectional")
    assert all(leg.body["kv_transfer_params"]["pd_bidirectional"] is False for leg in d.legs())
    # n = 1 on the same conversation still asks D to keep the turn.
    assert (await client.post("/v1/completions", json={"prompt": "a"}, headers=headers)).status \
        == 200
    assert d.legs()[-1].body["kv_transfer_params"].get("pd_bidirectional") is True


async def test_batch_shares_its_requests_body_budget(engines, proxy):
    release = asyncio.Event()

    async def hold(engine: FakeEngine, request: web.Request, body: dict[str, Any]):
        if body["prompt"].startswith("held"):
            await asyncio.wait_for(release.wait(), 5)
        return await vllm_like(engine, request, body)

    p, d = await engines("prefill", override=hold), await engines("decode", override=vllm_like)
    client = await proxy([p], [d], max_request_bytes=4096, max_total_body_bytes=6000)
    batch = {"prompt": ["held" + "x" * 1400, "held" + "y" * 1400]}  # ~2.9 KB
    first = asyncio.ensure_future(client.post("/v1/completions", json=batch))
    await wait_for(lambda: p.in_flight == 2)
    # Counted once: 2.9 KB held, so 2.5 KB more fit under 6000.
    resp = await client.post("/v1/completions", json={"prompt": "z" * 2500})
    assert resp.status == 200
    release.set()
    assert (await first).status == 200


async def test_telemetry_per_prompt(engines, proxy):
    p, d = await engines("prefill", override=vllm_like), await engines("decode", override=vllm_like)
    client = await proxy([p], [d], transfer_telemetry=True)
    body = {"prompt": ["a", "b"], "max_tokens": 2}
    got = await (await client.post("/v1/completions", json=body,
                                   headers={"X-Request-Id": RID})).json()
    assert [t["request_id"] for t in got["pd_telemetry"]] == [f"{RID}-0", f"{RID}-1"]
    assert all(t["proxy"]["mode"] == "pull" for t in got["pd_telemetry"])
    resp = await client.post("/v1/completions", json={**body, "stream": True},
                             headers={"X-Request-Id": RID})
    events = parse_sse(await resp.read())
    finishing = {e["choices"][0]["index"]: e["pd_telemetry"]["request_id"]
                 for e in events if isinstance(e, dict) and "pd_telemetry" in e}
    assert finishing == {0: f"{RID}-0", 1: f"{RID}-1"}
