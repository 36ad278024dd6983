"""D's worker half in pull mode: read each prompt's KV out of P's blocks.

Runs on D's worker main thread (the engine step). ``expect`` takes the
scheduler's ``RecvSpec``s; ``advance`` (every step) moves each load through

    HANDSHAKE -> POSTING -> READING -> done | failed

with the pin in flight beside the READ, and never blocks the step:

- Side-channel round trips (handshake, pin, release) leave on one lane per
  P endpoint (``Outbox``). A frozen or dead P delays only its own loads;
  when one of its requests times out, what is queued behind it fails at
  once instead of waiting one more timeout each.
- HANDSHAKE fetches and checks P's layout once per ``(engine id, host,
  port)``. Every load holds its own reference to the peer it handshook
  with, so one failed pin, post or READ fails that load only. When P is
  sharded differently (another TP size), the peer is the set of P ranks
  this rank reads head slices from (``tp_slices``): one READ per P rank,
  all posted together, and the load is done (or failed) only when every
  one settled. A pin that P
  does not know (``LEASE_UNKNOWN``) or a failed READ makes the peer
  *suspect*: a fresh handshake checks it, and only a new engine id at that
  endpoint (P restarted) retires the cached peer.
- The pin and the READ leave together (issue 29: the pin's round trip is
  off the handoff's critical path). The pin asks P to pin the lease and
  returns how long it is guaranteed; the READ's bytes are trusted only when
  the pin came back valid and the READ ended inside that window. Why that
  is enough: P frees lent blocks only when their lease ends, a lease never
  comes back once ended, and a pin that finds it live (after D sent the pin,
  so after the READ was posted) proves it was live, blocks untouched, from
  P's answer until then and is guaranteed past ``pin_sent + remaining``.
  A READ of blocks whose lease is gone only reads (P is not harmed); its
  bytes are thrown away and the load fails as before. A pin answer that
  comes before a queued post sets the post's deadline (never post after
  the lease may have run out); a failed one cancels the post.
- A concurrent pull's load has no pin at all (issue 29, protocol 10): P
  extended the lease as it sent its answer to D's scheduler, after it had
  a ``PullWait`` D sent at a time D knows, so ``RecvSpec.valid_until``
  (that send time + the extension) bounds P's expiry from below on this
  host's clock; the READ's window is that, checked as a pin's.
- POSTING hands the READ to one poster thread: on one host UCX copies
  inside the post call (about 16 ms per 256 MiB), and NIXL releases the GIL
  meanwhile, so other requests' decode is not held up. READING polls.
- Every reply and every post that returns rings ``wait_progress``, so a
  worker step with nothing else to do can wait for the loads it just
  started and report them in the same step (``PDWorker``).

A READ that cannot be released (it may still write into D's blocks) keeps
its load unreported, and so D's blocks allocated, until it settles. P's
NIXL agents live in ``peers.AgentCache`` (the cache P's pusher uses for D's):
one is removed only when no READ uses it, and an idle one after
``PEER_IDLE_TTL_S``, with its cached handshake.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm_pd_ext.log import get_logger
from vllm_pd_ext.policy import FailureReason
from vllm_pd_ext.transport import Transport, TransportError, XferState
from vllm_pd_ext.transport.coalesce import Descriptor, build_descriptors
from vllm_pd_ext.transport.tp_slices import (
    Slice,
    TPMappingError,
    sharding_of,
    slice_descriptors,
    slices_for,
)
from vllm_pd_ext.wire import outbox, telemetry
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.auth import FrameAuth
from vllm_pd_ext.wire.outbox import Outbox
from vllm_pd_ext.wire.protocol import ErrorCode
from vllm_pd_ext.wire.side_channel import SideChannelError
from vllm_pd_ext.wire.specs import RecvSpec, monotonic_clock_id
from vllm_pd_ext.wire.telemetry import TransferRecord
from vllm_pd_ext.worker.peers import (
    PEER_IDLE_TTL_S,
    AgentCache,
    CachedAgent,
    layout_problem,
    memory_problem,
)

logger = get_logger(__name__)

#: A lease P's answer guaranteed with less than this left is pinned as a
#: sequential pull's is (a late answer; the READ would not fit).
UNPINNED_MIN_LEFT_S = 2.0
#: Never post a READ with less than this left on the pinned lease.
PIN_SAFETY_MARGIN_S = 1.0
#: How often ``advance`` looks for idle peers.
REAP_EVERY_S = 1.0

#: (remote engine id, host, port): one handshake each. An id alone would let
#: one request naming a real engine id at another host replace its agent.
PeerKey = tuple[str, str, int]
#: (request id, local block ids, reason, detail) of a failed load.
Failure = tuple[str, list[int], FailureReason, str]


class RecvState(enum.Enum):
    HANDSHAKE = "handshake"
    POSTING = "posting"
    READING = "reading"


@dataclass
class PeerSet:
    """What this D rank reads of one P engine: per P rank it reads from,
    that rank's agent (as loaded in the ``AgentCache``) and the head slices
    (None: whole blocks, P sharded like D)."""

    reads: list[tuple[CachedAgent, list[Slice] | None]]
    #: Heads per block: ours, P's.
    heads: tuple[int, int] = (1, 1)

    @property
    def agents(self) -> list[CachedAgent]:
        return [a for a, _ in self.reads]

    @property
    def name(self) -> str:
        return ",".join(a.name for a in self.agents)


@dataclass
class _PeerEntry:
    """The handshake cache slot of one ``PeerKey``: its checked handshake is
    the ``PeerSet`` of P's NIXL agents this rank reads."""

    key: PeerKey
    peer: PeerSet | None = None
    #: A handshake in flight: the first, or a suspect peer's re-check.
    pending: Future[proto.Reply | SideChannelError] | None = None
    waiting: set[str] = field(default_factory=set)


@dataclass
class RecvJob:
    spec: RecvSpec
    arrived: float
    deadline: float
    state: RecvState = RecvState.HANDSHAKE
    peer: PeerSet | None = None
    #: The post on the poster thread, until it returned.
    future: Future[Any] | None = None
    #: The pin's reply, until it was checked.
    pin: Future[proto.Reply | SideChannelError] | None = None
    pin_sent: float = 0.0
    #: When the pin's reply reached this rank (the outbox thread's clock read).
    pin_at: float = 0.0
    #: Until when (D's clock) the pin guarantees P keeps the blocks: a READ
    #: that ends later may have copied blocks P already reused. 0: not known.
    valid_until: float = 0.0
    #: The latest the READ may still be posted (the poster thread reads it):
    #: unbounded until the pin answered, -inf once it failed.
    post_by: float = math.inf
    #: The pin failed: raised once the READ settled.
    pin_error: LoadFailed | None = None
    #: No pin: P's answer extended the lease (``RecvSpec.valid_until``).
    pin_in_answer: bool = False
    #: The post failed before any READ went out: raised once the pin answered
    #: (a failed pin's reason wins).
    not_posted: LoadFailed | None = None
    #: The posted READs (one per P rank read) not released yet.
    handles: list[Any] = field(default_factory=list)
    #: A post that failed after an earlier READ of this load was posted:
    #: raised once the posted ones settled.
    post_error: LoadFailed | None = None
    posted: float = 0.0
    done_at: float = 0.0
    #: This load holds its peer's agents (``AgentCache.acquire``).
    holds_agents: bool = False
    #: Every posted READ settled and was released.
    settled: bool = False
    #: NIXL reported an error for one of its READs.
    read_error: bool = False
    nbytes: int = 0
    ndescs: int = 0
    stuck_logged: bool = False

    @property
    def key(self) -> PeerKey:
        s = self.spec
        return (s.remote_engine_id, s.remote_host, s.remote_port)

    def record(self, now: float, outcome: str = "ok", detail: str = "") -> TransferRecord:
        """This load's telemetry (``telemetry.py``), its phases as far as it got."""
        s = self.spec
        read_end = self.done_at or now
        return TransferRecord(
            request_id=s.request_id, remote_request_id=s.remote_request_id,
            p_engine=s.remote_engine_id, p_addr=f"{s.remote_host}:{s.remote_port}",
            mode="readback" if s.readback else "pull", outcome=outcome, detail=detail[:300],
            bytes=self.nbytes, descriptors=self.ndescs, blocks=len(s.local_block_ids),
            tokens=s.num_tokens,
            handshake_ms=telemetry.ms((self.pin_sent or self.posted or now) - self.arrived),
            pin_ms=(telemetry.ms((self.pin_at or now) - self.pin_sent) if self.pin_sent
                    else None),
            read_ms=telemetry.ms(read_end - self.posted) if self.posted else None,
            pin_with_read=bool(self.pin_sent) or None,
            pin_in_answer=self.pin_in_answer or None,
            # Built when the load is found ended, in the step that reports it.
            worker_ms=telemetry.ms(now - self.arrived),
            lease_left_s=(round(self.valid_until - self.posted, 3)
                          if self.posted and self.valid_until else None))


class LoadFailed(Exception):
    def __init__(self, reason: FailureReason, detail: str, release: bool = True) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        #: False when P surely holds no pin of ours (nothing to release) or
        #: cannot answer (a timed-out handshake): no release is sent.
        self.release = release


class PullReader:
    """Every pull load of one D worker rank; see the module docstring."""

    def __init__(self, engine_id: str, tp_rank: int, compat: proto.CompatInfo,
                 transport: Transport, regions: list[proto.Region], *,
                 side_channel_timeout_s: float, transfer_timeout_s: float,
                 on_loaded: Callable[[RecvJob, float], None],
                 clock: Callable[[], float] = time.monotonic,
                 io: Outbox | None = None, auth: FrameAuth | None = None,
                 kernel_blocks: int = 1) -> None:
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.compat = compat
        self.transport = transport
        self.regions = regions
        self.transfer_timeout_s = transfer_timeout_s
        self._on_loaded = on_loaded
        self._clock = clock
        self._io = io or Outbox(side_channel_timeout_s, name=f"pd-pull{tp_rank}",
                                idle_ttl_s=outbox.LANE_IDLE_TTL_S,
                                fail_queued_on_timeout=True, auth=auth)
        # One thread: posts are serialised, never concurrent with each other.
        # It runs the transport's thread hook first (its CUDA device on GPU).
        self._poster = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-post",
                                          initializer=transport.enter_thread)
        self._peers: dict[PeerKey, _PeerEntry] = {}
        self.agents = AgentCache(transport, regions, "P", clock=clock,
                                 idle_ttl_s=PEER_IDLE_TTL_S, kernel_blocks=kernel_blocks)
        self._jobs: dict[str, RecvJob] = {}
        self._next_reap = 0.0
        #: Set by every side-channel reply and every post that returned.
        self._progress = threading.Event()
        #: Telemetry of the loads that ended since ``take_records``.
        self._records: list[TransferRecord] = []

    # ----------------------------------------------------------- intake
    def expect(self, spec: RecvSpec) -> None:
        now = self._clock()
        job = self._jobs[spec.request_id] = RecvJob(
            spec, arrived=now, deadline=now + self.transfer_timeout_s)
        entry = self._entry(job.key)
        entry.waiting.add(spec.request_id)
        if entry.peer is not None:
            for agent in entry.peer.agents:
                self.agents.touch(agent)

    def _entry(self, key: PeerKey) -> _PeerEntry:
        entry = self._peers.get(key)
        if entry is None:
            entry = self._peers[key] = _PeerEntry(key)
        if entry.peer is None and entry.pending is None:
            self._handshake(entry)
        return entry

    def _handshake(self, entry: _PeerEntry) -> None:
        engine_id, host, port = entry.key
        logger.info("PDConnector: handshake with engine %s at %s:%d (rank %d)", engine_id,
                    host, port, self.tp_rank)
        entry.pending = self._send(host, port, proto.HandshakeRequest(
            engine_id=self.engine_id, tp_rank=self.tp_rank, compat=self.compat))

    def _send(self, host: str, port: int, msg: proto.Request,
              on_reply: Callable[[], None] | None = None
              ) -> Future[proto.Reply | SideChannelError]:
        """``msg`` on P's lane; the future holds the reply. ``on_reply`` runs
        first, on the outbox thread (it must only set plain fields)."""
        fut: Future[proto.Reply | SideChannelError] = Future()

        def settle(reply: proto.Reply | SideChannelError) -> None:
            if on_reply is not None:
                on_reply()
            fut.set_result(reply)
            self._progress.set()

        self._io.send(host, port, msg, settle)
        return fut

    def wait_progress(self, timeout_s: float) -> bool:
        """Block until a reply or a post returned since the last call (True),
        or ``timeout_s`` passed. Step thread only."""
        woke = self._progress.wait(timeout_s)
        self._progress.clear()
        return woke

    # ------------------------------------------------------------- step
    def advance(self) -> list[Failure]:
        """Move every load on; return the loads that failed this pass.
        Finished loads are handed to ``on_loaded``."""
        failed: list[Failure] = []
        now = self._clock()
        for entry in list(self._peers.values()):
            if entry.pending is not None and entry.pending.done():
                failed += self._settle_handshake(entry)
        for rid, job in list(self._jobs.items()):
            if rid not in self._jobs:
                continue
            try:
                if job.state is RecvState.HANDSHAKE:
                    self._step_handshake(job)
                if job.pin is not None:
                    self._step_pin(job)
                if job.state is RecvState.POSTING:
                    self._step_post(job)
                if job.state is RecvState.READING:
                    self._step_read(job)
            except LoadFailed as exc:
                failed.append(self._fail(job, exc))
                continue
            if rid in self._jobs and now > job.deadline:
                late = self._timeout(job)
                if late is not None:
                    failed.append(self._fail(job, late))
        if now >= self._next_reap:
            self._next_reap = now + REAP_EVERY_S
            self._reap(now)
        return failed

    def _settle_handshake(self, entry: _PeerEntry) -> list[Failure]:
        assert entry.pending is not None
        reply = entry.pending.result()
        entry.pending = None
        engine_id, host, port = entry.key
        try:
            peer = self._adopt(entry, reply)
        except LoadFailed as exc:
            if entry.peer is not None:
                # A suspect peer's re-check failed: retire it (new loads
                # handshake afresh); loads holding it finish on their own.
                logger.warning("PDConnector: re-check of engine %s at %s:%d failed (%s); "
                               "forgetting its cached handshake", engine_id, host, port,
                               exc.detail)
                self._retire(entry.peer)
                entry.peer = None
            self._peers.pop(entry.key, None)
            detail = f"handshake with {host}:{port} failed: {exc.detail}"
            out = []
            # Everyone waiting on this handshake fails now, not after
            # another timeout each.
            for rid in list(entry.waiting):
                job = self._jobs.get(rid)
                if job is not None and job.state is RecvState.HANDSHAKE:
                    out.append(self._fail(job, LoadFailed(exc.reason, detail, exc.release)))
            return out
        if entry.peer is None:
            entry.peer = peer
        elif entry.peer.name != peer.name:  # pragma: no cover - _adopt refuses this
            self._retire(entry.peer)
            entry.peer = peer
        return []

    def _adopt(self, entry: _PeerEntry, reply: proto.Reply | SideChannelError
               ) -> PeerSet:
        engine_id, host, port = entry.key
        if isinstance(reply, SideChannelError):
            reason = (FailureReason.INCOMPATIBLE if reply.code == ErrorCode.INCOMPATIBLE
                      else FailureReason.HANDSHAKE)
            # A P that did not answer holds no pin of ours: nothing to release.
            raise LoadFailed(reason, str(reply), release=reply.refused)
        if not isinstance(reply, proto.HandshakeReply):
            raise LoadFailed(FailureReason.HANDSHAKE, f"unexpected reply {type(reply).__name__}")
        if reply.engine_id != engine_id:
            raise LoadFailed(FailureReason.HANDSHAKE,
                             f"the engine at {host}:{port} is {reply.engine_id}, not "
                             f"{engine_id} (P restarted?)")
        diff = self.compat.diff(reply.compat)
        if diff:
            raise LoadFailed(FailureReason.INCOMPATIBLE, "incompatible peer: " + "; ".join(diff))
        plan = self._plan(reply)
        heads = (self.compat.num_kv_heads, reply.compat.num_kv_heads)
        for agent, _ in plan:
            problem = layout_problem(agent, self.regions, self.agents.kernel_blocks,
                                     heads if len(plan) > 1 or plan[0][1] else None)
            if problem:
                raise LoadFailed(FailureReason.LAYOUT, problem)
            problem = memory_problem(agent, self.transport.mem_type)
            if problem:
                raise LoadFailed(FailureReason.INCOMPATIBLE, problem)
        claimed = ",".join(a.agent_name for a, _ in plan)
        if entry.peer is not None:
            if entry.peer.name != claimed:
                raise LoadFailed(FailureReason.HANDSHAKE,
                                 f"engine {engine_id} at {host}:{port} now has agent(s) "
                                 f"{claimed!r}, not {entry.peer.name!r}")
            logger.info("PDConnector: re-check of engine %s at %s:%d: unchanged", engine_id,
                        host, port)
            return entry.peer
        loaded: list[tuple[CachedAgent, list[Slice] | None]] = []
        try:
            for agent, sl in plan:
                loaded.append((self.agents.load(agent, engine_id, entry.key,
                                                heads if sl else None), sl))
        except TransportError as exc:  # AgentMismatch included
            for cached, _ in loaded:
                self.agents.retire(cached)
            raise LoadFailed(FailureReason.HANDSHAKE, f"{host}:{port}: {exc}") from exc
        peer = PeerSet(loaded, heads)
        logger.info("PDConnector: handshake with engine %s done (agent %s, compat %s%s)",
                    reply.engine_id, peer.name, reply.compat.digest(),
                    "" if not plan[0][1] else f"; TP {reply.compat.tp_size} -> "
                    f"{self.compat.tp_size}, rank {self.tp_rank} reads "
                    + "; ".join(f"{len(sl or ())} slice(s) of rank {a.tp_rank}"
                                for a, sl in plan))
        return peer

    def _plan(self, reply: proto.HandshakeReply
              ) -> list[tuple[proto.AgentInfo, list[Slice] | None]]:
        """P's agents this rank reads and what of each (None: whole blocks),
        checked against the names P's agents must have."""
        engine_id = reply.engine_id
        by_rank = {a.tp_rank: a for a in reply.agents} or {reply.agent.tp_rank: reply.agent}
        try:
            p, d = sharding_of(reply.compat), sharding_of(self.compat)
            slices = slices_for(self.tp_rank, p, d)
        except TPMappingError as exc:
            raise LoadFailed(FailureReason.INCOMPATIBLE, f"tensor parallelism: {exc}") from exc
        whole = (len(slices) == 1 and slices[0].num_heads == self.compat.num_kv_heads
                 == reply.compat.num_kv_heads)
        out: list[tuple[proto.AgentInfo, list[Slice] | None]] = []
        for rank in sorted({s.p_rank for s in slices}):
            agent = by_rank.get(rank)
            if agent is None:
                raise LoadFailed(FailureReason.HANDSHAKE,
                                 f"engine {engine_id} sent no agent for its rank {rank}, which "
                                 f"rank {self.tp_rank} reads")
            if agent.tp_rank != rank or not agent.agent_name.startswith(
                    f"{engine_id}-tp{rank}-"):
                raise LoadFailed(FailureReason.HANDSHAKE,
                                 f"engine {engine_id} claims a rank-{rank} NIXL agent named "
                                 f"{agent.agent_name!r} (rank {agent.tp_rank})")
            out.append((agent, None if whole else [s for s in slices if s.p_rank == rank]))
        return out

    def _step_handshake(self, job: RecvJob) -> None:
        entry = self._peers.get(job.key)
        if entry is None:
            # The entry was dropped (its peer retired) while this load waited.
            entry = self._entry(job.key)
            entry.waiting.add(job.spec.request_id)
            return
        if entry.peer is None:
            return
        entry.waiting.discard(job.spec.request_id)
        peer = job.peer = entry.peer
        spec = job.spec
        try:
            reads = [(a.name, self._descriptors(spec, peer, a, sl), a.agent.device_id)
                     for a, sl in peer.reads]
        except ValueError as exc:  # TPMappingError included
            # Released all the same: P frees the blocks now, not at expiry.
            raise LoadFailed(FailureReason.LAYOUT, str(exc)) from exc

        def pinned(job: RecvJob = job) -> None:
            job.pin_at = self._clock()

        left = spec.valid_until - self._clock()
        if (spec.valid_until and spec.clock and spec.clock == monotonic_clock_id()
                and left > UNPINNED_MIN_LEFT_S):
            # A concurrent pull: P's answer extended the lease and said how
            # long (``d_pull_wait``), on the clock this process reads too:
            # no pin round trip.
            job.valid_until = spec.valid_until
            job.post_by = spec.valid_until - min(PIN_SAFETY_MARGIN_S, left / 4)
            job.pin_in_answer = True
        else:
            # The pin first: its send time bounds the READ's window from below.
            job.pin_sent = self._clock()
            job.pin = self._send(spec.remote_host, spec.remote_port, proto.LeaseRenew(
                engine_id=self.engine_id, request_ids=[spec.remote_request_id], acquire=True,
                tp_rank=self.tp_rank, consumer=spec.request_id,
                consumer_ranks=self.compat.tp_size), on_reply=pinned)
        job.posted = self._clock()
        job.nbytes = sum(n for _, descs, _ in reads for _, _, n in descs)
        job.ndescs = sum(len(descs) for _, descs, _ in reads)
        job.state = RecvState.POSTING
        for agent in peer.agents:
            self.agents.acquire(agent)
        job.holds_agents = True
        job.future = self._poster.submit(self._post, reads, job, spec.remote_request_id)
        job.future.add_done_callback(lambda _f: self._progress.set())

    def _step_pin(self, job: RecvJob) -> None:
        """Check the pin's reply once it came: set the READ's window, or fail
        the load once the READ settled (a queued post is not made)."""
        assert job.pin is not None
        if not job.pin.done():
            return
        spec = job.spec
        reply = job.pin.result()
        job.pin = None
        if isinstance(reply, SideChannelError):
            self._pin_failed(job, LoadFailed(FailureReason.LEASE_LOST, f"pin failed: {reply}"))
            return
        remaining = reply.remaining_s[0] if isinstance(reply, proto.LeaseStatus) else -1.0
        if remaining < 0:
            if remaining == proto.LEASE_UNKNOWN:
                self._suspect(job.key, f"P does not know lease {spec.remote_request_id}")
            what = {proto.LEASE_UNKNOWN: "unknown to P (P restarted, or the lease already "
                                         "ended: a replayed P answer?)",
                    proto.LEASE_EXPIRED: "expired on P"}.get(remaining, "not pinned")
            self._pin_failed(job, LoadFailed(
                FailureReason.LEASE_LOST, f"P's blocks for {spec.remote_request_id} are {what}",
                release=False))
            return
        job.valid_until = job.pin_sent + remaining
        # A post still queued goes out only with this margin left.
        job.post_by = job.valid_until - min(PIN_SAFETY_MARGIN_S, remaining / 4)

    def _pin_failed(self, job: RecvJob, exc: LoadFailed) -> None:
        job.pin_error = exc
        job.post_by = -math.inf  # a post still queued is not made
        if job.state is RecvState.READING:
            self._release_handles(job)  # cancel what can be cancelled now

    def _descriptors(self, spec: RecvSpec, peer: PeerSet, agent: CachedAgent,
                     slices: list[Slice] | None) -> list[Descriptor]:
        if slices is None:
            return build_descriptors(spec.local_block_ids, spec.remote_block_ids,
                                     self.regions, agent.agent.regions)
        return [d for sl in slices for d in slice_descriptors(
            spec.local_block_ids, spec.remote_block_ids, self.regions, agent.agent.regions,
            sl, *peer.heads)]

    def _post(self, reads: list[tuple[str, list[Descriptor], int]], job: RecvJob,
              remote_request_id: str
              ) -> tuple[list[Any], list[XferState], float, LoadFailed | None]:
        """Poster thread: post each P rank's READ, then poll once so that a
        copy done inside the post call is timed when it ended, not when the
        next step looks.

        ``job.post_by`` is checked at the post: posts are serialised, and one
        behind a long copy can wait past a lease its pin already bounded (or
        after its pin failed). A post that fails after an earlier one went
        out is returned, not raised: the posted READs must settle before D's
        blocks can go."""
        if self._clock() > job.post_by:
            raise LoadFailed(FailureReason.LEASE_LOST,
                             f"P's lease on {remote_request_id} ran out while the READ waited "
                             "for the poster thread; not read")
        handles: list[Any] = []
        error: LoadFailed | None = None
        for peer, descs, device_id in reads:
            try:
                handles.append(self.transport.post_read(peer, descs, device_id))
            except Exception as exc:
                if not handles:
                    raise
                error = LoadFailed(FailureReason.TRANSFER,
                                   f"READ post to {peer} failed: {type(exc).__name__}: {exc}")
                break
        return handles, [self.transport.poll(h) for h in handles], self._clock(), error

    def _step_post(self, job: RecvJob) -> None:
        assert job.future is not None
        if not job.future.done():
            return
        fut, job.future = job.future, None
        try:
            job.handles, states, at, job.post_error = fut.result()
        except TransportError as exc:
            self._suspect(job.key, f"READ post failed: {exc}")
            self._not_posted(job, LoadFailed(FailureReason.TRANSFER, str(exc)))
            return
        except LoadFailed as exc:
            self._not_posted(job, exc)
            return
        except Exception as exc:
            # A transport bug must fail this load, not the engine step. The
            # poll after a post never raises (transport contract), so an
            # exception here came from the post itself: nothing was posted.
            logger.exception("PDConnector: READ post for %s raised", job.spec.request_id)
            self._not_posted(job, LoadFailed(
                FailureReason.TRANSFER, f"READ post raised {type(exc).__name__}: {exc}"))
            return
        if all(s is XferState.DONE for s in states):
            job.done_at = at
        job.state = RecvState.READING

    def _not_posted(self, job: RecvJob, exc: LoadFailed) -> None:
        """Nothing was posted: the load fails, but after the pin answered,
        whose reason says more (a READ to a restarted P fails in the post;
        its pin says "unknown to P")."""
        self._unuse(job)
        job.not_posted = exc
        job.settled = True
        job.state = RecvState.READING

    def _step_read(self, job: RecvJob) -> None:
        if not job.settled:
            states = [self.transport.poll(h) for h in job.handles]
            if XferState.PROC in states and job.pin_error is None:
                return
            job.read_error = job.read_error or XferState.ERR in states
            if not self._release_handles(job):
                if not job.stuck_logged:
                    job.stuck_logged = True
                    logger.error("PDConnector: READ for %s finished (%s) but its handle cannot "
                                 "be released; keeping its blocks and retrying",
                                 job.spec.request_id, ",".join(s.value for s in states))
                return  # try again next step; blocks stay allocated
            job.settled = True
            job.done_at = job.done_at or self._clock()
            self._unuse(job)
        if job.pin is not None:
            return  # the bytes are in; the pin's answer says whether they count
        if job.pin_error is not None:
            raise job.pin_error
        if job.not_posted is not None:
            raise job.not_posted
        if job.post_error is not None:
            self._suspect(job.key, job.post_error.detail)
            raise job.post_error
        if job.read_error:
            self._suspect(job.key, "NIXL reported an error for a READ")
            raise LoadFailed(FailureReason.TRANSFER, "NIXL reported an error for the READ")
        done = self._clock()
        if job.done_at > job.valid_until:
            # P only promised the blocks until the pin's expiry; past it P may
            # have freed and refilled them (a P frozen mid-READ sweeps first
            # when it resumes), so bytes that landed later are not trusted.
            raise LoadFailed(
                FailureReason.LEASE_LOST,
                f"the READ of {job.spec.remote_request_id} ended "
                f"{job.done_at - job.valid_until:.1f} s after P's pinned lease could have "
                "expired (P frozen, or the READ stalled): P may have reused those blocks, so "
                "the KV is not used")
        del self._jobs[job.spec.request_id]
        self._release(job.spec, ok=True, reason="")
        self._records.append(job.record(done))
        self._on_loaded(job, done)

    def _release_handles(self, job: RecvJob) -> bool:
        """Release (or cancel) every READ handle of the load; True when none
        is left. One that cannot be released stays for the next try."""
        job.handles = [h for h in job.handles if not self.transport.release(h)]
        return not job.handles

    def _timeout(self, job: RecvJob) -> LoadFailed | None:
        if job.state is RecvState.POSTING:
            # The copy may be running inside the post call: D's blocks stay.
            if not job.stuck_logged:
                job.stuck_logged = True
                logger.error("PDConnector: READ post for %s passed its deadline; keeping its "
                             "blocks until the post returns", job.spec.request_id)
            return None
        if job.state is RecvState.READING and not job.settled:
            if not self._release_handles(job):
                if not job.stuck_logged:
                    job.stuck_logged = True
                    logger.error("PDConnector: READ for %s passed its deadline and cannot be "
                                 "cancelled; keeping its blocks until it settles",
                                 job.spec.request_id)
                return None
            job.settled = True
            self._unuse(job)
        return LoadFailed(FailureReason.TIMEOUT,
                          f"no KV after {self.transfer_timeout_s:.1f} s "
                          f"(state {job.state.value})")

    def _fail(self, job: RecvJob, exc: LoadFailed) -> Failure:
        spec = job.spec
        self._jobs.pop(spec.request_id, None)
        entry = self._peers.get(job.key)
        if entry is not None:
            entry.waiting.discard(spec.request_id)
        if exc.release:
            self._release(spec, ok=False, reason=exc.reason.value)
        self._records.append(job.record(self._clock(), exc.reason.value, exc.detail))
        return spec.request_id, spec.local_block_ids, exc.reason, exc.detail

    def _release(self, spec: RecvSpec, ok: bool, reason: str) -> None:
        self._io.send(spec.remote_host, spec.remote_port, proto.LeaseRelease(
            engine_id=self.engine_id, request_ids=[spec.remote_request_id],
            tp_rank=self.tp_rank, ok=ok, reason=reason, consumer=spec.request_id,
            consumer_ranks=self.compat.tp_size), _log_release_failure)

    # ------------------------------------------------------------ peers
    def _suspect(self, key: PeerKey, why: str) -> None:
        """Re-check the peer with a fresh handshake; keep using it meanwhile."""
        entry = self._peers.get(key)
        if entry is not None and entry.peer is not None and entry.pending is None:
            logger.info("PDConnector: %s; re-checking engine %s at %s:%d", why, *key)
            self._handshake(entry)

    def _unuse(self, job: RecvJob) -> None:
        if job.peer is not None and job.holds_agents:
            job.holds_agents = False
            for agent in job.peer.agents:
                self.agents.release(agent)

    def _retire(self, peer: PeerSet) -> None:
        for agent in peer.agents:
            self.agents.retire(agent)

    def _reap(self, now: float) -> None:
        """Idle agents go, and their cached handshakes with them (a set of
        P agents is used as one, so one gone retires the rest)."""
        for gone in self.agents.reap(now):
            key: PeerKey = gone.owner  # type: ignore[assignment]
            entry = self._peers.get(key)
            if entry is not None and entry.peer is not None and any(
                    a is gone for a in entry.peer.agents):
                self._retire(entry.peer)
                entry.peer = None
                if not entry.waiting and entry.pending is None:
                    del self._peers[key]

    # ------------------------------------------------------------ state
    def take_records(self) -> list[TransferRecord]:
        """The telemetry of the loads that ended since the last call."""
        out, self._records = self._records, []
        return out

    @property
    def num_in_flight(self) -> int:
        return len(self._jobs)

    @property
    def num_peers(self) -> int:
        """P agents loaded now (cached handshakes, and retired ones still in use)."""
        return len(self.agents)

    def close(self) -> None:
        self._io.close()
        self._poster.shutdown(wait=True)


def _log_release_failure(reply: proto.Reply | SideChannelError) -> None:
    if isinstance(reply, SideChannelError):
        logger.warning("PDConnector: release to P failed (its lease will expire): %s", reply)
