"""Request migration (issue 28): an engine's failure the client never sees.

Fake engines that generate deterministic tokens (token_engine.py): a
continuation from the prompt's ids plus the ids already sent gives exactly
the uninterrupted tokens, so every test compares the client's answer with
an uninterrupted run and checks that no token came twice or went missing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pdproxy_helpers import parse_sse, wait_for
from token_engine import Faults, TokenEngine, generate, stream_text, text_of, tokenize
from vllm_pd_proxy.app import METRICS

PROMPT = "tell me a story"
N = 12

#: The proxy's stream idle timeout where a test stalls a stream: long enough
#: that a loaded host's pause between two healthy chunks does not trip it.
IDLE_S = 1.0


def reference(path: str, body: dict[str, Any], n: int = N) -> str:
    return "".join(text_of(t) for t in generate(tokenize(path, body), n))


def migrations(client: Any) -> dict[tuple[str, str], float]:
    reg = client.server.app[METRICS].registry
    out = {}
    for metric in reg.collect():
        if metric.name == "pd_proxy_migrations":
            for s in metric.samples:
                if s.name.endswith("_total"):
                    out[(s.labels["cause"], s.labels["outcome"])] = s.value
    return out


async def pd(engines, proxy, d_faults: list[Faults | None], p_faults: list[Faults | None]
             | None = None, **config):
    ps = [await engines("prefill", override=TokenEngine(f)) for f in (p_faults or [None])]
    ds = [await engines("decode", override=TokenEngine(f)) for f in d_faults]
    client = await proxy(ps, ds, max_migrations=config.pop("max_migrations", 2), **config)
    return ps, ds, client


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_mid_stream_death_continues_on_another_d(engines, proxy, mode):
    _ps, (d0, d1), client = await pd(engines, proxy, [Faults(die_after=5), None],
                                    transfer_mode=mode, routing="round-robin")
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True,
            "stream_options": {"include_usage": True}}
    resp = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "r1"})
    assert resp.status == 200
    events = parse_sse(await resp.read())
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    # Token for token the uninterrupted answer: none twice, none missing.
    assert stream_text(events) == reference("/v1/completions", body)
    chunks = [e for e in events[:-1] if e["choices"]]
    assert len(chunks) == N
    # One stream to the client: the first D's id, the proxy's token ids hidden.
    assert {e["id"] for e in events[:-1]} == {chunks[0]["id"]}
    assert chunks[0]["id"].startswith(f"cmpl-{d0.engine_id}")
    assert all(c["choices"][0]["token_ids"] is None for c in chunks)
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks)
    usage = events[-2]["usage"]
    prompt_len = len(tokenize("/v1/completions", body))
    assert usage == {"prompt_tokens": prompt_len, "completion_tokens": N,
                     "total_tokens": prompt_len + N}
    # D1 continued from the prompt's ids plus the five sent, five fewer to go.
    (cont,) = d1.override.bodies  # type: ignore[union-attr]
    first_five = generate(tokenize("/v1/completions", body), 5)
    assert cont["prompt"] == [*tokenize("/v1/completions", body), *first_five]
    assert cont["max_tokens"] == N - 5 and cont["return_token_ids"] is True
    assert "kv_transfer_params" not in cont  # D prefills the continuation itself
    assert migrations(client) == {("mid_stream", "ok"): 1}


async def test_chat_stream_continues_as_chat_chunks(engines, proxy):
    _, (_d0, d1), client = await pd(engines, proxy, [Faults(error_after=4), None],
                                   routing="round-robin")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": N, "stream": True}
    resp = await client.post("/v1/chat/completions", json=body)
    events = parse_sse(await resp.read())
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert stream_text(events, chat=True) == reference("/v1/chat/completions", body)
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert {e["id"] for e in events[:-1]} == {events[0]["id"]}
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    (cont,) = d1.override.bodies  # type: ignore[union-attr]
    assert cont["max_tokens"] == N - 4 and "messages" not in cont
    assert migrations(client) == {("mid_stream", "ok"): 1}


async def test_client_asked_token_ids_sees_every_id_once(engines, proxy):
    _, _, client = await pd(engines, proxy, [Faults(die_after=3), None], routing="round-robin")
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True,
            "return_token_ids": True}
    events = parse_sse(await (await client.post("/v1/completions", json=body)).read())
    ids = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
    assert ids == generate(tokenize("/v1/completions", body), N)
    prompt_ids = [e["choices"][0]["prompt_token_ids"] for e in events[:-1]]
    assert prompt_ids[0] == tokenize("/v1/completions", body)
    assert all(p is None for p in prompt_ids[1:])


async def test_stalled_stream_continues_after_the_idle_timeout(engines, proxy):
    _, _, client = await pd(engines, proxy, [Faults(stall_after=6), None],
                            routing="round-robin", stream_idle_timeout=IDLE_S)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True}
    events = parse_sse(await (await client.post("/v1/completions", json=body)).read())
    assert stream_text(events) == reference("/v1/completions", body)
    assert migrations(client) == {("mid_stream", "ok"): 1}


async def test_death_just_before_the_finish_ends_with_length(engines, proxy):
    """Every token reached the client, only the finishing chunk was lost."""
    _, (_, d1), client = await pd(engines, proxy, [Faults(die_after=N), None],
                                  routing="round-robin")
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True,
            "stream_options": {"include_usage": True}}
    events = parse_sse(await (await client.post("/v1/completions", json=body)).read())
    # The fake dies before sending token N (index N-1 sent last): all N went out.
    assert stream_text(events) == reference("/v1/completions", body)
    assert [e["choices"][0]["finish_reason"] for e in events[:-2]][-1] == "length"
    assert events[-2]["usage"]["completion_tokens"] == N
    assert d1.override.legs == 0  # type: ignore[union-attr]


async def test_migrations_are_bounded_then_the_error_event_ends_the_stream(engines, proxy):
    _, ds, client = await pd(engines, proxy, [Faults(die_after=2)] * 3, routing="round-robin")
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True}
    events = parse_sse(await (await client.post("/v1/completions", json=body)).read())
    assert "error" in events[-2] and events[-1] == "[DONE]"
    # 2 tokens from each of the three legs, each once, in order.
    assert stream_text(events) == reference("/v1/completions", body, 6)
    assert sum(d.override.legs for d in ds) == 3  # type: ignore[union-attr]
    assert migrations(client) == {("mid_stream", "failed"): 2,
                                  ("mid_stream", "exhausted"): 1}


async def test_stop_strings_are_not_continued(engines, proxy):
    _, (d0, d1), client = await pd(engines, proxy, [Faults(die_after=3), None],
                                   routing="round-robin")
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True, "stop": ["zz"]}
    events = parse_sse(await (await client.post("/v1/completions", json=body)).read())
    assert "error" in events[-2]
    assert "return_token_ids" not in d0.override.bodies[0]  # type: ignore[union-attr]
    assert d1.override.legs == 0  # type: ignore[union-attr]
    assert migrations(client) == {("mid_stream", "unsupported"): 1}


@pytest.mark.parametrize("how", ["status", "error_event"])
@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_d_failure_before_the_first_byte_is_a_fresh_handoff(engines, proxy, how, mode):
    fault = Faults(status=500) if how == "status" else Faults(error_after=0)
    (p,), (d0, d1), client = await pd(engines, proxy, [fault, None], transfer_mode=mode,
                                      routing="round-robin")
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    events = parse_sse(await resp.read())
    assert stream_text(events) == reference("/v1/completions", body)
    # A new P leg (a new lease) for the second D, not P's first answer again.
    assert p.override.legs == 2  # type: ignore[union-attr]
    assert (d0.override.legs, d1.override.legs) == (1, 1)  # type: ignore[union-attr]
    assert migrations(client) == {("decode_failed", "ok"): 1}


async def test_non_streamed_d_death_is_a_fresh_handoff(engines, proxy):
    (_p,), (_d0, _d1), client = await pd(engines, proxy, [Faults(status=502), None],
                                      routing="round-robin")
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["text"] == reference("/v1/completions", body)
    assert migrations(client) == {("decode_failed", "ok"): 1}


@pytest.mark.parametrize("status", [500, 503])
async def test_p_failure_goes_to_another_p(engines, proxy, status):
    (p0, p1), (d,), client = await pd(engines, proxy, [None], [Faults(status=status), None],
                                      routing="round-robin", prefill_retries=0)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    assert (p0.override.legs, p1.override.legs) == (1, 1)  # type: ignore[union-attr]
    assert "kv_transfer_params" in d.override.bodies[0]  # type: ignore[union-attr]
    assert migrations(client) == {("prefill_failed", "ok"): 1}


async def test_no_p_left_prefills_on_d(engines, proxy):
    (_p,), (d,), client = await pd(engines, proxy, [None], [Faults(status=500)])
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True}
    resp = await client.post("/v1/completions", json=body)
    events = parse_sse(await resp.read())
    assert stream_text(events) == reference("/v1/completions", body)
    (leg,) = d.override.bodies  # type: ignore[union-attr]
    assert "kv_transfer_params" not in leg  # D prefilled it
    assert migrations(client) == {("prefill_failed", "ok"): 1, ("no_prefill", "ok"): 1}


async def test_client_errors_are_not_migrated(engines, proxy):
    (_p,), (_d0, d1), client = await pd(engines, proxy, [Faults(status=400), None],
                                      routing="round-robin")
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": PROMPT})
    assert resp.status == 400
    assert d1.override.legs == 0  # type: ignore[union-attr]
    assert migrations(client) == {}


async def test_zero_disables_migration(engines, proxy):
    _, (d0, d1), client = await pd(engines, proxy, [Faults(die_after=3), None],
                                   routing="round-robin", max_migrations=0)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True}
    events = parse_sse(await (await client.post("/v1/completions", json=body)).read())
    assert "error" in events[-2]
    assert "return_token_ids" not in d0.override.bodies[0]  # type: ignore[union-attr]
    assert d1.override.legs == 0  # type: ignore[union-attr]


async def test_added_latency_is_observed(engines, proxy):
    _, _, client = await pd(engines, proxy, [Faults(stall_after=2), None],
                            routing="round-robin", stream_idle_timeout=IDLE_S)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True}
    await (await client.post("/v1/completions", json=body)).read()
    text = (await (await client.get("/metrics")).read()).decode()
    count = [ln for ln in text.splitlines()
             if ln.startswith("pd_proxy_migration_added_seconds_count")]
    assert count == ["pd_proxy_migration_added_seconds_count 1.0"]
    total = [ln for ln in text.splitlines()
             if ln.startswith("pd_proxy_migration_added_seconds_sum")]
    assert float(total[0].split()[-1]) >= IDLE_S  # the stall itself


async def test_client_gone_mid_stream_is_not_migrated(engines, proxy):
    _, (d0, d1), client = await pd(engines, proxy, [None, None], routing="round-robin")
    d0.override.delay = 0.05  # type: ignore[union-attr]
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 200, "stream": True}
    resp = await client.post("/v1/completions", json=body)
    await resp.content.readany()
    resp.close()
    await wait_for(lambda: d0.in_flight == 0)
    await asyncio.sleep(0.1)
    assert d1.override.legs == 0  # type: ignore[union-attr]
    assert migrations(client) == {}


async def test_every_d_failing_ends_in_the_last_error_after_the_budget(engines, proxy):
    (p,), ds, client = await pd(engines, proxy, [Faults(status=500)] * 2, routing="round-robin")
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "stream": True}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 500
    assert "fake failure" in (await resp.json())["error"]["message"]
    assert p.override.legs == 3  # type: ignore[union-attr]
    assert sum(d.override.legs for d in ds) == 3  # type: ignore[union-attr]
    assert migrations(client) == {("decode_failed", "failed"): 2,
                                  ("decode_failed", "exhausted"): 1}
