"""slo/trace.py: the open-loop schedule (gamma arrivals scaled by rate) and
prompts keyed by (seed, point, index)."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from vllm_pd_ext.tools.slo.trace import as_text, make_trace

BASE = dict(num_requests=20, warmup=3, prompt_tokens=16, output_tokens=8, seed=7)


def _gaps(trace):
    return [b.at_s - a.at_s for a, b in itertools.pairwise(trace)]


def _cv(xs):
    return statistics.pstdev(xs) / statistics.fmean(xs)


def test_shape_warmup_flags_and_first_at_zero():
    trace = make_trace(rate=2.0, **BASE)
    assert len(trace) == 23
    assert [r.index for r in trace] == list(range(23))
    assert [r.warmup for r in trace] == [True] * 3 + [False] * 20
    assert trace[0].at_s == 0.0
    assert all(g > 0 for g in _gaps(trace))
    assert {r.output_tokens for r in trace} == {8}
    assert {len(r.prompt) for r in trace} == {16}
    assert all(10 <= t < 3000 for r in trace for t in r.prompt)


def test_same_seed_same_pattern_scaled_by_rate():
    slow, fast = make_trace(rate=1.0, **BASE), make_trace(rate=4.0, **BASE)
    for a, b in zip(slow, fast, strict=True):
        assert b.at_s == pytest.approx(a.at_s / 4, rel=1e-12, abs=1e-12)
        assert a.prompt == b.prompt  # prompts do not depend on the rate
    other = make_trace(rate=1.0, **{**BASE, "seed": 8})
    assert [r.at_s for r in other] != [r.at_s for r in slow]


def test_infinite_rate_sends_everything_at_once():
    assert {r.at_s for r in make_trace(rate=math.inf, **BASE)} == {0.0}


def test_poisson_mean_interarrival_is_one_over_rate():
    trace = make_trace(rate=4.0, num_requests=5000, warmup=0, prompt_tokens=1,
                       output_tokens=1, seed=1)
    gaps = _gaps(trace)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert _cv(gaps) == pytest.approx(1.0, abs=0.05)  # exponential: CV 1


def test_burstiness_below_one_is_burstier():
    kw = dict(rate=4.0, num_requests=5000, warmup=0, prompt_tokens=1, output_tokens=1, seed=1)
    poisson, bursty = make_trace(**kw), make_trace(**kw, burstiness=0.25)
    regular = make_trace(**kw, burstiness=4.0)
    assert _cv(_gaps(bursty)) > 1.5 > _cv(_gaps(poisson)) > 0.8 > _cv(_gaps(regular))
    assert statistics.fmean(_gaps(bursty)) == pytest.approx(0.25, rel=0.1)


def test_prompts_same_across_calls_distinct_across_points_and_requests():
    a, b = make_trace(rate=1.0, **BASE), make_trace(rate=1.0, **BASE)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    other_point = make_trace(rate=1.0, point=1, **BASE)
    assert all(x.prompt != y.prompt for x, y in zip(a, other_point, strict=True))
    assert len({tuple(r.prompt) for r in a}) == len(a)


def test_prompt_jitter_and_vocab():
    trace = make_trace(rate=1.0, num_requests=200, warmup=0, prompt_tokens=100,
                       output_tokens=1, seed=3, prompt_jitter=0.2, vocab=(50, 60))
    lengths = [len(r.prompt) for r in trace]
    assert min(lengths) >= 80 and max(lengths) <= 120
    assert len(set(lengths)) > 20
    assert {t for r in trace for t in r.prompt} == set(range(50, 60))
    tiny = make_trace(rate=1.0, num_requests=50, warmup=0, prompt_tokens=1, output_tokens=1,
                      seed=3, prompt_jitter=0.9)
    assert min(len(r.prompt) for r in tiny) == 1


@pytest.mark.parametrize(("override", "name"), [
    ({"rate": 0.0}, "rate"), ({"rate": -1.0}, "rate"), ({"rate": math.nan}, "rate"),
    ({"num_requests": -1}, "num_requests"), ({"warmup": -1}, "warmup"),
    ({"warmup": 1.5}, "warmup"), ({"prompt_tokens": 0}, "prompt_tokens"),
    ({"output_tokens": 0}, "output_tokens"), ({"burstiness": 0.0}, "burstiness"),
    ({"burstiness": math.inf}, "burstiness"), ({"prompt_jitter": 1.0}, "prompt_jitter"),
    ({"prompt_jitter": -0.1}, "prompt_jitter"), ({"vocab": (5, 5)}, "vocab"),
])
def test_bad_arguments_are_named(override, name):
    with pytest.raises(ValueError, match=name):
        make_trace(**{"rate": 1.0, **BASE, **override})


class WordTokenizer:
    """A stand-in tokenizer: id i is the word ``w{i}`` plus a space, and a
    text tokenizes back word by word (so a cut is exact)."""

    def decode(self, ids):
        return "".join(f"w{i} " for i in ids)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(w[1:]) for w in text.split()]}


class MergingTokenizer(WordTokenizer):
    """Re-tokenizes every word as two tokens (a decoded text that comes
    back longer, as random ids do with a real BPE)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [0, 0] * len(text.split())}


def test_as_text_keeps_the_trace_and_cuts_text_to_the_token_count():
    trace = make_trace(rate=2.0, num_requests=5, warmup=1, prompt_tokens=40,
                       output_tokens=8, seed=3, prompt_jitter=0.2)
    exact = as_text(trace, WordTokenizer())
    for ids, text in zip(trace, exact, strict=True):
        assert text.prompt == "".join(f"w{i} " for i in ids.prompt)
        assert (text.at_s, text.index, text.warmup) == (ids.at_s, ids.index, ids.warmup)
    longer = as_text(trace, MergingTokenizer())
    for ids, text in zip(trace, longer, strict=True):
        # The longest cut that fits: half the ids, at two tokens a word.
        assert len(text.prompt.split()) == len(ids.prompt) // 2
