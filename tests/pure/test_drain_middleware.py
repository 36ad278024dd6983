"""The drain middleware (vllm_pd_ext/drain.py) at the ASGI level, with a fake app.

Real engines drain in tests/e2e/test_drain.py; here the rules: new POSTs are
refused with 503 + X-PD-Draining + Retry-After once draining, GETs pass with
the header, requests admitted before the drain finish, and the hand-over to
vLLM's shutdown comes only once they have (or at the drain timeout), giving
vLLM only what is left of the drain. With a secret, POST /pd/drain needs the
drain token; on one API server of several it drains them all through vLLM's
parent process, or refuses (409) where that parent would kill at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import types
from typing import Any

from vllm_pd_ext.drain import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DrainMiddleware,
    DrainState,
    VllmSide,
    drain_timeout_from_argv,
    handover_window_s,
)
from vllm_pd_ext.drain_auth import DRAIN_LABEL, drain_token
from vllm_pd_ext.drain_auth import main as drain_token_cli
from vllm_pd_ext.wire import auth


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


async def _call(mw: DrainMiddleware, method: str, path: str,
                headers: list[tuple[bytes, bytes]] | None = None,
                app: Any = None) -> tuple[int, dict[str, str], bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": method, "path": path, "headers": headers or []}
    if app is not None:
        scope["app"] = app  # Starlette puts itself here: the middleware finds vLLM's config
    await mw(scope, receive, send)
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


# ------------------------------------------------------------- vLLM, faked
class FakeConfig:
    """The part of vLLM's config the middleware's ``VllmSide`` reads."""

    def __init__(self, shutdown_timeout: int = 0) -> None:
        self.shutdown_timeout = shutdown_timeout


class FakeStarlette:
    """``scope["app"]``: ``app.state.engine_client.vllm_config``, as vLLM's app has."""

    def __init__(self, config: FakeConfig) -> None:
        self.state = types.SimpleNamespace(
            engine_client=types.SimpleNamespace(vllm_config=config))


class FakeVllm(VllmSide):
    """vLLM behind ``compat``: records the window and the signals to the parent."""

    def __init__(self, num_api_servers: int = 1, rank: int = 0, parent_pid: int | None = 4242
                 ) -> None:
        self.windows: list[int] = []
        self.num_api_servers, self.rank = num_api_servers, rank
        self.parent_pid = parent_pid
        self.parent_signals = 0

    def set_window(self, vllm_config: Any, seconds: int) -> int:
        self.windows.append(seconds)
        return seconds

    def api_servers(self, vllm_config: Any) -> tuple[int, int]:
        return self.num_api_servers, self.rank

    def parent_drains(self, vllm_config: Any) -> bool:
        return int(vllm_config.shutdown_timeout) > 0

    def sigterm_parent(self) -> int | None:
        self.parent_signals += 1
        return self.parent_pid


async def _wait_for(cond: Any, timeout: float = 2.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


# ------------------------------------------------- item 1: what is left, not all
def test_handover_window_is_what_is_left_in_whole_seconds_at_least_one() -> None:
    assert handover_window_s(49.7, 120.0) == 49  # rounded down: within drain_timeout
    assert handover_window_s(0.0, 120.0) == 1  # spent: vLLM still gets a second
    assert handover_window_s(120.0, 120.0) == 120
    assert handover_window_s(0.0, 0.0) == 0  # drain_timeout 0: vLLM's abort-at-once


async def test_hand_over_gives_vllm_only_what_is_left_of_the_drain() -> None:
    now = [1000.0]
    app, vllm = FakeApp(), FakeVllm()
    handed: list[int] = []
    mw = DrainMiddleware(app, timeout_s=120, hand_over=lambda: handed.append(1),
                         clock=lambda: now[0], vllm=vllm)
    starlette = FakeStarlette(FakeConfig())
    admitted = asyncio.ensure_future(_call(mw, "POST", "/v1/completions", app=starlette))
    await asyncio.sleep(0.01)
    mw.begin("SIGTERM")
    now[0] += 70.0  # the admitted request took 70 s of the 120
    app.hold.set()
    await admitted
    await _wait_for(lambda: bool(handed))
    assert vllm.windows == [50]  # not 120: the whole drain stays within drain_timeout


async def test_hand_over_at_the_timeout_gives_vllm_one_second() -> None:
    now = [1000.0]
    app, vllm = FakeApp(), FakeVllm()
    handed: list[int] = []
    mw = DrainMiddleware(app, timeout_s=30, hand_over=lambda: handed.append(1),
                         clock=lambda: now[0], vllm=vllm)
    stuck = asyncio.ensure_future(_call(mw, "POST", "/v1/completions",
                                        app=FakeStarlette(FakeConfig())))
    await asyncio.sleep(0.01)
    mw.begin("SIGTERM")
    now[0] += 45.0  # past the drain's timeout with the request still running
    await _wait_for(lambda: bool(handed))
    assert vllm.windows == [1] and mw.state.in_flight == 1
    app.hold.set()
    await stuck


# ---------------------------------------------- item 8: POST /pd/drain needs the token
SECRET, NEXT = "drain-test-secret-0123456789", "next-drain-secret-9876543210"
KR = auth.Keyring.parse(f"{SECRET},{NEXT}", "test")


def _bearer(token: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {token}".encode())]


async def test_post_drain_needs_the_drain_token_with_a_secret() -> None:
    app = FakeApp()
    mw = DrainMiddleware(app, timeout_s=30, hand_over=lambda: None, keyring=KR)
    for headers, why in (([], "missing Authorization header"),
                         (_bearer(SECRET), "matches none"),  # the secret itself is no token
                         (_bearer(drain_token(b"another-secret-0123456789")), "matches none"),
                         ([(b"authorization", f"Basic {drain_token(SECRET.encode())}"
                            .encode())], "Bearer")):
        status, got_headers, body = await _call(mw, "POST", "/pd/drain", headers)
        error = json.loads(body)["error"]
        assert status == 401 and error["type"] == "unauthenticated", (status, body)
        assert why in error["message"] and got_headers["www-authenticate"].startswith("Bearer")
        assert not mw.state.draining
    # Probes stay readable without the token.
    assert (await _call(mw, "GET", "/pd/ready"))[0] == 200
    status, _, body = await _call(mw, "GET", "/pd/drain")
    assert status == 200 and json.loads(body)["draining"] is False
    # Any secret of a keyring being rotated has its token accepted.
    status, _, body = await _call(mw, "POST", "/pd/drain", _bearer(drain_token(NEXT.encode())))
    assert status == 202 and json.loads(body)["draining"] is True


def test_drain_token_is_an_hmac_of_the_label_and_the_cli_prints_it(
        capsys: Any, monkeypatch: Any) -> None:
    token = drain_token(SECRET.encode())
    assert token == hmac.new(SECRET.encode(), DRAIN_LABEL, hashlib.sha256).hexdigest()
    monkeypatch.setenv("PD_DRAIN_TEST_SECRET", f"{SECRET},{NEXT}")
    assert drain_token_cli(["--auth-secret-env", "PD_DRAIN_TEST_SECRET"]) == 0
    assert capsys.readouterr().out.strip() == token  # the signing (first) secret's
    monkeypatch.delenv("PD_DRAIN_TEST_SECRET")
    assert drain_token_cli(["--auth-secret-env", "PD_DRAIN_TEST_SECRET"]) == 2


# ------------------------------------------ item 6: one API server of several
async def test_post_drain_on_one_api_server_of_several_drains_them_all() -> None:
    app, vllm = FakeApp(), FakeVllm(num_api_servers=2, rank=1)
    mw = DrainMiddleware(app, timeout_s=30, hand_over=lambda: None, vllm=vllm)
    starlette = FakeStarlette(FakeConfig(shutdown_timeout=30))  # the parent drains
    status, _, body = await _call(mw, "POST", "/pd/drain", app=starlette)
    state = json.loads(body)
    assert status == 202 and state["draining"] is True
    assert state["api_servers"] == 2 and state["api_server"] == 1
    assert vllm.parent_signals == 1  # SIGTERM to vLLM's parent: it drains every API server
    await _call(mw, "POST", "/pd/drain", app=starlette)
    assert vllm.parent_signals == 1  # once


async def test_post_drain_refused_where_the_parent_would_kill_at_once() -> None:
    for config, vllm in ((FakeConfig(shutdown_timeout=0), FakeVllm(num_api_servers=4)),
                         (FakeConfig(shutdown_timeout=30),
                          FakeVllm(num_api_servers=4, parent_pid=None))):
        mw = DrainMiddleware(FakeApp(), timeout_s=30, hand_over=lambda: None, vllm=vllm)
        status, _, body = await _call(mw, "POST", "/pd/drain", app=FakeStarlette(config))
        error = json.loads(body)["error"]
        assert status == 409 and error["type"] == "drain_unavailable", body
        assert "4 API servers" in error["message"] or "one of 4" in error["message"]
        assert "nothing was drained" in error["message"]
        assert not mw.state.draining
