"""Failure handling: passthrough, retries, mid-stream errors, timeouts, aborts."""

from __future__ import annotations

import asyncio

from aiohttp import web
from pdproxy_helpers import chunk, parse_sse, sse, wait_for


async def test_malformed_json_is_400(engines, proxy):
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d])
    for raw in (b"{not json", b"", b"[1, 2]"):
        resp = await client.post(
            "/v1/completions", data=raw, headers={"Content-Type": "application/json"}
        )
        assert resp.status == 400
        err = (await resp.json())["error"]
        assert err["type"] == "invalid_request_error"
        assert err["code"] == 400
        assert "JSON" in err["message"] or "empty" in err["message"]
    assert p.legs() == [] and d.legs() == []


async def test_decode_4xx_passthrough(engines, proxy):
    async def reject(engine, request, body):
        return web.Response(
            status=422, text='{"detail": "bad sampling"}', content_type="application/json"
        )

    p, d = await engines("prefill"), await engines("decode", override=reject)
    client = await proxy([p], [d])
    resp = await client.post("/v1/completions", json={"prompt": "a", "stream": True})
    assert resp.status == 422
    assert await resp.text() == '{"detail": "bad sampling"}'


async def test_prefill_4xx_passthrough_skips_decode(engines, proxy):
    p, d = await engines("prefill", fail_status=400), await engines("decode")
    p2 = await engines("prefill")
    client = await proxy([p, p2], [d], routing="round-robin")
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 400
    assert (await resp.json())["error"]["message"] == "fake prefill failure"
    assert d.legs() == [] and p2.legs() == []  # 4xx is not retried


async def test_prefill_503_retried_once_on_other_prefill(engines, proxy):
    bad, good = await engines("prefill", fail_status=503), await engines("prefill")
    d = await engines("decode")
    client = await proxy([bad, good], [d], routing="round-robin")
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 200
    assert len(bad.legs()) == 1 and len(good.legs()) == 1
    assert bad.legs()[0].headers["X-Request-Id"] == good.legs()[0].headers["X-Request-Id"]
    assert len(d.legs()) == 1
    metrics = await (await client.get("/metrics")).text()
    assert 'pd_proxy_retries_total{role="prefill"} 1.0' in metrics


async def test_prefill_retry_then_fail(engines, proxy):
    p1, p2 = await engines("prefill", fail_status=503), await engines("prefill", fail_status=502)
    d = await engines("decode")
    client = await proxy([p1, p2], [d])
    resp = await client.post("/v1/completions", json={"prompt": "a", "stream": True})
    assert resp.status in (502, 503)
    assert "error" in await resp.json()
    assert len(p1.legs()) + len(p2.legs()) == 2  # one try, one retry, no more
    assert d.legs() == []


async def test_prefill_connection_failure_retried(engines, proxy):
    dead, good = await engines("prefill"), await engines("prefill")
    d = await engines("decode")
    client = await proxy([dead, good], [d], routing="round-robin")
    await dead.close()
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 200
    assert len(good.legs()) == 1


async def test_missing_kv_transfer_params_is_502(engines, proxy):
    p, d = await engines("prefill"), await engines("decode")
    p.kv_params = None
    client = await proxy([p], [d])
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 502
    assert "kv_transfer_params" in (await resp.json())["error"]["message"]
    assert d.legs() == []


async def _die_mid_stream(engine, request, body):
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await out.write(sse(chunk(request.path, "first")))
    await out.write(b'data: {"partial')  # an event cut in the middle
    await asyncio.sleep(0.05)
    request.transport.close()  # the engine dies: chunked body never terminated
    return out


async def test_mid_stream_failure_ends_with_error_event(engines, proxy):
    p, d = await engines("prefill"), await engines("decode", override=_die_mid_stream)
    client = await proxy([p], [d])
    resp = await client.post("/v1/completions", json={"prompt": "a", "stream": True})
    assert resp.status == 200
    raw = await resp.read()
    assert b"partial" not in raw  # the cut event is dropped, not relayed half
    events = parse_sse(raw)
    assert events[0]["choices"][0]["text"] == "first"
    assert events[1]["error"]["code"] == 502
    assert d.url in events[1]["error"]["message"]
    assert events[2] == "[DONE]"
    assert len(events) == 3


async def test_no_retry_after_first_byte(engines, proxy):
    p = await engines("prefill")
    d1 = await engines("decode", override=_die_mid_stream)
    d2 = await engines("decode", override=_die_mid_stream)
    client = await proxy([p], [d1, d2])
    resp = await client.post("/v1/completions", json={"prompt": "a", "stream": True})
    events = parse_sse(await resp.read())
    assert "error" in events[-2]
    assert len(p.legs()) == 1
    assert len(d1.legs()) + len(d2.legs()) == 1


async def test_prefill_timeout_is_504(engines, proxy):
    # A timeout long enough for the leg to reach P on a loaded CI host (at
    # 0.2 s it could expire while connecting: then P never saw the leg and
    # had nothing to cancel), and a P that would hang far past the wait.
    p, d = await engines("prefill", delay=30), await engines("decode")
    client = await proxy([p], [d], prefill_timeout=1.0)
    resp = await asyncio.wait_for(client.post("/v1/completions", json={"prompt": "a"}), 10)
    assert resp.status == 504
    msg = (await resp.json())["error"]["message"]
    assert "timed out" in msg and p.url in msg
    assert p.received.is_set(), "the leg never reached P: nothing for the proxy to close"
    await wait_for(lambda: p.cancelled.is_set())  # the hung leg was closed


async def test_decode_timeout_is_504(engines, proxy):
    p, d = await engines("prefill"), await engines("decode", delay=5)
    client = await proxy([p], [d], decode_timeout=0.2)
    body = {"prompt": "a", "stream": True}
    resp = await asyncio.wait_for(client.post("/v1/completions", json=body), 3)
    assert resp.status == 504
    assert "timed out" in (await resp.json())["error"]["message"]


async def test_stream_idle_timeout_ends_stream_with_error(engines, proxy):
    p = await engines("prefill")
    d = await engines("decode", chunks=["a", "b"], chunk_delay=0.0)

    async def stall(engine, request, body):
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(sse(chunk(request.path, "a")))
        await asyncio.sleep(5)
        return out

    d.override = stall
    client = await proxy([p], [d], stream_idle_timeout=0.2)
    resp = await client.post("/v1/completions", json={"prompt": "a", "stream": True})
    events = parse_sse(await asyncio.wait_for(resp.read(), 3))
    assert events[0]["choices"][0]["text"] == "a"
    assert events[1]["error"]["code"] == 504
    assert events[2] == "[DONE]"


async def stream_from(engines, proxy, events: bytes, then):
    """A pull pair whose D streams ``events``, then awaits ``then()``; the
    client's streamed request to it. Returns (D, the proxy's client, the
    client's response)."""
    async def stream(engine, request, body):
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(events)
        await then(out)
        return out

    p, d = await engines("prefill"), await engines("decode", override=stream)
    client = await proxy([p], [d])
    resp = await client.post("/v1/completions", json={"prompt": "a", "stream": True})
    return d, client, resp


async def test_client_disconnect_cancels_decode_leg(engines, proxy):
    async def hold(out):
        await asyncio.sleep(10)

    d, client, resp = await stream_from(engines, proxy, sse(chunk("/v1/completions", "first")),
                                        hold)
    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 3)
    assert parse_sse(first)[0]["choices"][0]["text"] == "first"
    resp.close()  # client goes away mid-stream
    await wait_for(lambda: d.cancelled.is_set())
    await wait_for(lambda: d.in_flight == 0)
    metrics = await (await client.get("/metrics")).text()
    assert 'pd_proxy_requests_total{mode="pull",outcome="cancelled"} 1.0' in metrics


async def test_client_closing_after_done_is_no_cancellation(engines, proxy):
    """Clients (SDKs, our own tests) close the connection once they read
    ``data: [DONE]``; D may hold its stream open a moment longer. The
    request was answered in full: its outcome is ok, not cancelled."""
    finished = asyncio.Event()

    async def linger(out):
        try:
            await asyncio.sleep(0.5)  # the client has gone by now
            await out.write(b": still here\n\n")
        finally:
            finished.set()  # ended, or cancelled by the proxy

    d, client, resp = await stream_from(
        engines, proxy, sse(chunk("/v1/completions", "all of it")) + b"data: [DONE]\n\n", linger)
    raw = await asyncio.wait_for(resp.content.readuntil(b"data: [DONE]\n\n"), 3)
    assert parse_sse(raw)[0]["choices"][0]["text"] == "all of it"
    resp.close()
    await asyncio.wait_for(finished.wait(), 5)
    await wait_for(lambda: d.in_flight == 0)
    async with asyncio.timeout(5):
        while 'pd_proxy_requests_total{' not in (metrics := await (await client.get(
                "/metrics")).text()):
            await asyncio.sleep(0.02)  # recorded when the proxy's handler returns
    assert 'pd_proxy_requests_total{mode="pull",outcome="ok"} 1.0' in metrics
    assert 'outcome="cancelled"' not in metrics


async def test_client_disconnect_cancels_prefill_leg(engines, proxy):
    p, d = await engines("prefill", delay=10), await engines("decode")
    client = await proxy([p], [d])
    task = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "a"}))
    await wait_for(lambda: p.in_flight == 1)
    task.cancel()  # closes the client connection
    await wait_for(lambda: p.cancelled.is_set())
    assert d.legs() == []


async def test_prefill_disconnect_after_request_is_not_retried(engines, proxy):
    async def ran_then_dropped(engine, request, body):
        # P got the request (and may hold its KV under a lease now); the
        # connection dies before the answer.
        request.transport.close()
        return web.Response()

    bad, good = await engines("prefill", override=ran_then_dropped), await engines("prefill")
    d = await engines("decode")
    client = await proxy([bad, good], [d], routing="round-robin")
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 502
    message = (await resp.json())["error"]["message"]
    assert bad.url in message and "after the request was sent" in message
    assert len(bad.legs()) == 1 and good.legs() == [] and d.legs() == []
