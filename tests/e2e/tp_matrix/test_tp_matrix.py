"""The tensor-parallel matrix on real engines (issue 26 items 1-3).

Not part of the CI run (each cell starts its own P and D, TP=2 engines
included: about 10 minutes on 2 cores); run it with

    PD_EXT_TP_MATRIX=1 tests/run.sh tests/e2e/tp_matrix -rP

(docs/testing.md). CI runs the 1 -> 2 and 2 -> 1 pull cells on one shared
TP=2 engine (tests/e2e/test_tp.py). Per cell (P TP x D TP x mode), through
``vllm-pd-proxy``:

- the tokens equal the collocated TP=1 engine's (the oracle's near-tie
  rule) and the KV moved: D's external-KV token count, and the bytes (D's
  READ bytes in pull, P's WRITE bytes in push) are the prompt's blocks;
- a prefix-cache hit on D moves only the missing blocks;
- pull: an expired lease and a P killed after its answer: D recomputes
  (``kv_load_failure_policy=recompute``), the answer is still the
  reference's, nothing moved, no block is held on D and D stays up.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
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
    poke,
    prefill,
    token_prompt,
)
from vllm_pd_ext.testing.engines import Engine, Proxy
from vllm_pd_ext.testing.oracle import near_tie_nats

pytestmark = pytest.mark.engine

LEASE_S = 4.0
TP_EPS = near_tie_nats("bfloat16", tensor_parallel=True)
BYTES_WRITTEN = "vllm:pd_ext_kv_bytes_written_total"


@dataclass(frozen=True)
class Cell:
    p_tp: int
    d_tp: int
    mode: str

    @property
    def id(self) -> str:
        return f"{self.mode}-P{self.p_tp}-D{self.d_tp}"


PULL = [Cell(2, 2, "pull"), Cell(1, 2, "pull"), Cell(2, 1, "pull")]
PUSH = [Cell(2, 2, "push"), Cell(1, 2, "push"), Cell(2, 1, "push")]
WORKING = PULL + PUSH


def cells(which: list[Cell]) -> Any:
    """Parametrize a test over these cells (the module's engines, per cell)."""
    return pytest.mark.parametrize("cell", which, indirect=True, ids=[c.id for c in which])


def _bind(tp: int, alone: str) -> str:
    return "0|1" if tp == 2 else alone


@pytest.fixture(scope="module")
def cell(request: pytest.FixtureRequest, model: str) -> Iterator[dict[str, Any]]:
    c: Cell = request.param
    logs = log_dir(f"tp-matrix-{c.id}")
    mode = {"transfer_mode": c.mode}
    p = Engine(f"p-tp{c.p_tp}", model, logs, role="kv_producer", cpu_bind=_bind(c.p_tp, "0"),
               tp_size=c.p_tp, extra_args=SERVE_ARGS,
               extra_config={**mode, "lease_duration": LEASE_S, "heartbeat_interval": 0.5})
    d = Engine(f"d-tp{c.d_tp}", model, logs, role="kv_consumer", cpu_bind=_bind(c.d_tp, "1"),
               tp_size=c.d_tp, failure_policy="recompute", extra_args=SERVE_ARGS,
               extra_config={**mode, "handshake_timeout": 2.0})
    with engine_set(p, d):
        proxy = Proxy([p.url], [d.url], logs, args=["--transfer-mode", c.mode,
                                                    "--local-prefill-threshold", "0"])
        proxy.start()
        try:
            proxy.wait_ready()
            yield {"cell": c, "p": p, "d": d, "proxy": proxy}
        finally:
            proxy.stop()
        if p.alive():
            assert_nothing_held([p], [d], model, within_s=20, what=c.id)


def _through_proxy(env: dict[str, Any], ref: Engine, model: str, prompt: list[int]
                   ) -> tuple[dict[str, float], dict[str, float], dict[str, float],
                              dict[str, float]]:
    p, d, proxy = env["p"], env["d"], env["proxy"]
    body = completion_body(model, prompt, max_tokens=12)
    status, want = ref.post("/v1/completions", body)
    assert status == 200, want
    p_before, d_before = p.metrics(), d.metrics()
    status, got = proxy.post("/v1/completions", body)
    assert status == 200, got
    poke(p, model)  # push: P counts its WRITEs when it next steps
    p_after, d_after = p.metrics(), d.metrics()
    assert_same_as_reference(ref, got, want, TP_EPS)
    return p_before, p_after, d_before, d_after


def _moved(env: dict[str, Any], p0: dict[str, float], p1: dict[str, float],
           d0: dict[str, float], d1: dict[str, float]) -> float:
    if env["cell"].mode == "push":
        return delta(p0, p1, BYTES_WRITTEN)
    return delta(d0, d1, KV_BYTES)


@cells(WORKING)
@pytest.mark.parametrize("n_tokens", [37, 2 * BLOCK_SIZE + 77])
def test_handoff_matches_collocated_and_moves_kv(cell: dict[str, Any], ref: Engine,
                                                 model: str, n_tokens: int) -> None:
    c: Cell = cell["cell"]
    prompt = token_prompt(n_tokens, seed=2700 + n_tokens + 10 * c.p_tp + c.d_tp)
    p0, p1, d0, d1 = _through_proxy(cell, ref, model, prompt)
    assert delta(d0, d1, EXTERNAL) == n_tokens
    assert _moved(cell, p0, p1, d0, d1) == blocks_for(n_tokens) * TINY_LAYERS * TINY_BLOCK_BYTES


@cells(WORKING)
def test_prefix_hit_on_d_moves_only_missing_blocks(cell: dict[str, Any], ref: Engine,
                                                   model: str) -> None:
    c: Cell = cell["cell"]
    first = token_prompt(2 * BLOCK_SIZE + 40, seed=2750 + 10 * c.p_tp + c.d_tp)
    _through_proxy(cell, ref, model, first)
    second = first[: 2 * BLOCK_SIZE] + token_prompt(90, seed=2760 + 10 * c.p_tp + c.d_tp)
    p0, p1, d0, d1 = _through_proxy(cell, ref, model, second)
    assert delta(d0, d1, CACHE_HIT) == 2 * BLOCK_SIZE
    assert delta(d0, d1, EXTERNAL) == 90
    assert _moved(cell, p0, p1, d0, d1) == TINY_LAYERS * TINY_BLOCK_BYTES


def _d_leg_after(cell: dict[str, Any], ref: Engine, model: str, seed: int,
                 between: Any) -> None:
    """P prefills; ``between()`` breaks the handoff; D's leg must then be
    recomputed on D: the reference's answer, no KV moved, nothing held."""
    p, d = cell["p"], cell["d"]
    body = completion_body(model, token_prompt(3 * BLOCK_SIZE + 9, seed=seed), max_tokens=8)
    status, want = ref.post("/v1/completions", body)
    assert status == 200
    params = prefill(p, body)
    between()
    before = d.metrics()
    status, got = d.post("/v1/completions", dict(body, kv_transfer_params=params))
    after = d.metrics()
    assert status == 200, got
    assert_same_as_reference(ref, got, want, TP_EPS)
    assert delta(before, after, EXTERNAL) == 0
    assert delta(before, after, KV_BYTES) == 0
    assert d.alive()
    deadline = time.monotonic() + 10
    while d.metrics()["vllm:kv_cache_usage_perc"] and time.monotonic() < deadline:
        time.sleep(0.3)
    assert d.metrics()["vllm:kv_cache_usage_perc"] == 0.0


@cells(PULL)
def test_lease_expiry_every_d_rank_gives_up_and_d_recomputes(
        cell: dict[str, Any], ref: Engine, model: str) -> None:
    """Pull only: in push P's own WRITE holds the lease (test_push.py)."""
    c: Cell = cell["cell"]
    p = cell["p"]
    _d_leg_after(cell, ref, model, 2780 + 10 * c.p_tp + c.d_tp,
                 lambda: (time.sleep(LEASE_S + 0.5), poke(p, model)))
    assert "expired on P" in cell["d"].log_text()


@cells(PULL)
def test_p_killed_after_its_answer_d_recomputes(cell: dict[str, Any], ref: Engine,
                                                model: str) -> None:
    """Last in the cell: P stays dead. Pull only (a killed push P:
    test_push.py and the soak)."""
    c: Cell = cell["cell"]
    p = cell["p"]

    def kill() -> None:
        p.kill()
        assert p.proc is not None
        p.proc.wait(timeout=30)

    _d_leg_after(cell, ref, model, 2790 + 10 * c.p_tp + c.d_tp, kill)
