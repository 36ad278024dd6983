"""Failure paths on real engines: mismatched peer, lease expiry, malformed
params, P killed before D reads under both failure policies, and a D killed
mid-stream behind the proxy (the stream continues on another D)."""

from __future__ import annotations

import http.client
import http.server
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.engine_set import engine_set
from tests.e2e.helpers import (
    EXTERNAL,
    assert_nothing_held,
    assert_same_as_reference,
    build_model,
    completion_body,
    delta,
    log_dir,
    pd_complete,
    poke,
    prefill,
    stream_text,
    token_prompt,
)
from vllm_pd_ext.testing.engines import Engine, Proxy
from vllm_pd_ext.testing.oracle import stream_output
from vllm_pd_ext.tools import sse
from vllm_pd_ext.tools.ports import free_port
from vllm_pd_ext.wire import telemetry

pytestmark = pytest.mark.engine

#: P's lease here: short enough to watch one expire, long enough that D's
#: pin (or its 5 s heartbeat) reaches P on a loaded host in every handoff.
LEASE_S = 10.0


@pytest.fixture(scope="module")
def fail_engines(model: str) -> Iterator[dict[str, Engine]]:
    """A short-lease P, a recompute-policy D and a D serving another model."""
    other = build_model("tiny-other", seed=1)
    logs = log_dir("failures")
    engs = {
        "p": Engine("p-short-lease", model, logs, role="kv_producer", cpu_bind="0",
                    extra_config={"lease_duration": LEASE_S, "heartbeat_interval": 0.5}),
        "d_recompute": Engine("d-recompute", model, logs, role="kv_consumer", cpu_bind="1",
                              failure_policy="recompute",
                              extra_config={"handshake_timeout": 2.0}),
        "d_other": Engine("d-other-model", other, logs, role="kv_consumer", cpu_bind="1"),
    }
    with engine_set(*engs.values()):
        yield engs


def test_mismatched_peer_is_refused_naming_the_field(fail_engines: dict[str, Engine],
                                                     model: str) -> None:
    p, d_other = fail_engines["p"], fail_engines["d_other"]
    body = completion_body(model, token_prompt(200, seed=31), max_tokens=4)
    params = prefill(p, body)
    status, got = d_other.post("/v1/completions",
                               dict(body, model=d_other.model, kv_transfer_params=params))
    assert status >= 500, got  # kv_load_failure_policy=fail: the request errors
    assert d_other.alive() and p.alive()
    log = d_other.log_text()
    # Unauthenticated (no secret here): D learns which field differs and its
    # own value, never P's; P's own log has both.
    assert f"incompatible peer: model differs: theirs={d_other.model!r}" in log, log[-3000:]
    assert f"ours={model!r}" not in log
    assert f"incompatible model: ours={model!r}" in p.log_text()
    # D told P at once, so P frees the blocks without waiting for the lease.
    poke(p, model)
    assert p.metrics()["vllm:kv_cache_usage_perc"] == 0.0
    assert p.metrics().get("vllm:pd_ext_lease_expiries_total", 0) == 0


def test_lease_expiry_frees_p_blocks_and_d_fails_cleanly(
        fail_engines: dict[str, Engine], d: Engine, model: str) -> None:
    p = fail_engines["p"]
    before = p.metrics()
    body = completion_body(model, token_prompt(300, seed=32), max_tokens=4)
    params = prefill(p, body)
    assert p.metrics().get("vllm:kv_cache_usage_perc", 0) > 0  # held under the lease
    time.sleep(LEASE_S + 0.5)  # nobody heartbeats this lease
    poke(p, model)  # the next request's arrival sweeps the expired lease
    after = p.metrics()
    assert delta(before, after, "vllm:pd_ext_lease_expiries_total") == 1
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    # A late D must not read the freed blocks: its pin is refused.
    status, got = d.post("/v1/completions", dict(body, kv_transfer_params=params))
    assert status >= 500, got
    assert "expired on P" in d.log_text()
    assert d.alive()


def test_malformed_kv_transfer_params_fail_the_request_only(d: Engine, ref: Engine,
                                                            model: str) -> None:
    bad = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "y",
           "remote_host": "127.0.0.1", "remote_port": "not-a-port", "remote_block_ids": [[1]]}
    body = completion_body(model, token_prompt(64, seed=33), max_tokens=4)
    status, got = d.post("/v1/completions", dict(body, kv_transfer_params=bad))
    assert status >= 400, got
    assert "remote_port" in d.log_text()
    # The engine stays up and serves the next request normally.
    ok_body = completion_body(model, token_prompt(64, seed=34), max_tokens=4)
    status, got = d.post("/v1/completions", ok_body)
    _, want = ref.post("/v1/completions", ok_body)
    assert status == 200, got
    assert_same_as_reference(ref, got, want)


HOSTILE = {  # field -> a value a client can send straight to D's HTTP port
    "remote_host": "p 1",  # libzmq refuses it in connect(): once killed pd-heartbeats
    "tp_size": 10**9,  # once looped a billion ranks: D's engine core was OOM-killed
    "remote_request_id": "x" * 10_000,
    "remote_block_ids": [[7] * (2**20 + 1)],
}


def test_hostile_params_fail_their_request_only(p: Engine, d: Engine, ref: Engine, model: str
                                                ) -> None:
    """Each hostile field is refused at decode time, in well under a second,
    naming the field; D stays up and the next genuine handoff moves KV."""
    body = completion_body(model, token_prompt(140, seed=39), max_tokens=6)
    for field, value in HOSTILE.items():
        params = {"do_remote_prefill": True, "remote_engine_id": "eng-x",
                  "remote_request_id": "req-x", "remote_host": "127.0.0.1",
                  "remote_port": p.side_channel_port, "remote_block_ids": [[1, 2]],
                  "remote_num_tokens": 140, field: value}
        started = time.monotonic()
        status, got = d.post("/v1/completions", dict(body, kv_transfer_params=params))
        assert status >= 400, (field, got)
        assert time.monotonic() - started < 10, field
        assert f"kv_transfer_params.{field}" in d.log_text() or (
            f"`{field}" in d.log_text()), field
        assert d.alive()
    # Each refused load is in D's per-request telemetry too, with its reason.
    refused = [r for r in map(telemetry.parse_log_line, d.log_text().splitlines())
               if r is not None and r.outcome == "bad_params"]
    assert len(refused) >= len(HOSTILE)
    assert all("kv_transfer_params" in r.detail and r.bytes == 0 for r in refused[-len(HOSTILE):])
    assert "Exception in thread" not in d.log_text()
    _, want = ref.post("/v1/completions", body)
    before = d.metrics()
    status, got = pd_complete(p, d, body)
    after = d.metrics()
    assert status == 200, got
    assert_same_as_reference(ref, got, want)
    assert delta(before, after, EXTERNAL) == 140


def test_p_restart_is_detected_and_rehandshaked(fail_engines: dict[str, Engine], d: Engine,
                                                ref: Engine, model: str) -> None:
    """P restarts on the same ports with a new engine id: D's cached handshake
    is not trusted for the new engine, params from before the restart fail
    cleanly, and the next handoff works, with KV really moved.

    One restart serves every check: D has handshaked with the old P (a
    handoff before it), so the stale params meet a cached handshake of
    another engine, and the handoff after it needs a new one."""
    p = fail_engines["p"]

    def handoff(seed: int) -> None:
        body = completion_body(model, token_prompt(150, seed=seed), max_tokens=6)
        _, want = ref.post("/v1/completions", body)
        before = d.metrics()
        status, got = d.post("/v1/completions", dict(body, kv_transfer_params=prefill(p, body)))
        after = d.metrics()
        assert status == 200, got
        assert_same_as_reference(ref, got, want)
        assert delta(before, after, EXTERNAL) == 150

    handoff(seed=36)  # D holds a handshake with the engine about to restart
    stale_body = completion_body(model, token_prompt(150, seed=37), max_tokens=6)
    stale = prefill(p, stale_body)
    p.kill()
    p.proc.wait(timeout=30)  # type: ignore[union-attr]
    p.start().wait_ready()
    status, got = d.post("/v1/completions", dict(stale_body, kv_transfer_params=stale))
    assert status >= 500, got  # fail policy: a clean error, not stale KV
    assert "unknown to P (P restarted" in d.log_text()
    handoff(seed=38)  # D handshakes with the new engine, without a restart of its own
    assert d.alive()


def test_replayed_d_leg_never_reads_freed_blocks(fail_engines: dict[str, Engine], d: Engine,
                                                 ref: Engine, model: str) -> None:
    """Item 6: the same P answer used again after its load released P's
    blocks. D (its own cache_salt, so no prefix hit hides the load) is
    refused the pin and fails cleanly (policy fail) or recomputes the same
    tokens (policy recompute); it never decodes over freed blocks."""
    p, d_recompute = fail_engines["p"], fail_engines["d_recompute"]
    body = completion_body(model, token_prompt(270, seed=41), max_tokens=8)
    _, want = ref.post("/v1/completions", body)
    params = prefill(p, body)
    before = d_recompute.metrics()
    status, got = d_recompute.post("/v1/completions", dict(body, kv_transfer_params=params))
    assert status == 200, got
    assert delta(before, d_recompute.metrics(), EXTERNAL) == 270
    assert_same_as_reference(ref, got, want)
    poke(p, model)  # P frees the released blocks (and may reuse them)
    status, got = d.post("/v1/completions", dict(body, cache_salt="replay-fail",
                                                 kv_transfer_params=params))
    assert status >= 500, got
    before = d_recompute.metrics()
    status, got = d_recompute.post("/v1/completions", dict(body, cache_salt="replay-recompute",
                                                           kv_transfer_params=params))
    after = d_recompute.metrics()
    assert status == 200, got
    assert delta(before, after, EXTERNAL) == 0
    assert delta(before, after, "vllm:pd_ext_kv_failures_total") == 1
    assert_same_as_reference(ref, got, want)
    # P forgot the released lease: the pin names it unknown, the load fails.
    assert "unknown to P" in d_recompute.log_text()


def test_n2_on_one_p_answer_loads_once_and_both_children_answer(
        fail_engines: dict[str, Engine], d: Engine, model: str) -> None:
    """Issue 24 item 2 (was issue 7's refusal): ``n=2`` on one P answer.
    vLLM refuses ``n > 1`` at temperature 0 itself, as a collocated engine
    does; sampled, it fans out two children carrying one P answer. One
    loads P's KV; the other waits for that load and reuses it through D's
    prefix cache: both answer, one load, no failure, even under policy
    fail. P's blocks are released, not left to expire."""
    p = fail_engines["p"]
    body = completion_body(model, token_prompt(260, seed=42), max_tokens=6)
    status, got = d.post("/v1/completions", dict(body, n=2, kv_transfer_params=prefill(p, body)))
    assert status == 400 and "n must be 1" in str(got), got  # vLLM's own greedy check
    sampled = dict(body, n=2, temperature=1.0, seed=7)
    p_before = p.metrics()
    before = d.metrics()
    t0 = time.monotonic()
    status, got = d.post("/v1/completions", dict(sampled, kv_transfer_params=prefill(p, body)))
    after = d.metrics()
    assert status == 200, got
    assert time.monotonic() - t0 < 30
    assert len(got["choices"]) == 2
    assert all(len(c["token_ids"]) == 6 for c in got["choices"])
    assert delta(before, after, EXTERNAL) == 260  # one load, from P
    assert delta(before, after, "vllm:pd_ext_kv_failures_total") == 0
    assert "shares the KV load of request" in d.log_text()
    poke(p, model)
    p_after = p.metrics()
    assert p_after["vllm:kv_cache_usage_perc"] == 0.0  # every lease released...
    assert delta(p_before, p_after, "vllm:pd_ext_lease_expiries_total") == 0  # ...not expired


class _DeadSideChannelP:
    """A stand-in for P's HTTP server: it forwards every request to the real
    P, but its answers' ``kv_transfer_params`` name a side channel nobody
    listens on, so D's load fails after token #1 already reached the
    client (issue 29). P's lease is never pinned and expires. (Its tests
    run before ``test_p_killed_before_d_reads``, which kills that P.)"""

    def __init__(self, real: Engine) -> None:
        dead = free_port()  # nothing listens on it

        class Handler(http.server.BaseHTTPRequestHandler):
            # Keep-alive, as vLLM's server: the proxy's pool reuses connections.
            protocol_version = "HTTP/1.1"

            def _forward(self, data: bytes | None) -> None:
                req = urllib.request.Request(real.url + self.path, data=data,
                                             method=self.command,
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=60) as r:
                        status, body = r.status, r.read()
                except urllib.error.HTTPError as exc:
                    status, body = exc.code, exc.read()
                if data is not None and status == 200:
                    answer = json.loads(body)
                    if isinstance(answer.get("kv_transfer_params"), dict):
                        answer["kv_transfer_params"]["remote_port"] = dead
                    body = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._forward(None)

            def do_POST(self) -> None:
                self._forward(self.rfile.read(int(self.headers["Content-Length"])))

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _DeadSideChannelP:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("case", ["d_recompute", "d_fail_migrates", "d_fail_no_migration"])
def test_d_load_failing_after_token_one_never_duplicates_or_loses_a_token(
        fail_engines: dict[str, Engine], d: Engine, ref: Engine, model: str,
        case: str) -> None:
    """Token #1 came from P and reached the client; then D's load fails.
    A recompute-policy D recomputes the prompt and token #1 itself and
    streams the rest; a fail-policy D's failure is a mid-stream failure the
    proxy continues (the rest from a local prefill of prompt + sent tokens)
    or, with --max-migrations 0, ends with one clean error event. Never a
    token twice or missing; nothing held afterwards."""
    p = fail_engines["p"]
    decode = fail_engines["d_recompute"] if case == "d_recompute" else d
    prompt = token_prompt(150, seed=29)
    _, want = ref.post("/v1/completions", completion_body(model, prompt, max_tokens=16,
                                                          ignore_eos=True))
    body = completion_body(model, prompt, max_tokens=16, ignore_eos=True, stream=True)
    args = [] if case == "d_fail_migrates" else ["--max-migrations", "0"]
    with _DeadSideChannelP(p) as fake_p:
        px = Proxy([fake_p.url], [decode.url], log_dir(f"proxy-load-fail-{case}"),
                   args=args).start()
        try:
            px.wait_ready()
            before = decode.metrics()
            _, events = stream_text(px.url + "/v1/completions", body)
            after = decode.metrics()
            with urllib.request.urlopen(px.url + "/metrics", timeout=10) as r:
                proxy_metrics = r.read().decode()
        finally:
            px.stop()
    assert 'pd_proxy_first_token_total{path="seeded",reason=""} 1.0' in proxy_metrics
    assert events[-1] == "[DONE]"
    assert delta(before, after, EXTERNAL) == 0  # no KV arrived: the load failed
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    got = stream_output([e for e in events if isinstance(e, dict) and "error" not in e])
    if case == "d_fail_no_migration":
        assert len(errors) == 1 and events[-2] is errors[0], events[-3:]
        assert got.tokens == tuple(want["choices"][0]["token_ids"][:1])  # token #1 once
    else:
        assert not errors, errors
        assert len(got.tokens) == 16, "a token was duplicated or lost"
        assert_same_as_reference(ref, got, want)
    assert_nothing_held([p], [decode], model, LEASE_S + 10, f"after the failed load ({case})")


def test_p_killed_before_d_reads(fail_engines: dict[str, Engine], d: Engine, ref: Engine,
                                 model: str) -> None:
    """P stays dead from here on (the restart test restarts it on its own,
    so the set's engines start once more, not twice)."""
    p, d_recompute = fail_engines["p"], fail_engines["d_recompute"]
    body = completion_body(model, token_prompt(260, seed=35), max_tokens=10)
    _, want = ref.post("/v1/completions", body)
    params = prefill(p, body)
    p.kill()  # SIGKILL: a crash, no goodbye
    p.proc.wait(timeout=30)  # type: ignore[union-attr]

    # fail: a clean error, D stays up.
    t0 = time.monotonic()
    status, got = d.post("/v1/completions", dict(body, kv_transfer_params=params))
    assert status >= 500, got
    assert time.monotonic() - t0 < 60
    assert d.alive()

    # recompute: D prefills locally and the tokens equal the collocated ones.
    before = d_recompute.metrics()
    status, got = d_recompute.post("/v1/completions", dict(body, kv_transfer_params=params))
    after = d_recompute.metrics()
    assert status == 200, got
    assert_same_as_reference(ref, got, want)
    assert delta(before, after, EXTERNAL) == 0
    assert delta(before, after, "vllm:pd_ext_kv_failures_total") == 1


def test_d_killed_mid_stream_the_stream_continues_on_the_other_d(
        fail_engines: dict[str, Engine], p: Engine, d: Engine, ref: Engine, model: str) -> None:
    """Issue 28, and last in this module (its victim stays dead, as the
    short-lease P of the test above does, so no engine starts for it): a D
    SIGKILLed after 20 tokens of a 200-token greedy stream; the proxy
    continues it on the other D from the token ids the client has. The
    client's stream completes, equal to the collocated reference, no token
    twice or missing, and the usage counts the whole answer."""
    victim = fail_engines["d_recompute"]
    victim_log_before = len(victim.log_text())
    px = Proxy([p.url], [victim.url, d.url], log_dir("proxy-migration"),
               args=["--routing", "round-robin"]).start()
    try:
        px.wait_ready()
        prompt = token_prompt(150, seed=28)
        body = completion_body(model, prompt, max_tokens=200, stream=True,
                               stream_options={"include_usage": True})
        _, want = ref.post("/v1/completions", completion_body(model, prompt, max_tokens=200))
        assert len(want["choices"][0]["token_ids"]) == 200, want
        events = _stream_killing(px.url + "/v1/completions", body, victim, after=20)
        assert events[-1] == "[DONE]"
        assert not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
        got = stream_output(events)
        assert len(got.tokens) == 200, "a token was duplicated or lost"
        assert_same_as_reference(ref, got, want)
        usage = events[-2]["usage"]
        assert usage["prompt_tokens"] == 150 and usage["completion_tokens"] == 200
        assert {e["id"] for e in events if isinstance(e, dict)} == {events[0]["id"]}
        # The victim served the first part, on the KV it read from P.
        assert "loaded 150 tokens" in victim.log_text()[victim_log_before:]
        log = px.log_path.read_text()
        assert "continuing on another decode engine" in log, log[-2000:]
        with urllib.request.urlopen(px.url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert 'pd_proxy_migrations_total{cause="mid_stream",outcome="ok"} 1.0' in metrics
        assert_nothing_held([p], [d], model, 15, "after the migration")
    finally:
        px.stop()


def _stream_killing(url: str, body: dict[str, Any], victim: Engine, after: int) -> list[Any]:
    """Stream ``body``; SIGKILL ``victim`` once ``after`` events arrived."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=120)
    events: list[Any] = []
    try:
        conn.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()[:300]
        for event in sse.response_events(resp):
            events.append("[DONE]" if event.kind is sse.Kind.DONE else event.data)
            if len(events) == after:
                assert victim.alive()
                victim.kill()  # SIGKILL, mid-generation
    finally:
        conn.close()
    return events
