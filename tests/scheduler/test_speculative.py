"""Speculative decoding and PDConnector (issue 24 item 3): methods that only
propose tokens run on D over loaded KV (``tests/e2e/test_d_variants.py``);
a drafter with a KV cache of its own is refused at startup, by name."""

from __future__ import annotations

import pytest
from pdsched import create_scheduler, create_vllm_config
from vllm.config import SpeculativeConfig

from vllm_pd_ext import compat


def _spec(method: str) -> SpeculativeConfig:
    # vLLM's own class and its own uses_draft_kv_cache(), without building a
    # drafter (no draft model exists here): only ``method`` is read.
    spec = object.__new__(SpeculativeConfig)
    object.__setattr__(spec, "method", method)
    return spec


@pytest.mark.parametrize("method", ["ngram", "suffix", "medusa"])
def test_proposers_without_drafter_kv_are_accepted(method: str) -> None:
    cfg = create_vllm_config("kv_consumer")
    cfg.speculative_config = _spec(method)
    assert compat.speculative_problem(cfg) is None


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "draft_model"])
@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_drafter_kv_methods_refuse_to_start_naming_the_method(method: str, role: str) -> None:
    cfg = create_vllm_config(role)
    cfg.speculative_config = _spec(method)
    with pytest.raises(ValueError, match=rf"speculative_config.method='{method}'.*drafter KV"):
        create_scheduler(cfg)


def test_no_speculation_is_accepted() -> None:
    assert compat.speculative_problem(create_vllm_config("kv_consumer")) is None
