"""--transfer-telemetry and --otel: the legs' timings and D's transfer record
reach the client in pd_telemetry (body or finishing chunk) and OpenTelemetry
spans; D's engine addresses never reach the client."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

from aiohttp import web
from pdproxy_helpers import FakeEngine, chunk, completion, parse_sse, sse
from vllm_pd_proxy.telemetry import LegMarks, annotate

RECORD = {"request_id": "cmpl-x-0", "remote_request_id": "p-1", "p_engine": "engine-a",
          "p_addr": "127.0.0.1:5600", "mode": "pull", "bytes": 786432, "descriptors": 4,
          "blocks": 3, "tokens": 300, "read_ms": 1.5, "kv_ready_ms": 9.0}


def telemetry_decode(delay: float = 0.05):
    """A D that answers like an engine with transfer_telemetry_in_response."""

    async def handler(eng: FakeEngine, request: web.Request, body: dict[str, Any]):
        await asyncio.sleep(delay)
        params = {"pd_transfer": RECORD, "remote_host": "10.1.2.3"}
        if not body.get("stream"):
            return web.json_response(dict(completion(request.path, body, "ok"),
                                          kv_transfer_params=params))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(sse(chunk(request.path, "o")))
        last = chunk(request.path, "k")
        last["choices"][0]["finish_reason"] = "length"
        last["kv_transfer_params"] = params
        await out.write(sse(last) + sse({"choices": [], "usage": {"completion_tokens": 2}})
                        + b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    return handler


def check(tele: dict[str, Any], rid: str) -> None:
    assert tele["request_id"] == rid
    t = tele["proxy"]
    assert t["mode"] == "pull"
    assert 0 <= t["prefill_sent_ms"] <= t["prefill_done_ms"] <= t["decode_sent_ms"]
    # The fake D waits 50 ms before its first byte.
    assert t["decode_first_byte_ms"] - t["decode_sent_ms"] >= 45
    assert tele["transfer"] == RECORD


async def test_pd_telemetry_in_the_body_and_the_finishing_chunk(engines, proxy):
    p = await engines("prefill", delay=0.03)
    d = await engines("decode", override=telemetry_decode())
    client = await proxy([p], [d], transfer_telemetry=True)
    body = {"model": "m", "prompt": "hello", "max_tokens": 2}
    resp = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "r1"})
    assert resp.status == 200
    got = await resp.json()
    assert "kv_transfer_params" not in got  # D's addresses stay inside
    check(got["pd_telemetry"], "r1")
    assert got["pd_telemetry"]["proxy"]["prefill_done_ms"] >= 25  # P waits 30 ms
    resp = await client.post("/v1/completions", json=dict(body, stream=True),
                             headers={"X-Request-Id": "r2"})
    events = parse_sse(await resp.read())
    assert events[-1] == "[DONE]"
    carrying = [e for e in events if isinstance(e, dict) and "pd_telemetry" in e]
    assert len(carrying) == 1 and carrying[0]["choices"][0]["finish_reason"] == "length"
    check(carrying[0]["pd_telemetry"], "r2")
    assert not any("kv_transfer_params" in e for e in events if isinstance(e, dict))


async def test_without_the_flag_answers_are_untouched(engines, proxy):
    p = await engines("prefill")
    d = await engines("decode")
    client = await proxy([p], [d])
    got = await (await client.post("/v1/completions", json={"model": "m", "prompt": "x"})).json()
    assert "pd_telemetry" not in got


async def test_a_d_without_telemetry_still_gets_the_proxy_timings(engines, proxy):
    p = await engines("prefill")
    d = await engines("decode")  # answers without kv_transfer_params
    client = await proxy([p], [d], transfer_telemetry=True)
    resp = await client.post("/v1/completions",
                             json={"model": "m", "prompt": "x", "stream": True})
    events = [e for e in parse_sse(await resp.read()) if isinstance(e, dict)]
    assert events and "pd_telemetry" not in events[0]  # not a finishing chunk


def test_annotate_leaves_other_events_unparsed_and_works_once():
    marks = LegMarks(started=0.0, mode="pull")
    marks.mark("decode_sent_ms", 0.002)
    first = b'data: {"choices":[{"text":"a","finish_reason":null}]}\n\n'
    assert annotate(first, True, marks, "r") == first
    last = (b'data: {"choices":[{"text":"b","finish_reason":"stop"}],'
            b'"kv_transfer_params":{"pd_transfer":{"bytes":7},"remote_host":"h"}}\n\n')
    out = annotate(last, True, marks, "r")
    (body,) = parse_sse(out)
    assert body["pd_telemetry"] == {"request_id": "r", "proxy": {"mode": "pull",
                                                                 "decode_sent_ms": 2.0},
                                    "transfer": {"bytes": 7}}
    assert "kv_transfer_params" not in body
    assert annotate(last, True, marks, "r") == last  # once per request
    # Multi-turn keeps D's other params for filing (the relay takes them out next).
    kept = annotate(last, True, LegMarks(started=0.0), "r", keep_kv=True)
    assert parse_sse(kept)[0]["kv_transfer_params"] == {"remote_host": "h"}
    assert annotate(b"not json", False, LegMarks(started=0.0), "r") == b"not json"


async def test_otel_spans_for_each_request(engines, proxy):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    p = await engines("prefill", delay=0.02)
    d = await engines("decode", override=telemetry_decode())
    client = await proxy([p], [d], otel=True)
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"},
                             headers={"X-Request-Id": "otel-1"})
    assert resp.status == 200
    assert "pd_telemetry" not in await resp.json()  # --otel alone changes no answer
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"pd.request", "pd.prefill_leg", "pd.decode_leg", "pd.kv_transfer"}
    root = spans["pd.request"]
    assert root.attributes["pd.request_id"] == "otel-1" and root.attributes["pd.status"] == 200
    for name in ("pd.prefill_leg", "pd.decode_leg", "pd.kv_transfer"):
        s = spans[name]
        assert s.parent is not None and s.parent.span_id == root.context.span_id
        assert root.start_time <= s.start_time <= s.end_time <= root.end_time
    assert spans["pd.prefill_leg"].end_time - spans["pd.prefill_leg"].start_time >= 15e6
    kv = spans["pd.kv_transfer"]
    assert kv.end_time - kv.start_time == 9_000_000  # D's kv_ready_ms
    assert kv.attributes["pd.transfer.bytes"] == 786432


def test_the_proxy_does_not_import_opentelemetry_without_otel():
    code = ("import sys; from vllm_pd_proxy.app import create_app; "
            "from vllm_pd_proxy.config import ProxyConfig; "
            "create_app(ProxyConfig(prefill=('http://127.0.0.1:1',), "
            "decode=('http://127.0.0.1:2',), transfer_telemetry=True)); "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
