"""``/v1/responses`` through the proxy (issue 24 item 4): disaggregated like
chat (P prefills one token under ``max_output_tokens``, stores nothing, D
gets the client's body verbatim with P's params); the fields that need one
engine to hold state are refused with 400 before any leg."""

from __future__ import annotations

import pytest
from pdproxy_helpers import parse_sse

from vllm_pd_ext.wire.auth import body_prompt_digest

BODY = {"model": "m", "instructions": "Be terse.", "input": "Say hello to the world.",
        "max_output_tokens": 20, "temperature": 0}


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("stream", [False, True])
async def test_responses_are_disaggregated(engines, proxy, mode, stream):
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d], transfer_mode=mode)
    resp = await client.post("/v1/responses", json={**BODY, "stream": stream})
    assert resp.status == 200
    (p_leg,), (d_leg,) = p.legs(), d.legs()
    assert p_leg.path == d_leg.path == "/v1/responses"
    assert p_leg.body["max_output_tokens"] == 1 and "max_tokens" not in p_leg.body
    assert p_leg.body["store"] is False and p_leg.body["background"] is False
    assert p_leg.body["stream"] is False
    assert p_leg.body["kv_transfer_params"]["do_remote_decode"] is True
    assert p_leg.body["input"] == BODY["input"]
    assert {k: v for k, v in d_leg.body.items() if k != "kv_transfer_params"} == {
        **BODY, "stream": stream}
    assert d_leg.body["kv_transfer_params"]["do_remote_prefill"] is True
    if stream:
        events = parse_sse(await resp.read())
        assert events[-1] == "[DONE]"


@pytest.mark.parametrize(("field", "value"), [("previous_response_id", "resp_123"),
                                              ("background", True)])
async def test_stateful_responses_fields_refused_before_any_leg(engines, proxy, field, value):
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d])
    resp = await client.post("/v1/responses", json={**BODY, field: value})
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["param"] == field and "not supported through the P/D proxy" in err["message"]
    assert p.seen == [] and d.seen == []
    # background false is no state: served.
    resp = await client.post("/v1/responses", json={**BODY, "background": False})
    assert resp.status == 200


def test_responses_prompt_is_in_the_leg_digest():
    """Signed legs bind the prompt: a Responses body's input and instructions
    are part of the digest; completion and chat digests are unchanged."""
    base = body_prompt_digest(BODY)
    assert body_prompt_digest({**BODY, "input": "Say goodbye."}) != base
    assert body_prompt_digest({**BODY, "instructions": "Be long."}) != base
    # What the digest was before /v1/responses (a proxy and an engine of
    # either version must agree on every completion and chat leg).
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert body_prompt_digest(chat) == "a07752e3e7ed19e5d2f485c7fd4f028a"
    assert body_prompt_digest({"prompt": [1, 2, 3]}) == "d942d1b79621a1b87348213f288c657b"
