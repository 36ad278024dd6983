"""P's worker half in push mode: post the WRITEs P's scheduler orders.

Runs in each of P's worker processes on one daemon thread ("pd-push"),
started by ``register_kv_caches`` and stopped by ``close``. It pulls
``WriteOrder``s from a ZMQ PULL socket bound to 127.0.0.1 (the address goes
to the scheduler in the handshake metadata), so a WRITE starts the moment
both the prefill and D's registration are in, whether or not P steps. The
thread survives any exception: a bug fails at most the order it hit.

Per order: load D's agent (see below), build coalesced descriptors (one per
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

D's agents are cached by agent name, which is the NIXL remote agent's own
identity, so each one is loaded and removed exactly once:

1. First order naming an agent: the name must be one of the order's D
   engine (``<engine_id>-tp<rank>-...``, as ``PDWorker`` names agents) and
   its KV layout must match ours; the metadata is loaded and NIXL's name
   for it must be the one the registration claimed. A mismatch fails that
   order only (the error names both names) and unloads nothing cached.
2. Later orders naming it must carry the very ``AgentInfo`` it was loaded
   with (a restarted D has a new name): another agent claiming the name
   fails its order and never replaces the cached one.
3. A WRITE to it that fails to post or ends in ``ERR`` marks it failed: it
   is removed once no WRITE to it is in flight, and the next order reloads
   it.
4. One unused (no WRITE posted or ending) for ``peer_idle_ttl_s`` is
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

logger = get_logger(__name__)

#: A D agent no WRITE used for this long is removed (D went away or restarted).
PEER_IDLE_TTL_S = 300.0
#: How often the push thread looks for idle agents, at most.
REAP_EVERY_S = 1.0


class AgentMismatch(TransportError):
    """An order's D agent is not the agent it claims to be; fails that order."""


@dataclass
class _Peer:
    """A D agent loaded into P's transport, as the first order named it."""

    d_engine_id: str
    agent: proto.AgentInfo
    last_used: float
    num_inflight: int = 0
    #: A WRITE to it failed: removed once none is in flight (reloaded on demand).
    failed: bool = False

    @property
    def name(self) -> str:
        return self.agent.agent_name


@dataclass
class _Write:
    order: proto.WriteOrder
    peer: _Peer
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
                 auth: FrameAuth | None = None) -> None:
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.transport = transport
        self.regions = regions
        self.own = own_side_channel
        self.transfer_timeout_s = transfer_timeout_s
        self.peer_idle_ttl_s = peer_idle_ttl_s
        self._on_write = on_write
        self._outbox = Outbox(notify_timeout_s, name="pd-push-result", auth=auth)
        #: Agent name (the transport's peer name) -> the agent loaded under it.
        self._peers: dict[str, _Peer] = {}
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
            peer = self._peer(order)
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
        peer.num_inflight += 1
        try:
            # Timed from before the post: on one host UCX copies inside it.
            posted = peer.last_used = time.monotonic()
            handle = self.transport.post_write(peer.name, descs, order.agent.device_id,
                                               proto.push_notif(order.pd_request_id,
                                                                order.notif_token))
        except (TransportError, ValueError) as exc:
            peer.num_inflight -= 1
            self._fail_peer(peer)
            self._finish_failed(order, f"WRITE could not be posted: {exc}")
            return
        self._inflight.append(_Write(order, peer, handle, posted,
                                     posted + self.transfer_timeout_s,
                                     sum(n for _, _, n in descs), len(descs)))

    def _peer(self, order: proto.WriteOrder) -> _Peer:
        """The cached agent for ``order``, loaded and checked on first use."""
        agent, d_engine = order.agent, order.d_engine_id
        name = agent.agent_name
        prefix = f"{d_engine}-tp{agent.tp_rank}-"
        if not name.startswith(prefix):
            raise AgentMismatch(f"D agent {name!r} is not engine {d_engine}'s (its rank "
                                f"{agent.tp_rank} agent is named {prefix}...)")
        peer = self._peers.get(name)
        if peer is not None:
            if peer.agent != agent or peer.d_engine_id != d_engine:
                raise AgentMismatch(
                    f"the order for engine {d_engine} names D agent {name!r} with other "
                    f"metadata than the agent P loaded under that name (for engine "
                    f"{peer.d_engine_id}); keeping the loaded one")
            return peer
        if len(agent.regions) != len(self.regions) or any(
                a.block_len != b.block_len
                for a, b in zip(agent.regions, self.regions, strict=False)):
            raise TransportError("D's KV region layout differs from ours")
        # A loaded agent's metadata under another name: refused without
        # loading it again (a miss only, so the scan is rare).
        owner = next((p.name for p in self._peers.values()
                      if p.agent.agent_metadata == agent.agent_metadata), None)
        loaded = owner or self.transport.add_peer(agent.agent_metadata)
        if loaded != name:
            if loaded not in self._peers:  # never unload an agent in use
                self._unload(loaded)
            raise AgentMismatch(f"the order for engine {d_engine} names D agent {name!r} but "
                                f"its NIXL metadata is agent {loaded!r}")
        peer = self._peers[name] = _Peer(d_engine, agent, time.monotonic())
        logger.info("PDConnector: push peer %s of engine %s added (rank %d)", name, d_engine,
                    self.tp_rank)
        return peer

    def _fail_peer(self, peer: _Peer) -> None:
        peer.failed = True
        if peer.num_inflight == 0:
            self._remove(peer)

    def _remove(self, peer: _Peer) -> None:
        assert peer.num_inflight == 0, "an agent with a WRITE in flight is never removed"
        if self._peers.get(peer.name) is peer:
            del self._peers[peer.name]
            self._unload(peer.name)

    def _unload(self, name: str) -> None:
        try:
            self.transport.remove_peer(name)
        except Exception:  # the contract says it never raises; stay alive if it does
            logger.exception("PDConnector: removing push peer %s failed", name)

    def _reap(self, now: float) -> None:
        if now < self._next_reap:
            return
        self._next_reap = now + min(REAP_EVERY_S, self.peer_idle_ttl_s / 2)
        for peer in list(self._peers.values()):
            if peer.num_inflight == 0 and now - peer.last_used >= self.peer_idle_ttl_s:
                logger.info("PDConnector: push peer %s of engine %s removed: unused for "
                            "%.0f s", peer.name, peer.d_engine_id, now - peer.last_used)
                self._remove(peer)

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
            w.peer.num_inflight -= 1
            w.peer.last_used = now
            if w.state is XferState.DONE:
                if w.peer.failed and w.peer.num_inflight == 0:
                    self._remove(w.peer)
                self._finish_ok(w, time.monotonic())
            else:
                self._fail_peer(w.peer)
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
        return len(self._peers)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._outbox.close()
        self._sock.close()
        self._ctx.term()
