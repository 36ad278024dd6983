"""``n`` through the proxy: P prefills once, D samples the n choices;
an ``n`` D would refuse is refused before any leg.

The engines are ``pdproxy_helpers.vllm_like``: fakes answering as vLLM's
completion server does (n choices, usage, streams).
"""

from __future__ import annotations

from typing import Any

import pytest
from pdproxy_helpers import parse_sse, vllm_like


def _per_choice(events: list[Any]) -> dict[int, list[Any]]:
    """Each choice's chunks in order (its choice and usage): the merged stream
    interleaves prompts differently from one engine, but never a choice's own."""
    out: dict[int, list[Any]] = {}
    for event in events:
        if isinstance(event, dict) and event.get("choices"):
            (choice,) = event["choices"]
            out.setdefault(choice["index"], []).append((choice, event.get("usage")))
    return out


def _refusals() -> list[tuple[dict[str, Any], str, str, dict[str, Any]]]:
    """(body, param, words of the message, proxy config)."""
    return [
        ({"prompt": "a", "n": 0}, "n", "positive integer", {}),
        ({"prompt": "a", "n": "2"}, "n", "positive integer", {}),
        ({"prompt": "a", "n": 1.5}, "n", "positive integer", {}),
        ({"prompt": "a", "n": True}, "n", "positive integer", {}),
        ({"prompt": "a", "n": 2, "temperature": 0}, "n", "greedy sampling", {}),
        ({"prompt": "a", "n": 2, "temperature": 0}, "n", "greedy sampling",
         {"transfer_mode": "push"}),
    ]


@pytest.mark.parametrize(("body", "param", "words", "config"), _refusals())
async def test_refused_with_400_before_any_leg(engines, proxy, body, param, words, config):
    p, d = await engines("prefill", override=vllm_like), await engines("decode", override=vllm_like)
    client = await proxy([p], [d], **config)
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"]
    assert p.seen == [] and d.seen == []  # not even an identity probe


async def test_greedy_chat_with_n_refused_before_any_leg(engines, proxy):
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d])
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "temperature": 0}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "n"
    assert p.seen == [] and d.seen == []
    # Sampled, it goes through: P without n, D with it.
    resp = await client.post("/v1/chat/completions", json={**body, "temperature": 0.5})
    assert resp.status == 200
    assert "n" not in p.legs()[0].body and d.legs()[0].body["n"] == 3


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("stream", [False, True])
async def test_n_prefills_once_and_decodes_n(engines, proxy, mode, stream):
    p = await engines("prefill", override=vllm_like)
    d = await engines("decode", override=vllm_like)
    client = await proxy([p], [d], transfer_mode=mode)
    body = {"prompt": "hello there", "n": 2, "best_of": 3, "temperature": 0.8, "seed": 7,
            "stream": stream}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    (p_leg,), (d_leg,) = p.legs(), d.legs()
    assert "n" not in p_leg.body and "best_of" not in p_leg.body
    assert p_leg.body["max_tokens"] == 1 and p_leg.body["seed"] == 7
    assert d_leg.body["n"] == 2 and d_leg.body["best_of"] == 3  # verbatim
    if stream:
        events = parse_sse(await resp.read())
        assert sorted(_per_choice(events)) == [0, 1]
    else:
        assert [c["text"] for c in (await resp.json())["choices"]] == [
            "hello there#0.", "hello there#1."]


async def test_multi_turn_keeps_nothing_with_n(engines, proxy):
    p, d = await engines("prefill", override=vllm_like), await engines("decode", override=vllm_like)
    client = await proxy([p], [d], multi_turn=True)
    headers = {"X-Session-Id": "conv-1"}
    body = {"prompt": "a", "n": 2, "temperature": 1.0}
    assert (await client.post("/v1/completions", json=body, headers=headers)).status == 200
    for leg in p.legs():
        assert "pd_bidirectional" not in leg.body["kv_transfer_params"]
    # Said, not left out: a bidirectional D would keep every choice otherwise.
    assert all(leg.body["kv_transfer_params"]["pd_bidirectional"] is False for leg in d.legs())
    # n = 1 on the same conversation still asks D to keep the turn.
    assert (await client.post("/v1/completions", json={"prompt": "a"}, headers=headers)).status \
        == 200
    assert d.legs()[-1].body["kv_transfer_params"].get("pd_bidirectional") is True
