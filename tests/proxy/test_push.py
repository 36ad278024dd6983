"""Push mode: identity probes, leg shapes, concurrency, P failure handling."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from aiohttp import web
from pdproxy_helpers import chunk, completion, parse_sse, sse, wait_for
from vllm_pd_proxy import health


async def test_push_leg_shapes_and_probe(engines, proxy):
    p = await engines("prefill", engine_id="engine-a", model="p-model")
    d = await engines("decode")
    client = await proxy([p], [d], transfer_mode="push")
    body = {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": True, "min_tokens": 2}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    assert parse_sse(await resp.read())[-1] == "[DONE]"

    probe = p.probes()[0]
    assert probe.body == {
        "model": "p-model",
        "prompt": [1],
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "pd_ext_probe": True},
    }
    (p_leg,) = p.legs()
    rid = p_leg.headers["X-Request-Id"]
    pd_id = p_leg.body["kv_transfer_params"]["pd_request_id"]
    # Unique per dispatch, traceable to the request id.
    assert pd_id.startswith(rid + "-") and len(pd_id) == len(rid) + 9
    assert p_leg.body == {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_mode": "push",
            "pd_request_id": pd_id,
        },
    }
    (d_leg,) = d.legs()
    assert d_leg.headers["X-Request-Id"] == rid
    assert d_leg.body == {
        **body,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "engine-a",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 2,
            "remote_request_id": pd_id,
            "pd_request_id": pd_id,
            "transfer_mode": "push",
            "pd_bidirectional": False,  # D keeps no turn (no --multi-turn)
        },
    }


async def test_push_legs_are_in_flight_together(engines, proxy):
    p, d = await engines("prefill"), await engines("decode")
    overlap = {}

    async def prefill_waits_for_decode(engine, request, body):
        # Answer only once D has its leg: sequential legs would deadlock here
        # and the 2 s timeout turns that into a test failure.
        try:
            await asyncio.wait_for(d.received.wait(), 2)
        except TimeoutError:
            return web.json_response({"error": "decode leg never arrived"}, status=500)
        overlap["d_in_flight_while_p"] = d.in_flight
        await asyncio.sleep(0.1)  # "prefill compute", so D can observe P in flight
        return web.json_response(completion(request.path, body, "x"))

    async def decode_waits_for_prefill(engine, request, body):
        await asyncio.wait_for(p.received.wait(), 2)
        overlap["p_in_flight_while_d"] = p.in_flight
        await asyncio.sleep(0.05)  # "waiting for the pushed KV"
        return await engine.stream(request, body)

    p.override, d.override = prefill_waits_for_decode, decode_waits_for_prefill
    client = await proxy([p], [d], transfer_mode="push")
    resp = await asyncio.wait_for(
        client.post("/v1/completions", json={"prompt": "a", "stream": True}), 5
    )
    assert resp.status == 200
    assert parse_sse(await resp.read())[-1] == "[DONE]"
    assert overlap == {"d_in_flight_while_p": 1, "p_in_flight_while_d": 1}


async def test_push_prefill_failure_cancels_decode(engines, proxy):
    p, d = await engines("prefill"), await engines("decode")

    async def prefill_fails(engine, request, body):
        await asyncio.wait_for(d.received.wait(), 2)
        return web.json_response({"error": {"message": "P exploded"}}, status=500)

    async def decode_waits(engine, request, body):
        await asyncio.sleep(10)  # waits for KV that never comes
        return web.Response()

    p.override, d.override = prefill_fails, decode_waits
    client = await proxy([p], [d], transfer_mode="push")
    resp = await asyncio.wait_for(
        client.post("/v1/completions", json={"prompt": "a", "stream": True}), 5
    )
    assert resp.status == 500
    assert (await resp.json())["error"]["message"] == "P exploded"
    await wait_for(lambda: d.cancelled.is_set())


async def test_push_identity_refreshed_after_restart(engines, proxy):
    p = await engines("prefill", engine_id="engine-a")
    d = await engines("decode")
    client = await proxy([p], [d], transfer_mode="push", health_interval=0.1)

    async def engine_id_of_next_d_leg():
        before = len(d.legs())
        resp = await client.post("/v1/completions", json={"prompt": "a"})
        assert resp.status == 200
        assert len(d.legs()) == before + 1
        return d.legs()[-1].body["kv_transfer_params"]["remote_engine_id"]

    assert await engine_id_of_next_d_leg() == "engine-a"
    p.restart("engine-b")  # the engine restarted with a new identity
    probes = len(p.probes())
    await wait_for(lambda: len(p.probes()) >= probes + 2)  # background rounds re-probe
    assert await engine_id_of_next_d_leg() == "engine-b"
    health = await (await client.get("/health")).json()
    assert health["prefill"][0]["identity"]["remote_engine_id"] == "engine-b"


async def test_push_answers_confirm_the_identity_so_rounds_do_not_probe(engines, proxy):
    """The identity probe is a forward step on P that a prefill arriving
    meanwhile waits out: while push P answers keep naming the probed engine,
    the background rounds (here 20 of them) probe nothing (at most 2: a
    request slowed past 5.5 rounds on a loaded machine lets one through;
    every round probed before)."""
    interval = 0.05
    p = await engines("prefill", engine_id="engine-a")
    d = await engines("decode")
    client = await proxy([p], [d], transfer_mode="push", health_interval=interval)
    assert (await client.post("/v1/completions", json={"prompt": "a"})).status == 200
    probes, rounds = len(p.probes()), len(p.health_checks())
    assert probes >= 1
    while len(p.health_checks()) < rounds + 20:
        assert (await client.post("/v1/completions", json={"prompt": "b"})).status == 200
    assert len(p.probes()) - probes <= 2, len(p.probes()) - probes
    assert d.legs()[-1].body["kv_transfer_params"]["remote_engine_id"] == "engine-a"


async def test_push_idle_prefill_is_reprobed_once_its_identity_is_stale(engines, proxy):
    """Without traffic the rounds still re-probe (a restart at the same URL
    that /health never saw), but only an identity 6 rounds old, not every
    round: consecutive probes are at least 5 intervals apart."""
    interval = 0.02
    p = await engines("prefill", engine_id="engine-a")
    d = await engines("decode")
    await proxy([p], [d], transfer_mode="push", health_interval=interval)
    await wait_for(lambda: len(p.probes()) >= 4, timeout=10)
    times = [s.at for s in p.probes()]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= (health.IDENTITY_STALE_ROUNDS - 1) * interval, gaps


async def test_push_reprobe_after_prefill_failure(engines, proxy):
    p = await engines("prefill", engine_id="engine-a")
    d = await engines("decode")
    client = await proxy([p], [d], transfer_mode="push", health_interval=60)
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert d.legs()[-1].body["kv_transfer_params"]["remote_engine_id"] == "engine-a"
    probes = len(p.probes())

    p.restart("engine-b")
    p.fail_status = 503  # restarted, first leg fails
    d.delay = 1.0  # D waits for a KV push that never comes
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 503
    await wait_for(lambda: d.cancelled.is_set())
    await wait_for(lambda: len(p.probes()) > probes)  # not waiting 60 s for a round
    p.fail_status, d.delay = None, 0.0
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 200
    assert d.legs()[-1].body["kv_transfer_params"]["remote_engine_id"] == "engine-b"


@pytest.mark.parametrize("reported", [None, "pull"])
async def test_push_rejects_engine_without_push_support(engines, proxy, reported):
    # vLLM's in-tree connector answers the probe like a normal request (no
    # transfer_mode); a pull-configured vllm_pd_ext engine says "pull". Push
    # mode must refuse both rather than send D legs they cannot serve.
    p = await engines("prefill", probe_transfer_mode=reported)
    d = await engines("decode")
    client = await proxy([p], [d], transfer_mode="push")
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 502
    assert "transfer_mode" in (await resp.json())["error"]["message"]
    assert d.legs() == [] and p.legs() == []
    resp = await client.get("/health")
    assert resp.status == 503
    assert "transfer_mode" in (await resp.json())["prefill"][0]["identity_error"]


async def _stale_identity_setup(engines, proxy, **config):
    """P probed as engine-a, then restarted as engine-b; no health round in between."""
    p = await engines("prefill", engine_id="engine-a")
    d = await engines("decode")
    client = await proxy([p], [d], transfer_mode="push", health_interval=60, **config)
    assert (await client.post("/v1/completions", json={"prompt": "a"})).status == 200
    assert d.legs()[-1].body["kv_transfer_params"]["remote_engine_id"] == "engine-a"
    p.restart("engine-b")
    return p, d, client


async def test_push_answer_from_restarted_prefill_fails_and_refreshes_identity(engines, proxy):
    p, d, client = await _stale_identity_setup(engines, proxy)
    probes = len(p.probes())

    async def decode_waits_for_kv(engine, request, body):
        await asyncio.sleep(10)  # the KV never comes: D was told the old engine id
        return web.Response()

    d.override = decode_waits_for_kv
    resp = await asyncio.wait_for(
        client.post("/v1/completions", json={"prompt": "a", "stream": True}), 5
    )
    assert resp.status == 502
    message = (await resp.json())["error"]["message"]
    assert "identity changed" in message and "engine-a" in message and "engine-b" in message
    assert d.legs()[-1].body["kv_transfer_params"]["remote_engine_id"] == "engine-a"
    await wait_for(lambda: d.cancelled.is_set())  # the doomed D leg is aborted
    assert len(p.legs()) == 2  # not retried

    # The very next request uses P's new identity, taken from P's answer.
    d.override = None
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 200
    assert d.legs()[-1].body["kv_transfer_params"]["remote_engine_id"] == "engine-b"
    assert len(p.probes()) == probes  # no probe needed
    health = await (await client.get("/health")).json()
    assert health["prefill"][0]["identity"]["remote_engine_id"] == "engine-b"


async def test_push_identity_mismatch_after_decode_output_refreshes_only(engines, proxy):
    # D already streams (e.g. it recomputed the prompt): the client keeps its
    # answer, and the identity is still refreshed from P's late answer.
    p, d, client = await _stale_identity_setup(engines, proxy)
    from vllm_pd_proxy.app import PREFILL

    backend = client.server.app[PREFILL].backends[0]
    first_sent = asyncio.Event()

    async def prefill_answers_late(engine, request, body):
        await asyncio.wait_for(first_sent.wait(), 2)
        answer = completion(request.path, body, "x")
        return web.json_response({**answer, "kv_transfer_params": engine.kv_params})

    async def decode_streams_across_p_answer(engine, request, body):
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(sse(chunk(request.path, "first")))
        first_sent.set()
        # Ends only once the proxy has taken P's new identity from its answer.
        await wait_for(lambda: backend.identity.engine_id == "engine-b", 2)
        await out.write(sse(chunk(request.path, "second")))
        await out.write(b"data: [DONE]\n\n")
        return out

    p.override, d.override = prefill_answers_late, decode_streams_across_p_answer
    resp = await client.post("/v1/completions", json={"prompt": "a", "stream": True})
    assert resp.status == 200
    events = parse_sse(await asyncio.wait_for(resp.read(), 5))
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["first", "second"]
    assert events[-1] == "[DONE]"
    p.override = d.override = None
    assert (await client.post("/v1/completions", json={"prompt": "a"})).status == 200
    assert d.legs()[-1].body["kv_transfer_params"]["remote_engine_id"] == "engine-b"


async def test_push_decode_failure_while_prefill_runs_reprobes_prefill(engines, proxy):
    # A restarted P refuses D's registration at once, so D fails before P's
    # answer (which would name the new identity) arrives and is cancelled.
    p, d, client = await _stale_identity_setup(engines, proxy)
    probes = len(p.probes())

    async def prefill_still_running(engine, request, body):
        await asyncio.sleep(10)
        return web.Response()

    p.override, d.fail_status = prefill_still_running, 500
    resp = await asyncio.wait_for(client.post("/v1/completions", json={"prompt": "a"}), 5)
    assert resp.status == 500
    await wait_for(lambda: p.cancelled.is_set())
    await wait_for(lambda: len(p.probes()) > probes)  # not waiting 60 s for a round
    p.override, d.fail_status = None, None
    assert (await client.post("/v1/completions", json={"prompt": "a"})).status == 200
    assert d.legs()[-1].body["kv_transfer_params"]["remote_engine_id"] == "engine-b"


async def test_push_prefill_back_after_an_absence_is_probed_before_its_next_leg(
    engines, proxy
):
    """Regression (rolling-restart soak, push): a P restarted at the same URL
    came back healthy in a health round that did not re-probe its identity,
    and the D legs dispatched in the next 70 ms carried the old engine id,
    which the new P refused (3 HTTP 500s in 10,105 requests). An engine back
    from unhealthy or draining must be probed before a D leg names it."""
    p = await engines("prefill", engine_id="engine-a")
    d = await engines("decode")
    client = await proxy([p], [d], transfer_mode="push", health_interval=60)
    assert (await client.post("/v1/completions", json={"prompt": "a"})).status == 200
    assert d.legs()[-1].body["kv_transfer_params"]["remote_engine_id"] == "engine-a"
    p.health_status = 500  # going away ...
    await client.get("/health")  # (a round without identity probes)
    p.restart("engine-b")  # ... and back as a new engine at the same URL
    p.health_status = 200
    health = await (await client.get("/health")).json()
    assert health["prefill"][0]["state"] == "healthy"
    resp = await client.post("/v1/completions", json={"prompt": "b"})
    assert resp.status == 200
    assert d.legs()[-1].body["kv_transfer_params"]["remote_engine_id"] == "engine-b"


def _remote_engine(body) -> str | None:
    return (body.get("kv_transfer_params") or {}).get("remote_engine_id")


async def test_push_stale_identity_migrates_to_the_same_prefill_with_its_new_identity(
    engines, proxy
):
    """With migration (the default), the restarted P is not the sick engine:
    the prompt is dispatched again to it, under its new identity, and its KV
    is pushed (not prefilled on D because "no P is left")."""
    p, d, client = await _stale_identity_setup(engines, proxy, max_migrations=2)

    async def decode(engine, request, body):
        if _remote_engine(body) == "engine-a":
            await asyncio.sleep(10)  # the KV never comes: D was told the old engine id
        return web.json_response(completion(request.path, body, "ok"))

    d.override = decode
    resp = await asyncio.wait_for(client.post("/v1/completions", json={"prompt": "a"}), 5)
    assert resp.status == 200, await resp.text()
    assert [_remote_engine(leg.body) for leg in d.legs()[-2:]] == ["engine-a", "engine-b"]
    assert d.legs()[-1].body["kv_transfer_params"]["do_remote_prefill"] is True
    assert len(p.legs()) == 3  # the setup's, the stale dispatch's, the migration's


async def test_push_decode_refusal_by_a_restarted_prefill_migrates_with_a_fresh_probe(
    engines, proxy
):
    """D fails at once (the restarted P refused its registration) while P
    still prefills: the identity is dropped, so the migration's dispatch
    probes P first and names its new identity."""
    p, d, client = await _stale_identity_setup(engines, proxy, max_migrations=2)
    first = asyncio.Event()

    async def prefill(engine, request, body):
        if not first.is_set():
            first.set()
            await asyncio.sleep(10)  # still prefilling when D fails
        answer = completion(request.path, body, "x")
        return web.json_response({**answer, "kv_transfer_params": engine.kv_params})

    async def decode(engine, request, body):
        if _remote_engine(body) == "engine-a":
            await first.wait()
            err = {"error": {"message": "this is engine engine-b, not engine-a", "code": 500}}
            return web.json_response(err, status=500)
        return web.json_response(completion(request.path, body, "ok"))

    p.override, d.override = prefill, decode
    probes = len(p.probes())
    resp = await asyncio.wait_for(client.post("/v1/completions", json={"prompt": "a"}), 5)
    assert resp.status == 200, await resp.text()
    assert [_remote_engine(leg.body) for leg in d.legs()[-2:]] == ["engine-a", "engine-b"]
    assert len(p.probes()) > probes
