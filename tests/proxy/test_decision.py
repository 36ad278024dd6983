"""decision.py: the conditional-disaggregation rule, without HTTP or engines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from vllm_pd_proxy.decision import Decision, Reason, decide, is_saturated, needs_prompt_pass

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_threshold_zero_is_always_remote_and_estimates_nothing():
    decision = decide(10, 0, threshold=0, has_turn=True, max_prefill_queue=1, prefill_loads=[5])
    assert decision == Decision(False, Reason.ALWAYS_REMOTE, None)
    assert decision.label == "remote"


@pytest.mark.parametrize(("tokens", "cached", "local", "reason", "uncached"), [
    (99, 0, True, Reason.SHORT_PROMPT, 99),       # below the threshold on its own
    (0, 0, True, Reason.SHORT_PROMPT, 0),
    (100, 0, False, Reason.LONG_PROMPT, 100),     # the threshold itself is remote
    (500, 401, True, Reason.PREFIX_HIT, 99),      # long, but D caches most of it
    (500, 400, False, Reason.LONG_PROMPT, 100),
    (64, 96, True, Reason.SHORT_PROMPT, 0),       # cached chunks round past the estimate
    (160, 96, True, Reason.PREFIX_HIT, 64),
])
def test_decides_on_uncached_tokens(tokens, cached, local, reason, uncached):
    decision = decide(tokens, cached, threshold=100)
    assert decision == Decision(local, reason, uncached)
    assert decision.label == ("local" if local else "remote")


def test_a_turn_to_read_back_is_remote_whatever_the_length():
    for tokens, cached in ((5, 0), (500, 490), (500, 0)):
        decision = decide(tokens, cached, threshold=100, has_turn=True,
                          max_prefill_queue=1, prefill_loads=[9])
        assert (decision.is_local, decision.reason) == (False, Reason.MULTI_TURN)
        assert decision.uncached_tokens == max(0, tokens - cached)


@pytest.mark.parametrize(("limit", "loads", "reason"), [
    (2, [2, 3], Reason.PREFILL_BUSY),     # every usable P at the limit
    (2, [1, 3], Reason.LONG_PROMPT),      # one P still has room
    (2, [], Reason.LONG_PROMPT),          # no usable P: nothing to be busy (503 later)
    (0, [50, 50], Reason.LONG_PROMPT),    # --max-prefill-queue 0: off
])
def test_busy_prefill_engines_keep_long_prompts_local(limit, loads, reason):
    decision = decide(300, 0, threshold=100, max_prefill_queue=limit, prefill_loads=loads)
    assert decision.reason is reason
    assert decision.is_local == (reason is Reason.PREFILL_BUSY)


def test_short_prompts_are_local_before_loads_matter():
    decision = decide(10, 0, threshold=100, max_prefill_queue=2, prefill_loads=[0])
    assert decision.reason is Reason.SHORT_PROMPT and decision.is_local


def test_is_saturated():
    assert is_saturated([4, 4], 4) and is_saturated([7], 4)
    assert not is_saturated([3, 9], 4) and not is_saturated([], 4)


def test_reasons_are_the_documented_metric_labels():
    """The enum's values are the label values of pd_proxy_prefill_decisions_total."""
    row = next(line for line in DOCS.read_text().splitlines()
               if line.startswith("| `pd_proxy_prefill_decisions_total`"))
    documented = re.findall(r"`(\w+)`", row.split("`reason`", 1)[1].split("|")[0])
    assert documented == [reason.value for reason in Reason]
    assert f"{Reason.PREFIX_HIT}" == "prefix_hit" and str(Reason.MULTI_TURN) == "multi_turn"


@pytest.mark.parametrize(("body", "needs"), [
    ({"prompt": "a"}, False),
    ({"prompt": "a", "prompt_logprobs": 0}, True),     # 0 asks for the sampled token's
    ({"prompt": "a", "prompt_logprobs": None}, False),
    ({"prompt": "a", "echo": True, "logprobs": 0}, True),
    ({"prompt": "a", "echo": True}, False),             # echo alone needs no logprobs
    ({"prompt": "a", "logprobs": 3}, False),            # generated-token logprobs: D decodes
    ({"prompt": "a", "use_beam_search": True, "n": 2}, True),
    ({"prompt": "a", "use_beam_search": False}, False),
    ({"messages": [], "prompt_logprobs": 2}, True),
])
def test_prompt_pass_rule(body, needs):
    assert needs_prompt_pass(body) is needs


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 1}, {"echo": True, "logprobs": 1},
                                   {"use_beam_search": True, "n": 2, "temperature": 0}])
@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_prompt_pass_requests_send_no_p_leg(engines, proxy, extra, mode):
    """A request D must prefill itself (prompt logprobs, beam search) goes to
    D alone, whatever the threshold (0 here: everything else disaggregated)."""
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d], transfer_mode=mode)
    resp = await client.post("/v1/completions", json={"prompt": [1, 2, 3], **extra})
    assert resp.status == 200
    assert p.legs() == []
    (d_leg,) = d.legs()
    assert "kv_transfer_params" not in d_leg.body and d_leg.body.items() >= extra.items()
    metrics = await (await client.get("/metrics")).text()
    assert 'pd_proxy_prefill_decisions_total{decision="local",reason="prompt_pass"} 1.0' in metrics
    # The same prompt without them is disaggregated.
    assert (await client.post("/v1/completions", json={"prompt": [1, 2, 3]})).status == 200
    assert len(p.legs()) == 1
