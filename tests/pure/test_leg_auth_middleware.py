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


def call(mw: LegAuthMiddleware, body: dict[str, Any] | bytes, rid: str = "rid-1",
         method: str = "POST", chunks: int = 1, app: Any = None) -> tuple[int, Any]:
    """``body`` (a dict, or raw bytes as sent) through ``mw``: (status, answer)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
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
             "headers": [(b"x-request-id", rid.encode())], "client": ("10.0.0.9", 1),
             "app": app}
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
    assert call(mw, dict(BODY, kv_transfer_params=None)) == (200, b"ok")


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
    status, answer = call(mw, raw)
    assert status == 401 and app.bodies == []
    assert "not signed" in answer["error"]["message"]


@pytest.mark.parametrize("params", [
    {"pd_bidirectional": True},
    {"remote_block_ids": [[1, 2]], "remote_host": "127.0.0.1"},
    {"do_remote_decode": False, "do_remote_prefill": False, "pd_bidirectional": True},
])
def test_every_field_of_kv_transfer_params_needs_a_signature(params) -> None:
    """Issue 27 item 3: a keep leg (``pd_bidirectional`` alone) used to pass
    unchecked: D kept the turn and told the caller its host and blocks."""
    app = App()
    mw = LegAuthMiddleware(app, keyring=KR)
    status, answer = call(mw, dict(BODY, kv_transfer_params=params))
    assert status == 401 and "not signed" in answer["error"]["message"]
    assert app.bodies == []
    assert call(mw, signed(params))[0] == 200 and len(app.bodies) == 1


def test_params_that_are_not_an_object_get_a_400() -> None:
    mw = LegAuthMiddleware(App(), keyring=KR)
    status, answer = call(mw, dict(BODY, kv_transfer_params="do_remote_decode"))
    assert status == 400 and answer["error"]["param"] == "kv_transfer_params"
    # Empty params ask for nothing and pass, as a body without them does.
    assert call(mw, dict(BODY, kv_transfer_params={}))[0] == 200


@pytest.mark.parametrize("prompt, n", [(["a", "b"], 2), ([[1, 2], [3, 4], [5]], 3)])
def test_a_signed_leg_with_a_batch_of_prompts_gets_a_400_naming_prompt(prompt, n) -> None:
    """Issue 27 item 5: vLLM runs each prompt of a batch as a request with
    the one leg (P would pin a lease per prompt for one answer)."""
    app = App()
    mw = LegAuthMiddleware(app, keyring=KR)
    body = dict(BODY, prompt=prompt)
    status, answer = call(mw, signed({"do_remote_decode": True}, body=body))
    assert status == 400 and answer["error"]["param"] == "prompt"
    assert f"batch of {n}" in answer["error"]["message"] and app.bodies == []
    one = dict(BODY, prompt=[1, 2, 3])  # one token-id prompt is no batch
    assert call(mw, signed({"do_remote_decode": True}, body=one))[0] == 200


def test_a_key_given_twice_gets_a_400() -> None:
    """The check and the engine must see the same params: parsers differ on
    which of two copies wins, so a body with two is refused."""
    app = App()
    mw = LegAuthMiddleware(app, keyring=KR)
    inner = json.dumps(signed({"do_remote_decode": True}))[1:-1]
    raw = ('{"kv_transfer_params": {}, ' + inner + "}").encode()
    status, answer = call(mw, raw)
    assert status == 400 and app.bodies == []
    assert "more than once" in answer["error"]["message"]


def test_a_stale_leg_with_an_escaped_key_and_another_prompt_is_refused() -> None:
    """The issue's reproduction: a signed P leg seen once, replayed after the
    window with the key escaped and another prompt, got 200 and a lease."""
    from vllm_pd_ext.leg_auth import check_leg

    old = signed({"do_remote_decode": True}, now=time.time() - 40)
    for body in (old, dict(old, prompt="another prompt")):
        raw = json.dumps(body).replace('"kv_transfer_params"', '"kv_transfer\\u005fparams"')
        problem = check_leg(KR, raw.encode(), "rid-1", time.time(), 30.0)
        assert problem is not None and problem.status == 401 and "window" in problem.reason


def test_the_secret_comes_from_vllms_parsed_config_else_the_environment(caplog) -> None:
    """Issue 27 item 4: the middleware read only ``--kv-transfer-config
    JSON`` from argv; any other spelling turned it off without a word."""
    from types import SimpleNamespace

    from vllm_pd_ext.leg_auth import resolve

    extra = {"auth_secret_env": "MY_PD_SECRET", "auth_window_s": 7}
    kv = SimpleNamespace(kv_connector_extra_config=extra)
    app = SimpleNamespace(state=SimpleNamespace(vllm_config=SimpleNamespace(
        kv_transfer_config=kv)))
    import os

    os.environ["MY_PD_SECRET"] = SECRET
    try:
        kr, window = resolve(app)
    finally:
        del os.environ["MY_PD_SECRET"]
    assert kr is not None and kr.signing_kid == KR.signing_kid and window == 7
    # Parsed args carry it too (a launcher without vllm_config on the state).
    kr, window = resolve(SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(
        kv_transfer_config={"kv_connector_extra_config": {"auth_window_s": 9}}))),
        environ={auth.DEFAULT_SECRET_ENV: SECRET})
    assert window == 9
    # No config anywhere, but the engine's environment holds a secret: use
    # it, and say so at ERROR.
    with caplog.at_level("ERROR"):
        kr, _ = resolve(None, environ={auth.DEFAULT_SECRET_ENV: SECRET})
    assert kr is not None and kr.signing_kid == KR.signing_kid
    assert "found no kv_transfer_config" in caplog.text
    assert resolve(None, environ={}) == (None, auth.DEFAULT_WINDOW_S)


def test_the_middleware_resolves_its_secret_at_the_first_request() -> None:
    from types import SimpleNamespace

    app = App()
    mw = LegAuthMiddleware(app, from_argv=False, lazy=True)
    vllm_app = SimpleNamespace(state=SimpleNamespace(vllm_config=SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={
            "auth_secret_env": "PD_TEST_SECRET_X"}))))
    import os

    os.environ["PD_TEST_SECRET_X"] = SECRET
    try:
        status, _ = call(mw, dict(BODY, kv_transfer_params={"do_remote_decode": True}),
                         app=vllm_app)
    finally:
        del os.environ["PD_TEST_SECRET_X"]
    assert status == 401 and mw.keyring is not None and app.bodies == []
