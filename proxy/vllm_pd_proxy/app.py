"""The aiohttp application: routes, shared state and its lifecycle.

``create_app(config)`` builds the pools, routing policies, metrics and the
prefill gate (back-pressure; request-independent, no I/O) and registers :func:`_upstream_ctx` as a
cleanup context. On startup that context opens the one long-lived
``ClientSession`` (bounded ``TCPConnector`` pool) used for every backend call,
builds the :class:`~vllm_pd_proxy.health.HealthMonitor` and
:class:`~vllm_pd_proxy.forward.Forwarder`, and starts the background health
loop; on shutdown it stops the loop and closes the session. All state hangs
off the application under ``web.AppKey`` keys; the module holds none.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses,
GET /v1/models, GET /health, GET /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping

import aiohttp
from aiohttp import web

from . import errors
from .admission import PrefillGate
from .backends import Pool
from .config import ProxyConfig, TransferMode
from .forward import Forwarder
from .health import HealthMonitor
from .metrics import CONTENT_TYPE, Metrics
from .prompt import PrefixChunks
from .routing import PolicyFactory, make_policy

CONFIG = web.AppKey("config", ProxyConfig)
PREFILL = web.AppKey("prefill_pool", Pool)
DECODE = web.AppKey("decode_pool", Pool)
METRICS = web.AppKey("metrics", Metrics)
GATE = web.AppKey("prefill_gate", PrefillGate)
MONITOR = web.AppKey("monitor", HealthMonitor)
FORWARDER = web.AppKey("forwarder", Forwarder)
SESSION = web.AppKey("session", aiohttp.ClientSession)


def create_app(
    config: ProxyConfig, policies: Mapping[str, PolicyFactory] | None = None
) -> web.Application:
    """Build the proxy application; ``policies`` adds routing policies by name."""
    config = config.validated()
    prefill = Pool("prefill", config.prefill, make_policy(config.routing, policies))
    decode = Pool("decode", config.decode, make_policy(config.routing, policies))
    if config.local_prefill_threshold:
        for backend in decode.backends:
            backend.prefixes = PrefixChunks(config.prefix_cache_size)
    app = web.Application(client_max_size=config.max_request_bytes)
    app[CONFIG] = config
    app[PREFILL] = prefill
    app[DECODE] = decode
    app[METRICS] = Metrics([prefill, decode])
    app[GATE] = PrefillGate(
        prefill,
        config.max_inflight_per_prefill,
        config.max_queued,
        config.queue_timeout,
        app[METRICS],
    )
    app.cleanup_ctx.append(_upstream_ctx)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/responses", _responses)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def _upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    connector = aiohttp.TCPConnector(
        limit=config.max_connections,
        limit_per_host=config.max_connections_per_backend,
        keepalive_timeout=config.keepalive_timeout,
    )
    # total=None: legs are bounded by the proxy's own per-phase timeouts
    # (asyncio.timeout in upstream/relay), not by aiohttp's 5-minute default.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout)
    session = aiohttp.ClientSession(connector=connector, timeout=timeout)
    gate = app[GATE]
    pools = (app[PREFILL], app[DECODE])
    monitor = HealthMonitor(config, pools, session, app[METRICS], on_change=gate.wake)
    app[SESSION] = session
    app[MONITOR] = monitor
    app[FORWARDER] = Forwarder(
        config, app[PREFILL], app[DECODE], session, monitor, app[METRICS], gate
    )
    loop_task = asyncio.create_task(monitor.run(), name="pd-proxy-health")
    try:
        yield
    finally:
        loop_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop_task
        await monitor.close()
        await session.close()


async def _completions(request: web.Request) -> web.StreamResponse:
    return await request.app[FORWARDER].handle(request, chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await request.app[FORWARDER].handle(request, chat=True)


async def _responses(request: web.Request) -> web.StreamResponse:
    return await request.app[FORWARDER].handle(request, chat=True, responses=True)


async def _models(request: web.Request) -> web.StreamResponse:
    """GET /v1/models, answered by a decode engine (it serves the model).

    A client call: it carries the client's ``Authorization``, never the
    proxy's ``--backend-api-key`` (which would open the engines to anyone who
    can reach the proxy).
    """
    app = request.app
    backend = app[DECODE].pick(0)
    if backend is None:
        return errors.no_backend(app[DECODE].describe_unavailable()).response("-")
    timeout = app[CONFIG].health_timeout
    session = app[SESSION]
    auth = request.headers.get("Authorization")
    headers = {"Authorization": auth} if auth else None
    try:
        async with asyncio.timeout(timeout):
            async with session.get(backend.url + "/v1/models", headers=headers) as resp:
                data = await resp.read()
                ctype = resp.headers.get("Content-Type", "application/json")
                return web.Response(status=resp.status, body=data, headers={"Content-Type": ctype})
    except aiohttp.ClientError as exc:
        app[MONITOR].check_soon(backend)
        return errors.upstream_unreachable("decode", backend, exc).response("-")
    except TimeoutError:
        return errors.upstream_timeout("decode", backend, timeout, "/v1/models").response("-")


async def _health(request: web.Request) -> web.Response:
    """Probe every backend now; 200 if one prefill and one decode engine are usable."""
    app = request.app
    await app[MONITOR].refresh()
    prefill, decode = app[PREFILL], app[DECODE]
    push = app[CONFIG].transfer_mode == TransferMode.PUSH
    # In push mode a prefill engine is only usable once its identity is known.
    usable_p = sum(1 for b in prefill.backends if b.state == "healthy" and (not push or b.identity))
    usable_d = decode.healthy_count()
    ok = usable_p > 0 and usable_d > 0
    body = {
        "status": "ok" if ok else "unavailable",
        "transfer_mode": app[CONFIG].transfer_mode,
        "usable_prefill": usable_p,
        "usable_decode": usable_d,
        "prefill": [b.as_json() for b in prefill.backends],
        "decode": [b.as_json() for b in decode.backends],
    }
    return web.Response(
        status=200 if ok else 503, text=json.dumps(body), content_type="application/json"
    )


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
