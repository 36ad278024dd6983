"""Push mode on real engines, through ``vllm-pd-proxy --transfer-mode push``.

The pull suite's guarantees (tokens equal the collocated engine's at
temperature 0; D's external-KV count and byte counters show the KV moved;
prefix hits move only the missing blocks) must hold with both legs
dispatched concurrently, and no block may stay held on either engine
after any test (checked after every test).
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.concurrency import check_concurrent_load
from tests.e2e.conformance import CASES as PARITY_CASES
from tests.e2e.conformance import SERVE_ARGS, Case, check_case
from tests.e2e.engine_set import engine_set
from tests.e2e.helpers import (
    BLOCK_SIZE,
    EXTERNAL,
    KV_BYTES,
    TINY_BLOCK_BYTES,
    TINY_LAYERS,
    assert_same_as_reference,
    blocks_for,
    completion_body,
    delta,
    log_dir,
    open_stream,
    poke,
    run_clients,
    send_completion,
    stream_text,
    text_prompt,
    token_prompt,
)
from tests.e2e.test_proxy_e2e import first_token_paths
from tests.e2e.test_pull import CASES
from vllm_pd_ext import STEP_TRACE_ENV
from vllm_pd_ext.testing.engines import Engine, Proxy
from vllm_pd_ext.testing.oracle import stream_output
from vllm_pd_ext.tools import step_split

pytestmark = pytest.mark.engine

WRITES = "vllm:pd_ext_kv_writes_total"
BYTES_WRITTEN = "vllm:pd_ext_kv_bytes_written_total"
BLOCK = TINY_LAYERS * TINY_BLOCK_BYTES
P_LEASE_S = 4.0
D_PUSH_TIMEOUT_S = 8.0
D_SIDE_CHANNEL_TIMEOUT_S = 2.0
D_TRANSFER_TIMEOUT_S = 5.0
#: D gives up on a push this long after registering (see PushConsumer).
D_DEADLINE_S = D_PUSH_TIMEOUT_S + D_SIDE_CHANNEL_TIMEOUT_S
#: d_recompute's push_timeout (the default): what "at once" is measured against there.
D_RECOMPUTE_WAIT_S = 60.0


@pytest.fixture(scope="module")
def push(model: str) -> Iterator[dict[str, Any]]:
    logs = log_dir("push")
    engs = {
        "p": Engine("p-push", model, logs, role="kv_producer", cpu_bind="0", extra_args=SERVE_ARGS,
                    extra_config={"transfer_mode": "push", "lease_duration": P_LEASE_S}),
        "d": Engine("d-push", model, logs, role="kv_consumer", cpu_bind="1",
                    failure_policy="fail", extra_args=SERVE_ARGS,
                    extra_config={"transfer_mode": "push", "push_timeout": D_PUSH_TIMEOUT_S,
                                  "handshake_timeout": D_SIDE_CHANNEL_TIMEOUT_S,
                                  "transfer_timeout": D_TRANSFER_TIMEOUT_S,
                                  # Opt-in: every push test here runs D's
                                  # landing path (d_recompute the default).
                                  "same_step_landing": True},
                    # The step-phase trace (a diagnostic) on a D every test
                    # here checks: it must not change an answer.
                    env={STEP_TRACE_ENV: str(logs / "steps-d-push")}),
        "d_recompute": Engine("d-push-recompute", model, logs, role="kv_consumer",
                              cpu_bind="1", failure_policy="recompute",
                              extra_config={"transfer_mode": "push"}),
    }
    with engine_set(*engs.values()):
        proxy = Proxy([engs["p"].url], [engs["d"].url], logs,
                      args=["--transfer-mode", "push"]).start()
        try:
            proxy.wait_ready()
            yield dict(engs, proxy=proxy)
        finally:
            proxy.stop()


@pytest.fixture(autouse=True)
def no_block_leaked(push: dict[str, Any], model: str) -> Iterator[None]:
    yield
    engines = [push["p"], push["d"], push["d_recompute"]]
    assert all(e.alive() for e in engines)
    deadline = time.monotonic() + 15
    while True:
        poke(push["p"], model)  # an idle P frees released leases when a request arrives
        usage = [e.metrics()["vllm:kv_cache_usage_perc"] for e in engines]
        if not any(usage) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert not any(usage), f"blocks held after the test (P, D, D-recompute usage): {usage}"


def post_json(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def d_params(p: Engine, pd_id: str, engine_id: str) -> dict[str, Any]:
    """What the proxy gives D's leg in push mode."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "push",
            "remote_engine_id": engine_id, "remote_host": "127.0.0.1",
            "remote_port": p.side_channel_port, "tp_size": 1, "remote_request_id": pd_id,
            "pd_request_id": pd_id}


def p_params(pd_id: str) -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_mode": "push",
            "pd_request_id": pd_id}


def p_metrics(p: Engine, model: str) -> dict[str, float]:
    """P's metrics, after one request: an idle P does not step, and vLLM
    collects connector stats (the push thread's WRITEs) only with a step."""
    poke(p, model)
    return p.metrics()


def engine_id(p: Engine) -> str:
    probe = {"do_remote_decode": True, "pd_ext_probe": True, "transfer_mode": "push"}
    status, body = p.post("/v1/completions", {"model": p.model, "prompt": [5, 6, 7],
                                              "max_tokens": 1, "kv_transfer_params": probe})
    assert status == 200, body
    return str(body["kv_transfer_params"]["remote_engine_id"])



@pytest.mark.parametrize("n_tokens", list(CASES.values()), ids=list(CASES))
def test_push_matches_collocated_and_moves_kv(ref: Engine, push: dict[str, Any], model: str,
                                              n_tokens: int) -> None:
    p, d, proxy = push["p"], push["d"], push["proxy"]
    body = completion_body(model, token_prompt(n_tokens, seed=100 + n_tokens), max_tokens=12)
    status, want = ref.post("/v1/completions", body)
    assert status == 200, want
    p0, d0 = p_metrics(p, model), d.metrics()
    status, got = post_json(proxy.url + "/v1/completions", body)
    assert status == 200, got
    p1, d1 = p_metrics(p, model), d.metrics()
    assert_same_as_reference(ref, got, want)
    assert delta(d0, d1, EXTERNAL) == n_tokens
    assert delta(d0, d1, KV_BYTES) == blocks_for(n_tokens) * BLOCK
    assert delta(p0, p1, WRITES) == 1
    assert delta(p0, p1, BYTES_WRITTEN) == blocks_for(n_tokens) * BLOCK
    # Push metrics: one registration matched, one WRITE with coalesced descriptors.
    assert delta(p0, p1, "vllm:pd_ext_push_registration_wait_seconds_count") == 1
    assert delta(p0, p1, "vllm:pd_ext_push_descriptors_per_write_count") == 1
    assert 1 <= delta(p0, p1, "vllm:pd_ext_kv_descriptors_total") <= TINY_LAYERS * 2


def test_push_streaming_and_chat_match_collocated(ref: Engine, push: dict[str, Any],
                                                  model: str) -> None:
    d, proxy = push["d"], push["proxy"]
    body = completion_body(model, token_prompt(222, seed=141), max_tokens=16)
    _, want = ref.post("/v1/completions", body)
    before = d.metrics()
    text, events = stream_text(proxy.url + "/v1/completions", body)
    assert events[-1] == "[DONE]"
    streamed = stream_output(events)
    assert streamed.text == text
    assert_same_as_reference(ref, streamed, want)
    chat = {"model": model, "messages": [{"role": "user", "content": "tell me about blocks"}],
            "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    _, want_chat = ref.post("/v1/chat/completions", chat)
    status, got_chat = post_json(proxy.url + "/v1/chat/completions", chat)
    assert status == 200, got_chat
    assert_same_as_reference(ref, got_chat, want_chat)
    after = d.metrics()
    assert delta(before, after, EXTERNAL) == 222 + got_chat["usage"]["prompt_tokens"]


def test_partial_prefix_hit_on_d_writes_only_missing_blocks(ref: Engine, push: dict[str, Any],
                                                            model: str) -> None:
    """D already holds the first two blocks: P writes exactly the third, into
    the right block (an off-by-a-block write would change the tokens)."""
    p, d, proxy = push["p"], push["d"], push["proxy"]
    shared = token_prompt(2 * BLOCK_SIZE, seed=51)
    first = completion_body(model, shared + token_prompt(90, seed=52), max_tokens=4)
    status, _ = post_json(proxy.url + "/v1/completions", first)
    assert status == 200
    body = completion_body(model, shared + token_prompt(90, seed=53), max_tokens=12)
    _, want = ref.post("/v1/completions", body)
    p0, d0 = p_metrics(p, model), d.metrics()
    status, got = post_json(proxy.url + "/v1/completions", body)
    assert status == 200, got
    p1, d1 = p_metrics(p, model), d.metrics()
    assert_same_as_reference(ref, got, want)
    assert delta(d0, d1, EXTERNAL) == 90
    assert delta(d0, d1, "vllm:prompt_tokens_by_source_total[local_cache_hit]") == 256
    assert delta(d0, d1, KV_BYTES) == 1 * BLOCK
    assert delta(p0, p1, BYTES_WRITTEN) == 1 * BLOCK


def test_registration_before_prefill_waits_beyond_p_lease(ref: Engine, push: dict[str, Any],
                                                          model: str) -> None:
    """D registers first; P's prefill arrives after longer than P's lease:
    the registration (bounded by D's push_timeout) still matches."""
    p, d = push["p"], push["d"]
    pd_id = "late-prefill-1"
    body = completion_body(model, token_prompt(150, seed=61), max_tokens=8)
    _, want = ref.post("/v1/completions", body)
    d0 = d.metrics()
    import threading

    result: dict[str, Any] = {}
    leg = threading.Thread(target=lambda: result.update(out=d.post(
        "/v1/completions", dict(body, kv_transfer_params=d_params(p, pd_id, engine_id(p))))))
    leg.start()
    time.sleep(P_LEASE_S + 1)
    status, _ = p.post("/v1/completions", dict(body, max_tokens=1,
                                               kv_transfer_params=p_params(pd_id)))
    assert status == 200
    leg.join(60)
    status, got = result["out"]
    assert status == 200, got
    assert_same_as_reference(ref, got, want)
    assert delta(d0, d.metrics(), EXTERNAL) == 150


def test_prefill_without_registration_expires_and_late_d_fails_cleanly(
        push: dict[str, Any], model: str) -> None:
    p, d = push["p"], push["d"]
    pd_id = "never-registered-1"
    body = completion_body(model, token_prompt(300, seed=62), max_tokens=4)
    p0 = p.metrics()
    status, _ = p.post("/v1/completions", dict(body, max_tokens=1,
                                               kv_transfer_params=p_params(pd_id)))
    assert status == 200
    assert p.metrics()["vllm:kv_cache_usage_perc"] > 0  # held for D under the lease
    time.sleep(P_LEASE_S + 0.5)
    poke(p, model)
    p1 = p.metrics()
    assert p1["vllm:kv_cache_usage_perc"] == 0.0
    assert delta(p0, p1, "vllm:pd_ext_lease_expiries_total") == 1
    started = time.monotonic()
    status, got = d.post("/v1/completions", dict(body, kv_transfer_params=d_params(
        p, pd_id, engine_id(p))))
    assert status >= 500, got
    assert time.monotonic() - started < D_DEADLINE_S - 2  # at once (a timeout takes D_DEADLINE_S)
    assert f"pd_request_id {pd_id!r} was already expired" in d.log_text()


def test_d_abort_after_registering_frees_blocks_and_p_never_writes(
        push: dict[str, Any], model: str) -> None:
    """The client leaves while D waits for P: D aborts with P before reusing
    its blocks, and P's later prefill for that id is freed, never written."""
    import http.client

    p, d = push["p"], push["d"]
    pd_id = "aborted-on-d-1"
    body = completion_body(model, token_prompt(300, seed=63), max_tokens=4)
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
    conn.request("POST", "/v1/completions",
                 json.dumps(dict(body, kv_transfer_params=d_params(p, pd_id, engine_id(p)))),
                 {"Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    while "push registration " + pd_id not in p.log_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert d.metrics()["vllm:kv_cache_usage_perc"] > 0  # registered blocks
    conn.close()  # the client goes away: vLLM aborts the request on D
    deadline = time.monotonic() + 10
    while d.metrics()["vllm:kv_cache_usage_perc"] > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert d.metrics()["vllm:kv_cache_usage_perc"] == 0.0
    assert f"push {pd_id} aborted by engine" in p.log_text()
    p0 = p_metrics(p, model)
    status, _ = p.post("/v1/completions", dict(body, max_tokens=1,
                                               kv_transfer_params=p_params(pd_id)))
    assert status == 200
    assert delta(p0, p_metrics(p, model), WRITES) == 0
    assert "finished after D gave up (aborted)" in p.log_text()


def test_registration_that_never_finds_its_prefill_is_bounded(push: dict[str, Any],
                                                              model: str) -> None:
    p, d = push["p"], push["d"]
    body = completion_body(model, token_prompt(200, seed=64), max_tokens=4)
    started = time.monotonic()
    status, got = d.post("/v1/completions", dict(body, kv_transfer_params=d_params(
        p, "never-prefilled-1", engine_id(p))))
    took = time.monotonic() - started
    assert status >= 500, got
    assert D_DEADLINE_S - 1 < took < D_DEADLINE_S + 5
    assert "no KV from P within push_timeout" in d.log_text()


def test_registration_with_a_dead_p_is_bounded(push: dict[str, Any], model: str) -> None:
    from vllm_pd_ext.testing.engines import free_port

    d = push["d"]
    dead = Engine("nobody", model, log_dir("push"))
    dead.side_channel_port = free_port()
    body = completion_body(model, token_prompt(200, seed=65), max_tokens=4)
    started = time.monotonic()
    status, got = d.post("/v1/completions", dict(body, kv_transfer_params=d_params(
        dead, "dead-p-1", "no-such-engine")))
    took = time.monotonic() - started
    assert status >= 500, got
    # D cannot tell a dead P from a slow one: it keeps the blocks until any
    # WRITE P could still post has ended (window: send timeout + push_timeout
    # + transfer_timeout), then fails the request.
    window = 2 * D_SIDE_CHANNEL_TIMEOUT_S + D_PUSH_TIMEOUT_S + D_TRANSFER_TIMEOUT_S
    assert window - 1 < took < window + 2 * D_SIDE_CHANNEL_TIMEOUT_S + 4
    assert "P is unreachable" in d.log_text()


def prefill_one_prompt_decode_another(p: Engine, d: Engine, pd_id: str, seed: int,
                                      d_body: dict[str, Any]) -> tuple[int, Any, float]:
    """P prefills a 37-token prompt under ``pd_id``; D gets ``d_body`` (300
    tokens) under the same id, so P refuses to write. Returns D's answer and
    how long it took."""
    p_body = completion_body(p.model, token_prompt(37, seed=seed), max_tokens=1)
    status, _ = p.post("/v1/completions", dict(p_body, kv_transfer_params=p_params(pd_id)))
    assert status == 200
    started = time.monotonic()
    status, got = d.post("/v1/completions", dict(d_body, kv_transfer_params=d_params(
        p, pd_id, engine_id(p))))
    return status, got, time.monotonic() - started


def test_p_that_cannot_write_tells_d_at_once(push: dict[str, Any], model: str) -> None:
    """P refuses to write (D's prompt differs from the one P prefilled): D
    fails at once under ``fail``, without waiting for its deadline."""
    d = push["d"]
    d_body = completion_body(model, token_prompt(300, seed=67), max_tokens=4)
    status, got, took = prefill_one_prompt_decode_another(push["p"], d, "cannot-write-1", 66,
                                                          d_body)
    assert status >= 500, got
    assert took < D_DEADLINE_S - 2  # the deadline's path cannot end sooner
    assert "P could not write the KV: P prefilled 37 tokens but D's prompt has 300" in (
        d.log_text())


def identity_probes(proxy: Proxy) -> float:
    """``pd_proxy_identity_probes_total{result="success"}``."""
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'pd_proxy_identity_probes_total\{result="success"\} (\S+)', text)
    return float(m[1]) if m else 0.0


def test_p_answers_confirm_its_identity_so_health_rounds_do_not_probe_it(
        ref: Engine, push: dict[str, Any], model: str) -> None:
    """The identity probe is a one-token completion, a forward step on the
    real P: a proxy whose health rounds run every 0.2 s probes P once, then
    not again while P's push answers keep naming the same engine (each round
    probed before). The answers stay the collocated engine's, over moved KV."""
    logs = log_dir("push-probes")
    proxy = Proxy([push["p"].url], [push["d"].url], logs,
                  args=["--transfer-mode", "push", "--health-interval", "0.2"]).start()
    try:
        proxy.wait_ready()
        probes, m0 = identity_probes(proxy), push["d"].metrics()
        assert probes >= 1
        answers = []
        end = time.monotonic() + 3.0  # 15 rounds
        while time.monotonic() < end:
            # A new prompt each time: D loads it. (The reference answers come
            # after the timed rounds: the shared engine may be slow.)
            body = completion_body(model, text_prompt(40, seed=911 + len(answers)),
                                   max_tokens=3, ignore_eos=True)
            answers.append((body, send_completion(proxy.url, body, f"probe-{len(answers)}")))
        # Probing each round would be about 15; a request slowed past 6
        # rounds (1.2 s) on a loaded host lets one through, rarely two.
        assert identity_probes(proxy) - probes <= 3, (identity_probes(proxy), probes,
                                                      len(answers))
        prompts = 0
        for body, got in answers:
            _, want = ref.post("/v1/completions", body)
            assert_same_as_reference(ref, got, want)
            prompts += want["usage"]["prompt_tokens"]
        # Most of every prompt came as KV (D's own prefix cache serves the
        # odd block two prompts share).
        assert len(answers) >= 3 and delta(m0, push["d"].metrics(), EXTERNAL) >= 0.75 * prompts
    finally:
        proxy.stop()


def test_step_trace_splits_d_first_step_after_the_load(
        ref: Engine, push: dict[str, Any], model: str) -> None:
    """The step-phase trace (``VLLM_PD_EXT_STEP_TRACE``, compat/step_trace.py)
    on a real D behind the default (concurrent) push flow: one request whose
    token #1 came from P adds exactly one ``first, 1 token`` step to D's
    split (token #2, computed over the pushed KV), then its decode steps,
    each phase timed; the KV really moved and the answer is the collocated
    engine's."""
    d = push["d"]
    folder = Path(d.env[STEP_TRACE_ENV])

    def kinds() -> dict[str, int]:
        if not folder.exists():
            return {}
        steps = step_split.classify(step_split.cut_steps(
            [e for evs in step_split.read_folder(folder).values() for e in evs]))
        return {k: sum(1 for s in steps if s.kind == k) for k in step_split.KINDS}

    body = completion_body(model, text_prompt(90, seed=907), max_tokens=6, ignore_eos=True)
    _, want = ref.post("/v1/completions", body)
    before, m0, paths0 = kinds(), d.metrics(), first_token_paths(push["proxy"])
    got = send_completion(push["proxy"].url, body, "step-trace")
    m1, paths1 = d.metrics(), first_token_paths(push["proxy"])
    assert_same_as_reference(ref, got, want)
    taken = {k: v - paths0.get(k, 0.0) for k, v in paths1.items() if v != paths0.get(k, 0.0)}
    # Token #1 from P, or (a token #1 ending inside a character, which a
    # CPU's rounding may give) the pair sent again unseeded: D computes it,
    # and the cancelled seeded leg may have loaded and stepped once too.
    assert taken in ({"seeded:concurrent": 1.0}, {"fallback:incomplete_text": 1.0}), taken
    seeded = "seeded:concurrent" in taken
    loaded = delta(m0, m1, EXTERNAL)
    prompt = want["usage"]["prompt_tokens"]
    assert loaded == prompt if seeded else prompt <= loaded <= 2 * prompt
    from_d = want["usage"]["completion_tokens"] - seeded
    # D's first step over the pushed KV, its second, then the rest.
    later = from_d - 2
    deadline = time.monotonic() + 10
    while (kinds().get("later", 0) < before.get("later", 0) + later
           and time.monotonic() < deadline):
        time.sleep(0.1)  # the trace's last lines follow the answer
    after = kinds()
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in step_split.KINDS}
    assert grew["first, prefill"] == grew["prefill chunk"] == 0, grew  # D computed no prompt
    if seeded:
        assert (grew["first, 1 token"], grew["second"], grew["later"]) == (1, 1, later), grew
    else:
        assert grew["first, 1 token"] in (1, 2) and grew["second"] in (1, 2), grew
        assert grew["later"] >= later, grew
    rows, note = step_split.split_folder(folder)
    first = rows["first, 1 token"]
    for phase in ("schedule", "to worker", "admit", "prepare", "forward", "sample", "step"):
        value = first[phase]
        assert isinstance(value, float) and value > 0, (phase, first, note)
    step = first["step"]
    assert isinstance(step, float) and step >= first["forward"]  # type: ignore[operator]


def test_concurrent_dispatch_streams_token_one_from_p_and_d_loads_the_kv(
        ref: Engine, push: dict[str, Any], model: str) -> None:
    """Issue 29 item 2, real engines: the proxy's default push flow sends
    D's leg beside P's; P's token #1 comes with the KV, D appends it and
    continues. Under a small concurrent load of text prompts (streamed and
    not), every answer's tokens, text, finish reason and usage equal the
    collocated engine's, D loaded every prompt as KV, and the telemetry
    names the path. Chat too: D's leg is the client's chat request, whose
    chunks the proxy splices after P's role chunk and token #1."""
    p, d = push["p"], push["d"]
    px = Proxy([p.url], [d.url], log_dir("push-concurrent"),
               args=["--transfer-mode", "push", "--transfer-telemetry"]).start()
    try:
        px.wait_ready()
        jobs = []
        for i in range(12):
            body = completion_body(model, text_prompt(60 + 37 * i, seed=142 + i),
                                   max_tokens=6 + i % 5, ignore_eos=True, stream=i % 2 == 0)
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
            jobs.append((f"concurrent-{i}", body))
        for i in range(6):
            chat: dict[str, Any] = {
                "model": model, "temperature": 0, "return_token_ids": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": text_prompt(40 + 29 * i, seed=171 + i)}],
                "stream": i % 2 == 0}
            # Both of chat's limits (max_completion_tokens wins in vLLM).
            chat["max_completion_tokens" if i % 3 else "max_tokens"] = 5 + i
            if chat["stream"]:
                chat["stream_options"] = {"include_usage": True}
            jobs.append((f"concurrent-chat-{i}", chat))
        wants = {rid: ref.post("/v1/chat/completions" if "messages" in body
                               else "/v1/completions", {
            **{k: v for k, v in body.items() if k != "stream_options"}, "stream": False})[1]
            for rid, body in jobs}
        before = d.metrics()
        results = run_clients(px.url, jobs, 4)
        after = d.metrics()
        _, events = stream_text(px.url + "/v1/completions", jobs[0][1])
        _, chat_events = stream_text(px.url + "/v1/chat/completions", jobs[12][1])
        last = d.metrics()
    finally:
        px.stop()
    prompt_tokens = 0
    for rid, _ in jobs:
        got = results[rid]
        assert not isinstance(got, BaseException), (rid, got)
        want = wants[rid]
        # The oracle compares the text too (token #2 on is D's detokenizing).
        assert_same_as_reference(ref, got, want)
        prompt_tokens += want["usage"]["prompt_tokens"]
    assert delta(before, after, EXTERNAL) == prompt_tokens  # every prompt came as KV
    # D's scheduler saw KV land from its worker's forwarded notifications
    # and computed token #2 in that step (same_step_landing), not a step
    # after the workers' report. Not every time: a notification that lands
    # while D's step runs is collected by that step's worker first.
    assert 1 <= delta(before, last, LANDED) <= len(jobs) + 2
    assert events[-1] == "[DONE]"
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    usage = [{k: e["usage"][k] for k in counts}
             for e in events if isinstance(e, dict) and e.get("usage")]
    assert usage == [{k: wants[jobs[0][0]]["usage"][k] for k in counts}]
    tele = [e["pd_telemetry"] for e in events if isinstance(e, dict) and "pd_telemetry" in e]
    assert len(tele) == 1, events
    # (This D does not put its transfer record in its answers: the proxy's part.)
    proxy_t = tele[0]["proxy"]
    assert proxy_t["mode"] == "push" and proxy_t["first_token"] == "seeded:concurrent"
    # D's leg left before P answered; token #1 reached the client first.
    assert proxy_t["decode_sent_ms"] < proxy_t["prefill_done_ms"] <= proxy_t["first_token_ms"]
    assert "cannot continue after P's token #1" not in d.log_text()
    # A chat stream: one role chunk, first; its usage the collocated one's.
    chunks = [e for e in chat_events if isinstance(e, dict) and e.get("choices")]
    assert ["role" in c["choices"][0]["delta"] for c in chunks] == [True] + [False] * (
        len(chunks) - 1)
    chat_usage = [{k: e["usage"][k] for k in counts}
                  for e in chat_events if isinstance(e, dict) and e.get("usage")]
    assert chat_usage == [{k: wants[jobs[12][0]]["usage"][k] for k in counts}]
    chat_tele = [e["pd_telemetry"]["proxy"] for e in chat_events
                 if isinstance(e, dict) and "pd_telemetry" in e]
    assert [t["first_token"] for t in chat_tele] == ["seeded:concurrent"]


#: D's loads scheduled in the step its scheduler saw them land.
LANDED = "vllm:pd_ext_landed_before_step_total"
#: P's counter of prompt tokens its prefix cache served.
LOCAL_HIT = "vllm:prompt_tokens_by_source_total[local_cache_hit]"
#: An engine's counter of prompt tokens it computed itself.
COMPUTED = "vllm:prompt_tokens_by_source_total[local_compute]"


def prompts_with_a_partial_token_one(ref: Engine, model: str, want: int = 1,
                                     tries: int = 300) -> list[str]:
    """Text prompts whose greedy token #1 ends inside a character (its text
    is empty or ends with U+FFFD), found on this CPU's collocated engine
    (bf16 rounds differently on other CPUs, so no prompt can be fixed in
    advance). About 1 prompt in 30 has one."""
    found: list[str] = []
    rng = random.Random(5000)
    for i in range(tries):
        # Random ids as text (vllm-pd-bench's --text-prompts): word prompts
        # end on too few distinct tokens to find one.
        ids = rng.choices(range(10, 3000), k=24 + i % 9)
        _, detok = ref.post("/detokenize", {"model": model, "tokens": ids})
        prompt = detok["prompt"]
        _, got = ref.post("/v1/completions", completion_body(model, prompt, max_tokens=1))
        text = got["choices"][0]["text"]
        # vLLM holds an incomplete character back (text ""), or ends it with
        # U+FFFD; the proxy refuses either as a seed (first_token.seed_refusal).
        if not text or text.endswith("\ufffd"):
            found.append(prompt)
            if len(found) == want:
                return found
    raise AssertionError(f"{len(found)} of {tries} prompts had a token #1 inside a "
                         f"character; the test needs {want}")


def test_concurrent_token_one_inside_a_character_goes_again_unseeded(
        ref: Engine, push: dict[str, Any], model: str) -> None:
    """A token #1 that ends inside a character cannot seed D's concurrent leg
    (D's detokenizer would have to join it with token #2): the proxy cancels
    that leg and sends the pair again unseeded. The answer equals the
    collocated one, and D still loaded the prompt as KV: P's prefix cache
    served the second P leg, D computed token #1 from the pushed KV. Before,
    D prefilled the whole prompt itself (twice the TTFT, and a prefill in
    D's decode batch)."""
    p, d = push["p"], push["d"]
    (prompt,) = prompts_with_a_partial_token_one(ref, model)
    px = Proxy([p.url], [d.url], log_dir("push-concurrent-partial"),
               args=["--transfer-mode", "push", "--transfer-telemetry"]).start()
    try:
        px.wait_ready()
        outputs, events = [], []
        for stream in (True, False):
            body = completion_body(model, prompt, max_tokens=7, ignore_eos=True,
                                   stream=stream)
            _, want = ref.post("/v1/completions", dict(body, stream=False))
            d0, p0 = d.metrics(), p.metrics()
            if stream:
                _, events = stream_text(px.url + "/v1/completions", body)
                got = stream_output(events)
            else:
                got = send_completion(px.url, body, "partial-non-streamed")
            d1, p1 = d.metrics(), p.metrics()
            outputs.append((got, want))
            n = want["usage"]["prompt_tokens"]
            # The unseeded leg loaded the prompt as KV. (The cancelled seeded
            # leg may have loaded it too, and counted it, when D's KV and
            # token #2 beat P's answer to the proxy.)
            assert delta(d0, d1, EXTERNAL) >= n, stream
            # D computed no prompt of its own: the fallback before was D's
            # prefill of the whole prompt.
            assert delta(d0, d1, COMPUTED) < BLOCK_SIZE, stream
            # A P leg hit P's prefix cache: every full block of the prompt
            # (the unseeded leg after the seeded one; the second round's
            # legs after the first round's).
            assert delta(p0, p1, LOCAL_HIT) >= (n // BLOCK_SIZE) * BLOCK_SIZE, stream
    finally:
        px.stop()
    for got, want in outputs:
        assert_same_as_reference(ref, got, want)
    tele = [e["pd_telemetry"]["proxy"] for e in events
            if isinstance(e, dict) and "pd_telemetry" in e]
    assert [t["first_token"] for t in tele] == ["fallback:incomplete_text"], tele


def test_a_seed_pending_leg_p_cannot_write_errors_even_under_recompute(
        push: dict[str, Any], model: str) -> None:
    """A D leg sent before token #1 (``pd_seed_pending``) whose KV never
    comes must not recompute (it would sample token #1 again, which the
    client has from P): D answers with an error, fast, under the recompute
    policy too, and stays up; the proxy continues such a request elsewhere."""
    d = push["d_recompute"]
    d_body = completion_body(model, token_prompt(300, seed=1772), max_tokens=6)
    pd_id = "seed-cannot-write"
    p_body = completion_body(model, token_prompt(37, seed=1773), max_tokens=1)
    status, _ = push["p"].post("/v1/completions",
                               dict(p_body, kv_transfer_params=p_params(pd_id)))
    assert status == 200
    d0 = d.metrics()
    started = time.monotonic()
    status, got = d.post("/v1/completions", dict(d_body, kv_transfer_params=dict(
        d_params(push["p"], pd_id, engine_id(push["p"])), pd_seed_pending=True)))
    assert time.monotonic() - started < D_RECOMPUTE_WAIT_S / 2
    assert status >= 500 or (status == 200 and got["choices"][0]["finish_reason"] == "error"), got
    assert delta(d0, d.metrics(), EXTERNAL) == 0
    assert "cannot continue after P's token #1: its KV load failed" in d.log_text()
    assert "vLLM patch fail_seed_requests applied in the EngineCore" in d.log_text()
    assert d.alive()


def test_mode_mismatch_is_refused_both_ways(p: Engine, d: Engine, push: dict[str, Any],
                                            model: str) -> None:
    """A push D against a pull P, and a pull D given push params."""
    body = completion_body(model, token_prompt(100, seed=68), max_tokens=4)
    started = time.monotonic()
    status, got = push["d"].post("/v1/completions", dict(body, kv_transfer_params=d_params(
        p, "mode-mismatch-1", "whatever")))
    assert status >= 500, got
    assert time.monotonic() - started < D_DEADLINE_S - 2
    assert "incompatible peer: transfer_mode differs: theirs='push'" in push["d"].log_text()
    assert "transfer_mode: ours='pull' theirs='push'" in p.log_text()
    status, got = d.post("/v1/completions", dict(body, kv_transfer_params=d_params(
        push["p"], "mode-mismatch-2", "whatever")))
    assert status >= 500, got
    assert "transfer_mode='push' but this engine runs transfer_mode='pull'" in d.log_text()
    assert p.alive() and d.alive()


def test_p_that_cannot_write_recomputes_under_recompute_policy(
        ref: Engine, push: dict[str, Any], model: str) -> None:
    d = push["d_recompute"]
    d_body = completion_body(model, token_prompt(300, seed=70), max_tokens=12)
    _, want = ref.post("/v1/completions", d_body)
    d0 = d.metrics()
    status, got, took = prefill_one_prompt_decode_another(push["p"], d, "cannot-write-2", 69,
                                                          d_body)
    assert status == 200, got
    assert took < D_RECOMPUTE_WAIT_S / 2
    assert_same_as_reference(ref, got, want)
    assert delta(d0, d.metrics(), EXTERNAL) == 0  # recomputed on D, nothing loaded


def until_ok(proxy: Proxy, body: dict[str, Any], within: float = 60) -> tuple[Any, int]:
    """POST through the proxy until one answers 200; every try must answer
    (no hang) within its own bound. Returns the answer and the failed tries."""
    deadline = time.monotonic() + within
    failures = 0
    while True:
        started = time.monotonic()
        status, got = post_json(proxy.url + "/v1/completions", body, timeout=D_DEADLINE_S + 10)
        assert time.monotonic() - started < D_DEADLINE_S + 10
        if status == 200:
            return got, failures
        failures += 1
        assert time.monotonic() < deadline, f"no success within {within} s: {status} {got}"
        time.sleep(0.5)


def proxy_knows(proxy: Proxy, p_engine_id: str, within: float = 30) -> None:
    """Wait until the proxy routes to P as ``p_engine_id``. Until then it
    has no usable P and (with migration) prefills on D: the test is about
    the push after the restart, so it waits for the proxy to know P."""
    deadline = time.monotonic() + within
    health: dict[str, Any] = {}
    while time.monotonic() < deadline:
        with (contextlib.suppress(OSError, ValueError),
              urllib.request.urlopen(proxy.url + "/health", timeout=10) as r):
            health = json.loads(r.read())
        if health.get("status") == "ok" and any(
                (b.get("identity") or {}).get("remote_engine_id") == p_engine_id
                for b in health.get("prefill", [])):
            return
        time.sleep(0.5)
    raise AssertionError(f"the proxy did not learn P as {p_engine_id} within {within} s: "
                         f"{health}")


def test_p_and_d_restarts_are_detected_and_the_next_push_works(
        ref: Engine, push: dict[str, Any], model: str) -> None:
    """P restarts on the same ports (new engine id), then D does (new NIXL
    agent): stale identities are refused or replaced, nothing crashes or
    hangs, and pushes work again with KV moved."""
    p, d, proxy = push["p"], push["d"], push["proxy"]
    old_id = engine_id(p)
    p.stop()
    p.start().wait_ready()
    new_id = engine_id(p)
    assert new_id != old_id
    # D told about the old P is refused at once by the new one.
    body = completion_body(model, token_prompt(130, seed=71), max_tokens=4)
    status, got = d.post("/v1/completions", dict(body, kv_transfer_params=d_params(
        p, "stale-p-1", old_id)))
    assert status >= 500, got
    assert f"this is engine {new_id}, not {old_id} (P restarted?)" in d.log_text()
    body = completion_body(model, token_prompt(260, seed=72), max_tokens=8)
    _, want = ref.post("/v1/completions", body)
    proxy_knows(proxy, new_id)
    d0 = d.metrics()
    got, _ = until_ok(proxy, body)
    assert_same_as_reference(ref, got, want)
    assert delta(d0, d.metrics(), EXTERNAL) == 260

    d.stop()
    d.start().wait_ready()
    body = completion_body(model, token_prompt(300, seed=73), max_tokens=8)
    _, want = ref.post("/v1/completions", body)
    got, _ = until_ok(proxy, body)
    assert_same_as_reference(ref, got, want)
    assert d.metrics()[EXTERNAL] == 300  # a fresh D: everything it holds came from P
    # The old D's agent, then the new one's (worker/peers.py's log line).
    assert len(re.findall(r"D agent \S+ of engine \S+ added", p.log_text())) == 2


def test_prompt_longer_than_context_returns_backend_4xx(push: dict[str, Any], model: str
                                                        ) -> None:
    proxy = push["proxy"]
    body = completion_body(model, token_prompt(2100, seed=74), max_tokens=4)
    status, got = post_json(proxy.url + "/v1/completions", body)
    assert 400 <= status < 500, got
    assert "2100" in str(got)


def test_client_disconnect_through_proxy_frees_blocks_on_both_engines(
        push: dict[str, Any], model: str) -> None:
    """A client that leaves mid-stream leaves no block held on P or D (the
    autouse check). Whether D aborts before the end depends on when vLLM's
    API server, starved on 2 cores, flushes its stream, so unlike the pull
    suite this test does not assert an early abort; the push-specific abort
    (while D waits for the KV) is ``test_d_abort_after_registering_*``."""
    d, proxy = push["d"], push["proxy"]
    body = completion_body(model, token_prompt(200, seed=75), max_tokens=1500,
                           ignore_eos=True, stream=True)
    before = d.metrics()
    # Token #1 comes from P, then D's tokens: decoding on D, with pushed KV;
    # then the client goes away.
    with open_stream(proxy.url + "/v1/completions", body, events=3):
        pass
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = d.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0:
            break
        time.sleep(0.2)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0
    assert delta(before, m, EXTERNAL) == 200


def test_malformed_push_params_fail_only_that_request(ref: Engine, push: dict[str, Any],
                                                      model: str) -> None:
    p, d, proxy = push["p"], push["d"], push["proxy"]
    body = completion_body(model, token_prompt(90, seed=76), max_tokens=4)
    bad = d_params(p, "x", engine_id(p))
    del bad["pd_request_id"]
    status, got = d.post("/v1/completions", dict(body, kv_transfer_params=bad))
    assert status >= 500, got
    assert "do_remote_prefill (push mode) needs pd_request_id" in d.log_text()
    _, want = ref.post("/v1/completions", body)
    status, got = post_json(proxy.url + "/v1/completions", body)
    assert status == 200, got
    assert_same_as_reference(ref, got, want)


def test_concurrent_clients_get_collocated_outputs_and_kv_moves_push(
        ref: Engine, push: dict[str, Any], model: str) -> None:
    """Issue 10's load in push mode (tests/e2e/concurrency.py)."""
    check_concurrent_load("push", push["p"], push["d"], push["proxy"], ref, model)


@pytest.mark.parametrize("case", PARITY_CASES, ids=[c.name for c in PARITY_CASES])
def test_same_as_collocated_push(case: Case, ref: Engine, push: dict[str, Any],
                                 model: str) -> None:
    """Issue 24 item 6: the request-parity cases (``conformance.py``) in push
    mode; the no-block-held check runs after every test of this module."""
    print(check_case(case, ref, push["proxy"].url, push["d"], model))
