"""Routing across XpYd and conditional disaggregation."""

from __future__ import annotations

import asyncio

from pdproxy_helpers import wait_for
from vllm_pd_proxy.backends import Backend
from vllm_pd_proxy.routing import LeastLoaded, RoundRobin, make_policy


def test_least_loaded_policy_prefers_least_outstanding_work():
    a, b, c = (Backend(f"http://127.0.0.1:{i}", "prefill", i) for i in (1, 2, 3))
    a.acquire(10_000)  # one huge prompt
    b.acquire(100)
    b.acquire(100)  # two small ones
    policy = LeastLoaded()
    assert {policy.choose([a, b, c], 10) for _ in range(5)} == {c}  # idle wins
    c.acquire(5000)
    assert policy.choose([a, b, c], 10) is b  # 200 + 2*64 < 5064 < 10064
    c.release(5000)
    # Ties rotate, so idle engines share sequential load.
    b.release(100)
    b.release(100)
    a.release(10_000)
    assert {policy.choose([a, b, c], 10).index for _ in range(3)} == {1, 2, 3}


def test_round_robin_and_registry():
    a, b = Backend("http://127.0.0.1:1", "decode", 0), Backend("http://127.0.0.1:2", "decode", 1)
    policy = make_policy("round-robin")
    assert isinstance(policy, RoundRobin)
    assert [policy.choose([a, b], 0) for _ in range(4)] == [a, b, a, b]
    assert isinstance(make_policy("mine", {"mine": LeastLoaded}), LeastLoaded)
    try:
        make_policy("nope")
    except ValueError as exc:
        assert "least-loaded" in str(exc)
    else:
        raise AssertionError("unknown policy accepted")


async def test_round_robin_alternates(engines, proxy):
    ps = [await engines("prefill"), await engines("prefill")]
    ds = [await engines("decode"), await engines("decode")]
    client = await proxy(ps, ds, routing="round-robin")
    for i in range(4):  # "seed" only marks which request each leg belongs to
        resp = await client.post("/v1/completions", json={"prompt": "a", "seed": i})
        assert resp.status == 200
    for engines_ in (ps, ds):
        assert [s.body["seed"] for s in engines_[0].legs()] == [0, 2]
        assert [s.body["seed"] for s in engines_[1].legs()] == [1, 3]


async def test_least_loaded_prefers_idle_decode(engines, proxy):
    release = asyncio.Event()

    async def maybe_hang(engine, request, body):
        if body["prompt"] == "hang":
            await asyncio.wait_for(release.wait(), 5)
        return await engine.stream(request, body)

    p = await engines("prefill")
    ds = [await engines("decode", override=maybe_hang) for _ in range(2)]
    client = await proxy([p], ds)  # least-loaded is the default
    busy_req = asyncio.ensure_future(
        client.post("/v1/completions", json={"prompt": "hang", "stream": True})
    )
    await wait_for(lambda: sum(d.in_flight for d in ds) == 1)
    busy = next(d for d in ds if d.in_flight == 1)
    idle = next(d for d in ds if d is not busy)
    for _ in range(3):
        resp = await client.post("/v1/completions", json={"prompt": "short", "stream": True})
        assert resp.status == 200
        await resp.read()
    assert len(idle.legs()) == 3 and len(busy.legs()) == 1
    release.set()
    assert (await busy_req).status == 200


async def test_unhealthy_backend_is_skipped(engines, proxy):
    p = await engines("prefill")
    sick, well = await engines("decode", health_status=503), await engines("decode")
    client = await proxy([p], [sick, well], routing="round-robin")
    await client.get("/health")  # probes now and marks `sick` unhealthy
    for _ in range(4):
        assert (await client.post("/v1/completions", json={"prompt": "a"})).status == 200
    assert sick.legs() == [] and len(well.legs()) == 4


async def test_no_healthy_decode_is_503(engines, proxy):
    p, d = await engines("prefill"), await engines("decode", health_status=500)
    client = await proxy([p], [d])
    await client.get("/health")
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 503
    assert "no healthy decode backend" in (await resp.json())["error"]["message"]
    assert p.legs() == []


async def test_conditional_disaggregation(engines, proxy):
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d], local_prefill_threshold=100)
    short = {"prompt": "x" * 100, "kv_transfer_params": {"do_remote_prefill": True}}  # ~25 tok
    resp = await client.post("/v1/completions", json=short)
    assert resp.status == 200
    assert p.legs() == []
    assert "kv_transfer_params" not in d.legs()[0].body  # D prefills locally

    resp = await client.post("/v1/completions", json={"prompt": "x" * 1000})  # ~250 tokens
    assert resp.status == 200
    assert len(p.legs()) == 1
    assert d.legs()[1].body["kv_transfer_params"] == {**p.kv_params, "pd_bidirectional": False}

    resp = await client.post("/v1/completions", json={"prompt": list(range(150))})  # 150 ids
    assert len(p.legs()) == 2
    metrics = await (await client.get("/metrics")).text()
    assert 'pd_proxy_prefill_decisions_total{decision="local",reason="short_prompt"} 1.0' in metrics
    assert 'pd_proxy_prefill_decisions_total{decision="remote",reason="long_prompt"} 2.0' in metrics


async def test_decides_on_uncached_tokens_of_the_chosen_decode(engines, proxy):
    """The threshold applies to the prompt minus what the chosen D probably
    caches: the chunks of prompts the proxy already sent to that D."""
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d], local_prefill_threshold=100)
    system = "S" * 800  # 200 tokens: 6 whole chunks of 32 tokens (128 chars)
    assert (await client.post("/v1/completions", json={"prompt": system + "q1"})).status == 200
    assert len(p.legs()) == 1  # first time: 200 uncached tokens, remote
    assert (await client.post("/v1/completions", json={"prompt": system + "q2"})).status == 200
    assert len(p.legs()) == 1  # 192 of 200 tokens cached on D: 8 uncached, local
    assert "kv_transfer_params" not in d.legs()[1].body
    long_tail = system + "n" * 800  # 192 cached + 208 new tokens: remote again
    assert (await client.post("/v1/completions", json={"prompt": long_tail})).status == 200
    assert len(p.legs()) == 2
    other = "T" * 800
    assert (await client.post("/v1/completions", json={"prompt": other})).status == 200
    assert len(p.legs()) == 3  # another prefix: nothing cached
    metrics = await (await client.get("/metrics")).text()
    assert 'pd_proxy_prefill_decisions_total{decision="local",reason="prefix_hit"} 1.0' in metrics
    assert 'pd_proxy_prefill_decisions_total{decision="remote",reason="long_prompt"} 3.0' in metrics


async def test_hostile_token_ids_do_not_break_the_decision(engines, proxy):
    """Unhashable items in a token-id prompt end the proxy's chunk chain; the
    request is still forwarded (the engine, not the proxy, refuses such ids)."""
    p, d = await engines("prefill"), await engines("decode")
    client = await proxy([p], [d], local_prefill_threshold=100)
    prompt = [*range(40), {"x": [1]}, *range(300)]
    resp = await client.post("/v1/completions", json={"prompt": prompt})
    assert resp.status == 200
    assert len(p.legs()) == 1  # 341 tokens, nothing cached: remote


async def test_a_prefix_cached_on_another_decode_does_not_count(engines, proxy):
    p = await engines("prefill")
    d0, d1 = await engines("decode"), await engines("decode")
    client = await proxy([p], [d0, d1], local_prefill_threshold=100, routing="round-robin")
    system = "S" * 800
    for q in ("q1", "q2", "q3"):
        assert (await client.post("/v1/completions", json={"prompt": system + q})).status == 200
    # q1 -> d0 (remote), q2 -> d1 (nothing cached there: remote), q3 -> d0 (cached: local)
    assert len(p.legs()) == 2
    assert [len(d0.legs()), len(d1.legs())] == [2, 1]
    assert "kv_transfer_params" not in d0.legs()[1].body


async def test_busy_prefill_pool_prefills_locally(engines, proxy):
    """The load term: with every P at --max-prefill-queue legs in flight, a
    long prompt is prefilled on D rather than queued behind them."""
    p, d = await engines("prefill", delay=1.0), await engines("decode")
    client = await proxy([p], [d], local_prefill_threshold=50, max_prefill_queue=1)
    long_body = {"prompt": "L" * 2000}  # 500 tokens, far above the threshold
    first = asyncio.ensure_future(client.post("/v1/completions", json=long_body))
    for _ in range(100):
        if p.in_flight:
            break
        await asyncio.sleep(0.01)
    assert p.in_flight == 1
    resp = await client.post("/v1/completions", json={"prompt": "M" * 2000})
    assert resp.status == 200
    assert len(p.legs()) == 1  # only the first went to P
    assert (await first).status == 200
    metrics = await (await client.get("/metrics")).text()
    assert 'pd_proxy_prefill_decisions_total{decision="local",reason="prefill_busy"} 1.0' in metrics


async def test_slow_health_probe_does_not_take_the_last_backend_out(engines, proxy):
    """A /health that times out marks the engine unhealthy but "slow": when no
    healthy engine of that role is left, requests still go to it (an overloaded
    engine is not a dead one), while a 503-answering engine stays excluded."""
    p = await engines("prefill")
    slow = await engines("decode", health_delay=1.0)
    client = await proxy([p], [slow], health_timeout=0.2)
    health = await (await client.get("/health")).json()
    assert "timed out" in health["decode"][0]["last_error"]
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 200
    assert len(slow.legs()) == 1
