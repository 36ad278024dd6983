"""P's worker half in push mode: post the WRITEs P's scheduler orders.

Runs in each of P's worker processes on one daemon thread ("pd-push"),
started by ``register_kv_caches`` and stopped by ``close``. It pulls
``WriteOrder``s from a ZMQ PULL socket bound to 127.0.0.1 (the address goes
to the scheduler in the handshake metadata), so a WRITE starts the moment
both the prefill and D's registration are in, whether or not P steps. The
thread survives any exception: a bug fails at most the order it hit.

Per order: load D's agent (see below), build coalesced descriptors (one per
contiguous run, as in pull), post one WRITE carrying the notification
``pdx:<token>/<pd_request_id>`` (NIXL delivers it after the data), poll it with the
other in-flight WRITEs, release the handle. When P and D shard differently
(``WriteOrder.targets``, ``tp_slices``), one WRITE per D rank this rank
writes head slices to, each notifying ``pdx:<token>.<rank>.<writers>/<id>``,
and the order settles once every one of them did. Then:

- success: release this rank's lease share on P (P frees its blocks);
- failure: release the lease share with ``ok=False`` and the reason, only
  *after* the handle is released. P's scheduler tells D (``PushResult``)
  once every rank has settled, so D never reuses a block a WRITE may still
  touch.

A handle that cannot be released keeps both P's blocks (lease held) and D's
(no result sent) until it can.

D's agents are cached by agent name in ``peers.AgentCache`` (the same cache
D's pull reader uses for P's): checked and loaded by the first order naming
one, then only for orders carrying the very ``AgentInfo`` it was loaded with
(a restarted D has a new name; another agent claiming the name fails its
order and never replaces the cached one). A WRITE to it that fails to post
or ends in ``ERR`` retires it: it is removed once no WRITE to it is in
flight, and the next order reloads it. One unused for ``peer_idle_ttl_s`` is
removed (D went away), never while a WRITE to it is in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from vllm_pd_ext.log import get_logger
from vllm_pd_ext.transport import Transport, TransportError, XferState
from vllm_pd_ext.transport.coalesce import Descriptor, build_descriptors
from vllm_pd_ext.transport.tp_slices import Slice, slice_descriptors
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.auth import FrameAuth
from vllm_pd_ext.wire.outbox import Outbox
from vllm_pd_ext.wire.zmq_context import GcSafeContext
from vllm_pd_ext.worker.peers import PEER_IDLE_TTL_S, AgentCache, AgentMismatch, CachedAgent

logger = get_logger(__name__)

#: How often the push thread looks for idle agents, at most.
REAP_EVERY_S = 1.0
#: The push thread's pause between progress rounds while a young WRITE is
#: in flight. On one host UCX copies and sends the notification only when
#: the initiator progresses: at one round per millisecond (the socket
#: poll's floor) P's 786 KB WRITE ended 1.6 ms p50 after the post and D had
#: its notification after 2.3 ms; at this pace 1.0 to 1.1 and 1.9 ms
#: (docs/slo.md, "The gap, third step").
INFLIGHT_PACE_S = 1e-4
#: A WRITE in flight longer than this is large or stuck (a dead D, until
#: ``transfer_timeout``): it is progressed once per millisecond, as before,
#: so that one dead peer does not keep P's core busy.
FAST_PROGRESS_S = 0.1


@dataclass
class _Part:
    """One WRITE of an order: to one D rank's agent."""

    peer: CachedAgent
    handle: Any
    state: XferState = XferState.PROC
    released: bool = False


@dataclass
class _Write:
    order: proto.WriteOrder
    parts: list[_Part]
    posted: float
    deadline: float
    nbytes: int
    ndescs: int
    stuck_logged: bool = False
    #: A post that failed after an earlier part was posted: the order fails
    #: once the posted parts settled.
    error: str = ""

    @property
    def state(self) -> XferState:
        states = {p.state for p in self.parts}
        return (XferState.PROC if XferState.PROC in states
                else XferState.ERR if XferState.ERR in states or self.error
                else XferState.DONE)


class Pusher:
    """One push P worker's WRITE poster and its D-agent cache (module
    docstring). Only the ``pd-push`` thread touches the cache and the
    in-flight WRITEs; ``num_peers`` and ``num_in_flight`` are snapshots."""

    def __init__(self, engine_id: str, tp_rank: int, transport: Transport,
                 regions: list[proto.Region], own_side_channel: tuple[str, int],
                 transfer_timeout_s: float, notify_timeout_s: float,
                 on_write: Callable[[int, int, int, float], None] | None = None,
                 peer_idle_ttl_s: float = PEER_IDLE_TTL_S,
                 auth: FrameAuth | None = None, kernel_blocks: int = 1,
                 fast_progress_s: float = FAST_PROGRESS_S) -> None:
        self.engine_id = engine_id
        self.fast_progress_s = fast_progress_s
        self.tp_rank = tp_rank
        self.transport = transport
        self.regions = regions
        self.own = own_side_channel
        self.transfer_timeout_s = transfer_timeout_s
        self.peer_idle_ttl_s = peer_idle_ttl_s
        self._on_write = on_write
        self._outbox = Outbox(notify_timeout_s, name="pd-push-result", auth=auth)
        self._agents = AgentCache(transport, regions, "D", idle_ttl_s=peer_idle_ttl_s,
                                  kernel_blocks=kernel_blocks)
        self._inflight: list[_Write] = []
        self._next_reap = 0.0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = GcSafeContext()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-push", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Every NIXL call of this role (add_peer included) is on this thread.
        self.transport.enter_thread()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                self._step(poller)
            except Exception:  # the thread must outlive any bug
                logger.exception("PDConnector: push thread error; going on")
                time.sleep(0.1)  # no hot loop on a persistent error

    def _step(self, poller: zmq.Poller) -> None:
        # While WRITEs are in flight this thread is their progress engine.
        # For a young one, look at the socket without blocking (its
        # timeout's floor is 1 ms) and pause INFLIGHT_PACE_S after the
        # progress round instead; older ones get a round per millisecond.
        young = self._young(time.monotonic())
        if poller.poll(0 if young else 1 if self._inflight else 200):
            try:
                order = proto.decode_order(self._sock.recv(zmq.NOBLOCK))
            except zmq.ZMQError:
                order = None
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.error("PDConnector: malformed write order dropped: %s", exc)
                order = None
            if order is not None:
                try:
                    self._start(order)
                except Exception:  # this order only; keep writing the others
                    # Only the post itself gets here: it may have started,
                    # so the blocks stay pinned (a leak, never corruption).
                    logger.exception("PDConnector: WRITE for %s failed while posting; "
                                     "its blocks stay pinned", order.pd_request_id)
        if self._inflight:
            self._progress()
            if self._young(time.monotonic()):
                time.sleep(INFLIGHT_PACE_S)
        self._reap(time.monotonic())

    def _young(self, now: float) -> bool:
        return any(now - w.posted < self.fast_progress_s for w in self._inflight)

    def _start(self, order: proto.WriteOrder) -> None:
        if time.monotonic() >= order.post_before:
            self._finish_failed(order, "D's registration window closed before P could post "
                                "the WRITE")
            return
        plan: list[tuple[CachedAgent, list[Descriptor], bytes]] = []
        try:
            targets: list[proto.WriteTarget | None] = [*order.targets] or [None]
            for target in targets:
                agent = order.agent if target is None else target.agent
                heads = None if target is None else (target.p_heads, target.d_heads)
                peer = self._agents.load(agent, order.d_engine_id, order.d_engine_id, heads)
                plan.append((peer, self._descriptors(order, peer, target),
                             proto.push_notif(order.pd_request_id, order.notif_token,
                                              self.tp_rank if target else 0,
                                              target.writers if target else 1,
                                              order.seed)))
        except AgentMismatch as exc:
            self._finish_failed(order, str(exc))
            return
        except Exception as exc:  # nothing posted: releasing the blocks is safe
            self._finish_failed(order, f"WRITE could not be prepared: {exc}")
            return
        # Counted before the post: if the post raises something unexpected it
        # may have started, and the agent must then never be removed.
        for peer, _, _ in plan:
            self._agents.acquire(peer)
        parts: list[_Part] = []
        error = ""
        # Timed from before the post: on one host UCX copies inside it.
        posted = time.monotonic()
        for peer, descs, notif in plan:
            try:
                parts.append(_Part(peer, self.transport.post_write(
                    peer.name, descs, peer.agent.device_id, notif)))
            except (TransportError, ValueError) as exc:
                self._agents.retire(peer)
                error = f"WRITE could not be posted: {exc}"
                break
        for peer, _, _ in plan[len(parts):]:
            self._agents.release(peer)
        if not parts:
            self._finish_failed(order, error)
            return
        self._inflight.append(_Write(order, parts, posted, posted + self.transfer_timeout_s,
                                     sum(n for _, d, _ in plan for _, _, n in d),
                                     sum(len(d) for _, d, _ in plan), error=error))

    def _descriptors(self, order: proto.WriteOrder, peer: CachedAgent,
                     target: proto.WriteTarget | None) -> list[Descriptor]:
        """(P's address, D's address, bytes): whole blocks, or ``target``'s
        head slices (built as D would read them, then turned around)."""
        if target is None:
            return build_descriptors(order.src_block_ids, order.dst_block_ids, self.regions,
                                     peer.agent.regions)
        out: list[Descriptor] = []
        for p_head, d_head, num in target.slices:
            sl = Slice(self.tp_rank, p_head, d_head, num)
            out += [(p, d, n) for d, p, n in slice_descriptors(
                order.dst_block_ids, order.src_block_ids, peer.agent.regions, self.regions,
                sl, target.d_heads, target.p_heads)]
        return out

    def _reap(self, now: float) -> None:
        if now < self._next_reap:
            return
        self._next_reap = now + min(REAP_EVERY_S, self.peer_idle_ttl_s / 2)
        self._agents.reap(now)

    def _progress(self) -> None:
        now = time.monotonic()
        for w in list(self._inflight):
            for part in w.parts:
                if part.state is not XferState.PROC:
                    continue
                try:
                    part.state = self.transport.poll(part.handle)
                except Exception:  # the contract says ERR, never raise
                    logger.exception("PDConnector: polling the WRITE for %s failed",
                                     w.order.pd_request_id)
                    part.state = XferState.ERR
                if part.state is XferState.PROC and now > w.deadline:
                    part.state = XferState.ERR
                    logger.error("PDConnector: WRITE for %s passed transfer_timeout",
                                 w.order.pd_request_id)
            if w.state is XferState.PROC:
                continue
            if not self._release_handles(w):
                continue
            self._inflight.remove(w)
            for part in w.parts:
                self._agents.release(part.peer)
                if part.state is XferState.ERR:
                    self._agents.retire(part.peer)
            if w.state is XferState.DONE:
                self._finish_ok(w, time.monotonic())
            else:
                self._finish_failed(w.order, w.error or "NIXL reported an error for the WRITE")

    def _release_handles(self, w: _Write) -> bool:
        """Release every part's handle; True once none is left."""
        for part in w.parts:
            if part.released:
                continue
            try:
                part.released = self.transport.release(part.handle)
            except Exception:  # treated as "may still be in flight": try again later
                logger.exception("PDConnector: releasing the WRITE handle for %s failed",
                                 w.order.pd_request_id)
        released = all(p.released for p in w.parts)
        if not released and not w.stuck_logged:
            w.stuck_logged = True
            logger.error("PDConnector: WRITE for %s ended (%s) but its handle cannot be "
                         "released; keeping blocks on both sides", w.order.pd_request_id,
                         w.state.value)
        return released

    def _finish_ok(self, w: _Write, done: float) -> None:
        if self._on_write is not None:
            try:
                self._on_write(w.nbytes, w.ndescs, len(w.order.dst_block_ids), done - w.posted)
            except Exception:  # stats only: the lease must still be released
                logger.exception("PDConnector: recording the WRITE for %s failed",
                                 w.order.pd_request_id)
        self._release(w.order, ok=True, reason="")
        logger.info("PDConnector: pushed %s to engine %s (request %s): %d B, %d descriptors, "
                    "%.2f ms", w.order.pd_request_id, w.order.d_engine_id,
                    w.order.d_request_id, w.nbytes, w.ndescs, (done - w.posted) * 1e3)

    def _finish_failed(self, order: proto.WriteOrder, detail: str) -> None:
        logger.error("PDConnector: push %s to engine %s failed: %s", order.pd_request_id,
                     order.d_engine_id, detail)
        self._release(order, ok=False, reason=detail)

    def _release(self, order: proto.WriteOrder, ok: bool, reason: str) -> None:
        self._outbox.send(self.own[0], self.own[1], proto.LeaseRelease(
            engine_id=self.engine_id, request_ids=[order.pd_request_id], tp_rank=self.tp_rank,
            ok=ok, reason=reason[:500]))

    @property
    def num_in_flight(self) -> int:
        return len(self._inflight)

    @property
    def num_peers(self) -> int:
        """D agents loaded now (read from any thread; a snapshot)."""
        return len(self._agents)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._outbox.close()
        self._sock.close()
        self._ctx.term()
