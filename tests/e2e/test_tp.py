"""Tensor parallelism across sizes on real engines (issue 26 items 2, 7).

One engine ``x2`` runs TP=2 (a core per rank) with ``kv_role=kv_both``: it
is the D of the session's TP=1 P (1 -> 2: each D rank reads its head from
P's one rank) and the P of the session's TP=1 D (2 -> 1: D's one rank reads
one head from each of P's ranks). The tiny model has 2 KV heads, so every
TP=2 rank holds one. Each case proves the two things every e2e case
proves: the tokens equal the collocated TP=1 engine's (the oracle's
near-tie rule, docs/testing.md, with the TP epsilon: TP=2 sums its
all-reduce in another order, and a decoy shows wrong KV is still seen)
and the KV moved (D's external-KV token count, and exactly the prompt's
bytes over D's ranks together). The full matrix (2 -> 2, push, kills,
expiries) runs in ``python -m vllm_pd_ext.testing.tp_matrix`` (docs/testing.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conformance import SERVE_ARGS
from tests.e2e.engine_set import engine_set
from tests.e2e.helpers import (
    BLOCK_SIZE,
    CACHE_HIT,
    EXTERNAL,
    KV_BYTES,
    TINY_BLOCK_BYTES,
    TINY_LAYERS,
    assert_nothing_held,
    assert_same_as_reference,
    blocks_for,
    completion_body,
    delta,
    log_dir,
    pd_complete,
    prefill,
    token_prompt,
)
from vllm_pd_ext.testing.engines import Engine
from vllm_pd_ext.testing.oracle import compare, near_tie_nats, output_of

pytestmark = pytest.mark.engine

DESCRIPTORS = "vllm:pd_ext_kv_descriptors_total"
#: The oracle's near-tie epsilon for a TP=2 engine against the TP=1
#: reference (vllm_pd_ext/testing/oracle.py: measured, and why it is wider).
TP_EPS = near_tie_nats("bfloat16", tensor_parallel=True)


@pytest.fixture(scope="module")
def x2(p: Engine, d: Engine, model: str) -> Iterator[Engine]:
    e = Engine("x2-tp2", model, log_dir("tp"), role="kv_both", cpu_bind="0|1", tp_size=2,
               failure_policy="fail", extra_args=SERVE_ARGS,
               extra_config={"transfer_telemetry_in_response": True})
    with engine_set(e):
        yield e
        assert_nothing_held([p, e], [d, e], model, within_s=20, what="tp")


def handoff(ref: Engine, p: Engine, d: Engine, prompt: list[int]
            ) -> tuple[dict[str, Any], dict[str, float]]:
    """P then D legs of ``prompt`` (greedy, 12 tokens): D's answer, which
    must be the TP=1 reference's by the oracle, and D's metric deltas."""
    body = completion_body(ref.model, prompt, max_tokens=12)
    status, want = ref.post("/v1/completions", body)
    assert status == 200, want
    before = d.metrics()
    status, got = pd_complete(p, d, body)
    assert status == 200, got
    after = d.metrics()
    assert_same_as_reference(ref, got, want, TP_EPS)
    return got, {k: delta(before, after, k) for k in (EXTERNAL, CACHE_HIT, KV_BYTES,
                                                      DESCRIPTORS)}


@pytest.mark.parametrize("n_tokens", [37, 3 * BLOCK_SIZE + 5])
def test_p_tp1_to_d_tp2_matches_collocated_and_moves_kv(
        ref: Engine, p: Engine, x2: Engine, n_tokens: int) -> None:
    got, moved = handoff(ref, p, x2, token_prompt(n_tokens, seed=2600 + n_tokens))
    assert moved[EXTERNAL] == n_tokens
    # Each D rank read its half of every block: the prompt's bytes once.
    assert moved[KV_BYTES] == blocks_for(n_tokens) * TINY_LAYERS * TINY_BLOCK_BYTES
    # A head slice is one range per block and layer, on each of the 2 ranks.
    assert moved[DESCRIPTORS] == 2 * blocks_for(n_tokens) * TINY_LAYERS
    # D's answer carries one transfer record, both ranks' merged (even when
    # they finished in different steps).
    rec = got["kv_transfer_params"]["pd_transfer"]
    assert rec["ranks"] == 2 and rec["outcome"] == "ok", rec
    assert rec["bytes"] == moved[KV_BYTES]


def test_p_tp2_to_d_tp1_matches_collocated_and_moves_kv(
        ref: Engine, x2: Engine, d: Engine) -> None:
    n_tokens = 2 * BLOCK_SIZE + 77
    _, moved = handoff(ref, x2, d, token_prompt(n_tokens, seed=2611))
    assert moved[EXTERNAL] == n_tokens
    assert moved[KV_BYTES] == blocks_for(n_tokens) * TINY_LAYERS * TINY_BLOCK_BYTES
    # D's one rank read one head slice per block and layer from each P rank.
    assert moved[DESCRIPTORS] == 2 * blocks_for(n_tokens) * TINY_LAYERS


def test_prefix_hit_on_d_tp2_reads_only_missing_blocks(
        ref: Engine, p: Engine, x2: Engine, model: str) -> None:
    first = token_prompt(2 * BLOCK_SIZE + 40, seed=2620)
    status, _ = pd_complete(p, x2, completion_body(model, first, max_tokens=4))
    assert status == 200
    _, moved = handoff(ref, p, x2, first[: 2 * BLOCK_SIZE] + token_prompt(90, seed=2621))
    assert moved[CACHE_HIT] == 2 * BLOCK_SIZE
    assert moved[EXTERNAL] == 90
    assert moved[KV_BYTES] == 1 * TINY_LAYERS * TINY_BLOCK_BYTES


def test_tp2_alone_is_within_the_oracles_tolerance_of_tp1(ref: Engine, x2: Engine,
                                                          model: str) -> None:
    """The baseline the cases above rest on: x2 serving alone (no P/D) sums
    its all-reduce in another order than the TP=1 reference, and must still
    be the reference's output by the oracle's near-tie rule; how many are
    bit-exact is printed (-rP)."""
    exact = 0
    for n_tokens, seed in [(333, 2632), (700, 2633)]:
        body = completion_body(model, token_prompt(n_tokens, seed=seed), max_tokens=16)
        status, want = ref.post("/v1/completions", body)
        assert status == 200, want
        status, got = x2.post("/v1/completions", body)
        assert status == 200, got
        exact += assert_same_as_reference(ref, got, want, TP_EPS).exact
    print(f"TP=2 alone vs TP=1: {exact} of 2 outputs bit-exact, the rest near ties")


def test_oracle_sees_wrong_kv_on_a_tp2_decoder(ref: Engine, p: Engine, x2: Engine,
                                               model: str) -> None:
    """Negative control: x2 decodes a prompt over the KV P made for another
    prompt of the same length (moved by the head-slice path); the oracle
    must call it different although the KV moved."""
    n_tokens = 3 * BLOCK_SIZE + 5
    prompt = token_prompt(n_tokens, seed=2640)
    body = completion_body(model, prompt, max_tokens=12)
    status, want = ref.post("/v1/completions", body)
    assert status == 200, want
    params = prefill(p, completion_body(model, token_prompt(n_tokens, seed=2641),
                                        max_tokens=1))
    assert params.pop("remote_prompt_digest")  # as in test_oracle.py: no digest check
    before = x2.metrics()
    status, got = x2.post("/v1/completions", dict(body, kv_transfer_params=params,
                                                  cache_salt="tp-decoy"))
    after = x2.metrics()
    assert status == 200, got
    assert delta(before, after, EXTERNAL) == n_tokens
    verdict = compare(ref.url, model, prompt, output_of(got).tokens, output_of(want).tokens,
                      TP_EPS)
    assert not verdict.same and not verdict.exact, verdict.summary()
    print(f"decoy on TP=2: {verdict.detail}")  # -rP: how far beyond the epsilon
