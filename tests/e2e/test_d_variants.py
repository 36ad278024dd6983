"""Decode engines configured unlike the collocated one (issue 24 items 3, 5):
n-gram speculative decoding on D, and D under KV pressure preempting
requests whose prompt KV came from P.

One D serves both: speculation on, and a KV cache of 12 blocks (1,536
tokens), so four 300-token prompts that each decode 300 tokens (five
blocks each) cannot all stay resident. It sits behind the proxy with the
session's P; the collocated ``ref`` is the oracle. A preempted request is
recomputed on D when it resumes (its P lease was released after the first
load): its answer must still be the collocated engine's, and no block may
stay held.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.engine_set import engine_set
from tests.e2e.helpers import (
    EXTERNAL,
    assert_nothing_held,
    assert_outputs_are_reference,
    assert_same_as_reference,
    completion_body,
    delta,
    log_dir,
    run_clients,
    token_prompt,
)
from vllm_pd_ext.testing.engines import Engine, Proxy

pytestmark = pytest.mark.engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 2}
DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"


@pytest.fixture(scope="module")
def variant(p: Engine, model: str) -> Iterator[dict[str, Any]]:
    logs = log_dir("d_variants")
    d = Engine("d-spec-small", model, logs, role="kv_consumer", cpu_bind="1",
               failure_policy="fail", kv_bytes=12 * 4 * 64 * 1024, max_model_len=1024,
               extra_args=["--speculative-config", json.dumps(NGRAM)])
    with engine_set(d):
        proxy = Proxy([p.url], [d.url], logs).start()
        try:
            proxy.wait_ready()
            yield {"d": d, "proxy": proxy}
        finally:
            proxy.stop()
        assert_nothing_held([p], [d], model, within_s=20, what="d variants")


def test_ngram_speculation_on_d_over_loaded_kv(ref: Engine, variant: dict[str, Any],
                                              model: str) -> None:
    """Item 3: D drafts with n-gram prompt lookup over KV it loaded from P;
    greedy answers equal the collocated engine's (which does not speculate).
    A small allowed-token set makes the text repeat, so drafts happen and
    some are accepted."""
    d, proxy = variant["d"], variant["proxy"]
    alphabet = [40, 41, 42]
    before = d.metrics()
    for seed in range(3):
        prompt = [alphabet[i % 3] if i % 5 else alphabet[(i + seed) % 3] for i in range(200)]
        body = completion_body(model, prompt, max_tokens=40, ignore_eos=True,
                               allowed_token_ids=alphabet)
        _, want = ref.post("/v1/completions", body)
        status, got = proxy.post("/v1/completions", body)
        assert status == 200, got
        assert_same_as_reference(ref, got, want)
    after = d.metrics()
    assert delta(before, after, EXTERNAL) == 3 * 200  # every prompt's KV came from P
    assert delta(before, after, DRAFTS) > 0, "D never speculated"
    assert delta(before, after, ACCEPTED) > 0, "no draft token was ever accepted"
    print(f"drafts {delta(before, after, DRAFTS):.0f}, accepted tokens "
          f"{delta(before, after, ACCEPTED):.0f}")


def test_preempted_requests_resume_with_collocated_answers(ref: Engine,
                                                           variant: dict[str, Any],
                                                           model: str) -> None:
    """Item 5: four concurrent requests need 20 blocks of D's 12: D preempts
    some after their KV came from P. Each answer is still the collocated
    engine's; each prompt was loaded from P exactly once (a resumed request
    recomputes: its lease is gone); nothing stays held (module teardown)."""
    d, proxy = variant["d"], variant["proxy"]
    jobs = [(f"preempt-{i}", completion_body(model, token_prompt(300, seed=90 + i),
                                             max_tokens=300, ignore_eos=True))
            for i in range(4)]
    before = d.metrics()
    results = run_clients(proxy.url, jobs, clients=4)
    after = d.metrics()
    failures = {rid: r for rid, r in results.items() if isinstance(r, BaseException)}
    assert not failures, failures
    assert delta(before, after, PREEMPTIONS) > 0, "D never preempted: the test lost its point"
    assert delta(before, after, EXTERNAL) == 4 * 300
    assert_outputs_are_reference(ref, jobs, results, max_tokens=300)
    print(f"preemptions {delta(before, after, PREEMPTIONS):.0f}")
