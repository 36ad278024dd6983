"""GET /health, GET /metrics, background health rounds."""

from __future__ import annotations

import pytest
from pdproxy_helpers import wait_for
from vllm_pd_proxy.config import TransferMode
from vllm_pd_proxy.health import ProbeError, concurrent_pull, identity_from_params


async def test_health_reports_each_backend(engines, proxy):
    p = await engines("prefill")
    d1, d2 = await engines("decode"), await engines("decode")
    client = await proxy([p], [d1, d2])
    resp = await client.get("/health")
    assert resp.status == 200
    body = await resp.json()
    assert body["status"] == "ok"
    assert [b["url"] for b in body["prefill"]] == [p.url]
    assert [b["url"] for b in body["decode"]] == [d1.url, d2.url]
    assert {b["state"] for b in body["prefill"] + body["decode"]} == {"healthy"}

    d1.health_status = 503
    body = await (await client.get("/health")).json()
    assert body["status"] == "ok"  # d2 still serves
    assert body["decode"][0]["state"] == "unhealthy"
    assert "503" in body["decode"][0]["last_error"]

    d2.health_status = 500
    resp = await client.get("/health")
    assert resp.status == 503
    assert (await resp.json())["status"] == "unavailable"

    d1.health_status = d2.health_status = 200
    assert (await client.get("/health")).status == 200


async def test_health_503_without_prefill(engines, proxy):
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d])
    await p.close()
    resp = await client.get("/health")
    assert resp.status == 503
    state = (await resp.json())["prefill"][0]
    assert state["state"] == "unhealthy" and "health probe failed" in state["last_error"]


async def test_background_round_marks_and_recovers(engines, proxy):
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d], health_interval=0.05)
    app_pools = client.server.app
    from vllm_pd_proxy.app import DECODE

    backend = app_pools[DECODE].backends[0]
    await wait_for(lambda: backend.state == "healthy")
    d.health_status = 503
    await wait_for(lambda: backend.state == "unhealthy")
    d.health_status = 200
    await wait_for(lambda: backend.state == "healthy")


async def test_metrics_exposition(engines, proxy):
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d])
    assert (
        await client.post("/v1/completions", json={"prompt": "a", "stream": True})
    ).status == 200
    assert (await client.post("/v1/completions", data=b"{")).status == 400
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    text = await resp.text()
    assert 'pd_proxy_requests_total{mode="pull",outcome="ok"} 1.0' in text
    assert 'pd_proxy_requests_total{mode="none",outcome="bad_request"} 1.0' in text
    assert f'pd_proxy_backend_in_flight{{backend="{d.url}",role="decode"}} 0.0' in text
    assert f'pd_proxy_backend_legs_total{{backend="{p.url}",role="prefill"}} 1.0' in text
    for name in ("prefill_leg", "decode_leg", "ttft"):
        assert f"pd_proxy_{name}_seconds_count 1.0" in text
    assert "pd_proxy_e2e_seconds_count 2.0" in text  # the 400 counts too


def test_identity_is_decoded_as_the_push_d_leg_will_be():
    """P's identity goes through D's decoder (of the push D leg that will
    carry it): one D would refuse fails the probe, naming the field. As
    before, a port as a string and a missing tp_size are accepted."""
    good = {"remote_engine_id": "e", "remote_host": "10.0.0.1", "remote_port": "5600",
            "tp_size": None, "transfer_mode": "push", "remote_block_ids": [[1]]}
    identity = identity_from_params(good)
    assert (identity.engine_id, identity.host, identity.port, identity.tp_size) == (
        "e", "10.0.0.1", 5600, 1)
    with pytest.raises(ProbeError, match=r"lack \['remote_host'\]"):
        identity_from_params(dict(good, remote_host=None))
    with pytest.raises(ProbeError, match="not 'push'"):
        identity_from_params(dict(good, transfer_mode="pull"))
    for field, value in (("remote_port", 0), ("remote_port", "x"), ("remote_host", "a b"),
                         ("tp_size", 4096), ("remote_engine_id", 7)):
        with pytest.raises(ProbeError, match=f"malformed: .*{field}"):
            identity_from_params(dict(good, **{field: value}))


def test_a_pull_identity_says_pull_or_nothing():
    """A concurrent pull's D leg names P's identity: a vllm_pd_ext pull P
    says ``pull`` (it takes a concurrent pull); vLLM's NixlConnector says
    nothing (an identity, but the sequential pull); a push P is refused."""
    good = {"remote_engine_id": "e", "remote_host": "10.0.0.1", "remote_port": 5600,
            "tp_size": 2, "transfer_mode": "pull", "remote_block_ids": None}
    identity = identity_from_params(good, TransferMode.PULL)
    assert (identity.engine_id, identity.port, identity.tp_size) == ("e", 5600, 2)
    assert concurrent_pull(identity)
    in_tree = identity_from_params(dict(good, transfer_mode=None), TransferMode.PULL)
    assert in_tree.transfer_mode is None and not concurrent_pull(in_tree)
    with pytest.raises(ProbeError, match="transfer_mode='push', not 'pull'"):
        identity_from_params(dict(good, transfer_mode="push"), TransferMode.PULL)
    with pytest.raises(ProbeError, match=r"malformed: .*remote_port"):
        identity_from_params(dict(good, remote_port=0), TransferMode.PULL)
