"""The request schedule of one rate point: arrival times and prompts.

Pure (stdlib only). Arrivals follow ``vllm bench serve``: gamma
inter-arrival times with shape ``burstiness`` and mean ``1/rate``
(burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular).
The unit-rate intervals depend on ``seed`` alone and are divided by
``rate``, so one seed gives the same arrival pattern, scaled, at every rate.

Prompts are random token ids drawn from a generator keyed by
``(seed, point, index)``: the same for every deployment at one seed and
point, different between points and requests, so an engine's prefix cache
cannot hit across rate points. The first ``warmup`` requests are sent at the
same rate but excluded from the metrics. ``as_text`` turns them into text
(the caller's tokenizer) for a path that takes no token-id prompts.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TraceRequest:
    """One scheduled request."""

    index: int
    #: Scheduled send time, seconds from the start of the rate point.
    at_s: float
    #: Token ids; text with ``--text-prompts`` (``as_text``).
    prompt: list[int] | str
    output_tokens: int
    warmup: bool


def unit_intervals(count: int, seed: int, burstiness: float = 1.0) -> list[float]:
    """``count`` gamma inter-arrival times of mean 1 (a unit-rate process)."""
    rng = random.Random(f"vllm-pd-bench/arrivals/{seed}")
    return [rng.gammavariate(burstiness, 1.0 / burstiness) for _ in range(count)]


def make_prompt(seed: int, point: int, index: int, prompt_tokens: int,
                prompt_jitter: float = 0.0, vocab: tuple[int, int] = (10, 3000)) -> list[int]:
    """Request ``index``'s prompt at rate point ``point``: token ids in
    ``range(*vocab)``; with ``prompt_jitter`` j its length is uniform in
    ``[prompt_tokens*(1-j), prompt_tokens*(1+j)]``, rounded, at least 1."""
    rng = random.Random(f"vllm-pd-bench/prompt/{seed}/{point}/{index}")
    length = prompt_tokens
    if prompt_jitter > 0:
        length = max(1, round(rng.uniform(prompt_tokens * (1 - prompt_jitter),
                                          prompt_tokens * (1 + prompt_jitter))))
    return rng.choices(range(vocab[0], vocab[1]), k=length)


def as_text(trace: list[TraceRequest], tokenizer: Any) -> list[TraceRequest]:
    """The same trace with text prompts: each prompt's ids decoded, cut so
    that the text tokenizes back to at most as many tokens (a decoded id
    sequence usually re-tokenizes longer). For a proxy path that takes text
    only (push's ``--concurrent-dispatch``): the lengths stay within a few
    tokens of the id prompts'."""
    out = []
    def tokens(ids: list[int], k: int) -> tuple[int, str]:
        text = tokenizer.decode(ids[:k])
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]), text

    for req in trace:
        assert not isinstance(req.prompt, str)
        ids = list(req.prompt)
        target = len(ids)

        lo, hi, best = 1, target, tokens(ids, 1)[1]
        while lo <= hi:  # the longest cut whose text fits the target
            mid = (lo + hi) // 2
            n, text = tokens(ids, mid)
            if n <= target:
                lo, best = mid + 1, text
            else:
                hi = mid - 1
        out.append(dataclasses.replace(req, prompt=best))
    return out


def make_trace(*, rate: float, num_requests: int, warmup: int, prompt_tokens: int,
               output_tokens: int, seed: int, point: int = 0, burstiness: float = 1.0,
               prompt_jitter: float = 0.0,
               vocab: tuple[int, int] = (10, 3000)) -> list[TraceRequest]:
    """``warmup + num_requests`` requests, the first ``warmup`` flagged as
    warm-up, the first at t=0; ``rate=inf`` sends them all at t=0."""
    _check(rate=rate, num_requests=num_requests, warmup=warmup, prompt_tokens=prompt_tokens,
           output_tokens=output_tokens, burstiness=burstiness, prompt_jitter=prompt_jitter,
           vocab=vocab)
    count = warmup + num_requests
    at = [0.0] * count
    if math.isfinite(rate):
        t = 0.0
        for i, gap in enumerate(unit_intervals(max(0, count - 1), seed, burstiness), start=1):
            t += gap
            at[i] = t / rate
    return [TraceRequest(index=i, at_s=at[i],
                         prompt=make_prompt(seed, point, i, prompt_tokens, prompt_jitter, vocab),
                         output_tokens=output_tokens, warmup=i < warmup)
            for i in range(count)]


def _check(*, rate: float, num_requests: int, warmup: int, prompt_tokens: int,
           output_tokens: int, burstiness: float, prompt_jitter: float,
           vocab: tuple[int, int]) -> None:
    if not rate > 0:  # also refuses NaN
        raise ValueError(f"rate must be > 0 (inf: all at once), got {rate!r}")
    for name, value, least in (("num_requests", num_requests, 0), ("warmup", warmup, 0),
                               ("prompt_tokens", prompt_tokens, 1),
                               ("output_tokens", output_tokens, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness!r}")
    if not 0 <= prompt_jitter < 1:
        raise ValueError(f"prompt_jitter must be in [0, 1), got {prompt_jitter!r}")
    lo, hi = vocab
    if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo < hi):
        raise ValueError(f"vocab must be (low, high) token ids with 0 <= low < high, "
                         f"got {vocab!r}")
