"""The worker half of PDConnector (runs in each vLLM worker process).

Lifecycle:

1. ``register_kv_caches``: check ``kv_buffer_device`` against where the KV
   is (``device.py``), describe each layer's KV tensor as block regions,
   install the transport's thread hook, register the memory with the
   transport (NIXL: DRAM on CPU, VRAM on GPU),
   start this rank's role and publish ``PDHandshakeMetadata`` for the
   scheduler's side channel. Roles, one module each:

   - D, pull: ``d_pull.PullReader`` reads P's blocks;
   - D, push: ``d_push.PushReceiver`` waits for P's WRITEs;
   - P, push: ``p_push.Pusher`` posts the WRITEs its scheduler orders;
   - P, pull: nothing runs here (D reads; the scheduler half pins).
2. Every step, ``start_load_kv`` hands the scheduler's specs to the role and
   lets it advance (never blocking the step).
3. ``get_transfer_results`` reports finished and failed receives (failed ids
   in both ``finished_recving`` and ``failed_recving`` so vLLM's failure
   policy applies). In a step that computes nothing (the scheduler says so)
   it first waits, up to ``pull_report_wait_ms``, for the pull loads in
   flight: a load started in this step is usually done in well under a
   millisecond, and reporting it now saves D's scheduler a whole step.
   vLLM sleeps 1 ms after such a step anyway, so nothing else waits.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from vllm_pd_ext import compat
from vllm_pd_ext.compat import patches
from vllm_pd_ext.compat.engine import note_model_step
from vllm_pd_ext.config import PDConfig
from vllm_pd_ext.log import get_logger
from vllm_pd_ext.metadata import PDConnectorMetadata, PDHandshakeMetadata, PDWorkerMetadata
from vllm_pd_ext.policy import FailureReason, LoadReport
from vllm_pd_ext.stats import PDStats
from vllm_pd_ext.transport import Transport
from vllm_pd_ext.wire import telemetry
from vllm_pd_ext.wire.protocol import AgentInfo, Region, TransferMode
from vllm_pd_ext.wire.pump_bell import Bell
from vllm_pd_ext.wire.telemetry import TransferRecord
from vllm_pd_ext.wire.wakeup import Waker
from vllm_pd_ext.worker import device
from vllm_pd_ext.worker.d_pull import PullReader, RecvJob
from vllm_pd_ext.worker.d_push import PushReceiver
from vllm_pd_ext.worker.p_push import Pusher

logger = get_logger(__name__)

#: While a step waits for its pull loads, the longest it goes without looking.
AWAIT_POLL_S = 0.0005


class PDWorker:
    def __init__(self, vllm_config: Any, cfg: PDConfig, transport: Transport | None = None,
                 tp_rank: int | None = None) -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.engine_id = compat.engine_id(vllm_config)
        self.tp_rank = compat.tp_rank() if tp_rank is None else tp_rank
        self.compat = compat.compat_info(vllm_config, cfg.transfer_mode)
        #: Signs this worker's side-channel messages (pins, releases, results).
        self.auth = cfg.frame_auth()
        self.transport = transport
        self.regions: list[Region] = []
        #: Kernel blocks per KV block (compat.kernel_blocks_per_block); peers must agree.
        self.kernel_blocks = 1
        self.agent: AgentInfo | None = None
        self._report = LoadReport()
        self._stats = PDStats()
        # Guards _stats: the push thread records its WRITEs from another thread.
        self._stats_lock = threading.Lock()
        self.reader: PullReader | None = None
        self.pusher: Pusher | None = None
        self.receiver: PushReceiver | None = None
        self.waker: Waker | None = None
        #: The progress pump's bell (the pump owns it once started).
        self.bell: Bell | None = None
        #: Telemetry of loads that ended outside the pull reader (push, and
        #: failures the scheduler decided); sent with the step's results.
        self._records: list[TransferRecord] = []
        #: Request id -> P's token #1 from its WRITE's notification, for D's
        #: scheduler (``pd_seed_pending``), sent with this step's records.
        self._seeds: dict[str, int] = {}
        #: This step computes nothing (``PDConnectorMetadata.idle``).
        self._idle_step = False

    # ------------------------------------------------------------- startup
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        first = next(iter(kv_caches.values()))
        num_blocks = self._num_blocks(first)
        mem = device.kv_memory(first)
        mem_type, device_id = mem.mem_type, mem.device_id
        kv_cfg = self.vllm_config.kv_transfer_config
        # Before anything is registered or started: a kv_buffer_device we
        # cannot honour stops the engine instead of being ignored.
        device.check_kv_buffer_device(getattr(kv_cfg, "kv_buffer_device", None), mem)
        self.regions = compat.kv_regions(kv_caches, num_blocks)
        self.kernel_blocks = compat.kernel_blocks_per_block(kv_caches, num_blocks)
        # This worker process's patches of vLLM (its shared-memory queue readers).
        patches.apply(patches.Process.WORKER, patches.Context(cfg=self.cfg))
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
            from vllm_pd_ext.worker.hugepages import prefer_huge_pages

            # Before registration, so NIXL/UCX never sees the small pages.
            done, tried = prefer_huge_pages(ranges)
            logger.info("PDConnector: KV cache on huge pages: %d of %d MiB", done >> 20,
                        tried >> 20)
        # Every thread that calls the transport runs this hook first (its
        # CUDA device on GPU); this step thread too, since it calls it.
        self.transport.set_thread_hook(device.thread_hook(mem))
        self.transport.enter_thread()
        self.transport.register(sorted(ranges.items()), mem_type, device_id)
        push = self.cfg.transfer_mode is TransferMode.PUSH
        # The transfer's target must progress for UCX wire-up (and, in push,
        # to collect notifications): P in pull mode, D in push mode.
        target = kv_cfg.is_kv_consumer if push else kv_cfg.is_kv_producer
        # Multi-turn: D's kept turns are read (by the next turn's P) too.
        target = target or self.cfg.bidirectional_kv_xfer
        if push and kv_cfg.is_kv_consumer and self.cfg.push_idle_wait_ms > 0:
            # Ends D's scheduler's idle wait the moment a WRITE's notification lands.
            self.waker = Waker(self.tp_rank)
        if (target and not self.cfg.nixl_progress_thread
                and self.cfg.nixl_progress_interval_ms > 0):
            # The scheduler half rings it when a peer starts working with us.
            self.bell = Bell()
            # Only push's receiver takes notifications; in pull they would pile up.
            self.transport.start_progress_pump(
                self.cfg.nixl_progress_interval_ms / 1e3, keep_notifs=push,
                on_notif=self._on_notif if self.waker is not None else None, bell=self.bell,
                # A push D (not read from: no multi-turn) knows when work is
                # due: fast while it expects WRITEs, not for 10 s after each.
                pending=(self._expects_writes if push and kv_cfg.is_kv_consumer
                         and not self.cfg.bidirectional_kv_xfer else None))
        if push and kv_cfg.is_kv_producer:
            own = (self.cfg.advertised_host,
                   compat.side_channel_port(self.vllm_config, self.cfg.side_channel_port))
            self.pusher = Pusher(self.engine_id, self.tp_rank, self.transport, self.regions,
                                 own, self.cfg.transfer_timeout, self.cfg.handshake_timeout,
                                 on_write=self._record_write, auth=self.auth,
                                 kernel_blocks=self.kernel_blocks)
        if push and kv_cfg.is_kv_consumer:
            self.receiver = PushReceiver(self.transport)
        self.agent = AgentInfo(
            tp_rank=self.tp_rank, agent_name=self.transport.agent_name,
            agent_metadata=self.transport.metadata(), mem_type=mem_type, device_id=device_id,
            kernel_blocks=self.kernel_blocks, regions=self.regions)
        logger.info("PDConnector: worker rank %d registered %d KV regions (%d blocks, %d B "
                    "per block) with %s", self.tp_rank, len(self.regions), num_blocks,
                    self.regions[0].block_len, type(self.transport).__name__)

    def _expects_writes(self) -> bool:
        """Read on the pump's thread: this rank waits for a WRITE."""
        receiver = self.receiver
        return receiver is not None and receiver.num_waiting > 0

    def _on_notif(self, notifs: list[bytes]) -> None:
        """The progress pump kept WRITE notifications: the scheduler may
        schedule their requests' first step at once (``same_step_landing``),
        so this worker's reader of the step RPCs spins for it, as after a
        step that reported a load (``note_model_step``), instead of waking
        from a sleep for it (0.4 to 3.8 ms on CPU). Then forward them."""
        note_model_step(True)
        assert self.waker is not None
        self.waker.wake(notifs)

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
            order_endpoint=self.pusher.endpoint if self.pusher is not None else None,
            wake_endpoint=self.waker.endpoint if self.waker is not None else None,
            pump_endpoint=self.bell.endpoint if self.bell is not None else None)

    # ------------------------------------------------------------- per step
    def start_load_kv(self, meta: PDConnectorMetadata | None) -> None:
        self._idle_step = meta is not None and meta.idle
        if meta is not None:
            for rid, (reason, why) in meta.reqs_to_fail.items():
                self._fail_now(rid, [], FailureReason(reason), why)
            if meta.reqs_to_recv:
                reader = self._pull_reader()
                for spec in meta.reqs_to_recv:
                    reader.expect(spec)
            if self.receiver is not None:
                now = time.monotonic()
                expected = self.receiver.num_waiting
                for push_spec in meta.push_recv:
                    self.receiver.expect(push_spec, now)
                if not expected and self.receiver.num_waiting and self.bell is not None:
                    # The pump may be at its idle pace: it must see these
                    # WRITEs land at once.
                    self.bell.poke()
                for rid, (reason, why) in meta.push_fail.items():
                    # Already reported as landed: never report a request twice.
                    if self.receiver.drop(rid):
                        self._fail_now(rid, [], FailureReason(reason), why)
        self._advance_pull()

    def _pull_reader(self) -> PullReader:
        if self.reader is None:
            if self.transport is None or self.agent is None:
                raise RuntimeError("PDConnector: KV load scheduled before register_kv_caches")
            # Started on first use: a P or a push engine never needs it.
            self.reader = PullReader(
                self.engine_id, self.tp_rank, self.compat, self.transport, self.regions,
                side_channel_timeout_s=self.cfg.handshake_timeout,
                transfer_timeout_s=self.cfg.transfer_timeout, on_loaded=self._loaded,
                auth=self.auth, kernel_blocks=self.kernel_blocks)
        return self.reader

    def _advance_pull(self) -> None:
        if self.reader is None:
            return
        for rid, block_ids, reason, detail in self.reader.advance():
            # The reader recorded these loads' telemetry itself.
            self._fail_now(rid, block_ids, reason, detail, record=False)

    def _await_pull(self, budget_s: float) -> None:
        """Advance the pull loads until one ends or ``budget_s`` passed;
        woken by each side-channel reply and each returned post, and looking
        at least every ``AWAIT_POLL_S`` (a READ that completes on its own,
        as on GPU, rings nothing)."""
        reader = self.reader
        if reader is None or budget_s <= 0:
            return
        end = time.monotonic() + budget_s
        while reader.num_in_flight and not self._report.finished_recving:
            self._advance_pull()
            left = end - time.monotonic()
            if self._report.finished_recving or left <= 0:
                return
            reader.wait_progress(min(left, AWAIT_POLL_S))

    def _loaded(self, job: RecvJob, done: float) -> None:
        copied = job.done_at or done
        with self._stats_lock:
            if job.spec.readback:
                self._stats.record_readback(job.nbytes, copied - job.posted)
            else:
                self._stats.record_transfer(job.nbytes, job.ndescs,
                                            len(job.spec.local_block_ids), copied - job.posted,
                                            done - job.arrived)
        self._report.add_done(job.spec.request_id)
        logger.info("PDConnector: request %s %s %d tokens (%d B, %d descriptors) from "
                    "engine %s in %.2f ms", job.spec.request_id,
                    "read back" if job.spec.readback else "loaded", job.spec.num_tokens,
                    job.nbytes, job.ndescs, job.spec.remote_engine_id,
                    (copied - job.posted) * 1e3)

    def _fail_now(self, rid: str, block_ids: list[int], reason: FailureReason,
                  detail: str, record: bool = True) -> None:
        if record:
            # Where the KV came from is filled in by D's scheduler, which
            # holds the request's params.
            self._records.append(TransferRecord(
                request_id=rid, remote_request_id="", p_engine="", p_addr="",
                mode=self.cfg.transfer_mode, outcome=reason.value, detail=detail[:300],
                blocks=len(block_ids)))
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

    # ------------------------------------------------------------- results
    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        if self._idle_step:
            self._idle_step = False
            self._await_pull(self.cfg.pull_report_wait_ms / 1e3)
        self._advance_pull()
        if self.receiver is not None and self.receiver.num_waiting:
            block_bytes = sum(r.block_len for r in self.regions)
            for landed in self.receiver.collect(time.monotonic()):
                spec = landed.spec
                if spec.want_seed and landed.seed < 0:
                    # D waits for token #1 to continue after it (the client
                    # has it from P): without it D cannot go on.
                    self._fail_now(spec.request_id, spec.local_block_ids,
                                   FailureReason.TRANSFER,
                                   "P's WRITE notification carried no token #1 (is P an "
                                   "older vllm_pd_ext?)")
                    continue
                if spec.want_seed:
                    self._seeds[spec.request_id] = landed.seed
                self._report.add_done(spec.request_id)
                nbytes = block_bytes * len(spec.local_block_ids)
                with self._stats_lock:
                    self._stats.record_landed(nbytes, len(spec.local_block_ids), landed.wait_s)
                self._records.append(TransferRecord(
                    request_id=spec.request_id, remote_request_id=spec.pd_request_id,
                    p_engine="", p_addr="", mode="push", bytes=nbytes,
                    blocks=len(spec.local_block_ids), tokens=spec.num_tokens,
                    write_wait_ms=telemetry.ms(landed.wait_s)))
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

    def build_worker_meta(self) -> PDWorkerMetadata | None:
        """The telemetry of the loads this rank ended since the last step."""
        records, self._records = self._records, []
        seeds, self._seeds = self._seeds, {}
        if self.reader is not None:
            records += self.reader.take_records()
        return PDWorkerMetadata(records, seeds) if records or seeds else None

    @property
    def num_in_flight(self) -> int:
        return self.reader.num_in_flight if self.reader is not None else 0

    def shutdown(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
        if self.reader is not None:
            self.reader.close()
        if self.transport is not None:
            self.transport.close()
        if self.waker is not None:
            self.waker.close()
