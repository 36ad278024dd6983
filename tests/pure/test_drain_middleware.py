"""The drain middleware (vllm_pd_ext/drain.py) at the ASGI level, with a fake app.

Real engines drain in tests/e2e/test_drain.py; here the rules: new POSTs are
refused with 503 + X-PD-Draining + Retry-After once draining, GETs pass with
the header, requests admitted before the drain finish, and the hand-over to
vLLM's shutdown comes only once they have (or at the drain timeout).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from vllm_pd_ext.drain import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DrainMiddleware,
    DrainState,
    drain_timeout_from_argv,
)


class FakeApp:
    """Answers 200 after ``hold`` is set (a request in progress until then)."""

    def __init__(self) -> None:
        self.hold = asyncio.Event()
        self.calls: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.calls.append(scope["path"])
        if scope["method"] == "POST":
            await self.hold.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def _call(mw: DrainMiddleware, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    await mw({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {k.decode(): v.decode() for k, v in start.get("headers", [])}
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], headers, body


def test_state_counts_and_times_out() -> None:
    now = [100.0]
    st = DrainState(10.0, clock=lambda: now[0])
    assert st.admit() and st.in_flight == 1
    assert st.start("test") and not st.start("again")
    assert not st.admit() and st.refused == 1 and st.in_flight == 1
    now[0] += 4
    assert st.remaining_s() == 6.0
    now[0] += 20
    assert st.remaining_s() == 0.0
    st.done()
    assert st.as_json()["in_flight"] == 0 and st.as_json()["reason"] == "test"


async def test_refuses_new_work_finishes_admitted_then_hands_over() -> None:
    app = FakeApp()
    handed: list[float] = []
    mw = DrainMiddleware(app, timeout_s=30, hand_over=lambda: handed.append(1.0))
    admitted = asyncio.ensure_future(_call(mw, "POST", "/v1/completions"))
    await asyncio.sleep(0.01)
    assert mw.state.in_flight == 1

    status, headers, body = await _call(mw, "POST", "/pd/drain")
    assert status == 202 and json.loads(body)["draining"] is True
    status, headers, body = await _call(mw, "POST", "/v1/chat/completions")
    assert status == 503 and headers["x-pd-draining"] == "1" and headers["retry-after"] == "1"
    assert json.loads(body)["error"]["type"] == "draining"
    status, headers, _ = await _call(mw, "GET", "/health")  # alive, but says it drains
    assert status == 200 and headers["x-pd-draining"] == "1"
    status, _, _ = await _call(mw, "GET", "/pd/ready")
    assert status == 503
    await asyncio.sleep(0.2)
    assert not handed  # the admitted request is still running

    app.hold.set()
    assert (await admitted)[0] == 200
    for _ in range(40):
        if handed:
            break
        await asyncio.sleep(0.05)
    assert handed and mw.state.handed_over
    assert app.calls.count("/v1/completions") == 1 and "/v1/chat/completions" not in app.calls


async def test_hands_over_at_the_timeout_with_requests_still_running() -> None:
    app = FakeApp()
    handed: list[float] = []
    mw = DrainMiddleware(app, timeout_s=0.3, hand_over=lambda: handed.append(1.0))
    stuck = asyncio.ensure_future(_call(mw, "POST", "/v1/completions"))
    await asyncio.sleep(0.01)
    mw.begin("test")
    await asyncio.sleep(0.6)
    assert handed and mw.state.in_flight == 1
    app.hold.set()
    await stuck


async def test_not_draining_passes_everything_through() -> None:
    app = FakeApp()
    app.hold.set()
    mw = DrainMiddleware(app, timeout_s=30, hand_over=lambda: None)
    status, headers, _ = await _call(mw, "POST", "/v1/completions")
    assert status == 200 and "x-pd-draining" not in headers
    assert (await _call(mw, "GET", "/pd/ready"))[0] == 200
    assert json.loads((await _call(mw, "GET", "/pd/drain"))[2])["draining"] is False


def test_drain_timeout_comes_from_the_engines_kv_transfer_config() -> None:
    cfg = '{"kv_connector":"PDConnector","kv_connector_extra_config":{"drain_timeout":45}}'
    assert drain_timeout_from_argv(["vllm", "serve", "m", "--kv-transfer-config", cfg]) == 45.0
    assert drain_timeout_from_argv(["x", f"--kv-transfer-config={cfg}"]) == 45.0
    # Missing or malformed: the default (the connector itself refuses a bad key).
    assert drain_timeout_from_argv(["x"]) == DEFAULT_DRAIN_TIMEOUT_S
    assert drain_timeout_from_argv(["x", "--kv-transfer-config", "{oops"]) == \
        DEFAULT_DRAIN_TIMEOUT_S
    bad = '{"kv_connector_extra_config":{"drain_timeout":-3}}'
    assert drain_timeout_from_argv(["x", "--kv-transfer-config", bad]) == DEFAULT_DRAIN_TIMEOUT_S
