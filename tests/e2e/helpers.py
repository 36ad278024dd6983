"""Shared helpers for end-to-end tests against real vLLM engines."""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from vllm_pd_ext.testing.engines import REPO, Engine
from vllm_pd_ext.testing.oracle import (
    Output,
    Verdict,
    compare,
    near_tie_nats,
    output_of,
    stream_output,
)
from vllm_pd_ext.tools import sse

BLOCK_SIZE = 128  # vLLM's CPU default
TINY_LAYERS = 4
TINY_BLOCK_BYTES = 2 * 128 * 2 * 64 * 2  # heads x block x (K+V) x head_dim x bf16 = 64 KiB
EXTERNAL = "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
CACHE_HIT = "vllm:prompt_tokens_by_source_total[local_cache_hit]"
KV_BYTES = "vllm:pd_ext_kv_bytes_total"


def build_model(name: str, seed: int = 0, preset: str = "tiny") -> str:
    out = REPO / ".models" / name
    subprocess.run([sys.executable, str(REPO / "examples/make_tiny_model.py"), "--out", str(out),
                    "--preset", preset, "--seed", str(seed)], check=True,
                   stdout=subprocess.DEVNULL)
    return str(out)


def token_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 3000) for _ in range(n)]


def blocks_for(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK_SIZE)


def completion_body(model: str, prompt: Any, max_tokens: int = 12, **extra: Any
                    ) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}
    body.update(extra)
    return body


def assert_same_as_reference(ref: Engine, got: Mapping[str, Any] | Output,
                             want: Mapping[str, Any] | Output,
                             eps: float | None = None) -> Verdict:
    """The suite's equality oracle (vllm_pd_ext/testing/oracle.py, rule in
    docs/testing.md): ``got`` (a P/D answer) must be the collocated ``ref``
    engine's own greedy output ``want`` token for token, or differ from it
    only where ``ref`` itself rates ``got``'s token within the near-tie
    epsilon of its best at every generated position. Both answers need
    ``return_token_ids``. ``eps``: another near-tie epsilon than the dtype's
    (tensor parallelism, tests/e2e/test_tp.py)."""
    g = got if isinstance(got, Output) else output_of(got)
    w = want if isinstance(want, Output) else output_of(want)
    assert g.prompt == w.prompt, "the P/D answer and the reference saw different prompts"
    verdict = compare(ref.url, ref.model, g.prompt, g.tokens, w.tokens,
                      near_tie_nats(ref.dtype) if eps is None else eps)
    assert verdict.same, f"P/D output differs from the collocated engine's: {verdict.detail}"
    if verdict.exact:
        assert g.text == w.text
    else:
        print(f"oracle: {verdict.summary()}")  # shown with -rP and on a later failure
    return verdict


def prefill(p: Engine, body: dict[str, Any]) -> dict[str, Any]:
    leg = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    status, resp = p.post("/v1/completions", leg)
    assert status == 200, resp
    params = resp.get("kv_transfer_params")
    assert params and params["do_remote_prefill"] is True, resp
    return params


def pd_complete(p: Engine, d: Engine, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    params = prefill(p, body)
    return d.post("/v1/completions", dict(body, kv_transfer_params=params))


def poke(engine: Engine, model: str) -> None:
    """One plain request: an idle P frees released or expired leases when the
    next request arrives (it does not step while idle)."""
    status, body = engine.post("/v1/completions", completion_body(model, [11, 12, 13],
                                                                  max_tokens=1))
    assert status == 200, body


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def stream_text(url: str, body: dict[str, Any], timeout: float = 120,
                headers: Mapping[str, str] | None = None) -> tuple[str, list[Any]]:
    """POST with stream=true; returns the joined text and the parsed events."""
    req = urllib.request.Request(url, data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        events = sse_events(r)
    text = "".join(sse.text_of(ev) for ev in events if isinstance(ev, dict))
    return text, events


def sse_events(resp: sse.Readable) -> list[Any]:
    """The payloads of an SSE response (``tools/sse.py``), ``"[DONE]"``
    included (the last item) when the stream sent it; reading stops there."""
    events: list[Any] = []
    for event in sse.response_events(resp):
        events.append(event.payload)
        if event.kind is sse.Kind.DONE:
            break
    return events


@contextlib.contextmanager
def open_stream(url: str, body: dict[str, Any], headers: Mapping[str, str] | None = None,
                timeout: float = 60, events: int = 1) -> Iterator[dict[str, Any]]:
    """POST ``body`` (streamed) and hold the stream open once its first
    ``events`` events came (generation under way; token #1 comes from P, so
    ``events`` > 1 waits for D's), yielding the first; leaving the block
    closes the connection, as a client that goes away mid-stream."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=timeout)
    try:
        conn.request("POST", u.path, json.dumps(dict(body, stream=True)),
                     {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()[:300]
        stream = sse.response_events(resp)
        first = next(stream, None)
        assert first is not None and first.kind is sse.Kind.CHUNK, first
        for _ in range(events - 1):
            more = next(stream, None)
            assert more is not None and more.kind is sse.Kind.CHUNK, more
        yield first.data
    finally:
        conn.close()


def send_completion(url: str, body: dict[str, Any], rid: str) -> Output:
    """POST one completion (streamed or not; chat when ``body`` has
    messages) and insist on a complete 200 answer."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "X-Request-Id": rid})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
            if not body.get("stream"):
                return output_of(json.loads(r.read()))
            events = sse_events(r)
            errs = [ev for ev in events if isinstance(ev, dict) and "error" in ev]
            assert not errs, f"{rid}: error event in the stream: {errs[0]}"
            assert events and events[-1] == "[DONE]", f"{rid}: stream ended without [DONE]"
            return stream_output(events)
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{rid}: HTTP {exc.code}: {exc.read()[:300]!r}") from None


def run_clients(url: str, jobs: list[tuple[str, dict[str, Any]]], clients: int,
                timeout: float = 300) -> dict[str, Output | BaseException]:
    """``clients`` closed-loop threads send ``jobs`` (request id, body) to
    ``url``; each request's Output, or the exception that ended it."""
    results: dict[str, Output | BaseException] = {}
    lock = threading.Lock()
    queue = iter(jobs)

    def client() -> None:
        while True:
            with lock:
                job = next(queue, None)
            if job is None:
                return
            rid, body = job
            try:
                out: Output | BaseException = send_completion(url, body, rid)
            except BaseException as exc:  # reported by the caller, with every other failure
                out = exc
            with lock:
                results[rid] = out

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=timeout)
    return results


def log_dir(name: str) -> Path:
    return REPO / ".runs" / "tests" / name


def assert_outputs_are_reference(ref: Engine, jobs: list[tuple[str, dict[str, Any]]],
                                 results: Mapping[str, Any], max_tokens: int) -> None:
    """Every job's output (``run_clients``) is the collocated ``ref`` engine's,
    by the oracle, with ``max_tokens`` tokens."""
    for rid, body in jobs:
        got = results[rid]
        assert isinstance(got, Output)
        assert len(got.tokens) == max_tokens, f"{rid}: {len(got.tokens)} tokens"
        status, want = ref.post("/v1/completions", dict(body, stream=False))
        assert status == 200, want
        assert_same_as_reference(ref, got, output_of(want))


def assert_nothing_held(ps: list[Engine], ds: list[Engine], model: str, within_s: float,
                        what: str) -> None:
    """No KV block stays in use on any engine (an idle P frees released
    leases on its next request, hence the pokes), within ``within_s``; all
    engines still alive."""
    deadline = time.monotonic() + within_s
    while True:
        for p in ps:
            poke(p, model)
        usage = [e.metrics()["vllm:kv_cache_usage_perc"] for e in (*ps, *ds)]
        if not any(usage) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    names = " ".join(e.name for e in (*ps, *ds))
    assert not any(usage), f"{what}: blocks held afterwards ({names}): {usage}"
    assert all(e.alive() for e in (*ps, *ds))


def text_prompt(n_words: int, seed: int) -> str:
    """A text prompt (concurrent dispatch takes text prompts and chat, not
    token ids)."""
    rng = random.Random(seed)
    words = ["block", "cache", "token", "prefill", "decode", "lease", "write", "stream",
             "engine", "proxy", "layer", "head", "tiny", "model", "vector", "page"]
    return " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(n_words))
