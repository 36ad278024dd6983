"""Multi-turn conversations in push mode on real engines (the pull mode's
module is test_multiturn.py, whose helpers and checks these tests share).

P and D run ``bidirectional_kv_xfer`` with ``transfer_mode`` push behind
``vllm-pd-proxy --multi-turn --transfer-mode push``; D keeps each turn for
``decoder_kv_blocks_ttl`` (``PUSH_TTL``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.engine_set import engine_set
from tests.e2e.helpers import (
    EXTERNAL,
    assert_same_as_reference,
    completion_body,
    delta,
    log_dir,
    poke,
    token_prompt,
)
from tests.e2e.test_multiturn import (
    KEPT,
    READBACK,
    USAGE,
    _direct_kept_turn,
    _fallbacks,
    _four_turns,
    _proxy_count,
)
from vllm_pd_ext.testing.engines import Engine, Proxy

pytestmark = pytest.mark.engine

PUSH_TTL = 20.0


@pytest.fixture(scope="module")
def push_engines(model: str) -> Iterator[dict[str, Any]]:
    logs = log_dir("multiturn-push")
    push = {"bidirectional_kv_xfer": True, "transfer_mode": "push",
            "decoder_kv_blocks_ttl": PUSH_TTL}
    engs = {
        "p": Engine("mtx-p", model, logs, role="kv_both", cpu_bind="0", extra_config=push),
        "d0": Engine("mtx-d", model, logs, role="kv_both", cpu_bind="1",
                     extra_config=push, failure_policy="fail"),
    }
    with engine_set(*engs.values()):
        px = Proxy([engs["p"].url], [engs["d0"].url], logs,
                   # No health rounds during the tests: in push mode each one
                   # probes P's identity with a small prefill, which P's
                   # computed-token counter would count.
                   args=["--multi-turn", "--transfer-mode", "push",
                         "--health-interval", "600"]).start()
        try:
            yield {**engs, "proxy": px.wait_ready()}
        finally:
            px.stop()


def test_four_turns_push(ref: Engine, model: str, push_engines: dict[str, Any]) -> None:
    _four_turns(ref, model, push_engines, seed=302)


def test_lease_expiry_between_turns(ref: Engine, model: str,
                                    push_engines: dict[str, Any]) -> None:
    """D's kept turn expires before the next turn: the proxy no longer hands
    it out, a P leg that still names it falls back (expired), D freed it."""
    p, d, proxy = push_engines["p"], push_engines["d0"], push_engines["proxy"]
    kept0 = d.metrics().get(KEPT, 0.0)
    session = {"X-Session-Id": "expiry"}
    prompt = token_prompt(200, 330)
    status, first = proxy.post("/v1/completions", completion_body(
        model, prompt, max_tokens=130, ignore_eos=True), headers=session)
    assert status == 200, first
    # The same conversation run by hand, to hold D's answer (the proxy keeps
    # it inside).
    kept_params = _direct_kept_turn(p, d, model, [*prompt, 5])
    assert kept_params["remote_block_hashes"], kept_params
    # Both turns are kept (earlier tests' kept turns may expire meanwhile, so
    # D's usage is no baseline here).
    deadline = time.monotonic() + 10
    while d.metrics().get(KEPT, 0.0) < kept0 + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert d.metrics().get(KEPT, 0.0) == kept0 + 2
    assert d.metrics()[USAGE] > 0
    expired0 = d.metrics().get("vllm:pd_ext_turns_expired_total", 0.0)
    time.sleep(PUSH_TTL + 1)
    poke(d, model)  # an idle D sweeps on the next request
    assert d.metrics().get("vllm:pd_ext_turns_expired_total", 0.0) >= expired0 + 2
    # Every kept turn on this D (TTL PUSH_TTL) has expired: nothing is pinned.
    assert d.metrics()[USAGE] == 0.0, "D did not free its expired kept turns"
    history = prompt + first["choices"][0]["token_ids"] + token_prompt(20, 331)
    body = completion_body(model, history, max_tokens=8)
    _, want = ref.post("/v1/completions", body)
    expired = _proxy_count(proxy, "expired")
    before, d_before = p.metrics(), d.metrics()
    status, got = proxy.post("/v1/completions", body, headers=session)
    assert status == 200, got
    assert_same_as_reference(ref, got, want)
    assert delta(d_before, d.metrics(), EXTERNAL) > 0  # KV still moved P -> D
    assert _proxy_count(proxy, "expired") == expired + 1
    assert delta(before, p.metrics(), READBACK) == 0
    # A P leg that still names the expired turn (a proxy without expiry
    # tracking) is refused by P itself before any read.
    fell = _fallbacks(p, "expired")
    stale = dict(kept_params, do_remote_decode=True, do_remote_prefill=False,
                 transfer_mode="push", pd_request_id="stale-1")
    direct = completion_body(model, history, max_tokens=1, kv_transfer_params=stale)
    status, answer = p.post("/v1/completions", direct)
    assert status == 200, answer
    assert _fallbacks(p, "expired") == fell + 1
