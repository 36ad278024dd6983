"""Backend health probing and prefill identity discovery.

Lifecycle: the app's cleanup context creates one :class:`HealthMonitor` with
the shared ClientSession and starts :meth:`HealthMonitor.run`, a background
task that every ``--health-interval`` seconds sends ``GET /health`` to every
backend and, in push mode, re-probes the identity of each healthy prefill
engine that nothing confirmed for ``IDENTITY_STALE_ROUNDS`` rounds (an
engine restart changes its ``remote_engine_id``; every such P answer names
the engine that served it, so a prefill engine with traffic is never
probed, and an idle one once per that many rounds). A pull proxy with
``--concurrent-dispatch`` (``ProxyConfig.probes_identity``) probes no
identity in its rounds: a pull D leg can always go sequentially, so the
identity is probed only when a concurrent pull first needs it, refreshed
by every answer, and dropped when the engine comes back from away. The request path calls
:meth:`check_soon` after a failed leg (so a dead engine leaves rotation within
milliseconds instead of at the next round), :meth:`ensure_identity` when a
prefill engine has not been probed yet, and
:meth:`check_answer_identity` with every P answer whose D leg was sent the
identity (a push or concurrent pull dispatch; the answer names the engine
that served it), so a restart at the same URL is noticed by the first request
it affects, not at the next round. Every state change calls ``on_change``
(the prefill gate's ``wake``: an engine back in rotation has free slots). The
cleanup context cancels everything on shutdown.

Engines started with ``--api-key`` need ``Authorization`` on ``/v1/*``: the
monitor's own calls (health, ``/v1/models``, identity probe) send
``--backend-api-key`` as a bearer token. It is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import aiohttp

from vllm_pd_ext.wire.auth import sign_leg
from vllm_pd_ext.wire.protocol import ParamsError, decode_params

from . import errors
from .backends import Backend, Pool, PrefillIdentity
from .config import ProxyConfig, TransferMode
from .metrics import Metrics

logger = logging.getLogger("vllm_pd_proxy.health")

IDENTITY_KEYS = ("remote_engine_id", "remote_host", "remote_port")
#: Health rounds after which an identity no probe or P answer confirmed is
#: probed again. The identity probe is a one-token completion: a forward step
#: on P, which a prefill arriving meanwhile waits out (on the bench model
#: here 38 ms, 22% of a 300-token TTFT; one prefill in 20 started within 10
#: ms of one when each round probed). A restart at the same URL is still seen
#: by the health round (the engine is away while it restarts), by the first
#: P answer that names another engine, and by this probe when idle.
IDENTITY_STALE_ROUNDS = 6
DRAINING_NOTE = "the engine is draining: it finishes what it has, takes nothing new, then exits"


class ProbeError(Exception):
    """The identity probe of a prefill engine failed; the message says why."""


class HealthMonitor:
    """Owns health state transitions and identity probes of all backends."""

    def __init__(
        self,
        config: ProxyConfig,
        pools: Iterable[Pool],
        session: aiohttp.ClientSession,
        metrics: Metrics,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._config = config
        # Called after a backend's state (or slow flag) changed: the prefill
        # gate may now hand out slots, or fail waiters with no engine left.
        self._on_change = on_change
        self._pools = list(pools)
        self._session = session
        self._metrics = metrics
        # Push, or pull with concurrent dispatch: a sequential pull never
        # probes (the probe is a forward step on P that nothing needs then).
        self._identities = config.probes_identity
        self._mode = TransferMode(config.transfer_mode)
        # Only push re-probes in its rounds. A pull round's probe would put a
        # forward step on P (and a prompt token in its counters) while no
        # request needs the identity; a pull P with traffic confirms it by
        # its answers, and one that restarted is caught by its first answer.
        self._round_probes = self._mode is TransferMode.PUSH
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pending_checks: set[Backend] = set()
        self._probing: dict[Backend, asyncio.Task[PrefillIdentity]] = {}
        self._refresh: asyncio.Task[None] | None = None
        key = config.backend_api_key
        self._auth: dict[str, str] = {"Authorization": f"Bearer {key}"} if key else {}

    @property
    def backends(self) -> list[Backend]:
        return [b for pool in self._pools for b in pool.backends]

    # -- background loop ---------------------------------------------------

    async def run(self) -> None:
        """Probe forever; the first round starts immediately."""
        while True:
            try:
                await self.round(with_identity=self._round_probes, only_stale=True)
            except Exception:  # keep the loop alive whatever one round hits
                logger.exception("health round failed")
            await asyncio.sleep(self._config.health_interval)

    async def round(self, with_identity: bool, only_stale: bool = False) -> None:
        """Check every backend once (and re-probe prefill identities: with
        ``only_stale``, only those unconfirmed for ``IDENTITY_STALE_ROUNDS``)."""
        await asyncio.gather(
            *(self._check_and_probe(b, with_identity, only_stale) for b in self.backends))

    async def refresh(self) -> None:
        """A health round for GET /health; concurrent callers share one round."""
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self.round(with_identity=False))
        await asyncio.shield(self._refresh)

    async def _check_and_probe(self, backend: Backend, with_identity: bool,
                               only_stale: bool = False) -> None:
        await self.check(backend)
        if with_identity and backend.role == "prefill" and backend.state == "healthy":
            if only_stale and not self._identity_stale(backend):
                return
            with contextlib.suppress(ProbeError):
                await self._probe_coalesced(backend)

    def _identity_stale(self, backend: Backend) -> bool:
        """No identity, or none confirmed for ``IDENTITY_STALE_ROUNDS`` rounds."""
        if backend.identity is None or backend.identity_at is None:
            return True
        age = time.monotonic() - backend.identity_at
        # Half a round of slack: a round that starts a little early (the
        # previous one's own time) must not skip a due probe by one round.
        return age >= (IDENTITY_STALE_ROUNDS - 0.5) * self._config.health_interval

    async def check(self, backend: Backend) -> None:
        """GET {backend}/health and record the result."""
        before, was_slow = backend.state, backend.slow
        try:
            async with asyncio.timeout(self._config.health_timeout):
                async with self._session.get(backend.url + "/health", headers=self._auth) as resp:
                    await resp.read()
                    status = resp.status
                    draining = errors.says_draining(status, resp.headers)
        except TimeoutError:
            backend.mark(
                "unhealthy",
                f"health probe timed out after {self._config.health_timeout:g} s",
                slow=True,
            )
        except aiohttp.ClientError as exc:
            backend.mark("unhealthy", f"health probe failed: {type(exc).__name__}: {exc}")
        else:
            if draining:
                backend.mark("draining", DRAINING_NOTE)
            elif status == 200:
                backend.mark("healthy")
            else:
                backend.mark("unhealthy", f"GET /health answered HTTP {status}")
        if (
            self._identities
            and backend.role == "prefill"
            and before in ("unhealthy", "draining")
            and backend.state == "healthy"
        ):
            # Back after being away: it may be a restarted engine with a new
            # id, and a D leg sent the old one is refused by P. Learn it
            # before the next dispatch that needs it (ensure_identity probes).
            backend.identity = None
        if backend.state != before:
            log = logger.info if backend.state in ("healthy", "draining") else logger.warning
            log(
                "%s backend %s: %s -> %s %s",
                backend.role,
                backend.url,
                before,
                backend.state,
                backend.last_error or "",
            )
        if self._on_change is not None and (backend.state, backend.slow) != (before, was_slow):
            self._on_change()

    def mark_draining(self, backend: Backend) -> None:
        """A leg was refused because ``backend`` drains: out of rotation now,
        not at the next round (the round brings it back once it restarted)."""
        if backend.state == "draining":
            return
        before = backend.state
        backend.mark("draining", DRAINING_NOTE)
        logger.info("%s backend %s: %s -> draining", backend.role, backend.url, before)
        if self._on_change is not None:
            self._on_change()

    def check_soon(self, backend: Backend, reprobe: bool = False) -> None:
        """Schedule an out-of-band check (after a failed leg); deduplicated."""
        if backend in self._pending_checks:
            return
        self._pending_checks.add(backend)

        async def _run() -> None:
            try:
                await self._check_and_probe(backend, reprobe and self._identities)
            finally:
                self._pending_checks.discard(backend)

        self.spawn(_run())

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in the background, cancelled by :meth:`close`."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        tasks = [*self._tasks, *self._probing.values()]
        if self._refresh is not None:
            tasks.append(self._refresh)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- prefill identity (push; pull with concurrent dispatch) -------------

    async def ensure_identity(self, backend: Backend) -> PrefillIdentity:
        """The cached identity, or a fresh probe (raises ProbeError)."""
        if backend.identity is not None:
            return backend.identity
        failed_at = backend.identity_error_at
        if failed_at is not None and time.monotonic() - failed_at < self._config.health_interval:
            # Probed and refused moments ago: do not re-probe on every request;
            # the background round retries it.
            raise ProbeError(backend.identity_error or "identity probe failed")
        return await self._probe_coalesced(backend)

    async def _probe_coalesced(self, backend: Backend) -> PrefillIdentity:
        task = self._probing.get(backend)
        if task is None or task.done():
            task = asyncio.ensure_future(self._probe(backend))
            # Mark the error retrieved even if every waiter was cancelled.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._probing[backend] = task
        return await asyncio.shield(task)

    def check_answer_identity(
        self, backend: Backend, dispatched: PrefillIdentity, params: Any
    ) -> str | None:
        """Compare a P answer's identity with the one its D leg was sent (a
        push or a concurrent pull dispatch).

        ``params`` is the answer's ``kv_transfer_params``. On a mismatch (P
        restarted at the same URL: new engine id, maybe a new side channel)
        the cached identity is replaced by the answered one at once, or
        dropped (so the next request probes) if the answer is not a usable
        identity for the proxy's transfer mode; returns a description of
        the mismatch. None when they agree or the answer names no engine (P
        handed over no KV: nothing to compare).
        """
        if not isinstance(params, dict) or params.get("remote_engine_id") is None:
            return None
        answered = _endpoint_of(params)
        sent = (dispatched.engine_id, dispatched.host, str(dispatched.port))
        if answered == sent:
            if backend.identity == dispatched:  # not replaced meanwhile
                backend.identity_at = time.monotonic()
            return None
        what = (
            f"the decode leg was sent engine {sent[0]} at {sent[1]}:{sent[2]} but the prefill "
            f"answer came from engine {answered[0]} at {answered[1]}:{answered[2]} (restarted?)"
        )
        try:
            identity = identity_from_params(params, self._mode)
        except ProbeError as exc:
            backend.identity = None  # the next request probes afresh
            logger.warning(
                "prefill %s identity changed: %s; answer unusable (%s), identity dropped",
                backend.url,
                what,
                exc,
            )
        else:
            logger.info(
                "prefill %s identity changed: %s; identity refreshed from the answer",
                backend.url,
                what,
            )
            backend.identity = identity
            backend.identity_at = time.monotonic()
            backend.identity_error = backend.identity_error_at = None
        return what

    async def _probe(self, backend: Backend) -> PrefillIdentity:
        try:
            identity = await self._probe_once(backend)
        except ProbeError as exc:
            # Keep the previous identity: a probe can fail under load while
            # the engine is fine; a stale one is caught by the P-leg failure.
            backend.identity_error = str(exc)
            backend.identity_error_at = time.monotonic()
            self._metrics.probes.labels("failure").inc()
            logger.warning("identity probe of %s failed: %s", backend.url, exc)
            raise
        old = backend.identity
        if old is not None and old.engine_id != identity.engine_id:
            logger.info(
                "prefill %s engine id changed %s -> %s (restart?)",
                backend.url,
                old.engine_id,
                identity.engine_id,
            )
        backend.identity = identity
        backend.identity_at = time.monotonic()
        backend.identity_error = backend.identity_error_at = None
        self._metrics.probes.labels("success").inc()
        return identity

    async def _get_json(self, method: str, url: str, body: Any = None,
                        request_id: str | None = None) -> Any:
        rid = request_id or "pd-probe-" + uuid.uuid4().hex
        headers = {**self._auth, "X-Request-Id": rid}
        try:
            async with asyncio.timeout(self._config.health_timeout):
                async with self._session.request(method, url, json=body, headers=headers) as r:
                    data = await r.read()
                    status = r.status
        except TimeoutError:
            raise ProbeError(f"{method} {url} timed out") from None
        except aiohttp.ClientError as exc:
            raise ProbeError(f"{method} {url} failed: {type(exc).__name__}: {exc}") from None
        if status != 200:
            text = data[:200].decode("utf-8", "replace")
            raise ProbeError(f"{method} {url} answered HTTP {status}: {text}")
        try:
            return json.loads(data)
        except ValueError:
            raise ProbeError(f"{method} {url} answered invalid JSON") from None

    async def _probe_once(self, backend: Backend) -> PrefillIdentity:
        models = await self._get_json("GET", backend.url + "/v1/models")
        try:
            model = models["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise ProbeError(f"GET {backend.url}/v1/models lists no model") from None
        probe = {
            "model": model,
            "prompt": [1],
            "max_tokens": 1,
            "stream": False,
        }
        rid = "pd-probe-" + uuid.uuid4().hex
        params: dict[str, Any] = {"do_remote_decode": True, "pd_ext_probe": True}
        if self._config.auth is not None:
            # An engine with a secret answers only a signed probe.
            params = sign_leg(self._config.auth, params, rid, probe)
        probe["kv_transfer_params"] = params
        answer = await self._get_json("POST", backend.url + "/v1/completions", probe, rid)
        answered = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(answered, dict):
            raise ProbeError("probe answer has no kv_transfer_params")
        return identity_from_params(answered, self._mode)


def identity_from_params(params: dict[str, Any],
                         mode: TransferMode = TransferMode.PUSH) -> PrefillIdentity:
    """A prefill identity for the proxy's transfer ``mode`` from P's
    ``kv_transfer_params``; ProbeError if not.

    The same fields come back from the identity probe and from every P leg
    (vllm_pd_ext's connector builds both from one dict). They are decoded
    as D will decode the D leg that carries them
    (:func:`~vllm_pd_ext.wire.protocol.decode_params`): an identity D would
    refuse fails here, once, naming the field, not in every D leg.

    ``mode`` push: the answer must say ``push``. Pull: ``pull`` or nothing
    (vLLM's own params omit it; :func:`concurrent_pull` tells the two apart),
    never ``push``: such an engine refuses pull legs.
    """
    missing = [k for k in IDENTITY_KEYS if params.get(k) is None]
    if missing:
        raise ProbeError(f"probe kv_transfer_params lack {missing}")
    answered = params.get("transfer_mode")
    if mode == TransferMode.PUSH and answered != TransferMode.PUSH:
        # vLLM's in-tree NixlConnector answers the probe like a normal
        # request (no transfer_mode) and a pull-configured vllm_pd_ext
        # engine says "pull": neither accepts push legs, so refuse the
        # engine here instead of failing every D leg later.
        raise ProbeError(
            f"probe answered transfer_mode={answered!r}, not 'push': the engine must run "
            "the vllm_pd_ext connector with transfer_mode push for --transfer-mode push"
        )
    if mode == TransferMode.PULL and answered not in (None, TransferMode.PULL):
        raise ProbeError(
            f"probe answered transfer_mode={answered!r}, not 'pull': the engine must run "
            "its connector in pull mode for --transfer-mode pull"
        )
    d_leg = {k: params[k] for k in IDENTITY_KEYS}
    # Checked by push's D-leg rules in either mode: the identity's fields
    # are checked alike in both, and push's need no block ids (a concurrent
    # pull D leg names none; D learns them from P).
    d_leg.update(do_remote_prefill=True, transfer_mode=TransferMode.PUSH.value,
                 pd_request_id="probe", tp_size=params.get("tp_size") or 1)
    try:
        typed = decode_params(d_leg)
    except ParamsError as exc:
        raise ProbeError(f"probe kv_transfer_params malformed: {exc}") from None
    assert typed is not None and typed.remote_engine_id and typed.remote_host
    assert typed.remote_port is not None  # decode_params requires all three
    return PrefillIdentity(
        engine_id=typed.remote_engine_id,
        host=typed.remote_host,
        port=typed.remote_port,
        tp_size=typed.tp_size,
        transfer_mode=answered,
        probed_at=time.monotonic(),
    )


def concurrent_pull(identity: PrefillIdentity) -> bool:
    """Whether a pull P takes a concurrent pull (D's leg before P's blocks
    exist): only vllm_pd_ext's connector, whose answers say ``pull``;
    vLLM's in-tree NixlConnector, which says nothing, gets the sequential
    pull it knows."""
    return identity.transfer_mode == TransferMode.PULL


def _endpoint_of(params: dict[str, Any]) -> tuple[str, str, str]:
    """(engine id, host, port) as strings, for comparing identities loosely typed."""
    return (
        str(params.get("remote_engine_id")),
        str(params.get("remote_host")),
        str(params.get("remote_port")),
    )
