"""vllm-pd-size against a real handoff: the bytes it predicts for our tiny
model are the bytes D really reads (whole blocks, as vLLM allocates them)."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    KV_BYTES,
    completion_body,
    delta,
    pd_complete,
    token_prompt,
)
from vllm_pd_ext.testing.engines import Engine
from vllm_pd_ext.tools.sizing.formula import load_config, spec_from_config

pytestmark = pytest.mark.engine


def test_predicted_kv_bytes_are_the_bytes_moved(p: Engine, d: Engine, model: str) -> None:
    spec = spec_from_config(load_config(model))
    tokens = 300
    before = d.metrics()
    status, answer = pd_complete(p, d, completion_body(model, token_prompt(tokens, 77),
                                                       max_tokens=2))
    assert status == 200, answer
    moved = delta(before, d.metrics(), KV_BYTES)
    blocks = -(-tokens // BLOCK_SIZE)
    assert moved == spec.bytes_per_token * blocks * BLOCK_SIZE > 0
