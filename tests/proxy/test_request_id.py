"""Client-controlled text in logs: X-Request-Id sanitizing, escaped error messages."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from aiohttp import web

_RAW_IDS = [
    # A forged access-log field: spaces must not survive.
    (b"x status=200 outcome=ok", "x_status_200_outcome_ok"),
    (b"tab\there", "tab_here"),
    # Not UTF-8 (aiohttp hands it over as a surrogate escape) and non-ASCII.
    (b"caf\xc3\xa9-\xe9", "caf_-_"),
    (b"a" * 5000, "a" * 128),
    (b"rid-42:trace/ok", "rid-42:trace/ok"),
]


async def _raw_post(port: int, request_id: bytes, body: bytes) -> tuple[int, dict[str, str]]:
    """POST with exactly these header bytes (aiohttp's client would re-encode them)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\nX-Request-Id: %s\r\n\r\n%s" % (len(body), request_id, body)
    )
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in head[1:])
    return int(head[0].split()[1]), headers


def _access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vllm_pd_proxy.access"]


@pytest.mark.parametrize(("raw", "clean"), _RAW_IDS)
async def test_client_request_id_is_sanitized_everywhere(engines, proxy, caplog, raw, clean):
    caplog.set_level(logging.INFO, logger="vllm_pd_proxy")
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d])
    status, headers = await _raw_post(client.server.port, raw, b'{"prompt": "a"}')
    assert status == 200
    assert headers["X-Request-Id"] == clean
    assert [leg.headers["X-Request-Id"] for leg in p.legs() + d.legs()] == [clean, clean]
    (line,) = _access_lines(caplog)
    assert line.startswith(f"request_id={clean} endpoint=")
    assert line.count("status=") == 1 and line.count("outcome=") == 1


async def test_push_ids_are_built_from_the_sanitized_id(engines, proxy):
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d], transfer_mode="push")
    status, _ = await _raw_post(client.server.port, b"a b\tc" + b"x" * 500, b'{"prompt": "a"}')
    assert status == 200
    pd_id = d.legs()[0].body["kv_transfer_params"]["pd_request_id"]
    assert pd_id.startswith("a_b_c") and len(pd_id) == 128 + 9


async def test_error_message_cannot_forge_access_log_lines(engines, proxy, caplog):
    # vLLM quotes client input in its errors (e.g. an unknown model name).
    async def echo_model(engine, request, body):
        message = f"The model `{body['model']}` does not exist."
        return web.json_response({"error": {"message": message}}, status=404)

    caplog.set_level(logging.INFO, logger="vllm_pd_proxy")
    p, d = await engines("prefill", override=echo_model), await engines("decode")
    client = await proxy([p], [d])
    forged = 'm`"\nrequest_id=forged endpoint=/v1/completions status=200 outcome=ok'
    resp = await client.post("/v1/completions", json={"model": forged, "prompt": "a"})
    assert resp.status == 404
    (line,) = _access_lines(caplog)
    assert "\n" not in line and "\r" not in line
    fields, error = line.split(" error=", 1)
    # The rest of the line is one JSON string: the forged fields are inside it.
    assert "request_id=forged" in json.loads(error)
    assert "status=404 outcome=upstream_4xx" in fields and "forged" not in fields
