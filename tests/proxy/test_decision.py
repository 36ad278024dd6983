"""decision.py: the conditional-disaggregation rule, without HTTP or engines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from vllm_pd_proxy.decision import Decision, Reason, decide, is_saturated

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
