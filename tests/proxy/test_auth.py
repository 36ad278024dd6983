"""Engines started with --api-key: the proxy's own calls and client calls."""

from __future__ import annotations

import logging

from vllm_pd_proxy.app import CONFIG
from vllm_pd_proxy.cli import API_KEY_ENV, build_parser, config_from_args

KEY = "sk-backend-3f9c1e"


async def test_backend_api_key_authorizes_probes_and_client_auth_is_forwarded(
    engines, proxy, caplog
):
    caplog.set_level(logging.DEBUG, logger="vllm_pd_proxy")
    bearer = {"Authorization": f"Bearer {KEY}"}
    p = await engines("prefill", api_key=KEY)
    d = await engines("decode", api_key=KEY)
    client = await proxy([p], [d], transfer_mode="push", backend_api_key=KEY)

    resp = await client.post("/v1/completions", json={"prompt": "a"}, headers=bearer)
    assert resp.status == 200  # the identity probe got through
    own_calls = [*p.probes(), *p.gets, *d.gets]  # probes, /v1/models, /health
    assert {s.path for s in own_calls} == {"/v1/completions", "/v1/models", "/health"}
    assert all(s.headers.get("Authorization") == bearer["Authorization"] for s in own_calls)
    assert [leg.headers["Authorization"] for leg in p.legs() + d.legs()] == [
        bearer["Authorization"]
    ] * 2

    # /v1/models is a client call: the client's header, never the proxy's key.
    resp = await client.get("/v1/models", headers=bearer)
    assert resp.status == 200
    assert (await resp.json())["data"][0]["id"] == "fake-model"
    resp = await client.get("/v1/models")
    assert resp.status == 401
    assert "Authorization" not in d.gets[-1].headers

    health = await client.get("/health")
    assert health.status == 200
    assert KEY not in await health.text()
    assert KEY not in repr(client.server.app[CONFIG])
    assert KEY not in caplog.text


async def test_wrong_backend_api_key_fails_probe_without_logging_it(engines, proxy, caplog):
    caplog.set_level(logging.DEBUG, logger="vllm_pd_proxy")
    p = await engines("prefill", api_key=KEY)
    d = await engines("decode", api_key=KEY)
    client = await proxy([p], [d], transfer_mode="push", backend_api_key="wrong-key-77")
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 502
    assert "401" in (await resp.json())["error"]["message"]
    assert "identity probe" in caplog.text  # the failure is logged...
    assert "wrong-key-77" not in caplog.text  # ...without the key


def test_backend_api_key_flag_env_and_help(monkeypatch):
    base = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert config_from_args(build_parser().parse_args(base)).backend_api_key is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    config = config_from_args(build_parser().parse_args(base))
    assert config.backend_api_key == "from-env"
    assert "from-env" not in repr(config)
    assert "from-env" not in build_parser().format_help()
    flagged = [*base, "--backend-api-key", "from-flag"]
    assert config_from_args(build_parser().parse_args(flagged)).backend_api_key == "from-flag"
    monkeypatch.setenv(API_KEY_ENV, "")
    assert config_from_args(build_parser().parse_args(base)).backend_api_key is None
