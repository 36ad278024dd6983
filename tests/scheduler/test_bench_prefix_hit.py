"""The premise of ``bench_idle_ab.py --prefix-hit``, on vLLM's real scheduler.

The benchmark's ``hit-idle`` / ``hit-warm`` arms stand for D's first step
after a KV load without the handoff: a request whose first step computes
exactly one token over KV that is already in the cache. They get there by
sending a prompt of ``hit_length`` tokens twice; these tests check that
vLLM schedules the second one as exactly that, and that a length off the
block grid would not (so the helper's rounding is what makes the arm mean
what it says).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.pdsched import (
    BLOCK_SIZE,
    create_request,
    create_scheduler,
    create_vllm_config,
    engine_step,
)


def load_bench() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_idle_ab.py"
    spec = importlib.util.spec_from_file_location("bench_idle_ab", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def first_step_tokens(prompt_len: int) -> tuple[int, int]:
    """Send a ``prompt_len``-token prompt twice to one real scheduler (sync
    mode, prefix caching on); returns (tokens scheduled in the second
    request's first step, its cached tokens then)."""
    sched = create_scheduler(create_vllm_config(), num_blocks=64)
    prompt = [10 + i % 3000 for i in range(prompt_len)]
    fill = create_request(prompt_len, prompt=prompt, max_tokens=1)
    sched.add_request(fill)
    out, _ = engine_step(sched)
    assert out.num_scheduled_tokens[fill.request_id] == prompt_len  # nothing cached yet
    assert fill.is_finished()
    again = create_request(prompt_len, prompt=prompt, max_tokens=1)
    sched.add_request(again)
    out, _ = engine_step(sched)
    scheduled = out.num_scheduled_tokens[again.request_id]
    [new] = out.scheduled_new_reqs
    assert new.req_id == again.request_id
    cached = new.num_computed_tokens  # what the first step starts from
    assert again.is_finished()
    return scheduled, cached


@pytest.mark.parametrize("length", [32, 128, 300, 1000])
def test_the_hit_arm_s_first_step_computes_one_token_over_cached_kv(length):
    bench = load_bench()
    n = bench.hit_length(length, BLOCK_SIZE)
    assert abs(n - length) <= BLOCK_SIZE // 2 + 1  # the nearest such length
    assert first_step_tokens(n) == (1, n - 1)


def test_a_prompt_of_whole_blocks_would_recompute_a_block():
    """Why ``hit_length`` adds one: vLLM never serves a whole prompt from
    its cache, so a prompt of whole blocks recomputes its last block."""
    assert first_step_tokens(4 * BLOCK_SIZE) == (BLOCK_SIZE, 3 * BLOCK_SIZE)


def test_hit_length_defaults_to_vllm_s_cpu_block():
    bench = load_bench()
    assert bench.CPU_BLOCK == 128
    assert [bench.hit_length(x) for x in (128, 300, 1000, 4000)] == [129, 257, 1025, 3969]
