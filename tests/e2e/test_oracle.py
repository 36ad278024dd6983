"""The equality oracle still sees KV content (negative controls, real engines).

The oracle tolerates a runner-up only at a near tie of the reference's own
scores, so it must not be blind: when D decodes a prompt over the KV of a
*decoy* (P prefilled another prompt of the same length, and D loaded that
KV as its own), every output must be called different, although the KV
really moved. The same test also runs the genuine handoff of each prompt,
which the oracle must call the same: a check that says "different" to
everything would fail there.
"""

from __future__ import annotations

import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    EXTERNAL,
    completion_body,
    delta,
    pd_complete,
    prefill,
    token_prompt,
)
from vllm_pd_ext.testing.engines import Engine
from vllm_pd_ext.testing.oracle import compare, near_tie_nats, output_of

pytestmark = pytest.mark.engine

#: (prompt length, seed): one block, three blocks, a partial last block.
PROMPTS = [(128, 901), (384, 902), (333, 903)]


def decoys(prompt: list[int], seed: int) -> dict[str, list[int]]:
    """Prompts of the same length whose KV, loaded as ``prompt``'s, is wrong:
    wholly (another prompt) or in one block (a stale or misplaced block).
    Not one token: a single wrong token among hundreds can leave the greedy
    output unchanged (seen with 1 of 384), which no oracle can see."""
    start = (len(prompt) // 2) // BLOCK_SIZE * BLOCK_SIZE
    end = min(start + BLOCK_SIZE, len(prompt))
    return {
        "another prompt": token_prompt(len(prompt), seed=seed + 10_000),
        "one block differs": [*prompt[:start], *token_prompt(end - start, seed=seed + 20_000),
                              *prompt[end:]],
    }


@pytest.mark.parametrize(("n_tokens", "seed"), PROMPTS, ids=[str(n) for n, _ in PROMPTS])
def test_oracle_calls_output_on_decoy_kv_different(ref: Engine, p: Engine, d: Engine,
                                                   model: str, n_tokens: int, seed: int
                                                   ) -> None:
    eps = near_tie_nats(ref.dtype)
    prompt = token_prompt(n_tokens, seed=seed)
    body = completion_body(model, prompt, max_tokens=12)
    status, want = ref.post("/v1/completions", body)
    assert status == 200, want
    reference = output_of(want)

    # Positive control: the genuine handoff is the same output.
    status, got = pd_complete(p, d, body)
    assert status == 200, got
    genuine = output_of(got)
    verdict = compare(ref.url, model, prompt, genuine.tokens, reference.tokens, eps)
    assert verdict.same, verdict.detail

    for name, decoy in decoys(prompt, seed).items():
        assert len(decoy) == n_tokens and decoy != prompt
        params = prefill(p, completion_body(model, decoy, max_tokens=1))
        # D now refuses a P answer made for another prompt (its digest):
        # the oracle must still see wrong KV where that check is absent
        # (vLLM's NixlConnector, or a P without the digest), so the decoy
        # leg goes without it.
        assert params.pop("remote_prompt_digest")
        # A salt of its own keeps D's prefix cache out of it both ways: no
        # hit on the genuine blocks, and the decoy's KV is cached under keys
        # that no other request uses.
        leg = dict(body, kv_transfer_params=params, cache_salt=f"decoy-{seed}-{name}")
        before = d.metrics()
        status, got = d.post("/v1/completions", leg)
        after = d.metrics()
        assert status == 200, got
        # D really decoded over the decoy's KV (no silent recompute).
        assert delta(before, after, EXTERNAL) == n_tokens, name
        out = output_of(got)
        verdict = compare(ref.url, model, prompt, out.tokens, reference.tokens, eps)
        assert not verdict.same, (
            f"{name}: the oracle did not see wrong KV: {verdict.summary()}; "
            f"decoy output {out.tokens}, reference {reference.tokens}")
        assert not verdict.exact and verdict.position is not None
        print(f"{n_tokens} tokens, {name}: {verdict.detail}")  # -rP shows the margins
