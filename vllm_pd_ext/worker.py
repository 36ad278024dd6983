"""The worker half of PDConnector (runs in each vLLM worker process).

Lifecycle:

1. ``register_kv_caches``: describe each layer's KV tensor as block regions,
   register the memory with the transport (NIXL: DRAM on CPU, VRAM on GPU)
   and publish ``PDHandshakeMetadata`` for the scheduler's side channel.
   Push mode: P's workers start a ``Pusher`` (posts the WRITEs its
   scheduler orders) and D's a ``PushReceiver`` (waits for their
   notifications); the rest of this docstring is pull mode.
2. Every step, ``start_load_kv`` takes the scheduler's ``RecvSpec``s and
   advances each receive through a small state machine, never blocking the
   step (side-channel round trips run on a thread pool):

       HANDSHAKE -> PIN -> POSTING -> READING -> done | failed

   HANDSHAKE fetches and checks the peer's layout once per remote engine
   (cached; dropped when the peer fails or restarts). PIN asks P to pin the
   lease and returns how long it is guaranteed; READs are posted only inside
   that window. POSTING hands the READ to one poster thread: on one host
   UCX copies inside the post call (about 16 ms per 256 MiB), and NIXL
   releases the GIL meanwhile, so the engine step (other requests' decode)
   is not held up. READING polls the transport.
3. ``get_transfer_results`` reports finished and failed receives (failed ids
   in both ``finished_recving`` and ``failed_recving`` so vLLM's failure
   policy applies).

A READ that cannot be released (it may still write into D's blocks) keeps
its request unreported, and so its blocks allocated, until it settles.
"""

from __future__ import annotations

import enum
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm_pd_ext import compat
from vllm_pd_ext import protocol as proto
from vllm_pd_ext.coalesce import build_descriptors
from vllm_pd_ext.config import PDConfig
from vllm_pd_ext.log import get_logger
from vllm_pd_ext.metadata import PDConnectorMetadata, PDHandshakeMetadata, RecvSpec
from vllm_pd_ext.policy import FailureReason, LoadReport
from vllm_pd_ext.push_receiver import PushReceiver
from vllm_pd_ext.pusher import Pusher
from vllm_pd_ext.side_channel import SideChannelClient, SideChannelError
from vllm_pd_ext.stats import PDStats
from vllm_pd_ext.transport import Transport, TransportError, XferState

logger = get_logger(__name__)

#: Never post a READ with less than this left on the pinned lease.
PIN_SAFETY_MARGIN_S = 1.0


class RecvState(enum.Enum):
    HANDSHAKE = "handshake"
    PIN = "pin"
    POSTING = "posting"
    READING = "reading"


@dataclass
class Peer:
    engine_id: str
    name: str
    agent: proto.AgentInfo


@dataclass
class RecvJob:
    spec: RecvSpec
    arrived: float
    deadline: float
    state: RecvState = RecvState.HANDSHAKE
    future: Future[Any] | None = None
    pin_sent: float = 0.0
    handle: Any = None
    posted: float = 0.0
    done_at: float = 0.0
    nbytes: int = 0
    ndescs: int = 0
    stuck_logged: bool = False


@dataclass
class _PeerSlot:
    future: Future[proto.Reply]
    peer: Peer | None = None
    jobs_waiting: set[str] = field(default_factory=set)


class PDWorker:
    def __init__(self, vllm_config: Any, cfg: PDConfig, transport: Transport | None = None,
                 tp_rank: int | None = None) -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.engine_id = compat.engine_id(vllm_config)
        if tp_rank is None:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        self.tp_rank = tp_rank
        self.compat = compat.compat_info(vllm_config, cfg.transfer_mode)
        self.transport = transport
        self.regions: list[proto.Region] = []
        self.agent: proto.AgentInfo | None = None
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pd-io")
        # One thread: posts are serialised, never concurrent with each other.
        self._poster = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-post")
        self._local = threading.local()
        self._peers: dict[str, _PeerSlot] = {}
        self._jobs: dict[str, RecvJob] = {}
        self._report = LoadReport()
        self._stats = PDStats()
        # Guards _stats: the push thread records its WRITEs from another thread.
        self._stats_lock = threading.Lock()
        self.pusher: Pusher | None = None
        self.receiver: PushReceiver | None = None

    # ------------------------------------------------------------- startup
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        first = next(iter(kv_caches.values()))
        num_blocks = self._num_blocks(first)
        self.regions = compat.kv_regions(kv_caches, num_blocks)
        mem_type = "VRAM" if first.is_cuda else "DRAM"
        device_id = (first.device.index or 0) if first.is_cuda else 0
        if self.transport is None:
            from vllm_pd_ext.transport import make_nixl_transport

            name = f"{self.engine_id}-tp{self.tp_rank}-{uuid.uuid4().hex[:8]}"
            self.transport = make_nixl_transport(
                name, self.cfg.nixl_backends, self.cfg.nixl_progress_thread)
        # Register whole storages once each (layers may be views of one slab).
        ranges = {}
        for t in kv_caches.values():
            storage = t.untyped_storage()
            ranges[storage.data_ptr()] = storage.nbytes()
        if mem_type == "DRAM" and self.cfg.kv_huge_pages:
            from vllm_pd_ext.hugepages import prefer_huge_pages

            # Before registration, so NIXL/UCX never sees the small pages.
            done, tried = prefer_huge_pages(ranges)
            logger.info("PDConnector: KV cache on huge pages: %d of %d MiB", done >> 20,
                        tried >> 20)
        self.transport.register(sorted(ranges.items()), mem_type, device_id)
        kv_cfg = self.vllm_config.kv_transfer_config
        push = self.cfg.transfer_mode == "push"
        # The transfer's target must progress for UCX wire-up (and, in push,
        # to collect notifications): P in pull mode, D in push mode.
        target = kv_cfg.is_kv_consumer if push else kv_cfg.is_kv_producer
        if (target and not self.cfg.nixl_progress_thread
                and self.cfg.nixl_progress_interval_ms > 0):
            # Only push's receiver takes notifications; in pull they would pile up.
            self.transport.start_progress_pump(self.cfg.nixl_progress_interval_ms / 1e3,
                                               keep_notifs=push)
        if push and kv_cfg.is_kv_producer:
            own = (self.cfg.side_channel_host,
                   compat.side_channel_port(self.vllm_config, self.cfg.side_channel_port))
            self.pusher = Pusher(self.engine_id, self.tp_rank, self.transport, self.regions,
                                 own, self.cfg.transfer_timeout, self.cfg.handshake_timeout,
                                 on_write=self._record_write)
        if push and kv_cfg.is_kv_consumer:
            self.receiver = PushReceiver(self.transport)
        self.agent = proto.AgentInfo(
            tp_rank=self.tp_rank, agent_name=self.transport.agent_name,
            agent_metadata=self.transport.metadata(), mem_type=mem_type, device_id=device_id,
            regions=self.regions)
        logger.info("PDConnector: worker rank %d registered %d KV regions (%d blocks, %d B "
                    "per block) with %s", self.tp_rank, len(self.regions), num_blocks,
                    self.regions[0].block_len, type(self.transport).__name__)

    def _num_blocks(self, t: Any) -> int:
        cc = self.vllm_config.cache_config
        n = getattr(cc, "num_gpu_blocks", None)
        if n:
            return int(n)
        return int(t.shape[1] if t.shape[0] == 2 and t.dim() == 5 else t.shape[0])

    def get_handshake_metadata(self) -> PDHandshakeMetadata | None:
        if self.agent is None:
            return None
        return PDHandshakeMetadata(
            agent=self.agent,
            order_endpoint=self.pusher.endpoint if self.pusher is not None else None)

    # ------------------------------------------------------------- per step
    def start_load_kv(self, meta: PDConnectorMetadata | None) -> None:
        now = time.monotonic()
        if meta is not None:
            for rid, (reason, why) in meta.reqs_to_fail.items():
                self._fail_now(rid, [], FailureReason(reason), why)
            for spec in meta.reqs_to_recv:
                self._jobs[spec.request_id] = RecvJob(
                    spec, arrived=now, deadline=now + self.cfg.transfer_timeout)
                self._start_handshake(spec)
            if self.receiver is not None:
                for push_spec in meta.push_recv:
                    self.receiver.expect(push_spec, now)
                for rid, (reason, why) in meta.push_fail.items():
                    # Already reported as landed: never report a request twice.
                    if self.receiver.drop(rid):
                        self._fail_now(rid, [], FailureReason(reason), why)
        if self._jobs:
            self._advance()

    def _client(self) -> SideChannelClient:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = SideChannelClient(self.cfg.handshake_timeout)
        return client

    def _start_handshake(self, spec: RecvSpec) -> None:
        slot = self._peers.get(spec.remote_engine_id)
        if slot is None:
            msg = proto.HandshakeRequest(
                engine_id=self.engine_id, tp_rank=self.tp_rank, compat=self.compat)
            fut = self._io.submit(self._client_request, spec.remote_host, spec.remote_port, msg)
            slot = self._peers[spec.remote_engine_id] = _PeerSlot(fut)
            logger.info("PDConnector: handshake with engine %s at %s:%d (rank %d)",
                        spec.remote_engine_id, spec.remote_host, spec.remote_port, self.tp_rank)
        slot.jobs_waiting.add(spec.request_id)

    def _client_request(self, host: str, port: int, msg: proto.Request) -> proto.Reply:
        return self._client().request(host, port, msg)

    def _advance(self) -> None:
        now = time.monotonic()
        for rid, job in list(self._jobs.items()):
            if rid not in self._jobs:
                continue  # failed together with its peer's handshake this pass
            try:
                if job.state is RecvState.HANDSHAKE:
                    self._step_handshake(job)
                if job.state is RecvState.PIN:
                    self._step_pin(job, now)
                if job.state is RecvState.POSTING:
                    self._step_post(job)
                if job.state is RecvState.READING:
                    self._step_read(job)
            except _LoadFailed as exc:
                self._fail(job, exc.reason, exc.detail)
                continue
            if rid in self._jobs and now > job.deadline:
                self._timeout(job)

    def _step_handshake(self, job: RecvJob) -> None:
        spec = job.spec
        slot = self._peers.get(spec.remote_engine_id)
        if slot is None:
            # The cached handshake was dropped (another load to this peer failed
            # or the peer restarted) while this job waited: ask again.
            self._start_handshake(spec)
            return
        if slot.peer is None:
            if not slot.future.done():
                return
            try:
                reply = slot.future.result()
                slot.peer = self._adopt_peer(spec, reply)
            except (SideChannelError, TransportError, _LoadFailed) as exc:
                self._peers.pop(spec.remote_engine_id, None)
                reason = getattr(exc, "reason", FailureReason.HANDSHAKE)
                if "incompatible" in str(exc):
                    reason = FailureReason.INCOMPATIBLE
                detail = f"handshake with {spec.remote_host}:{spec.remote_port} failed: {exc}"
                # Everyone waiting on this handshake fails now, not after
                # another handshake_timeout each.
                for other in slot.jobs_waiting - {spec.request_id}:
                    waiting = self._jobs.get(other)
                    if waiting is not None and waiting.state is RecvState.HANDSHAKE:
                        self._fail(waiting, reason, detail)
                raise _LoadFailed(reason, detail) from exc
        slot.jobs_waiting.discard(spec.request_id)  # no longer waits on the handshake
        job.state = RecvState.PIN
        job.pin_sent = time.monotonic()
        job.future = self._io.submit(
            self._client_request, spec.remote_host, spec.remote_port,
            proto.LeaseRenew(engine_id=self.engine_id, request_ids=[spec.remote_request_id],
                             acquire=True))

    def _adopt_peer(self, spec: RecvSpec, reply: proto.Reply) -> Peer:
        if not isinstance(reply, proto.HandshakeReply):
            raise _LoadFailed(FailureReason.HANDSHAKE, f"unexpected reply {type(reply).__name__}")
        if reply.engine_id != spec.remote_engine_id:
            raise _LoadFailed(FailureReason.HANDSHAKE,
                              f"the engine at {spec.remote_host}:{spec.remote_port} is "
                              f"{reply.engine_id}, not {spec.remote_engine_id} (P restarted?)")
        diff = self.compat.diff(reply.compat)
        if diff:
            raise _LoadFailed(FailureReason.INCOMPATIBLE, "incompatible peer: " + "; ".join(diff))
        if len(reply.agent.regions) != len(self.regions) or any(
                a.block_len != b.block_len for a, b in zip(reply.agent.regions, self.regions,
                                                           strict=False)):
            raise _LoadFailed(FailureReason.LAYOUT, "KV region layout differs from ours")
        assert self.transport is not None
        name = self.transport.add_peer(reply.agent.agent_metadata)
        logger.info("PDConnector: handshake with engine %s done (agent %s, compat %s)",
                    reply.engine_id, name, reply.compat.digest())
        return Peer(reply.engine_id, name, reply.agent)

    def _step_pin(self, job: RecvJob, now: float) -> None:
        assert job.future is not None
        if not job.future.done():
            return
        spec = job.spec
        try:
            reply = job.future.result()
        except SideChannelError as exc:
            self._drop_peer(spec.remote_engine_id)
            raise _LoadFailed(FailureReason.LEASE_LOST, f"pin failed: {exc}") from exc
        remaining = reply.remaining_s[0] if isinstance(reply, proto.LeaseStatus) else -1.0
        valid_until = job.pin_sent + remaining
        margin = min(PIN_SAFETY_MARGIN_S, remaining / 4)
        if remaining < 0 or valid_until - time.monotonic() < margin:
            if remaining == proto.LEASE_UNKNOWN:
                self._drop_peer(spec.remote_engine_id)
            what = {proto.LEASE_UNKNOWN: "unknown to P (P restarted?)",
                    proto.LEASE_EXPIRED: "expired on P"}.get(remaining, "about to expire")
            raise _LoadFailed(FailureReason.LEASE_LOST,
                              f"P's blocks for {spec.remote_request_id} are {what}")
        slot = self._peers.get(spec.remote_engine_id)
        if slot is None or slot.peer is None:
            raise _LoadFailed(FailureReason.HANDSHAKE, "peer dropped while pinning")
        peer = slot.peer
        try:
            descs = build_descriptors(spec.local_block_ids, spec.remote_block_ids,
                                      self.regions, peer.agent.regions)
        except ValueError as exc:
            raise _LoadFailed(FailureReason.LAYOUT, str(exc)) from exc
        assert self.transport is not None
        job.posted = time.monotonic()
        job.nbytes = sum(n for _, _, n in descs)
        job.ndescs = len(descs)
        job.state = RecvState.POSTING
        job.future = self._poster.submit(self._post, peer.name, descs, peer.agent.device_id,
                                         valid_until - margin, spec.remote_request_id)
        self._step_post(job)

    def _post(self, peer: str, descs: list[Any], device_id: int, post_by: float,
              remote_request_id: str) -> tuple[Any, XferState, float]:
        """Poster thread: post, then poll once so that a copy done inside the
        post call is timed when it ended, not when the next step looks.

        The pin's margin is checked again here, at the post: posts are
        serialised, and one behind a long copy can wait past the lease."""
        assert self.transport is not None
        if time.monotonic() > post_by:
            raise _LoadFailed(FailureReason.LEASE_LOST,
                              f"P's lease on {remote_request_id} ran out while the READ waited "
                              "for the poster thread; not read")
        handle = self.transport.post_read(peer, descs, device_id)
        return handle, self.transport.poll(handle), time.monotonic()

    def _step_post(self, job: RecvJob) -> None:
        assert job.future is not None
        if not job.future.done():
            return
        try:
            job.handle, state, at = job.future.result()
            if state is XferState.DONE:
                job.done_at = at
        except TransportError as exc:
            self._drop_peer(job.spec.remote_engine_id)
            raise _LoadFailed(FailureReason.TRANSFER, str(exc)) from exc
        finally:
            job.future = None
        job.state = RecvState.READING

    def _step_read(self, job: RecvJob) -> None:
        assert self.transport is not None
        state = self.transport.poll(job.handle)
        if state is XferState.PROC:
            return
        if not self.transport.release(job.handle):
            if not job.stuck_logged:
                job.stuck_logged = True
                logger.error("PDConnector: READ for %s finished (%s) but its handle cannot be "
                             "released; keeping its blocks and retrying", job.spec.request_id,
                             state.value)
            return  # try again next step; blocks stay allocated
        job.handle = None
        if state is XferState.ERR:
            self._drop_peer(job.spec.remote_engine_id)
            raise _LoadFailed(FailureReason.TRANSFER, "NIXL reported an error for the READ")
        done = time.monotonic()
        copied = job.done_at or done
        with self._stats_lock:
            self._stats.record_transfer(job.nbytes, job.ndescs, len(job.spec.local_block_ids),
                                        copied - job.posted, done - job.arrived)
        del self._jobs[job.spec.request_id]
        self._report.add_done(job.spec.request_id)
        self._send_release(job.spec, ok=True, reason="")
        logger.info("PDConnector: request %s loaded %d tokens (%d B, %d descriptors) from "
                    "engine %s in %.2f ms", job.spec.request_id, job.spec.num_tokens, job.nbytes,
                    job.ndescs, job.spec.remote_engine_id, (copied - job.posted) * 1e3)

    def _timeout(self, job: RecvJob) -> None:
        if job.state is RecvState.POSTING:
            # The copy may be running inside the post call: D's blocks stay.
            if not job.stuck_logged:
                job.stuck_logged = True
                logger.error("PDConnector: READ post for %s passed its deadline; keeping its "
                             "blocks until the post returns", job.spec.request_id)
            return
        if job.state is RecvState.READING:
            assert self.transport is not None
            if not self.transport.release(job.handle):
                if not job.stuck_logged:
                    job.stuck_logged = True
                    logger.error("PDConnector: READ for %s passed its deadline and cannot be "
                                 "cancelled; keeping its blocks until it settles",
                                 job.spec.request_id)
                return
            job.handle = None
        self._fail(job, FailureReason.TIMEOUT,
                   f"no KV after {self.cfg.transfer_timeout:.1f} s (state {job.state.value})")

    def _fail(self, job: RecvJob, reason: FailureReason, detail: str) -> None:
        self._jobs.pop(job.spec.request_id, None)
        slot = self._peers.get(job.spec.remote_engine_id)
        if slot is not None:
            slot.jobs_waiting.discard(job.spec.request_id)
        if reason is not FailureReason.LEASE_LOST:
            self._send_release(job.spec, ok=False, reason=reason.value)
        self._fail_now(job.spec.request_id, job.spec.local_block_ids, reason, detail)

    def _fail_now(self, rid: str, block_ids: list[int], reason: FailureReason,
                  detail: str) -> None:
        if reason is FailureReason.ABORTED:
            # The request already ended; reporting it lets vLLM free the blocks.
            self._report.add_failed(rid, block_ids)
            logger.info("PDConnector: request %s ended before its KV arrived (%s); P confirmed "
                        "no WRITE can land, releasing its blocks", rid, detail)
            return
        with self._stats_lock:
            self._stats.inc("num_failures")
        self._report.add_failed(rid, block_ids)
        logger.error("PDConnector: KV load for request %s failed (%s): %s; "
                     "kv_load_failure_policy applies", rid, reason.value, detail)

    def _send_release(self, spec: RecvSpec, ok: bool, reason: str) -> None:
        msg = proto.LeaseRelease(engine_id=self.engine_id, request_ids=[spec.remote_request_id],
                                 tp_rank=self.tp_rank, ok=ok, reason=reason)
        fut = self._io.submit(self._client_request, spec.remote_host, spec.remote_port, msg)
        fut.add_done_callback(_log_release_failure)

    def _drop_peer(self, engine_id: str) -> None:
        slot = self._peers.pop(engine_id, None)
        if slot is not None and slot.peer is not None and self.transport is not None:
            if not any(j.state in (RecvState.POSTING, RecvState.READING)
                       and j.spec.remote_engine_id == engine_id for j in self._jobs.values()):
                self.transport.remove_peer(slot.peer.name)
            logger.info("PDConnector: dropped cached handshake with engine %s", engine_id)

    # ------------------------------------------------------------- results
    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        if self._jobs:
            self._advance()
        if self.receiver is not None and self.receiver.num_waiting:
            block_bytes = sum(r.block_len for r in self.regions)
            for landed in self.receiver.collect(time.monotonic()):
                spec = landed.spec
                self._report.add_done(spec.request_id)
                nbytes = block_bytes * len(spec.local_block_ids)
                with self._stats_lock:
                    self._stats.record_landed(nbytes, len(spec.local_block_ids), landed.wait_s)
                logger.info("PDConnector: request %s received %d tokens (%d B) pushed for %s; "
                            "waited %.2f ms", spec.request_id, spec.num_tokens, nbytes,
                            spec.pd_request_id, landed.wait_s * 1e3)
        report, self._report = self._report, LoadReport()
        # P's blocks are pinned and freed by the scheduler half, so nothing is
        # ever reported in finished_sending.
        return set(), report.finished_recving, report.failed_recving

    def _record_write(self, nbytes: int, ndescs: int, nblocks: int, seconds: float) -> None:
        with self._stats_lock:
            self._stats.record_write(nbytes, ndescs, nblocks, seconds)

    def get_kv_connector_stats(self) -> PDStats | None:
        with self._stats_lock:
            return self._stats.take()

    @property
    def num_in_flight(self) -> int:
        return len(self._jobs)

    def shutdown(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
        self._io.shutdown(wait=False, cancel_futures=True)
        self._poster.shutdown(wait=True)
        if self.transport is not None:
            self.transport.close()


class _LoadFailed(Exception):
    def __init__(self, reason: FailureReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _log_release_failure(fut: Future[Any]) -> None:
    exc = fut.exception()
    if exc is not None:
        logger.warning("PDConnector: release to P failed (its lease will expire): %s", exc)
