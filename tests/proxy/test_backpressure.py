"""Back-pressure: per-prefill in-flight cap, FIFO queue, 503 + Retry-After.

HTTP tests run real requests through the proxy to fake engines; the gate
tests drive :class:`~vllm_pd_proxy.admission.PrefillGate` directly for races
that HTTP cannot time (a slot granted as its waiter leaves).
"""

from __future__ import annotations

import asyncio
import contextlib
import re

import pytest
from aiohttp import web
from pdproxy_helpers import chunk, completion, sse, wait_for
from vllm_pd_proxy.admission import PrefillGate
from vllm_pd_proxy.app import GATE, PREFILL
from vllm_pd_proxy.backends import Pool
from vllm_pd_proxy.cli import build_parser, config_from_args
from vllm_pd_proxy.config import ConfigError
from vllm_pd_proxy.errors import ProxyError
from vllm_pd_proxy.metrics import Metrics
from vllm_pd_proxy.routing import RoundRobin

MODES = ["pull", "push"]


class Handoff:
    """P and D overrides that behave like a KV handoff.

    P records prompts in arrival order (``order``) and holds the prompt
    ``hold`` (None: every prompt) until ``release`` is set, else answers after
    ``delay``. In push mode D answers only once P has answered the same
    ``pd_request_id``, as a real D waits for the pushed KV (a fake D that
    answered first would make the proxy cancel P's leg).
    """

    def __init__(self, hold: str | None = None, delay: float = 0.0) -> None:
        self.release = asyncio.Event()
        self.order: list[str] = []
        self._hold = hold
        self._delay = delay
        self._answered: dict[str, asyncio.Event] = {}

    def _event(self, pd_id: str) -> asyncio.Event:
        return self._answered.setdefault(pd_id, asyncio.Event())

    async def prefill(self, engine, request, body):
        self.order.append(body["prompt"])
        if self._delay:
            await asyncio.sleep(self._delay)
        elif self._hold is None or body["prompt"] == self._hold:
            await asyncio.wait_for(self.release.wait(), 5)
        pd_id = (body.get("kv_transfer_params") or {}).get("pd_request_id")
        if pd_id is not None:
            self._event(pd_id).set()
        answer = completion(request.path, body, "x")
        return web.json_response({**answer, "kv_transfer_params": engine.kv_params})

    async def answered(self, body) -> None:
        """Wait until P has answered the push request of this D leg (pull: no wait)."""
        pd_id = (body.get("kv_transfer_params") or {}).get("pd_request_id")
        if pd_id is not None:
            await asyncio.wait_for(self._event(pd_id).wait(), 5)

    async def decode(self, engine, request, body):
        await self.answered(body)
        if body.get("stream"):
            return await engine.stream(request, body)
        return web.json_response(completion(request.path, body, "".join(engine.chunks)))

    async def engines(self, engines, num_prefill: int = 1):
        ps = [await engines("prefill", override=self.prefill) for _ in range(num_prefill)]
        return ps, await engines("decode", override=self.decode)


def _post(client, prompt: str, **extra):
    return asyncio.ensure_future(client.post("/v1/completions", json={"prompt": prompt, **extra}))


def _metric(text: str, line_start: str) -> float:
    """The value of the first sample line of ``text`` starting with ``line_start``."""
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric line {line_start!r} in /metrics")


async def _metrics(client) -> str:
    return await (await client.get("/metrics")).text()


def _assert_no_slot_held(client) -> None:
    """The leak check: nobody queued and no slot held on any prefill engine."""
    gate = client.server.app[GATE]
    assert gate.depth == 0
    held = {b.url: gate.held(b) for b in client.server.app[PREFILL].backends}
    assert set(held.values()) == {0}, held


# -- the cap ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_cap_is_never_exceeded_under_concurrent_load(engines, proxy, mode):
    ps, d = await Handoff(delay=0.05).engines(engines, num_prefill=2)
    client = await proxy(ps, [d], transfer_mode=mode, max_inflight_per_prefill=2)
    resps = await asyncio.gather(
        *(client.post("/v1/completions", json={"prompt": f"r{i}"}) for i in range(12))
    )
    for resp in resps:
        assert resp.status == 200, await resp.text()
        await resp.read()
    # Reached on both engines, never passed: 12 requests against 4 slots.
    assert [p.max_in_flight for p in ps] == [2, 2]
    assert sum(len(p.legs()) for p in ps) == 12 and len(d.legs()) == 12
    metrics = await _metrics(client)
    assert _metric(metrics, "pd_proxy_queue_depth") == 0
    assert _metric(metrics, "pd_proxy_queue_wait_seconds_count") >= 8
    _assert_no_slot_held(client)


@pytest.mark.parametrize(("cap", "running", "queued"), [(0, 20, 0), (None, 16, 4)])
async def test_zero_disables_the_cap_and_the_default_is_16(engines, proxy, cap, running, queued):
    h = Handoff()
    (p,), d = await h.engines(engines)
    config = {} if cap is None else {"max_inflight_per_prefill": cap}
    client = await proxy([p], [d], **config)
    tasks = [_post(client, f"r{i}") for i in range(20)]
    gate = client.server.app[GATE]
    await wait_for(lambda: p.in_flight == running and gate.depth == queued)
    await asyncio.sleep(0.05)  # nothing else gets through meanwhile
    assert p.in_flight == running and gate.depth == queued
    assert _metric(await _metrics(client), "pd_proxy_queue_depth") == queued
    h.release.set()
    assert [(await t).status for t in tasks] == [200] * 20
    assert p.max_in_flight == running
    _assert_no_slot_held(client)


async def test_push_queued_request_sends_nothing_to_decode(engines, proxy):
    # The point of the cap in push mode: D holds blocks only for admitted requests.
    h = Handoff()
    (p,), d = await h.engines(engines)
    client = await proxy([p], [d], transfer_mode="push", max_inflight_per_prefill=1)
    gate = client.server.app[GATE]
    tasks = [_post(client, "r0")]
    await wait_for(lambda: p.in_flight == 1 and len(d.legs()) == 1)
    tasks += [_post(client, "r1"), _post(client, "r2")]
    await wait_for(lambda: gate.depth == 2)
    await asyncio.sleep(0.05)
    assert len(p.legs()) == 1 and len(d.legs()) == 1
    h.release.set()
    assert [(await t).status for t in tasks] == [200] * 3
    assert h.order == ["r0", "r1", "r2"] and len(d.legs()) == 3
    assert p.max_in_flight == 1
    _assert_no_slot_held(client)


async def test_push_slot_frees_when_prefill_answers_not_when_decode_ends(engines, proxy):
    # A P leg counts until its own response ends; D streaming on does not hold it.
    h = Handoff(delay=0.01)
    (p,), _ = await h.engines(engines)
    streaming = asyncio.Event()
    done = asyncio.Event()

    async def long_decode(engine, request, body):
        if body["prompt"] != "first":
            return await h.decode(engine, request, body)
        await h.answered(body)  # the KV is in: P has answered
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(sse(chunk(request.path, "first")))
        streaming.set()
        await asyncio.wait_for(done.wait(), 5)
        await out.write(b"data: [DONE]\n\n")
        return out

    d = await engines("decode", override=long_decode)
    client = await proxy([p], [d], transfer_mode="push", max_inflight_per_prefill=1)
    first = _post(client, "first", stream=True)
    await asyncio.wait_for(streaming.wait(), 4)
    await wait_for(lambda: p.in_flight == 0)  # P answered; D still streams
    # 4 s for a loaded host; held behind the first, it would wait for its 5 s stream.
    resp = await asyncio.wait_for(client.post("/v1/completions", json={"prompt": "second"}), 4)
    assert resp.status == 200  # admitted although the first request is still running
    done.set()
    assert (await first).status == 200
    _assert_no_slot_held(client)


async def test_local_prefill_requests_do_not_take_a_slot(engines, proxy):
    h = Handoff()
    (p,), d = await h.engines(engines)
    client = await proxy([p], [d], max_inflight_per_prefill=1, local_prefill_threshold=1000)
    long_prompt = "x" * 8000  # ~2000 tokens: remote
    first = _post(client, long_prompt)
    await wait_for(lambda: p.in_flight == 1)
    # P is full, yet a short prompt (prefilled by D) is answered at once.
    # 4 s for a loaded host; queued behind P's slot it would never be answered.
    resp = await asyncio.wait_for(client.post("/v1/completions", json={"prompt": "hi"}), 4)
    assert resp.status == 200
    assert client.server.app[GATE].depth == 0 and len(p.legs()) == 1
    h.release.set()
    assert (await first).status == 200
    _assert_no_slot_held(client)


# -- the queue ----------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_queue_admits_in_arrival_order(engines, proxy, mode):
    h = Handoff(hold="r0")
    (p,), d = await h.engines(engines)
    client = await proxy([p], [d], transfer_mode=mode, max_inflight_per_prefill=1)
    gate = client.server.app[GATE]
    tasks = [_post(client, "r0")]
    await wait_for(lambda: p.in_flight == 1)
    for i in range(1, 6):
        tasks.append(_post(client, f"r{i}"))
        await wait_for(lambda i=i: gate.depth == i)  # fixes the arrival order
    h.release.set()
    assert [(await t).status for t in tasks] == [200] * 6
    assert h.order == [f"r{i}" for i in range(6)]
    assert p.max_in_flight == 1
    _assert_no_slot_held(client)


@pytest.mark.parametrize(("mode", "stream"), [("pull", False), ("pull", True), ("push", True)])
async def test_queue_timeout_is_503_with_retry_after(engines, proxy, mode, stream):
    h = Handoff()
    (p,), d = await h.engines(engines)
    client = await proxy(
        [p], [d], transfer_mode=mode, max_inflight_per_prefill=1, queue_timeout=0.3
    )
    first = _post(client, "first")
    await wait_for(lambda: p.in_flight == 1)
    loop = asyncio.get_running_loop()
    started = loop.time()
    resp = await client.post("/v1/completions", json={"prompt": "late", "stream": stream})
    elapsed = loop.time() - started
    # A plain HTTP 503, also for a stream that had not started (no SSE event).
    assert resp.status == 503
    assert resp.content_type == "application/json"
    assert resp.headers["Retry-After"].isdigit() and int(resp.headers["Retry-After"]) >= 1
    err = (await resp.json())["error"]
    assert err["type"] == "service_unavailable" and err["code"] == 503
    m = re.fullmatch(
        r"all 1 prefill engines are at --max-inflight-per-prefill=1; "
        r"waited (\d+\.\d) s in the queue \(--queue-timeout 0\.3\)",
        err["message"],
    )
    assert m, err["message"]
    assert float(m[1]) >= 0.3 and 0.3 <= elapsed < 3
    # The rejected request reached no engine (in push mode D has the first only).
    assert h.order == ["first"] and len(d.legs()) == (1 if mode == "push" else 0)
    h.release.set()
    assert (await first).status == 200
    metrics = await _metrics(client)
    assert f'pd_proxy_requests_total{{mode="{mode}",outcome="queue_timeout"}} 1.0' in metrics
    assert _metric(metrics, "pd_proxy_queue_wait_seconds_count") == 1
    assert _metric(metrics, "pd_proxy_queue_wait_seconds_sum") >= 0.3
    assert _metric(metrics, "pd_proxy_queue_depth") == 0
    _assert_no_slot_held(client)


@pytest.mark.parametrize("max_queued", [0, 2])
async def test_full_queue_is_503_at_once(engines, proxy, max_queued):
    h = Handoff()
    (p,), d = await h.engines(engines)
    client = await proxy(
        [p], [d], max_inflight_per_prefill=1, max_queued=max_queued, queue_timeout=30
    )
    gate = client.server.app[GATE]
    tasks = [_post(client, "first")]
    await wait_for(lambda: p.in_flight == 1)
    for i in range(max_queued):
        tasks.append(_post(client, f"queued{i}"))
    await wait_for(lambda: gate.depth == max_queued)
    loop = asyncio.get_running_loop()
    started = loop.time()
    resp = await client.post("/v1/completions", json={"prompt": "one too many"})
    assert loop.time() - started < 10  # not after --queue-timeout 30 (wide for stalled hosts)
    assert resp.status == 503
    assert int(resp.headers["Retry-After"]) >= 1
    err = (await resp.json())["error"]
    assert err["type"] == "service_unavailable"
    assert err["message"] == (
        "all 1 prefill engines are at --max-inflight-per-prefill=1 and the queue is "
        f"full (--max-queued {max_queued})"
    )
    h.release.set()
    assert [(await t).status for t in tasks] == [200] * (1 + max_queued)
    assert "one too many" not in h.order
    metrics = await _metrics(client)
    assert 'pd_proxy_requests_total{mode="pull",outcome="queue_full"} 1.0' in metrics
    _assert_no_slot_held(client)


async def test_client_disconnect_while_queued_frees_its_place(engines, proxy):
    h = Handoff()
    (p,), d = await h.engines(engines)
    # One place in the queue: the next request can only queue if the leaver freed it.
    client = await proxy([p], [d], max_inflight_per_prefill=1, max_queued=1)
    gate = client.server.app[GATE]
    first = _post(client, "first")
    await wait_for(lambda: p.in_flight == 1)
    leaver = _post(client, "leaver")
    await wait_for(lambda: gate.depth == 1)
    assert _metric(await _metrics(client), "pd_proxy_queue_depth") == 1
    leaver.cancel()  # closes the client connection
    with contextlib.suppress(asyncio.CancelledError):
        await leaver
    await wait_for(lambda: gate.depth == 0)
    assert _metric(await _metrics(client), "pd_proxy_queue_depth") == 0
    stayer = _post(client, "stayer")
    await wait_for(lambda: gate.depth == 1)
    h.release.set()
    assert (await stayer).status == 200 and (await first).status == 200
    assert h.order == ["first", "stayer"]  # the leaver never reached P
    metrics = await _metrics(client)
    assert 'pd_proxy_requests_total{mode="pull",outcome="cancelled"} 1.0' in metrics
    assert _metric(metrics, "pd_proxy_queue_depth") == 0
    assert _metric(metrics, "pd_proxy_queue_wait_seconds_count") == 2
    _assert_no_slot_held(client)


async def test_queued_requests_fail_fast_when_no_prefill_is_left(engines, proxy):
    # Health changes wake the queue: waiters with no usable engine left get
    # 503 no_backend now, not a queue timeout later.
    h = Handoff()
    (p,), d = await h.engines(engines)
    client = await proxy([p], [d], max_inflight_per_prefill=1, queue_timeout=30)
    gate = client.server.app[GATE]
    first = _post(client, "first")
    await wait_for(lambda: p.in_flight == 1)
    queued = _post(client, "queued")
    await wait_for(lambda: gate.depth == 1)
    p.health_status = 503
    assert (await client.get("/health")).status == 503  # a round marks P unhealthy
    resp = await asyncio.wait_for(queued, 10)  # not the 30 s queue timeout; wide for loaded hosts
    assert resp.status == 503
    assert "no healthy prefill backend" in (await resp.json())["error"]["message"]
    h.release.set()
    assert (await first).status == 200
    assert h.order == ["first"]
    _assert_no_slot_held(client)


# -- slots released on failure --------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_prefill_errors_release_their_slot(engines, proxy, mode):
    p = await engines("prefill", fail_status=500)
    d = await engines("decode", delay=1.0 if mode == "push" else 0.0)
    client = await proxy(
        [p], [d], transfer_mode=mode, max_inflight_per_prefill=1, queue_timeout=0.5
    )
    # A leaked slot would make the second request queue and end as 503.
    for _ in range(3):
        resp = await asyncio.wait_for(client.post("/v1/completions", json={"prompt": "a"}), 3)
        assert resp.status == 500
    _assert_no_slot_held(client)
    p.fail_status = None
    d.delay = 0.0
    assert (await client.post("/v1/completions", json={"prompt": "a"})).status == 200
    _assert_no_slot_held(client)


async def test_prefill_timeout_releases_its_slot(engines, proxy):
    p, d = await engines("prefill", delay=5), await engines("decode")
    client = await proxy([p], [d], max_inflight_per_prefill=1, prefill_timeout=0.2)
    for _ in range(2):
        resp = await asyncio.wait_for(client.post("/v1/completions", json={"prompt": "a"}), 3)
        assert resp.status == 504
    _assert_no_slot_held(client)


async def test_retry_on_another_prefill_waits_for_a_slot(engines, proxy):
    h = Handoff()
    bad = await engines("prefill", fail_status=503)
    good = await engines("prefill", override=h.prefill)
    d = await engines("decode", override=h.decode)
    client = await proxy([bad, good], [d], max_inflight_per_prefill=1)
    gate = client.server.app[GATE]
    bad_b, good_b = client.server.app[PREFILL].backends
    first = _post(client, "first")  # ends on good (directly or after bad's 503)
    await wait_for(lambda: good.in_flight == 1)
    second = _post(client, "second")  # bad has room: 503 there, then a retry
    await wait_for(lambda: gate.depth == 1)
    # The retry waits for good's slot instead of exceeding the cap, and the
    # failed attempt gave bad's slot back.
    assert good.in_flight == 1 and gate.held(good_b) == 1 and gate.held(bad_b) == 0
    assert any(leg.body["prompt"] == "second" for leg in bad.legs())
    h.release.set()
    assert (await first).status == 200 and (await second).status == 200
    assert good.max_in_flight == 1 and h.order == ["first", "second"]
    metrics = await _metrics(client)
    assert _metric(metrics, 'pd_proxy_retries_total{role="prefill"}') >= 1
    _assert_no_slot_held(client)


# -- the gate on its own --------------------------------------------------------


def _gate(num_backends: int, cap: int = 1, timeout: float = 5.0) -> tuple[Pool, PrefillGate]:
    pool = Pool("prefill", [f"http://127.0.0.1:{i + 1}" for i in range(num_backends)], RoundRobin())
    return pool, PrefillGate(pool, cap, 16, timeout, Metrics([pool]))


async def test_gate_passes_on_a_slot_granted_to_a_waiter_that_left():
    pool, gate = _gate(1)
    (backend,) = pool.backends
    first = await gate.acquire(0)
    assert first is not None
    leaver = asyncio.ensure_future(gate.acquire(0))
    stayer = asyncio.ensure_future(gate.acquire(0))
    await wait_for(lambda: gate.depth == 2)
    first.release()  # the leaver is granted the slot ...
    leaver.cancel()  # ... and leaves before it could run
    slot = await asyncio.wait_for(stayer, 4)  # under the gate's 5 s timeout; wide for stalls
    assert slot is not None and slot.backend is backend
    with pytest.raises(asyncio.CancelledError):
        await leaver
    assert gate.held(backend) == 1 and gate.depth == 0
    slot.release()
    slot.release()  # idempotent
    assert gate.held(backend) == 0


async def test_gate_waiter_excluding_the_free_engine_does_not_block_the_next():
    pool, gate = _gate(2)
    a, b = pool.backends
    on_a, on_b = await gate.acquire(0, exclude=[b]), await gate.acquire(0, exclude=[a])
    assert on_a is not None and on_a.backend is a and on_b is not None and on_b.backend is b
    retry = asyncio.ensure_future(gate.acquire(0, exclude=[a]))  # failed on a before
    fresh = asyncio.ensure_future(gate.acquire(0))
    await wait_for(lambda: gate.depth == 2)
    on_a.release()
    got = await asyncio.wait_for(fresh, 4)  # under the gate's 5 s timeout; wide for stalls
    assert got is not None and got.backend is a
    assert not retry.done()
    on_b.release()
    got_retry = await asyncio.wait_for(retry, 4)
    assert got_retry is not None and got_retry.backend is b
    got.release()
    got_retry.release()
    assert gate.held(a) == gate.held(b) == 0 and gate.depth == 0


async def test_gate_waits_within_the_remaining_queue_budget():
    # A retry's wait counts with the request's earlier waits (--queue-timeout).
    _, gate = _gate(1, timeout=10.0)
    held = await gate.acquire(0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ProxyError) as exc:
        await gate.acquire(0, queued_s=9.8)
    # 0.2 s left of the 10 s budget (a wait of the whole budget: 10 s); wide for stalls
    assert 0.15 <= loop.time() - started < 5
    assert exc.value.status == 503 and exc.value.outcome == "queue_timeout"
    m = re.search(r"waited (\d+\.\d) s in the queue \(--queue-timeout 10\)", exc.value.message)
    assert m and float(m[1]) >= 9.9  # earlier waits included
    assert gate.depth == 0
    assert held is not None
    held.release()


# -- flags ----------------------------------------------------------------------


def test_backpressure_flags_and_defaults():
    base = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    config = config_from_args(build_parser().parse_args(base))
    assert (config.max_inflight_per_prefill, config.queue_timeout, config.max_queued) == (
        16,
        30.0,
        1024,
    )
    flags = ["--max-inflight-per-prefill", "4", "--queue-timeout", "2.5", "--max-queued", "0"]
    config = config_from_args(build_parser().parse_args(base + flags))
    assert (config.max_inflight_per_prefill, config.queue_timeout, config.max_queued) == (
        4,
        2.5,
        0,
    )
    for bad in (
        ["--max-inflight-per-prefill", "-1"],
        ["--queue-timeout", "0"],
        ["--max-queued", "-1"],
    ):
        with pytest.raises(ConfigError, match=bad[0]):
            config_from_args(build_parser().parse_args(base + bad))
