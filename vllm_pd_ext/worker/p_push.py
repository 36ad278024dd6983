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
other in-flight WRITEs, release the handle. Then:

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
from vllm_pd_ext.transport.coalesce import build_descriptors
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.auth import FrameAuth
from vllm_pd_ext.wire.outbox import Outbox
from vllm_pd_ext.worker.peers import PEER_IDLE_TTL_S, AgentCache, AgentMismatch, CachedAgent

logger = get_logger(__name__)

#: How often the push thread looks for idle agents, at most.
REAP_EVERY_S = 1.0


@dataclass
class _Write:
    order: proto.WriteOrder
    peer: CachedAgent
    handle: Any
    posted: float
    deadline: float
    nbytes: int
    ndescs: int
    state: XferState = XferState.PROC
    stuck_logged: bool = False


class Pusher:
    """One push P worker's WRITE poster and its D-agent cache (module
    docstring). Only the ``pd-push`` thread touches the cache and the
    in-flight WRITEs; ``num_peers`` and ``num_in_flight`` are snapshots."""

    def __init__(self, engine_id: str, tp_rank: int, transport: Transport,
                 regions: list[proto.Region], own_side_channel: tuple[str, int],
                 transfer_timeout_s: float, notify_timeout_s: float,
                 on_write: Callable[[int, int, int, float], None] | None = None,
                 peer_idle_ttl_s: float = PEER_IDLE_TTL_S,
                 auth: FrameAuth | None = None, kernel_blocks: int = 1) -> None:
        self.engine_id = engine_id
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
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
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
        # Poll the socket briefly while WRITEs are in flight, else idle.
        if poller.poll(1 if self._inflight else 200):
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
        self._reap(time.monotonic())

    def _start(self, order: proto.WriteOrder) -> None:
        if time.monotonic() >= order.post_before:
            self._finish_failed(order, "D's registration window closed before P could post "
                                "the WRITE")
            return
        try:
            peer = self._agents.load(order.agent, order.d_engine_id, order.d_engine_id)
        except AgentMismatch as exc:
            self._finish_failed(order, str(exc))
            return
        except Exception as exc:  # nothing posted: releasing the blocks is safe
            self._finish_failed(order, f"WRITE could not be prepared: {exc}")
            return
        try:
            descs = build_descriptors(order.src_block_ids, order.dst_block_ids, self.regions,
                                      order.agent.regions)
        except Exception as exc:  # this order's blocks; the agent is fine
            self._finish_failed(order, f"WRITE could not be prepared: {exc}")
            return
        # Counted before the post: if the post raises something unexpected it
        # may have started, and the agent must then never be removed.
        self._agents.acquire(peer)
        try:
            # Timed from before the post: on one host UCX copies inside it.
            posted = time.monotonic()
            handle = self.transport.post_write(peer.name, descs, order.agent.device_id,
                                               proto.push_notif(order.pd_request_id,
                                                                order.notif_token))
        except (TransportError, ValueError) as exc:
            self._agents.release(peer)
            self._agents.retire(peer)
            self._finish_failed(order, f"WRITE could not be posted: {exc}")
            return
        self._inflight.append(_Write(order, peer, handle, posted,
                                     posted + self.transfer_timeout_s,
                                     sum(n for _, _, n in descs), len(descs)))

    def _reap(self, now: float) -> None:
        if now < self._next_reap:
            return
        self._next_reap = now + min(REAP_EVERY_S, self.peer_idle_ttl_s / 2)
        self._agents.reap(now)

    def _progress(self) -> None:
        now = time.monotonic()
        for w in list(self._inflight):
            if w.state is XferState.PROC:
                try:
                    w.state = self.transport.poll(w.handle)
                except Exception:  # the contract says ERR, never raise
                    logger.exception("PDConnector: polling the WRITE for %s failed",
                                     w.order.pd_request_id)
                    w.state = XferState.ERR
                if w.state is XferState.PROC and now > w.deadline:
                    w.state = XferState.ERR
                    logger.error("PDConnector: WRITE for %s passed transfer_timeout",
                                 w.order.pd_request_id)
            if w.state is XferState.PROC:
                continue
            if not self._release_handle(w):
                continue
            self._inflight.remove(w)
            self._agents.release(w.peer)
            if w.state is XferState.DONE:
                self._finish_ok(w, time.monotonic())
            else:
                self._agents.retire(w.peer)
                self._finish_failed(w.order, "NIXL reported an error for the WRITE")

    def _release_handle(self, w: _Write) -> bool:
        try:
            released = self.transport.release(w.handle)
        except Exception:  # treated as "may still be in flight": try again later
            logger.exception("PDConnector: releasing the WRITE handle for %s failed",
                             w.order.pd_request_id)
            released = False
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
