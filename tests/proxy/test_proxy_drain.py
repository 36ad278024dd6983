"""A draining engine (vllm_pd_ext/drain.py) costs the client nothing.

The engine answers every new leg with 503 + ``X-PD-Draining: 1`` and keeps
``/health`` at 200 with the same header. The proxy sends the leg elsewhere
(pull: the P leg or the D leg alone; push: both legs again, under a new
``pd_request_id``), takes the engine out of rotation at once, shows it as
``draining`` in its health, and puts it back when it comes up undrained.
"""

from __future__ import annotations

from typing import Any

import pytest
from pdproxy_helpers import parse_sse

BODY: dict[str, Any] = {"model": "m", "prompt": "hi", "max_tokens": 4}


async def _drain_after_first_round(client: Any, engine: Any) -> None:
    """Start draining once the proxy has seen the engine healthy, so that the
    first leg it sends there is the one refused (not the health round)."""
    assert (await _states(client))[engine.url] == "healthy"
    engine.draining = True


async def _states(client: Any) -> dict[str, str]:
    resp = await client.get("/health")
    data = await resp.json()
    return {b["url"]: b["state"] for pool in ("prefill", "decode") for b in data[pool]}


@pytest.mark.parametrize("stream", [False, True])
async def test_pull_prefill_drains_leg_goes_to_the_other(engines, proxy, stream: bool) -> None:
    p0 = await engines("prefill")
    p1 = await engines("prefill")
    d = await engines("decode")
    client = await proxy([p0, p1], [d], routing="round-robin")
    await _drain_after_first_round(client, p0)
    for _ in range(3):
        resp = await client.post("/v1/completions", json=dict(BODY, stream=stream))
        assert resp.status == 200, await resp.text()
        if stream:
            assert parse_sse(await resp.read())[-1] == "[DONE]"
    assert len(p0.legs()) == 1  # refused once, then out of rotation
    assert len(p1.legs()) == 3 and len(d.legs()) == 3
    assert (await _states(client))[p0.url] == "draining"


async def test_pull_decode_drains_d_leg_goes_to_the_other_with_the_same_kv(
    engines, proxy
) -> None:
    p = await engines("prefill")
    d0 = await engines("decode")
    d1 = await engines("decode")
    client = await proxy([p], [d0, d1], routing="round-robin")
    await _drain_after_first_round(client, d0)
    for _ in range(3):
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status == 200, await resp.text()
    assert len(p.legs()) == 3  # one prefill per request: the KV is not recomputed
    assert len(d0.legs()) == 1 and len(d1.legs()) == 3
    assert d1.legs()[0].body["kv_transfer_params"] == d0.legs()[0].body["kv_transfer_params"]
    assert (await _states(client))[d0.url] == "draining"


@pytest.mark.parametrize("which", ["prefill", "decode"])
async def test_push_either_engine_drains_the_pair_is_sent_again(engines, proxy, which) -> None:
    p0 = await engines("prefill", engine_id="p0")
    p1 = await engines("prefill", engine_id="p1")
    # A real push D waits for P's KV: its first byte comes after P's answer.
    d0 = await engines("decode", delay=0.05)
    d1 = await engines("decode", delay=0.05)
    client = await proxy([p0, p1], [d0, d1], transfer_mode="push", routing="round-robin")
    drained = p0 if which == "prefill" else d0
    await _drain_after_first_round(client, drained)
    for _ in range(3):
        resp = await client.post("/v1/completions", json=dict(BODY, stream=True))
        assert resp.status == 200, await resp.text()
        assert parse_sse(await resp.read())[-1] == "[DONE]"
    assert len(drained.legs()) == 1  # refused once, then out of rotation
    assert (await _states(client))[drained.url] == "draining"
    def ids(*engines: Any) -> set[str]:
        return {s.body["kv_transfer_params"]["pd_request_id"] for e in engines for s in e.legs()}

    # Each request was served once by an undrained pair sharing one pd_request_id
    # (a cancelled dispatch's other leg went to the drained engine).
    both = ids(*(e for e in (d0, d1) if e is not drained)) & ids(
        *(e for e in (p0, p1) if e is not drained)
    )
    assert len(both) == 3


async def test_health_round_marks_draining_and_brings_it_back(engines, proxy) -> None:
    p0 = await engines("prefill", draining=True)
    p1 = await engines("prefill")
    d = await engines("decode")
    client = await proxy([p0, p1], [d], routing="round-robin")
    assert (await _states(client))[p0.url] == "draining"
    for _ in range(2):
        assert (await client.post("/v1/completions", json=BODY)).status == 200
    assert not p0.legs()  # known draining from its health: never sent a leg
    p0.draining = False  # restarted, undrained
    assert (await _states(client))[p0.url] == "healthy"
    for _ in range(2):
        assert (await client.post("/v1/completions", json=BODY)).status == 200
    assert len(p0.legs()) == 1


async def test_every_engine_draining_is_a_clear_503(engines, proxy) -> None:
    p = await engines("prefill", draining=True)
    d = await engines("decode")
    client = await proxy([p], [d])
    resp = await client.post("/v1/completions", json=BODY)
    assert resp.status == 503
    assert "draining" in (await resp.text())
