"""leg_auth.LegAuthMiddleware with a fake ASGI app: 401/403 before the engine (issue 12)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from vllm_pd_ext.leg_auth import LegAuthMiddleware, keyring_from_argv
from vllm_pd_ext.wire import auth

SECRET = "s3cret-for-tests-0123456789"
KR = auth.Keyring.parse(SECRET, "test")
BODY = {"model": "m", "prompt": "hello there", "max_tokens": 4}
D_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "127.0.0.1",
            "remote_port": 5600, "remote_request_id": "x", "remote_block_ids": [[0]]}


class App:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        msg = await receive()
        self.bodies.append(msg["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(mw: LegAuthMiddleware, body: dict[str, Any], rid: str = "rid-1",
         method: str = "POST", chunks: int = 1) -> tuple[int, Any]:
    raw = json.dumps(body).encode()
    step = -(-len(raw) // chunks)
    parts = [raw[i:i + step] for i in range(0, len(raw), step)]
    queue = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
             for i, p in enumerate(parts)]
    sent: list[Any] = []

    async def receive() -> Any:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(msg: Any) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": method, "path": "/v1/completions",
             "headers": [(b"x-request-id", rid.encode())], "client": ("10.0.0.9", 1)}
    asyncio.run(mw(scope, receive, send))
    status = sent[0]["status"]
    data = sent[1]["body"]
    return status, (json.loads(data) if status != 200 else data)


def signed(params: dict[str, Any], rid: str = "rid-1", body: dict[str, Any] = BODY,
           now: float | None = None) -> dict[str, Any]:
    return dict(body, kv_transfer_params=auth.sign_leg(KR, params, rid, body, now=now))


def test_signed_legs_reach_the_engine_unchanged_even_in_chunks() -> None:
    app = App()
    mw = LegAuthMiddleware(app, keyring=KR)
    leg = signed(D_PARAMS)
    assert call(mw, leg, chunks=3) == (200, b"ok")
    assert json.loads(app.bodies[0]) == leg
    assert call(mw, signed({"do_remote_decode": True})) == (200, b"ok")
    assert call(mw, BODY) == (200, b"ok")  # no handoff: a plain request
    assert call(mw, dict(BODY, kv_transfer_params={"do_remote_prefill": False})) == (200, b"ok")


@pytest.mark.parametrize("make, status, why", [
    (lambda: dict(BODY, kv_transfer_params=D_PARAMS), 401, "not signed"),
    (lambda: dict(BODY, kv_transfer_params={"do_remote_decode": True}), 401, "not signed"),
    (lambda: dict(signed(D_PARAMS), prompt="another prompt"), 403, "another prompt"),
    (lambda: signed(D_PARAMS, rid="rid-2"), 403, "another request id"),
    (lambda: signed(D_PARAMS, now=time.time() - 120), 401, "clocks out of sync"),
    (lambda: dict(BODY, kv_transfer_params=auth.sign_leg(
        auth.Keyring.parse("wrong-secret-0123456789", "x"), D_PARAMS, "rid-1", BODY)),
     401, "unknown key id"),
])
def test_bad_legs_get_a_4xx_naming_the_reason_and_never_reach_the_engine(make, status,
                                                                         why) -> None:
    app = App()
    mw = LegAuthMiddleware(app, keyring=KR)
    got, body = call(mw, make())
    assert got == status
    assert why in body["error"]["message"]
    assert body["error"]["type"] == ("unauthenticated" if status == 401 else "forbidden")
    assert app.bodies == [] and mw.num_refused == 1


def test_without_a_secret_everything_passes() -> None:
    app = App()
    mw = LegAuthMiddleware(app, from_argv=False)
    assert call(mw, dict(BODY, kv_transfer_params=D_PARAMS)) == (200, b"ok")


def test_the_secret_is_read_from_the_engines_kv_transfer_config(tmp_path) -> None:
    f = tmp_path / "s"
    f.write_text(SECRET)
    kv = {"kv_connector": "PDConnector",
          "kv_connector_extra_config": {"auth_secret_file": str(f), "auth_window_s": 5}}
    kr, window = keyring_from_argv(["vllm", "serve", "--kv-transfer-config", json.dumps(kv)])
    assert kr is not None and kr.signing_kid == KR.signing_kid and window == 5
    assert keyring_from_argv(["vllm", "serve"]) == (None, auth.DEFAULT_WINDOW_S)
    # A configured secret that cannot be read refuses every leg (fail closed).
    kv["kv_connector_extra_config"] = {"auth_secret_file": str(tmp_path / "missing")}
    kr, _ = keyring_from_argv([f"--kv-transfer-config={json.dumps(kv)}"])
    assert kr is not None and not kr.keys
    with pytest.raises(auth.AuthError):
        auth.verify_leg(kr, signed(D_PARAMS)["kv_transfer_params"])


def test_a_key_spelled_with_a_json_escape_is_still_checked() -> None:
    """Issue 27 item 2: ``"kv_transfer\\u005fparams"`` decodes to the key
    without its bytes in the body; it used to skip every check."""
    app = App()
    mw = LegAuthMiddleware(app, keyring=KR)
    raw = json.dumps(dict(BODY, kv_transfer_params=D_PARAMS)).replace(
        '"kv_transfer_params"', '"kv_transfer\\u005fparams"').encode()
    assert b"kv_transfer_params" not in raw
    assert json.loads(raw)["kv_transfer_params"] == D_PARAMS
    sent: list[Any] = []
    queue = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> Any:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(msg: Any) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"x-request-id", b"rid-1")], "client": ("10.0.0.9", 1)}
    asyncio.run(mw(scope, receive, send))
    assert sent[0]["status"] == 401 and app.bodies == []
    assert "not signed" in json.loads(sent[1]["body"])["error"]["message"]
