"""The proxy signs every leg's kv_transfer_params with the shared secret (issue 12 item 4).

Fake engines record the legs; each leg's ``pd_sig`` must verify with the
engines' own check (``auth.verify_leg``: key, MAC, window, prompt, request
id) against exactly the body and X-Request-Id the engine received.
"""

from __future__ import annotations

import time

import pytest
from vllm_pd_proxy.cli import build_parser, config_from_args
from vllm_pd_proxy.config import ConfigError

from vllm_pd_ext.wire import auth

SECRET = "s3cret-for-tests-0123456789"
KR = auth.Keyring.parse(SECRET, "test")


def verified(leg) -> None:
    auth.verify_leg(KR, leg.body["kv_transfer_params"],
                    request_id=leg.headers["X-Request-Id"], body=leg.body, now=time.time())


async def test_pull_legs_are_signed_for_their_request_and_prompt(engines, proxy):
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d], auth=KR)
    for path, body in (("/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 3}),
                       ("/v1/chat/completions", {"model": "m", "max_tokens": 3, "messages": [
                           {"role": "user", "content": "hi"}]})):
        resp = await client.post(path, json=body, headers={"X-Request-Id": "client-7"})
        assert resp.status == 200
        await resp.read()
    assert len(p.legs()) == 2 and len(d.legs()) == 2
    for leg in p.legs() + d.legs():
        verified(leg)
    # D's params are P's answer plus the signature and pd_bidirectional (D
    # keeps no turn without --multi-turn), nothing else changed.
    d_params = dict(d.legs()[0].body["kv_transfer_params"])
    d_params.pop(auth.LEG_FIELD)
    assert d_params == {**p.kv_params, "pd_bidirectional": False}
    # Each leg's signature binds it: P's does not verify for D's body and vice versa.
    with pytest.raises(auth.AuthError, match="another prompt"):
        auth.verify_leg(KR, d.legs()[0].body["kv_transfer_params"], body=d.legs()[1].body)


async def test_push_legs_and_identity_probe_are_signed(engines, proxy):
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d], auth=KR, transfer_mode="push")
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x",
                                                      "max_tokens": 3})
    assert resp.status == 200
    await resp.read()
    assert p.probes() and p.legs() and d.legs()
    for leg in p.probes() + p.legs() + d.legs():
        verified(leg)


async def test_without_a_secret_legs_carry_no_signature(engines, proxy):
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d])
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert resp.status == 200
    await resp.read()
    assert auth.LEG_FIELD not in d.legs()[0].body["kv_transfer_params"]


def test_cli_reads_the_secret_from_a_file_or_the_environment(tmp_path, monkeypatch):
    base = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    parser = build_parser()
    monkeypatch.delenv(auth.DEFAULT_SECRET_ENV, raising=False)
    assert config_from_args(parser.parse_args(base)).auth is None
    monkeypatch.setenv(auth.DEFAULT_SECRET_ENV, SECRET)
    assert config_from_args(parser.parse_args(base)).auth.signing_kid == KR.signing_kid
    f = tmp_path / "secret"
    f.write_text("other-secret-0123456789\n" + SECRET)
    cfg = config_from_args(parser.parse_args([*base, "--auth-secret-file", str(f)]))
    assert cfg.auth is not None and set(cfg.auth.keys) >= {KR.signing_kid}
    assert SECRET not in repr(cfg)
    with pytest.raises(ConfigError, match="--auth-secret-file"):
        config_from_args(parser.parse_args([*base, "--auth-secret-file", str(tmp_path / "x")]))
