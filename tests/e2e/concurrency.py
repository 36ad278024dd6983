"""The concurrent-load check of issue 10, shared by the pull test
(tests/e2e/test_concurrency.py, on the session's P/D pair) and the push test
(tests/e2e/test_push.py, on that module's push pair), so that no engine pair
is started for it alone.

8 clients send 40 requests at once through ``vllm-pd-proxy``: prompts of
40-700 tokens (1-6 blocks), every third one streamed, each a distinct random
prompt from a seed range no other test uses (so no prefix-cache hit can turn
a handoff into a local one). Then:

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

from tests.e2e.helpers import (
    BLOCK_SIZE,
    EXTERNAL,
    KV_BYTES,
    TINY_BLOCK_BYTES,
    TINY_LAYERS,
    assert_nothing_held,
    assert_outputs_are_reference,
    blocks_for,
    completion_body,
    delta,
    run_clients,
    token_prompt,
)
from vllm_pd_ext.testing.engines import Engine, Proxy

CLIENTS = 8
REQUESTS = 40
MAX_TOKENS = 8
BLOCK = TINY_LAYERS * TINY_BLOCK_BYTES
SEEDS = {"pull": 93_000, "push": 94_000}


def check_concurrent_load(mode: str, p: Engine, d: Engine, proxy: Proxy, ref: Engine,
                          model: str) -> None:
    """The load and every check of the module docstring, on one P/D pair."""
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

    assert_outputs_are_reference(ref, jobs, results, MAX_TOKENS)
    # The pair may be shared with other tests: allow one default lease (30 s)
    # for a lease another test left behind to run out.
    assert_nothing_held([p], [d], model, 35, mode)
