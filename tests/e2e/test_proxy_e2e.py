"""Our proxy in front of real PDConnector engines (pull mode)."""

from __future__ import annotations

import re
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.helpers import (
    CACHE_HIT,
    EXTERNAL,
    KV_BYTES,
    assert_same_as_reference,
    completion_body,
    delta,
    log_dir,
    open_stream,
    run_clients,
    stream_text,
    text_prompt,
    token_prompt,
)
from vllm_pd_ext.testing.engines import Engine, Proxy
from vllm_pd_ext.testing.oracle import stream_output
from vllm_pd_ext.wire import telemetry

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
    assert_same_as_reference(ref, got, want)
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
    got = stream_output(events)
    assert got.text == text
    assert_same_as_reference(ref, got, want)
    assert delta(before, after, EXTERNAL) == 180


def test_chat_completion_through_proxy(ref: Engine, d: Engine, proxy: Proxy, model: str
                                       ) -> None:
    body = {"model": model, "temperature": 0, "max_tokens": 10, "return_token_ids": True,
            "messages": [{"role": "user", "content": "Write a function that sorts a list. " * 8}]}
    _, want = ref.post("/v1/chat/completions", body)
    before = d.metrics()
    status, got = proxy.post("/v1/chat/completions", body)
    after = d.metrics()
    assert status == 200, got
    assert_same_as_reference(ref, got, want)
    assert delta(before, after, EXTERNAL) == got["usage"]["prompt_tokens"] > 0


def first_token_paths(proxy: Proxy) -> dict[str, float]:
    """``pd_proxy_first_token_total`` by ``path[:reason]``."""
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'pd_proxy_first_token_total\{path="([^"]*)",reason="([^"]*)"\} (\S+)',
                     line)
        if m:
            out[m[1] + (f":{m[2]}" if m[2] else "")] = float(m[3])
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_first_token_from_p_then_d_equals_collocated(ref: Engine, d: Engine, proxy: Proxy,
                                                     model: str, chat: bool, stream: bool
                                                     ) -> None:
    """Token #1 is P's, D continues from token #2 (no recompute of token #1):
    every token, the finish reason and the usage equal the collocated
    engine's, and D loaded P's whole prompt as KV."""
    if chat:
        path = "/v1/chat/completions"
        body: dict = {"model": model, "temperature": 0, "max_tokens": 12,
                      "return_token_ids": True, "messages": [
                          {"role": "user", "content": f"Seeded {stream} " * 40}]}
    else:
        path = "/v1/completions"
        body = completion_body(model, token_prompt(230, seed=27 + stream), max_tokens=12,
                               ignore_eos=True)
    _, want = ref.post(path, body)
    if stream:
        body["stream_options"] = {"include_usage": True}
    paths, before = first_token_paths(proxy), d.metrics()
    if stream:
        _, events = stream_text(proxy.url + path, body)
        got = stream_output(events)
        assert events[-1] == "[DONE]"
        usage = events[-2]["usage"]
        if chat:
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
        assert len({e["id"] for e in events[:-1]}) == 1
    else:
        status, answer = proxy.post(path, body)
        assert status == 200, answer
        got, usage = answer, answer["usage"]
    after = d.metrics()
    assert_same_as_reference(ref, got, want)
    prompt_tokens = want["usage"]["prompt_tokens"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [usage[k] for k in counts] == [want["usage"][k] for k in counts]
    assert (got.finish_reason if stream else got["choices"][0]["finish_reason"]) == \
        want["choices"][0]["finish_reason"]
    assert delta(before, after, EXTERNAL) == prompt_tokens  # KV moved, P's prompt
    now = first_token_paths(proxy)
    # Chat goes beside P's leg (concurrent pull); a prompt of token ids may
    # end inside a character, so it goes sequentially (proxy dispatch.py).
    path = "seeded:concurrent" if chat else "seeded"
    assert now.get(path, 0) - paths.get(path, 0) == 1, now


def test_concurrent_pull_loads_p_kv_beside_p_and_continues_after_token_one(
        ref: Engine, p: Engine, d: Engine, model: str) -> None:
    """Issue 29 item 2, pull: the proxy's default pull flow sends D's leg
    beside P's (text prompts and chat); D parks it without blocks until P's
    ``PullReady`` names P's blocks and token #1, READs them and continues
    from token #2. Under a small concurrent load, streamed and not, every
    answer (tokens, text, finish reason, usage) equals the collocated
    engine's, D loaded every prompt as KV, and the telemetry names the path
    and shows D's leg left before P answered."""
    px = Proxy([p.url], [d.url], log_dir("pull-concurrent"),
               args=["--transfer-telemetry"]).start()
    try:
        px.wait_ready()
        jobs: list[tuple[str, dict[str, Any]]] = []
        for i in range(6):
            body = completion_body(model, text_prompt(50 + 41 * i, seed=310 + i),
                                   max_tokens=5 + i % 4, ignore_eos=True, stream=i % 2 == 0)
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
            jobs.append((f"cpull-{i}", body))
        for i in range(4):
            chat: dict[str, Any] = {
                "model": model, "temperature": 0, "return_token_ids": True, "ignore_eos": True,
                "max_tokens": 4 + i, "stream": i % 2 == 1,
                "messages": [{"role": "user", "content": text_prompt(30 + 23 * i, seed=330 + i)}]}
            if chat["stream"]:
                chat["stream_options"] = {"include_usage": True}
            jobs.append((f"cpull-chat-{i}", chat))
        wants = {rid: ref.post("/v1/chat/completions" if "messages" in body
                               else "/v1/completions", {
            **{k: v for k, v in body.items() if k != "stream_options"}, "stream": False})[1]
            for rid, body in jobs}
        paths, before = first_token_paths(px), d.metrics()
        results = run_clients(px.url, jobs, 3)
        after = d.metrics()
        _, events = stream_text(px.url + "/v1/completions", jobs[0][1])
        now = first_token_paths(px)
    finally:
        px.stop()
    prompt_tokens = 0
    for rid, _ in jobs:
        got = results[rid]
        assert not isinstance(got, BaseException), (rid, got)
        assert_same_as_reference(ref, got, wants[rid])
        prompt_tokens += wants[rid]["usage"]["prompt_tokens"]
    assert delta(before, after, EXTERNAL) == prompt_tokens  # every prompt came as KV
    assert delta(before, after, KV_BYTES) > 0
    # Most went beside P's leg; a token #1 inside a character goes again
    # unseeded (the ``incomplete_text`` fallback, random weights).
    grew = {k: now.get(k, 0) - paths.get(k, 0) for k in now}
    assert grew.get("seeded:concurrent", 0) >= len(jobs) // 2, grew
    assert grew.get("seeded:concurrent", 0) + grew.get("fallback:incomplete_text", 0) == (
        len(jobs) + 1), grew
    tele = [e["pd_telemetry"] for e in events if isinstance(e, dict) and "pd_telemetry" in e]
    assert len(tele) == 1, events
    proxy_t, record = tele[0]["proxy"], tele[0]["transfer"]
    if proxy_t["first_token"] == "seeded:concurrent":
        # D's leg left before P answered; token #1 reached the client first.
        assert proxy_t["decode_sent_ms"] < proxy_t["prefill_done_ms"] <= (
            proxy_t["first_token_ms"])
        # D waited for P's answer, then READ P's blocks itself.
        assert record["mode"] == "pull" and record["outcome"] == "ok", record
        assert record["p_wait_ms"] > 0 and record["read_ms"] > 0, record
        assert record["kv_ready_ms"] > record["p_wait_ms"], record
        # No pin round trip: P's answer extended the lease (protocol 10).
        assert record["pin_in_answer"] is True and "pin_ms" not in record, record
    assert "cannot continue after P's token #1" not in d.log_text()


def test_prompt_longer_than_context_returns_backend_4xx(proxy: Proxy, p: Engine, model: str
                                                        ) -> None:
    body = completion_body(model, token_prompt(2100, seed=23), max_tokens=4)
    direct_status, _ = p.post("/v1/completions", body)
    status, got = proxy.post("/v1/completions", body)
    assert 400 <= direct_status < 500
    assert status == direct_status, got
    assert "error" in got and "2100" in str(got), got


def test_client_disconnect_aborts_the_decode_leg(d: Engine, proxy: Proxy, model: str) -> None:
    """Closing the client connection mid-stream makes D abort the request and
    free its blocks (it would otherwise generate 1500 more tokens)."""
    import time

    body = completion_body(model, token_prompt(200, seed=24), max_tokens=1500,
                           ignore_eos=True, stream=True)
    before = d.metrics()
    # Token #1 comes from P, then D's tokens: generation under way on D.
    with open_stream(proxy.url + "/v1/completions", body, events=3):
        assert d.metrics()["vllm:num_requests_running"] == 1
    # The client went away.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = d.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0:
            break
        time.sleep(0.2)
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    # Aborted early, not run to completion.
    assert m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 1500


def test_transfer_telemetry_through_proxy(ref: Engine, p: Engine, d: Engine, model: str
                                          ) -> None:
    """--transfer-telemetry: the stream's finishing chunk carries the proxy's
    leg timings and D's transfer record, whose bytes are the bytes D's
    metrics say it read; D logs the same record as one JSON line; D's
    engine addresses (its other kv_transfer_params) never reach the client."""
    px = Proxy([p.url], [d.url], log_dir("proxy-telemetry"),
               args=["--transfer-telemetry"]).start()
    try:
        px.wait_ready()
        body = completion_body(model, token_prompt(300, seed=25), max_tokens=8)
        _, want = ref.post("/v1/completions", body)
        before = d.metrics()
        _, events = stream_text(px.url + "/v1/completions", body)
        after = d.metrics()
    finally:
        px.stop()
    got = stream_output(events)
    assert_same_as_reference(ref, got, want)
    assert delta(before, after, EXTERNAL) == 300
    tele = [e["pd_telemetry"] for e in events if isinstance(e, dict) and "pd_telemetry" in e]
    assert len(tele) == 1, events
    assert not any("kv_transfer_params" in e for e in events if isinstance(e, dict))
    proxy_t, rec = tele[0]["proxy"], tele[0]["transfer"]
    assert proxy_t["mode"] == "pull" and proxy_t["first_token"] == "seeded"
    # Token #1 reached the client when P answered, before D's first byte.
    assert proxy_t["prefill_done_ms"] <= proxy_t["first_token_ms"] < proxy_t[
        "decode_first_byte_ms"]
    assert (0 <= proxy_t["prefill_sent_ms"] < proxy_t["prefill_done_ms"]
            <= proxy_t["decode_sent_ms"] < proxy_t["decode_first_byte_ms"])
    assert rec["outcome"] == "ok" and rec["mode"] == "pull"
    assert rec["bytes"] == delta(before, after, KV_BYTES) > 0
    assert rec["tokens"] == 300 and rec["blocks"] == 3 and rec["descriptors"] >= 1
    assert rec["p_engine"] and rec["p_addr"].endswith(f":{p.side_channel_port}")
    assert 0 < rec["lease_left_s"] <= 30
    assert rec["read_ms"] > 0 and rec["pin_ms"] > 0 and rec["handshake_ms"] > 0
    # The worker's phases (its job's arrival to the READ's end) lie within
    # the scheduler's span (the request's arrival to its KV reported loaded).
    # The pin ran beside the READ (issue 29).
    assert rec["pin_with_read"] is True
    phases = rec["handshake_ms"] + max(rec["pin_ms"], rec["read_ms"])
    assert phases <= rec["worker_ms"] + 0.01, (phases, rec)
    # The scheduler's pass and the worker's span lie within kv_ready (one
    # host: CLOCK_MONOTONIC is shared by D's processes); the rest is the
    # crossings of vLLM's step queues.
    assert rec["sched_ms"] >= 0 and rec["sched_ms"] + rec["worker_ms"] <= rec[
        "kv_ready_ms"] + 0.01, rec
    # D's API server stamped the request before its scheduler saw it.
    assert rec["api_ms"] > 0, rec
    logged = [r for r in map(telemetry.parse_log_line, d.log_text().splitlines())
              if r is not None and r.request_id == rec["request_id"]]
    assert [telemetry.to_dict(r) for r in logged] == [rec]


def test_default_threshold_decides_on_uncached_tokens(ref: Engine, p: Engine, d: Engine,
                                                      model: str) -> None:
    """The proxy's conditional rule against real engines: a short prompt is
    prefilled on D (no KV moves), a long one is disaggregated (its KV moves),
    and the long one again with a short new suffix is prefilled on D because
    D caches the rest, which D's own prefix-cache counter confirms. Every
    output equals the collocated engine's."""
    from vllm_pd_proxy.config import DEFAULT_LOCAL_PREFILL_THRESHOLD

    threshold = DEFAULT_LOCAL_PREFILL_THRESHOLD
    px = Proxy([p.url], [d.url], log_dir("proxy-threshold"),
               args=["--local-prefill-threshold", str(threshold)]).start()
    long_prompt = token_prompt(600, seed=1_401)
    cases = [  # (prompt, KV tokens D must receive, D's prefix-cache hit tokens)
        (token_prompt(threshold // 2, seed=1_402), 0, 0),
        (long_prompt, 600, 0),
        # 18 chunks of 32 tokens known to be on D: 124 uncached < threshold.
        # D's cache holds the 4 whole 128-token blocks of the long prompt.
        ([*long_prompt, *token_prompt(100, seed=1_403)], 0, 512),
    ]
    try:
        px.wait_ready()
        for prompt, moved, hit in cases:
            body = completion_body(model, prompt, max_tokens=6)
            _, want = ref.post("/v1/completions", body)
            before, p_before = d.metrics(), p.metrics()
            status, got = px.post("/v1/completions", body)
            after, p_after = d.metrics(), p.metrics()
            assert status == 200, got
            assert_same_as_reference(ref, got, want)
            assert delta(before, after, EXTERNAL) == moved, len(prompt)
            assert delta(before, after, CACHE_HIT) == hit, len(prompt)
            # P saw the long prompt only.
            p_tokens = delta(p_before, p_after, "vllm:prompt_tokens_total")
            assert p_tokens == (len(prompt) if moved else 0), len(prompt)
        with urllib.request.urlopen(px.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        px.stop()
    for decision, reason in (("local", "short_prompt"), ("remote", "long_prompt"),
                             ("local", "prefix_hit")):
        assert (f'pd_proxy_prefill_decisions_total{{decision="{decision}",reason="{reason}"}}'
                f" 1.0") in text
