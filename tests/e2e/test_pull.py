"""Pull mode end to end: real P and D vLLM servers with PDConnector over NIXL.

Every case proves two things: D's tokens equal the collocated engine's at
temperature 0, and the KV really moved (D counted the prompt tokens as
external KV and our byte counter grew by exactly the expected blocks).
"""

from __future__ import annotations

import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    CACHE_HIT,
    EXTERNAL,
    KV_BYTES,
    TINY_BLOCK_BYTES,
    TINY_LAYERS,
    assert_same_as_reference,
    blocks_for,
    completion_body,
    delta,
    pd_complete,
    poke,
    prefill,
    token_prompt,
)
from vllm_pd_ext.testing.engines import Engine

pytestmark = pytest.mark.engine

CASES = {
    "shorter_than_a_block": 37,
    "exactly_one_block": BLOCK_SIZE,
    "several_blocks": 3 * BLOCK_SIZE,
    "partial_last_block": 2 * BLOCK_SIZE + 77,
}


@pytest.mark.parametrize("n_tokens", list(CASES.values()), ids=list(CASES))
def test_pull_matches_collocated_and_moves_kv(
    ref: Engine, p: Engine, d: Engine, model: str, n_tokens: int
) -> None:
    body = completion_body(model, token_prompt(n_tokens, seed=n_tokens), max_tokens=12)
    status, want = ref.post("/v1/completions", body)
    assert status == 200, want
    before = d.metrics()
    status, got = pd_complete(p, d, body)
    assert status == 200, got
    after = d.metrics()

    assert_same_as_reference(ref, got, want)
    assert got["usage"]["prompt_tokens"] == n_tokens
    assert delta(before, after, EXTERNAL) == n_tokens
    assert delta(before, after, KV_BYTES) == blocks_for(n_tokens) * TINY_LAYERS * TINY_BLOCK_BYTES


def test_prefix_shared_with_earlier_prompt_reads_only_missing_blocks(
    ref: Engine, p: Engine, d: Engine, model: str
) -> None:
    first = token_prompt(2 * BLOCK_SIZE + 40, seed=1001)
    status, _ = pd_complete(p, d, completion_body(model, first, max_tokens=4))
    assert status == 200
    # Shares the first two full blocks with ``first``, then diverges.
    second = first[: 2 * BLOCK_SIZE] + token_prompt(90, seed=1002)
    body = completion_body(model, second, max_tokens=12)
    status, want = ref.post("/v1/completions", body)
    assert status == 200
    before = d.metrics()
    status, got = pd_complete(p, d, body)
    assert status == 200, got
    after = d.metrics()

    assert_same_as_reference(ref, got, want)
    assert delta(before, after, CACHE_HIT) == 2 * BLOCK_SIZE
    assert delta(before, after, EXTERNAL) == 90
    assert delta(before, after, KV_BYTES) == 1 * TINY_LAYERS * TINY_BLOCK_BYTES


def test_p_holds_blocks_until_d_reads_then_frees_them(p: Engine, d: Engine, model: str
                                                      ) -> None:
    """P pins a finished prefill's blocks until D's release, then frees them
    (released, not expired), and no block stays held."""
    before = p.metrics()
    body = completion_body(model, token_prompt(300, seed=7), max_tokens=2)
    params = prefill(p, body)
    assert p.metrics()["vllm:kv_cache_usage_perc"] > 0  # pinned under the lease
    status, _ = d.post("/v1/completions", dict(body, kv_transfer_params=params))
    assert status == 200
    poke(p, model)
    after = p.metrics()
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert delta(before, after, "vllm:pd_ext_lease_expiries_total") == 0
    assert delta(before, after, "vllm:pd_ext_leases_granted_total") == 1
