"""Memory bounds: total request-body budget and the SSE relay's event buffer."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from pdproxy_helpers import chunk, completion, parse_sse, sse, wait_for


def _post_data(raw: bytes, chunked: bool):
    """``raw`` as a plain body (Content-Length) or chunked, without a length."""
    if not chunked:
        return raw

    async def pieces():
        for i in range(0, len(raw), 500):
            yield raw[i : i + 500]

    return pieces()


@pytest.mark.parametrize("chunked", [False, True])
async def test_total_body_budget_refuses_with_503_and_recovers(engines, proxy, chunked):
    release = asyncio.Event()

    async def hold_first(engine, request, body):
        if body["prompt"].startswith("first"):
            await asyncio.wait_for(release.wait(), 5)
        answer = completion(request.path, body, "x")
        return web.json_response({**answer, "kv_transfer_params": engine.kv_params})

    p, d = await engines("prefill", override=hold_first), await engines("decode")
    client = await proxy([p], [d], max_request_bytes=4096, max_total_body_bytes=6000)
    first = asyncio.ensure_future(
        client.post("/v1/completions", json={"prompt": "first" + "x" * 3000})
    )
    await wait_for(lambda: p.in_flight == 1)  # ~3 KB held while P works

    raw = json.dumps({"prompt": "second" + "y" * 3000}).encode()
    headers = {"Content-Type": "application/json"}
    resp = await client.post("/v1/completions", data=_post_data(raw, chunked), headers=headers)
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "1"
    err = (await resp.json())["error"]
    assert err["type"] == "service_unavailable" and err["code"] == 503
    assert "--max-total-body-bytes 6000" in err["message"]
    assert len(p.legs()) == 1 and d.legs() == []  # the refused one went nowhere

    release.set()
    assert (await first).status == 200
    # Both bodies released: the same request now fits.
    resp = await client.post("/v1/completions", data=_post_data(raw, chunked), headers=headers)
    assert resp.status == 200
    metrics = await (await client.get("/metrics")).text()
    assert 'pd_proxy_requests_total{mode="none",outcome="overloaded"} 1.0' in metrics


async def test_chunked_body_over_request_cap_is_413(engines, proxy):
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d], max_request_bytes=2048)
    raw = json.dumps({"prompt": "z" * 5000}).encode()
    headers = {"Content-Type": "application/json"}
    resp = await client.post("/v1/completions", data=_post_data(raw, True), headers=headers)
    assert resp.status == 413
    assert p.legs() == []
    # Nothing stays reserved after a refused body.
    resp = await client.post("/v1/completions", json={"prompt": "ok"})
    assert resp.status == 200


async def _endless_event(engine, request, body, first: bytes):
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    if first:
        await out.write(first)
    piece = b"x" * 65536
    for _ in range(64):  # 4 MiB with no event boundary, then silence
        await out.write(piece)
    await asyncio.sleep(10)
    return out


async def test_endless_sse_event_mid_stream_ends_with_error_event(engines, proxy):
    async def endless(engine, request, body):
        return await _endless_event(engine, request, body, sse(chunk(request.path, "first")))

    p, d = await engines("prefill"), await engines("decode", override=endless)
    client = await proxy([p], [d], max_sse_event_bytes=1 << 20)
    resp = await client.post("/v1/completions", json={"prompt": "a", "stream": True})
    assert resp.status == 200
    events = parse_sse(await asyncio.wait_for(resp.read(), 5))
    assert events[0]["choices"][0]["text"] == "first"
    assert events[1]["error"]["code"] == 502
    assert "--max-sse-event-bytes 1048576" in events[1]["error"]["message"]
    assert events[2] == "[DONE]" and len(events) == 3
    await wait_for(lambda: d.cancelled.is_set())  # the runaway D leg is closed


async def test_endless_first_sse_event_is_502(engines, proxy):
    async def endless(engine, request, body):
        return await _endless_event(engine, request, body, b"data: ")

    p, d = await engines("prefill"), await engines("decode", override=endless)
    client = await proxy([p], [d], max_sse_event_bytes=1 << 20)
    body = {"prompt": "a", "stream": True}
    resp = await asyncio.wait_for(client.post("/v1/completions", json=body), 5)
    assert resp.status == 502
    message = (await resp.json())["error"]["message"]
    assert "--max-sse-event-bytes 1048576" in message and d.url in message
    await wait_for(lambda: d.cancelled.is_set())
    assert (await client.get("/health")).status == 200  # the proxy is fine
