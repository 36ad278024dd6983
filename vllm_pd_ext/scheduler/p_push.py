"""P's scheduler half in push mode: match registrations, order WRITEs.

Runs in P's EngineCore process. Two threads call in: the side-channel
thread (``handle`` for ``PushRegister`` / ``PushAbort``, ``on_release``
when a worker reports its WRITE settled) and the scheduler thread
(``prefill_done`` from ``request_finished``, ``sweep``, and
``forget_expired_prefills`` inside the lease sweep). The book is guarded by
the lease owner's lock: every section that touches it runs in
``LeaseService.atomic()``, together with the lease operations it needs.

P's own leg is ``admit``-ted when it arrives (scheduler thread,
``on_new_request``) and retired when it finishes; while P holds it, D's
``PushWaiting`` renews the registration (answered ``queued``), so D's wait
covers P's queue however long it is, and a registration expires only for a
request P never saw.

Whichever of registration and prefill comes second orders the WRITEs at
once, on its own thread: P's workers post them from their own push thread,
so a WRITE never waits for an engine step (an idle P does not step).
P's blocks stay pinned under a lease that cannot expire while a WRITE is
ordered (``LeaseService.hold``); each rank's release frees them. A failed
WRITE is reported to D here, by ``PushResult``, once every rank has
settled, so D never reuses blocks another rank may still be writing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from vllm_pd_ext.leases.lender import BlockLender
from vllm_pd_ext.leases.service import LeaseService
from vllm_pd_ext.log import get_logger
from vllm_pd_ext.scheduler.pushbook import (
    TOMBSTONES,
    Match,
    Prefill,
    PushBook,
    PushRefused,
    PushState,
)
from vllm_pd_ext.transport.tp_slices import Sharding, sharding_of, slices_for
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.auth import FrameAuth
from vllm_pd_ext.wire.outbox import Outbox
from vllm_pd_ext.wire.protocol import ErrorCode
from vllm_pd_ext.wire.zmq_context import GcSafeContext

logger = get_logger(__name__)


_REGISTERED_LOG = {
    proto.PushAcceptedState.WRITING: "writing",
    proto.PushAcceptedState.QUEUED: "prefill not finished yet (request queued here)",
    proto.PushAcceptedState.WAITING: "prefill not finished yet (request not seen here yet)",
}


class PushProducer:
    def __init__(self, engine_id: str, compat: proto.CompatInfo, block_size: int,
                 tp_size: int, leases: LeaseService, notify_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 auth: FrameAuth | None = None, lender: BlockLender | None = None) -> None:
        self.engine_id = engine_id
        self.compat = compat
        self.block_size = block_size
        self.tp_size = tp_size
        self.leases = leases
        #: Pins a finished prefill's blocks (``lend``); the scheduler's, over ``leases``.
        self.lender = lender
        self.book: PushBook[proto.PushRegister] = PushBook(clock)
        self._clock = clock
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._orders: dict[int, zmq.Socket[bytes]] = {}
        self._order_lock = threading.Lock()
        self._outbox = Outbox(notify_timeout_s, name="pd-push-notify", auth=auth)
        self._stats_lock = threading.Lock()
        self._waits: list[float] = []
        self.num_expired_registrations = 0
        #: Aborts and renewals refused: not from the engine that registered.
        self.num_wrong_sender = 0
        # pd_request_id -> [D's notify host, port, first failure detail], while
        # a WRITE is ordered. D hears of a failure only once *every* rank has
        # settled: with TP > 1 another rank's WRITE may still be landing.
        self._notify: dict[str, list[Any]] = {}

    def bind_workers(self, endpoints: dict[int, str]) -> None:
        """Connect to each worker rank's order socket (from handshake metadata)."""
        missing = sorted(set(range(self.tp_size)) - set(endpoints))
        if missing:
            raise RuntimeError(f"PDConnector: push mode, but workers {missing} publish no "
                               "order endpoint")
        self._ctx = GcSafeContext()
        for rank, addr in endpoints.items():
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
            self._orders[rank] = sock

    # ---------------------------------------------------------- side channel
    def handle(self, msg: proto.Request) -> proto.Reply:
        if isinstance(msg, proto.PushRegister):
            return self._register(msg)
        if isinstance(msg, proto.PushWaiting):
            return self._waiting(msg)
        if isinstance(msg, proto.PushAbort):
            return self._abort(msg)
        return proto.ErrorReply(ErrorCode.NOT_CONSUMER, f"engine {self.engine_id} is a push "
                                "producer; it takes no push results")

    def _register(self, msg: proto.PushRegister) -> proto.Reply:
        if msg.expect_engine_id != self.engine_id:
            return proto.ErrorReply(
                ErrorCode.STALE, f"this is engine {self.engine_id}, not {msg.expect_engine_id} "
                "(P restarted?)")
        d_tp = msg.compat.tp_size
        if (len(msg.agents) != d_tp or [a.tp_rank for a in msg.agents] != list(range(d_tp))
                or not msg.block_ids or msg.first_block < 0):
            return proto.ErrorReply(
                ErrorCode.MALFORMED, f"registration for {msg.pd_request_id}: "
                f"{len(msg.agents)} agents for D's TP {d_tp}, {len(msg.block_ids)} blocks "
                f"from {msg.first_block}")
        with self.leases.atomic():
            try:
                match = self.book.register(msg.pd_request_id, msg, msg.ttl_s, self.tp_size)
            except PushRefused as exc:
                logger.warning("PDConnector: push registration from engine %s refused: %s",
                               msg.engine_id, exc)
                return proto.ErrorReply(ErrorCode.REFUSED, str(exc))
            if match is not None:
                self._start(match)
                state = proto.PushAcceptedState.WRITING
            elif self.book.is_admitted(msg.pd_request_id):
                state = proto.PushAcceptedState.QUEUED
            else:
                state = proto.PushAcceptedState.WAITING
        logger.info("PDConnector: push registration %s from engine %s (request %s): %d blocks "
                    "from block %d; %s", msg.pd_request_id, msg.engine_id, msg.request_id,
                    len(msg.block_ids), msg.first_block, _REGISTERED_LOG[state])
        return proto.PushAccepted(engine_id=self.engine_id, state=state)

    def _waiting(self, msg: proto.PushWaiting) -> proto.Reply:
        """D still waits: renew the registration while P holds the request."""
        pd_id = msg.pd_request_id
        with self.leases.atomic():
            reg = self.book.registration(pd_id)
            if reg is not None and reg.engine_id != msg.engine_id:
                self.num_wrong_sender += 1
                return proto.ErrorReply(
                    ErrorCode.REFUSED, f"push {pd_id} was registered by engine "
                    f"{reg.engine_id}, not {msg.engine_id}")
            state = self.book.renew(pd_id)
            admitted = self.book.is_admitted(pd_id)
        if state is PushState.REGISTERED:
            return proto.PushAccepted(
                engine_id=self.engine_id,
                state=proto.PushAcceptedState.QUEUED if admitted
                else proto.PushAcceptedState.WAITING)
        if state is PushState.WRITING or state is PushState.DONE:
            return proto.PushAccepted(engine_id=self.engine_id,
                                      state=proto.PushAcceptedState.WRITING)
        return proto.ErrorReply(ErrorCode.UNKNOWN, f"no push registration {pd_id} waits here "
                                f"({state.value})")

    # ------------------------------------------------------------ P's own leg
    def admit(self, pd_id: str) -> None:
        """P's leg of ``pd_id`` arrived (scheduler thread)."""
        with self.leases.atomic():
            self.book.admit(pd_id)

    def retire(self, pd_id: str) -> None:
        """P's leg of ``pd_id`` finished, however it ended (scheduler thread)."""
        with self.leases.atomic():
            self.book.retire(pd_id)

    def _abort(self, msg: proto.PushAbort) -> proto.Reply:
        with self.leases.atomic():
            reg = self.book.registration(msg.pd_request_id)
            if reg is not None and reg.engine_id != msg.engine_id:
                self.num_wrong_sender += 1
                logger.warning("PDConnector: abort of push %s from engine %s refused: engine "
                               "%s registered it", msg.pd_request_id, msg.engine_id,
                               reg.engine_id)
                return proto.ErrorReply(
                    ErrorCode.REFUSED, f"push {msg.pd_request_id} was registered by another engine")
            state, prefill = self.book.abort(msg.pd_request_id)
            if prefill is not None:
                self._release_all(msg.pd_request_id)
        logger.info("PDConnector: push %s aborted by engine %s (%s): %s", msg.pd_request_id,
                    msg.engine_id, msg.reason or "no reason", state.value)
        return proto.PushAbortStatus(state)

    def on_release(self, msg: proto.LeaseRelease) -> None:
        """A worker's WRITE settled (lease released for its rank)."""
        with self.leases.atomic():
            for pd_id in msg.request_ids:
                self._settle(pd_id, msg.tp_rank, msg.ok, msg.reason)

    def _settle(self, pd_id: str, rank: int, ok: bool, detail: str) -> None:
        """One rank will touch D's blocks no more (lock held). Once all ranks
        settled and one failed, tell D at once."""
        notify = self._notify.get(pd_id)
        if notify is not None and not ok and not notify[2]:
            notify[2] = detail or "WRITE failed"
        outcome = self.book.settle(pd_id, rank, ok)
        if outcome is None:
            return
        self._notify.pop(pd_id, None)
        if outcome is False and notify is not None:
            self._outbox.send(notify[0], notify[1], proto.PushResult(
                engine_id=self.engine_id, pd_request_id=pd_id, tp_rank=-1, ok=False,
                detail=notify[2]))

    # ------------------------------------------------- the dispatcher's PMode
    def lease_key(self, request_id: str, params: proto.KVTransferParams) -> str:
        """Both engines know the push by the proxy's ``pd_request_id`` (P's and
        D's request ids differ)."""
        return str(params.pd_request_id)

    def lend(self, key: str, request_id: str, block_ids: list[int], num_tokens: int,
             prompt_digest: str, first_token: int = -1) -> float:
        """Lease the prompt's blocks under ``key``, then match D's registration
        (or wait for it); whichever came second orders the WRITEs."""
        assert self.lender is not None, "PushProducer built without the scheduler's lender"
        expiry = self.lender.lend(key, block_ids, num_consumers=self.tp_size)
        self.prefill_done(key, request_id, block_ids, num_tokens, prompt_digest, first_token)
        return expiry

    def forget_expired(self, keys: list[str]) -> None:
        self.forget_expired_prefills(keys)

    # ------------------------------------------------------------ scheduler
    def prefill_done(self, pd_id: str, request_id: str, block_ids: list[int],
                     num_tokens: int, prompt_digest: str = "", first_token: int = -1) -> None:
        """Blocks are pinned and leased under ``pd_id``; match or wait.
        ``first_token``: the token P sampled, for a D that asks for it."""
        prefill = Prefill(request_id, list(block_ids), num_tokens, self._clock(),
                          prompt_digest, first_token)
        with self.leases.atomic():
            outcome = self.book.prefill_done(pd_id, prefill, self.tp_size)
            if isinstance(outcome, PushState):
                self._release_all(pd_id)
            elif outcome is not None:
                self._start(outcome)
        if isinstance(outcome, PushState):
            logger.warning("PDConnector: prefill %s (%s) finished %s (%s); freeing its blocks",
                           request_id, pd_id, "after D gave up" if outcome in TOMBSTONES
                           else "twice", outcome.value)
        elif outcome is None:
            logger.info("PDConnector: prefill %s done; waiting for D's registration of %s",
                        request_id, pd_id)

    def prefill_failed(self, pd_id: str, request_id: str, status: str) -> None:
        with self.leases.atomic():
            reg = self.book.prefill_failed(pd_id)
        if reg is not None:
            detail = f"P's prefill {request_id} ended with {status}"
            logger.warning("PDConnector: push %s not written: %s", pd_id, detail)
            self._outbox.send(reg.notify_host, reg.notify_port, proto.PushResult(
                engine_id=self.engine_id, pd_request_id=pd_id, tp_rank=-1, ok=False,
                detail=detail))

    def announce(self, key: str, request_id: str, params: proto.KVTransferParams,
                 first_token: int, expiry: float) -> None:
        """Nothing: D registered, so ``lend`` already ordered the WRITE."""

    def sweep(self) -> None:
        with self.leases.atomic():
            gone = self.book.sweep()
        for pd_id in gone:
            logger.warning("PDConnector: push registration %s expired: its prefill never "
                           "finished here (did the request reach this P?)", pd_id)
        self.num_expired_registrations += len(gone)

    def forget_expired_prefills(self, pd_ids: Iterable[str]) -> None:
        """The leases of prefills D never registered for expired. Pass as the
        lease sweep's ``on_expired``: it must run in the sweep's critical
        section, since a registration in between would match blocks about to
        be freed."""
        with self.leases.atomic():
            for pd_id in pd_ids:
                self.book.forget_prefill(pd_id)

    def take_registration_waits(self) -> list[float]:
        with self._stats_lock:
            waits, self._waits = self._waits, []
        return waits

    # ------------------------------------------------------------ internals
    def _start(self, match: Match[proto.PushRegister]) -> None:
        """Order the WRITEs (lock held)."""
        reg, prefill = match.reg, match.prefill
        with self._stats_lock:
            self._waits.append(match.waited_s)
        n = len(reg.block_ids)
        expected = -(-prefill.num_tokens // self.block_size) - reg.first_block
        problem = None
        if reg.num_tokens != prefill.num_tokens:
            problem = (f"P prefilled {prefill.num_tokens} tokens but D's prompt has "
                       f"{reg.num_tokens} (different prompt or tokenizer?)")
        elif reg.prompt_digest and prefill.prompt_digest and (
                reg.prompt_digest != prefill.prompt_digest):
            problem = ("D's prompt is not the one P prefilled (prompt digests differ): a "
                       "push paired with another request's prefill")
        elif n != expected or reg.first_block + n > len(prefill.block_ids):
            problem = (f"block layout mismatch: D registered {n} blocks from block "
                       f"{reg.first_block}; P's prompt has {len(prefill.block_ids)} blocks and "
                       f"needs {expected} written")
        elif reg.want_seed and not 0 <= prefill.first_token <= proto.MAX_SEED:
            problem = ("D waits for P's token #1 with the KV (pd_seed_pending) but this "
                       "prefill sampled none")
        elif set(range(self.tp_size)) - set(self._orders):
            problem = "P's workers publish no write-order socket (unsupported vLLM version?)"
        self._notify[match.pd_request_id] = [reg.notify_host, reg.notify_port, ""]
        if problem is not None:
            self._fail_ranks(match, range(self.tp_size), problem)
            return
        if not self.leases.hold(match.pd_request_id):
            # The lease ended (expired or released) under the match: its
            # blocks are freed or about to be. Never write from them.
            self._fail_ranks(match, range(self.tp_size),
                             "P's lease on the prefilled blocks ended before the WRITE could "
                             "be ordered")
            return
        src = prefill.block_ids[reg.first_block:reg.first_block + n]
        targets = write_targets(sharding_of(self.compat), sharding_of(reg.compat), reg.agents)
        unsent = []
        for rank in range(self.tp_size):
            if targets is not None and not targets[rank]:
                # Sharded unlike D, this rank holds no head D reads from it
                # (a replica another rank writes): its share is done now.
                self.leases.release_ranks(match.pd_request_id, [rank], ok=True)
                self._settle(match.pd_request_id, rank, True, "")
                continue
            order = proto.WriteOrder(
                pd_request_id=match.pd_request_id, request_id=prefill.request_id,
                d_engine_id=reg.engine_id, d_request_id=reg.request_id,
                notify_host=reg.notify_host, notify_port=reg.notify_port,
                agent=reg.agents[rank % len(reg.agents)], src_block_ids=src,
                dst_block_ids=list(reg.block_ids), post_before=match.post_before,
                notif_token=reg.notif_token, targets=[] if targets is None else targets[rank],
                seed=prefill.first_token if reg.want_seed else -1)
            try:
                with self._order_lock:
                    # Never block under the lease lock (a full queue means a
                    # stuck worker).
                    self._orders[rank].send(proto.encode_order(order), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                unsent.append((rank, exc))
        if unsent:
            # Ranks that got their order settle it themselves; these never will.
            self._fail_ranks(match, [r for r, _ in unsent],
                             f"write order not delivered to P's worker: {unsent[0][1]}")

    def _fail_ranks(self, match: Match[proto.PushRegister], ranks: Iterable[int],
                    problem: str) -> None:
        """These ranks will not write (lock held): settle them and release
        their lease shares; D is told once no rank can write any more."""
        logger.error("PDConnector: push %s not written: %s", match.pd_request_id, problem)
        for rank in ranks:
            self.leases.release_ranks(match.pd_request_id, [rank], ok=False)
            self._settle(match.pd_request_id, rank, False, problem)

    def _release_all(self, pd_id: str) -> None:
        """Release every rank's share of the lease (lock held): sweep frees."""
        self.leases.release_ranks(pd_id, range(self.tp_size), ok=False)

    def close(self) -> None:
        self._outbox.close()
        with self._order_lock:
            for sock in self._orders.values():
                sock.close()
            self._orders.clear()
        if self._ctx is not None:
            self._ctx.term()



def write_targets(p: Sharding, d: Sharding, agents: list[proto.AgentInfo]
                  ) -> list[list[proto.WriteTarget]] | None:
    """Per P rank, the D ranks it writes head slices to; None when P and D
    shard alike (rank ``r`` writes whole blocks to D's rank ``r``). The
    registration's compat check already mapped the pair (``tp_slices.plan``)."""
    if p.tp_size == d.tp_size:
        return None
    out: list[list[proto.WriteTarget]] = [[] for _ in range(p.tp_size)]
    for d_rank in range(d.tp_size):
        slices = slices_for(d_rank, p, d)
        writers = len({s.p_rank for s in slices})
        for p_rank in sorted({s.p_rank for s in slices}):
            out[p_rank].append(proto.WriteTarget(
                agent=agents[d_rank], p_heads=p.heads_per_rank, d_heads=d.heads_per_rank,
                writers=writers, slices=[(s.p_head, s.d_head, s.num_heads) for s in slices
                                         if s.p_rank == p_rank]))
    return out
