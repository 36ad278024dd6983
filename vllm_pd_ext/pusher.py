"""P's worker half in push mode: post the WRITEs P's scheduler orders.

Runs in each of P's worker processes on one daemon thread ("pd-push"),
started by ``register_kv_caches`` and stopped by ``close``. It pulls
``WriteOrder``s from a ZMQ PULL socket bound to 127.0.0.1 (the address goes
to the scheduler in the handshake metadata), so a WRITE starts the moment
both the prefill and D's registration are in, whether or not P steps.

Per order: load D's agent (cached by name: a restarted D has a new name, a
peer that failed is dropped), build coalesced descriptors (one per
contiguous run, as in pull), post one WRITE carrying the notification
``pdx:<pd_request_id>`` (NIXL delivers it after the data), poll it with the
other in-flight WRITEs, release the handle. Then:

- success: release this rank's lease share on P (P frees its blocks);
- failure: release the lease share with ``ok=False`` and the reason, only
  *after* the handle is released. P's scheduler tells D (``PushResult``)
  once every rank has settled, so D never reuses a block a WRITE may still
  touch.

A handle that cannot be released keeps both P's blocks (lease held) and D's
(no result sent) until it can.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from vllm_pd_ext import protocol as proto
from vllm_pd_ext.coalesce import build_descriptors
from vllm_pd_ext.log import get_logger
from vllm_pd_ext.outbox import Outbox
from vllm_pd_ext.transport import Transport, TransportError, XferState

logger = get_logger(__name__)


@dataclass
class _Write:
    order: proto.WriteOrder
    peer: str
    handle: Any
    posted: float
    deadline: float
    nbytes: int
    ndescs: int
    state: XferState = XferState.PROC
    stuck_logged: bool = False


class Pusher:
    def __init__(self, engine_id: str, tp_rank: int, transport: Transport,
                 regions: list[proto.Region], own_side_channel: tuple[str, int],
                 transfer_timeout_s: float, notify_timeout_s: float,
                 on_write: Callable[[int, int, int, float], None] | None = None) -> None:
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.transport = transport
        self.regions = regions
        self.own = own_side_channel
        self.transfer_timeout_s = transfer_timeout_s
        self._on_write = on_write
        self._outbox = Outbox(notify_timeout_s, name="pd-push-result")
        self._peers: dict[str, str] = {}
        self._inflight: list[_Write] = []
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-push", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
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
                try:
                    self._progress()
                except Exception:
                    logger.exception("PDConnector: push progress failed; retrying")
                    time.sleep(0.1)  # no hot loop on a persistent error

    def _start(self, order: proto.WriteOrder) -> None:
        if time.monotonic() >= order.post_before:
            self._finish_failed(order, "D's registration window closed before P could post "
                                "the WRITE")
            return
        try:
            peer = self._peer(order.agent)
            descs = build_descriptors(order.src_block_ids, order.dst_block_ids, self.regions,
                                      order.agent.regions)
        except Exception as exc:  # nothing posted: releasing the blocks is safe
            self._drop_peer(order.agent.agent_name)
            self._finish_failed(order, f"WRITE could not be prepared: {exc}")
            return
        try:
            # Timed from before the post: on one host UCX copies inside it.
            posted = time.monotonic()
            handle = self.transport.post_write(peer, descs, order.agent.device_id,
                                               proto.push_notif(order.pd_request_id))
        except (TransportError, ValueError) as exc:
            self._drop_peer(order.agent.agent_name)
            self._finish_failed(order, f"WRITE could not be posted: {exc}")
            return
        self._inflight.append(_Write(order, peer, handle, posted,
                                     posted + self.transfer_timeout_s,
                                     sum(n for _, _, n in descs), len(descs)))

    def _peer(self, agent: proto.AgentInfo) -> str:
        name = self._peers.get(agent.agent_name)
        if name is None:
            if len(agent.regions) != len(self.regions) or any(
                    a.block_len != b.block_len
                    for a, b in zip(agent.regions, self.regions, strict=False)):
                raise TransportError("D's KV region layout differs from ours")
            name = self.transport.add_peer(agent.agent_metadata)
            self._peers[agent.agent_name] = name
            logger.info("PDConnector: push peer %s added (rank %d)", agent.agent_name,
                        self.tp_rank)
        return name

    def _drop_peer(self, agent_name: str) -> None:
        name = self._peers.pop(agent_name, None)
        if name is not None and not any(w.peer == name for w in self._inflight):
            self.transport.remove_peer(name)

    def _progress(self) -> None:
        now = time.monotonic()
        for w in list(self._inflight):
            if w.state is XferState.PROC:
                w.state = self.transport.poll(w.handle)
                if w.state is XferState.PROC and now > w.deadline:
                    w.state = XferState.ERR
                    logger.error("PDConnector: WRITE for %s passed transfer_timeout",
                                 w.order.pd_request_id)
            if w.state is XferState.PROC:
                continue
            if not self.transport.release(w.handle):
                if not w.stuck_logged:
                    w.stuck_logged = True
                    logger.error("PDConnector: WRITE for %s ended (%s) but its handle cannot "
                                 "be released; keeping blocks on both sides",
                                 w.order.pd_request_id, w.state.value)
                continue
            self._inflight.remove(w)
            if w.state is XferState.DONE:
                self._finish_ok(w, time.monotonic())
            else:
                self._drop_peer(w.order.agent.agent_name)
                self._finish_failed(w.order, "NIXL reported an error for the WRITE")

    def _finish_ok(self, w: _Write, done: float) -> None:
        if self._on_write is not None:
            self._on_write(w.nbytes, w.ndescs, len(w.order.dst_block_ids), done - w.posted)
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

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._outbox.close()
        self._sock.close()
        self._ctx.term()
