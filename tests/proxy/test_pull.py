"""Pull mode: leg shapes, relaying (streaming, non-streaming, chat), request ids."""

from __future__ import annotations

import uuid

from pdproxy_helpers import parse_sse

PULL_P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


async def test_pull_leg_shapes(engines, proxy):
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d])
    body = {
        "model": "m",
        "prompt": "hello there",
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 5,
        "min_completion_tokens": 5,
        "temperature": 0.3,
        "kv_transfer_params": {"client": "must not leak"},
    }
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    await resp.read()

    (p_leg,) = p.legs()
    assert p_leg.path == "/v1/completions"
    assert p_leg.body == {
        "model": "m",
        "prompt": "hello there",
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "temperature": 0.3,
        "kv_transfer_params": PULL_P_PARAMS,
    }
    (d_leg,) = d.legs()
    expected_d = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    # P's answer, verbatim, and that D keeps no turn (no --multi-turn).
    expected_d["kv_transfer_params"] = {**p.kv_params, "pd_bidirectional": False}
    assert d_leg.body == expected_d
    rid = p_leg.headers["X-Request-Id"]
    assert uuid.UUID(hex=rid).hex == rid and uuid.UUID(rid).version == 4  # uuid4 hex
    assert d_leg.headers["X-Request-Id"] == rid
    assert resp.headers["X-Request-Id"] == rid


async def test_client_request_id_and_auth_are_forwarded(engines, proxy):
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d])
    headers = {"X-Request-Id": "client-rid-1", "Authorization": "Bearer k"}
    resp = await client.post("/v1/completions", json={"prompt": "a"}, headers=headers)
    assert resp.status == 200
    for leg in (p.legs()[0], d.legs()[0]):
        assert leg.headers["X-Request-Id"] == "client-rid-1"
        assert leg.headers["Authorization"] == "Bearer k"


async def test_streaming_relay_in_order(engines, proxy):
    chunks = [f"tok{i} " for i in range(20)]
    p = await engines("prefill")
    d = await engines("decode", chunks=chunks, chunk_delay=0.005)
    client = await proxy([p], [d])
    resp = await client.post("/v1/completions", json={"prompt": "a", "stream": True})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = parse_sse(await resp.read())
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["text"] for e in events[:-1]] == chunks


async def test_non_streaming(engines, proxy):
    p, d = await engines("prefill"), await engines("decode", chunks=["full", " answer"])
    client = await proxy([p], [d])
    resp = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 7})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("application/json")
    data = await resp.json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["text"] == "full answer"
    assert d.legs()[0].body["max_tokens"] == 7


async def test_chat_completions(engines, proxy):
    p, d = await engines("prefill"), await engines("decode", chunks=["Hi", "!"])
    client = await proxy([p], [d])
    messages = [{"role": "user", "content": "hello"}]
    body = {"model": "m", "messages": messages, "max_completion_tokens": 9}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["message"]["content"] == "Hi!"
    assert p.legs()[0].path == "/v1/chat/completions"
    assert p.legs()[0].body["max_completion_tokens"] == 1
    assert p.legs()[0].body["messages"] == messages
    assert d.legs()[0].path == "/v1/chat/completions"
    assert d.legs()[0].body["max_completion_tokens"] == 9

    resp = await client.post("/v1/chat/completions", json={**body, "stream": True})
    events = parse_sse(await resp.read())
    assert [e["choices"][0]["delta"]["content"] for e in events[:-1]] == ["Hi", "!"]
    assert events[-1] == "[DONE]"


async def test_models_from_decode(engines, proxy):
    p, d = await engines("prefill", model="p-model"), await engines("decode", model="d-model")
    client = await proxy([p], [d])
    resp = await client.get("/v1/models")
    assert resp.status == 200
    assert (await resp.json())["data"][0]["id"] == "d-model"
