"""Token #1 from P (``--first-token-from-prefill``, the default), over fake engines.

The engines generate deterministic tokens (token_engine.py): a continuation
from the prompt's ids plus token #1 yields exactly the uninterrupted
tokens, as greedy decoding does on a real engine. Every test compares the
client's answer with an uninterrupted run (no token twice, none missing)
and looks at the legs: P's returns the token ids, D's continues after
token #1 with P's ``kv_transfer_params`` and ``pd_seeded_tokens`` 1.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pdproxy_helpers import parse_sse
from token_engine import Faults, TokenEngine, generate, stream_text, text_of, tokenize
from vllm_pd_proxy.app import METRICS

from vllm_pd_ext.wire.auth import Keyring, verify_leg

PROMPT = "tell me a story"
N = 8
CHAT = [{"role": "user", "content": "hi"}]


def reference(path: str, body: dict[str, Any], n: int = N) -> list[int]:
    return generate(tokenize(path, body), n)


def text(ids: list[int]) -> str:
    return "".join(text_of(t) for t in ids)


def first_token_counts(client: Any) -> dict[tuple[str, str], float]:
    out = {}
    for metric in client.server.app[METRICS].registry.collect():
        if metric.name == "pd_proxy_first_token":
            for s in metric.samples:
                if s.name.endswith("_total"):
                    out[(s.labels["path"], s.labels["reason"])] = s.value
    return out


async def pd(engines, proxy, d_faults=(None,), *, stop_first=False, gate=None, **config):
    mode = config.get("transfer_mode", "pull")
    if mode == "pull":
        # The tests not run over MODES take the sequential pull (the
        # concurrent one has MODES and test_concurrent_pull.py).
        config.setdefault("concurrent_dispatch", False)
    # The engine's identity names the proxy's mode, as vllm_pd_ext's does.
    p = await engines("prefill", override=TokenEngine(stop_first=stop_first),
                      probe_transfer_mode=mode)
    ds = [await engines("decode", override=TokenEngine(f, gate=gate)) for f in d_faults]
    config.setdefault("first_token_from_prefill", True)
    client = await proxy([p], ds, **config)
    return p, ds, client


def bodies(engine) -> list[dict[str, Any]]:
    return engine.override.bodies


#: The flows: pull and push with D's leg beside P's (``--concurrent-dispatch``,
#: the default: token #1 reaches D from P, with the KV or its blocks' names),
#: and each with D's leg after P's answer (``-seq``).
MODES = ["pull", "pull-seq", "push", "push-seq"]
#: The MODES whose D leg leaves beside P's.
CONCURRENT = ("pull", "push")


def flow(mode: str) -> dict[str, Any]:
    """The proxy config of a flow of ``MODES``."""
    return {"transfer_mode": mode.removesuffix("-seq"),
            "concurrent_dispatch": not mode.endswith("-seq")}


def assert_d_leg(mode: str, d_leg: dict[str, Any], prompt: Any, prompt_ids: list[int],
                 token_one: int, limit: int, chat: bool = False) -> None:
    """D's leg continues after token #1: sequential, its prompt carries the
    token (``pd_seeded_tokens``), a completions request even for chat;
    concurrent, D gets the client's request (a chat's messages) and token #1
    comes from P (``pd_seed_pending``)."""
    params = d_leg["kv_transfer_params"]
    assert d_leg["max_tokens"] == limit - 1
    if mode in CONCURRENT:
        assert d_leg["messages" if chat else "prompt"] == prompt
        assert d_leg["return_token_ids"] is True
        assert params["pd_seed_pending"] is True and "pd_seeded_tokens" not in params
    else:
        assert d_leg["prompt"] == [*prompt_ids, token_one]
        assert params["pd_seeded_tokens"] == 1 and "pd_seed_pending" not in params


def seeded_count(mode: str) -> dict[tuple[str, str], float]:
    return {("seeded", "concurrent" if mode in CONCURRENT else ""): 1}


@pytest.mark.parametrize("mode", MODES)
async def test_streamed_completion_gets_token_one_from_p_and_the_rest_from_d(
        engines, proxy, mode):
    p, (d,), client = await pd(engines, proxy, **flow(mode))
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True,
            "stream_options": {"include_usage": True}}
    resp = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "r1"})
    assert resp.status == 200 and resp.headers["X-Request-Id"] == "r1"
    events = parse_sse(await resp.read())
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    ref = reference("/v1/completions", body)
    assert stream_text(events) == text(ref)
    chunks = [e for e in events[:-1] if e["choices"]]
    assert len(chunks) == N and len({e["id"] for e in events[:-1]}) == 1
    assert all(c["choices"][0]["token_ids"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    prompt_ids = tokenize("/v1/completions", body)
    assert events[-2]["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": N,
                                   "total_tokens": len(prompt_ids) + N}
    (p_leg,) = [b for b in bodies(p)]
    assert p_leg["return_token_ids"] is True and p_leg["max_tokens"] == 1
    assert p_leg["kv_transfer_params"]["pd_first_token"] is True
    (d_leg,) = bodies(d)
    assert_d_leg(mode, d_leg, PROMPT, prompt_ids, ref[0], N)
    params = d_leg["kv_transfer_params"]
    assert params["pd_bidirectional"] is False
    if mode == "pull-seq":
        assert params["remote_engine_id"] == p.engine_id  # P's answer, verbatim
    else:
        assert params["pd_request_id"] == p_leg["kv_transfer_params"]["pd_request_id"]
        assert params["remote_engine_id"] == p.engine_id  # the probed identity
    assert d.legs()[0].path == "/v1/completions"
    assert first_token_counts(client) == seeded_count(mode)


async def test_token_one_reaches_the_client_before_d_answers(engines, proxy):
    gate = asyncio.Event()
    _p, _ds, client = await pd(engines, proxy, gate=gate)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
    assert not gate.is_set()  # D has not sent a byte yet
    chunk = json.loads(first[len(b"data: "):])
    ref = reference("/v1/completions", body)
    assert chunk["choices"][0]["text"] == text_of(ref[0])
    gate.set()
    rest = parse_sse(first + await resp.read())
    assert stream_text(rest) == text(ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("wants_ids", [True, False])
async def test_chat_stream_starts_with_the_role_then_token_one(engines, proxy, mode,
                                                              wants_ids):
    _p, (d,), client = await pd(engines, proxy, **flow(mode))
    body = {"model": "m", "messages": CHAT, "max_completion_tokens": N, "stream": True,
            "return_token_ids": wants_ids, "stream_options": {"include_usage": True}}
    events = parse_sse(await (await client.post("/v1/chat/completions", json=body)).read())
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    ref = reference("/v1/chat/completions", body)
    assert stream_text(events, chat=True) == text(ref)
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert len({e["id"] for e in events[:-1]}) == 1
    # One role chunk (P's), first; then one chunk per token, the last one
    # finishing; then the usage of the whole answer.
    roles = [e for e in events[:-1] if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert roles == [events[0]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    prompt_ids = tokenize("/v1/chat/completions", body)
    assert events[0]["prompt_token_ids"] == (prompt_ids if wants_ids else None)
    tokens = events[1:-2]
    assert len(tokens) == N and all(e["choices"][0]["delta"] for e in tokens)
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None] * (N - 1) + ["length"]
    ids = [t for e in tokens for t in e["choices"][0]["token_ids"] or ()]
    assert ids == (ref if wants_ids else [])  # each once, token #1's from P
    assert events[-2]["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": N,
                                   "total_tokens": len(prompt_ids) + N}
    (d_leg,) = bodies(d)
    if mode in CONCURRENT:
        # Beside P's leg, before token #1 existed: the client's own chat
        # request, one token shorter, on D's chat endpoint.
        assert d_leg["messages"] == CHAT and d_leg["max_completion_tokens"] == N - 1
        assert d_leg["kv_transfer_params"]["pd_seed_pending"] is True
        assert d.legs()[0].path == "/v1/chat/completions"
    else:
        assert "messages" not in d_leg and d_leg["max_tokens"] == N - 1
        assert d.legs()[0].path == "/v1/completions"
    assert first_token_counts(client) == seeded_count(mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chat", [False, True])
async def test_non_streamed_answer_merges_token_one_and_d_rest(engines, proxy, mode, chat):
    _p, (d,), client = await pd(engines, proxy, **flow(mode))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": "m", "max_tokens": N}
    body.update({"messages": CHAT} if chat else {"prompt": PROMPT})
    resp = await client.post(path, json=body)
    assert resp.status == 200
    answer = await resp.json()
    choice = answer["choices"][0]
    ref = reference(path, body)
    assert (choice["message"]["content"] if chat else choice["text"]) == text(ref)
    assert choice["finish_reason"] == "length" and choice["token_ids"] is None
    prompt_len = len(tokenize(path, body))
    assert answer["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": N,
                               "total_tokens": prompt_len + N}
    assert "kv_transfer_params" not in answer
    (d_leg,) = bodies(d)
    assert d_leg["stream"] is False
    assert_d_leg(mode, d_leg, CHAT if chat else PROMPT, tokenize(path, body), ref[0], N,
                 chat=chat)
    assert first_token_counts(client) == seeded_count(mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", [False, True])
async def test_token_one_that_ends_the_answer_is_p_answer_alone(engines, proxy, mode, stream):
    _p, (d,), client = await pd(engines, proxy, stop_first=True, **flow(mode))
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": stream,
            "stream_options": {"include_usage": True}} if stream else {
            "model": "m", "prompt": PROMPT, "max_tokens": N}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    ref = reference("/v1/completions", body, 1)
    if stream:
        events = parse_sse(await resp.read())
        assert events[-1] == "[DONE]" and stream_text(events) == text(ref)
        assert events[-3]["choices"][0]["finish_reason"] == "stop"
        assert events[-2]["usage"]["completion_tokens"] == 1
    else:
        answer = await resp.json()
        assert answer["choices"][0]["text"] == text(ref)
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert answer["usage"]["completion_tokens"] == 1
        assert "kv_transfer_params" not in answer
    if mode in CONCURRENT:
        # D's leg left with P's; P's answer being the whole one, it was
        # cancelled (a real D then aborts it: P handed over nothing for it).
        assert [b["kv_transfer_params"]["pd_seed_pending"] for b in bodies(d)] == [True]
    else:
        assert d.legs() == []  # no D leg at all
    assert first_token_counts(client) == {("prefill", ""): 1}


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_one_token_request_is_served_by_p_without_a_handoff(engines, proxy, mode):
    p, (d,), client = await pd(engines, proxy, transfer_mode=mode)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 1, "stream": True}
    events = parse_sse(await (await client.post("/v1/completions", json=body)).read())
    assert stream_text(events) == text(reference("/v1/completions", body, 1))
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    (p_leg,) = bodies(p)
    assert "kv_transfer_params" not in p_leg  # P keeps no lease for a D that never comes
    assert d.legs() == []


async def test_requests_it_cannot_serve_exactly_take_the_usual_path(engines, proxy):
    _p, (d,), client = await pd(engines, proxy)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stop": ["never"]}
    answer = await (await client.post("/v1/completions", json=body)).json()
    assert answer["choices"][0]["text"] == text(reference("/v1/completions", body))
    (d_leg,) = bodies(d)
    assert d_leg["prompt"] == PROMPT  # D computes token #1 itself
    assert "pd_seeded_tokens" not in d_leg["kv_transfer_params"]
    assert first_token_counts(client) == {("fallback", "stop_strings"): 1}


async def test_p_answer_without_token_ids_falls_back(engines, proxy):
    p = await engines("prefill")  # a plain fake: its answer names no ids
    d = await engines("decode")
    client = await proxy([p], [d], first_token_from_prefill=True, concurrent_dispatch=False)
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": PROMPT,
                                                      "max_tokens": 4})
    assert resp.status == 200
    assert first_token_counts(client) == {("fallback", "no_token_ids"): 1}
    assert d.legs()[0].body["prompt"] == PROMPT


async def test_a_prefill_that_is_not_vllm_pd_ext_falls_back(engines, proxy):
    """vLLM's NixlConnector P: its decode engines would not know pd_seeded_tokens
    (nor a concurrent pull: its identity names no transfer_mode, so even
    with --concurrent-dispatch, the default, the pull is sequential)."""
    p = await engines("prefill", override=TokenEngine(pd_ext=False), probe_transfer_mode=None)
    d = await engines("decode", override=TokenEngine())
    client = await proxy([p], [d], first_token_from_prefill=True)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N}
    answer = await (await client.post("/v1/completions", json=body)).json()
    assert answer["choices"][0]["text"] == text(reference("/v1/completions", body))
    assert first_token_counts(client) == {("fallback", "not_pd_ext"): 1}
    (d_leg,) = bodies(d)
    assert d_leg["prompt"] == PROMPT
    assert "pd_seed_pending" not in d_leg["kv_transfer_params"]


async def test_off_sends_no_first_token_fields(engines, proxy):
    p, (d,), client = await pd(engines, proxy, first_token_from_prefill=False)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True}
    events = parse_sse(await (await client.post("/v1/completions", json=body)).read())
    assert stream_text(events) == text(reference("/v1/completions", body))
    (p_leg,) = bodies(p)
    assert "return_token_ids" not in p_leg
    assert "pd_first_token" not in p_leg["kv_transfer_params"]
    assert bodies(d)[0]["prompt"] == PROMPT and first_token_counts(client) == {}


async def test_d_failing_after_token_one_ends_with_one_error_event_without_migration(
        engines, proxy):
    _p, _ds, client = await pd(engines, proxy, [Faults(status=500)], max_migrations=0)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200  # the stream started with token #1
    events = parse_sse(await resp.read())
    ref = reference("/v1/completions", body)
    assert stream_text(events) == text_of(ref[0])  # token #1 once, nothing after it
    assert "error" in events[-2] and events[-1] == "[DONE]"


@pytest.mark.parametrize("fault", [Faults(status=500), Faults(die_after=3),
                                   Faults(error_after=0)])
async def test_d_failing_after_token_one_continues_on_another_d(engines, proxy, fault):
    _p, (_d0, d1), client = await pd(engines, proxy, [fault, None], max_migrations=2,
                                    routing="round-robin")
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    events = parse_sse(await (await client.post("/v1/completions", json=body)).read())
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    ref = reference("/v1/completions", body)
    assert stream_text(events) == text(ref)
    ids = [t for e in events[:-1] if e["choices"] for t in e["choices"][0]["token_ids"]]
    assert ids == ref  # none twice, none missing
    assert events[-2]["usage"]["completion_tokens"] == N
    (cont,) = bodies(d1)
    assert cont["prompt"][:len(tokenize("/v1/completions", body)) + 1] == [
        *tokenize("/v1/completions", body), ref[0]]
    assert "kv_transfer_params" not in cont  # the other D prefills the continuation


async def test_telemetry_names_the_path(engines, proxy):
    _p, _ds, client = await pd(engines, proxy, transfer_telemetry=True)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N}
    answer = await (await client.post("/v1/completions", json=body)).json()
    assert answer["pd_telemetry"]["proxy"]["first_token"] == "seeded"
    stop = {**body, "stop": ["x"]}
    answer = await (await client.post("/v1/completions", json=stop)).json()
    assert answer["pd_telemetry"]["proxy"]["first_token"] == "fallback:stop_strings"


async def test_d_leg_is_signed_over_its_own_prompt(engines, proxy):
    keyring = Keyring.parse("s" * 32, "test")
    _p, (d,), client = await pd(engines, proxy, auth=keyring)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True}
    resp = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "r9"})
    events = parse_sse(await resp.read())
    assert stream_text(events) == text(reference("/v1/completions", body))
    (d_leg,) = bodies(d)
    # What D's API server checks: the signature binds the continuation's prompt.
    verify_leg(keyring, d_leg["kv_transfer_params"], request_id="r9", body=d_leg)
