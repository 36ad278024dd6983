"""The equality oracle: is a P/D output what one collocated engine would say?

Used by the end-to-end tests, the demo and the benchmarks. The rule, also in
docs/testing.md:

1. **Exact.** The candidate's token ids equal the reference engine's own
   greedy output: same.
2. **Otherwise, scored.** The reference engine prefills ``prompt +
   candidate`` once with ``prompt_logprobs`` (teacher forcing) and so gives,
   at every generated position ``j``, its log-probability of the candidate's
   token and of its own best token given the candidate's history. The
   candidate is the same output if at every position
   ``best_j - logprob_j(candidate_j) <= eps``: it only ever took a runner-up
   that the reference itself rates within ``eps`` nats of its best, a near
   tie that legitimate rounding can flip. One position further out and the
   outputs differ; the verdict names that position.
   A candidate that is a proper prefix of the reference's output (or the
   reason the other way round) differs: one of them stopped early.

Why: D computes the last prompt token (and, after a prefix hit, a tail) over
KV that P computed in other batch shapes, so its rounding differs from a
one-shot prefill; how much depends on the CPU's kernels (AVX-512 BF16, AMX,
AVX2). With random weights near ties are frequent, and exact equality then
fails on some CPUs although the KV is right. Wrong KV, even one token of it,
moves the logits far beyond ``eps`` (see the negative controls in
tests/e2e/test_oracle.py).

Unlike "compare up to the first divergence", scoring keeps judging every
position after a near tie, so a near tie hides nothing that follows it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: ``eps`` by the engines' ``--dtype``: the largest gap, in nats, between the
#: reference's best token and the candidate's token that still counts as a
#: near tie. bfloat16 keeps 8 bits of mantissa, so a logit in [4, 8) (the
#: tiny model's top logits: p1 4.7, p99 7.2, max 8.7) moves in steps of
#: 2**-5 = 0.031 nats; 0.1 is about three such steps. The largest gap seen
#: between a P/D output and the collocated engine was one step (0.031), over
#: about 1,000 scored positions with and without prefix hits.
NEAR_TIE_NATS: dict[str, float] = {"bfloat16": 0.1}
#: The same when the candidate ran with tensor parallelism and the reference
#: without: each rank's all-reduce sums partial products in another order.
#: Measured on an AMD EPYC (TP=2 alone against TP=1, tiny model, 40 prompts of 40-700
#: tokens, 16 tokens each): 28 bit-exact, 12 diverged at a reference gap of
#: 0 to 3 steps (0.094 nats); a TP=2 P's KV decoded by a TP=1 D once at 4
#: steps (0.125, the TP matrix). 0.25 (eight steps) leaves room for CPUs
#: that round otherwise, while wrong KV diverges by nats (tests/e2e/
#: test_tp.py's decoy; docs/testing.md).
TP_NEAR_TIE_NATS: dict[str, float] = {"bfloat16": 0.25}

#: One position's scores: token id -> the reference's log-probability. Holds
#: at least the candidate's token and the reference's best token.
PositionScores = Mapping[int, float]


class OracleError(RuntimeError):
    """The reference could not score a candidate (HTTP error, bad answer)."""


def near_tie_nats(dtype: str, tensor_parallel: bool = False) -> float:
    try:
        return (TP_NEAR_TIE_NATS if tensor_parallel else NEAR_TIE_NATS)[dtype]
    except KeyError:
        raise ValueError(f"no near-tie epsilon measured for dtype {dtype!r}; "
                         f"known: {', '.join(sorted(NEAR_TIE_NATS))}") from None


@dataclass(frozen=True)
class Verdict:
    """The oracle's answer for one candidate output."""

    same: bool
    #: Token for token the reference's own greedy output.
    exact: bool
    eps: float
    #: Positions where the candidate took a near-tie runner-up.
    near_ties: tuple[int, ...] = ()
    #: First position judged different (None when same).
    position: int | None = None
    #: Largest ``best - candidate`` gap over the scored positions.
    worst_gap: float = 0.0
    detail: str = ""
    scores: tuple[PositionScores, ...] = field(default=(), repr=False)

    def __bool__(self) -> bool:
        return self.same

    def summary(self) -> str:
        if self.exact:
            return "same (token for token)"
        if self.same:
            return (f"same up to near ties at positions {list(self.near_ties)} "
                    f"(largest gap {self.worst_gap:.4f} <= eps {self.eps} nats)")
        return f"different: {self.detail}"


def judge(candidate: Sequence[int], reference: Sequence[int],
          scores: Sequence[PositionScores] | None, eps: float) -> Verdict:
    """Apply the rule. ``scores[j]`` is the reference's scoring of position
    ``j`` given ``candidate[:j]``; it is needed only when the outputs are not
    identical (pass None to learn whether they are)."""
    cand, ref = list(candidate), list(reference)
    if cand == ref:
        return Verdict(same=True, exact=True, eps=eps)
    first = next((j for j, (a, b) in enumerate(zip(cand, ref, strict=False)) if a != b), None)
    if first is None:  # one is a proper prefix of the other
        which = "candidate" if len(cand) < len(ref) else "reference"
        return Verdict(same=False, exact=False, eps=eps, position=min(len(cand), len(ref)),
                       detail=f"the {which} stopped after {min(len(cand), len(ref))} tokens "
                              f"where the other went on (candidate {cand}, reference {ref})")
    if scores is None:
        raise ValueError("outputs differ: the reference's scores are needed")
    if len(scores) != len(cand):
        raise ValueError(f"{len(scores)} scored positions for {len(cand)} candidate tokens")
    near: list[int] = []
    worst = 0.0
    for j, (tok, pos) in enumerate(zip(cand, scores, strict=True)):
        if tok not in pos:
            raise ValueError(f"position {j}: no score for the candidate's token {tok}")
        best_tok, best = max(pos.items(), key=lambda kv: kv[1])
        gap = best - pos[tok]
        worst = max(worst, gap)
        if gap > eps:
            return Verdict(
                same=False, exact=False, eps=eps, near_ties=tuple(near), position=j,
                worst_gap=worst, scores=tuple(scores),
                detail=(f"at generated position {j} the candidate has token {tok} "
                        f"(logprob {pos[tok]:.4f}) where the reference's best is {best_tok} "
                        f"({best:.4f}): gap {gap:.4f} > eps {eps} nats; the outputs first "
                        f"differ at position {first} (candidate {cand}, reference {ref})"))
        if gap > 0 or tok != best_tok:
            near.append(j)
    return Verdict(same=True, exact=False, eps=eps, near_ties=tuple(near), worst_gap=worst,
                   scores=tuple(scores),
                   detail=f"first differs at position {first}, within eps at every position")


def teacher_forced_scores(url: str, model: str, prompt: Sequence[int],
                          candidate: Sequence[int], timeout: float = 120.0,
                          headers: Mapping[str, str] | None = None) -> list[dict[int, float]]:
    """The reference engine at ``url`` scores ``candidate`` after ``prompt``:
    one ``/v1/completions`` prefill with ``prompt_logprobs=1`` (vLLM returns
    the actual token and its top-1 at each prompt position)."""
    body = {"model": model, "prompt": [*prompt, *candidate], "max_tokens": 1,
            "temperature": 0, "prompt_logprobs": 1}
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer: Any = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise OracleError(f"scoring request to {url} failed: HTTP {exc.code}: "
                          f"{exc.read()[:500].decode(errors='replace')}") from exc
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as exc:
        raise OracleError(f"scoring request to {url} failed: {exc}") from exc
    try:
        per_pos = answer["choices"][0]["prompt_logprobs"]
        out = [{int(tok): float(v["logprob"]) for tok, v in per_pos[len(prompt) + j].items()}
               for j in range(len(candidate))]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise OracleError(f"scoring answer from {url} has no usable prompt_logprobs: "
                          f"{exc!r}") from exc
    return out


def compare(url: str, model: str, prompt: Sequence[int], candidate: Sequence[int],
            reference: Sequence[int], eps: float, timeout: float = 120.0) -> Verdict:
    """Judge ``candidate`` against the reference engine at ``url`` whose own
    greedy output for ``prompt`` was ``reference``; scores only when neither
    output is a prefix of the other."""
    n = min(len(candidate), len(reference))
    if list(candidate[:n]) == list(reference[:n]):
        return judge(candidate, reference, None, eps)
    return judge(candidate, reference,
                 teacher_forced_scores(url, model, prompt, candidate, timeout), eps)


@dataclass(frozen=True)
class Output:
    """What the oracle needs from one OpenAI answer: prompt ids, generated ids
    (requests must set ``return_token_ids``) and the text."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    text: str
    finish_reason: str | None


def output_of(body: Mapping[str, Any]) -> Output:
    """From a non-streamed ``/v1/completions`` or ``/v1/chat/completions`` answer."""
    choice = body["choices"][0]
    prompt = choice.get("prompt_token_ids") or body.get("prompt_token_ids")
    tokens = choice.get("token_ids")
    if prompt is None or tokens is None:
        raise OracleError("the answer has no prompt_token_ids/token_ids: send "
                          "return_token_ids=true")
    text = choice.get("text")
    if text is None:
        text = (choice.get("message") or {}).get("content") or ""
    return Output(tuple(prompt), tuple(tokens), text, choice.get("finish_reason"))


def stream_output(events: Sequence[Any]) -> Output:
    """From the parsed SSE events of a streamed answer (``"[DONE]"`` allowed)."""
    prompt: list[int] | None = None
    tokens: list[int] = []
    text = ""
    finish = None
    for ev in events:
        if not isinstance(ev, Mapping):
            continue
        if ev.get("prompt_token_ids") is not None:
            prompt = list(ev["prompt_token_ids"])
        for ch in ev.get("choices", []):
            if ch.get("prompt_token_ids") is not None:
                prompt = list(ch["prompt_token_ids"])
            tokens += ch.get("token_ids") or []
            text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
            finish = ch.get("finish_reason") or finish
    if prompt is None:
        raise OracleError("the stream has no prompt_token_ids: send return_token_ids=true")
    return Output(tuple(prompt), tuple(tokens), text, finish)
