"""The scheduler half of PDConnector (runs in the EngineCore process).

As P (producer): on ``request_finished`` of a ``do_remote_decode`` prefill it
pins the request's blocks in vLLM's block pool (one extra reference each),
grants a lease and returns vLLM-compatible ``kv_transfer_params``; vLLM then
drops its own references at once, so the request is gone from the scheduler
and an idle P does not step. The side channel serves handshakes and lease
messages; ``_sweep`` (on every step and on every new request, always on the
scheduler thread) drops our reference for each released or expired lease,
exactly once.

Why not vLLM's delayed free (``request_finished -> (True, ...)`` and
``finished_sending``): vLLM keeps stepping an engine that holds such
requests, and its worker busy-polls the step queue for a second after each
step, so an idle P holding one lease burns more than a core (measured: 119%
of a core; about 1.4% with pinning).

As D (consumer): a request arriving with ``do_remote_prefill`` is decoded
into ``KVTransferParams`` once (``on_new_request``) and kept in one
``DRequest`` record until it ends; heartbeats to P start at once,
``get_num_new_matched_tokens`` asks vLLM to load the prompt tokens D does
not hold asynchronously, and ``update_state_after_alloc`` hands D's fresh
blocks to the mode's half: ``d_pull_scheduler.PullConsumer`` pairs them with
P's blocks into a ``RecvSpec`` for the workers. Heartbeats stop when the load
is reported finished (or failed). Two live requests naming one P lease (a
replayed P answer, ``n > 1``) are refused: the second fails its load with a
clear error.

Push mode (``transfer_mode: push``) reuses the pinning, leases and
heartbeats, keyed by the proxy's ``pd_request_id`` (P's and D's internal
ids differ): P's half is ``p_push_scheduler.PushProducer`` (match D's
registration with the finished prefill, order the WRITEs), D's is
``d_push_scheduler.PushConsumer`` (register the blocks D lacks, bound the
wait, abort before reusing blocks).

Multi-turn (``bidirectional_kv_xfer``, ``bidir.py``): at the end of a turn D
keeps the request's full blocks under a lease of its own (``_keep_turn``:
the same pinning, ``LeaseService`` and sweep as P, first expiry
``decoder_kv_blocks_ttl``, within ``decoder_kv_blocks_budget``) and answers
with their block hashes; on the next turn P's ``readback.ReadBackConsumer``
reads back the prefix that matches its prompt, from either transfer mode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from vllm_pd_ext import compat
from vllm_pd_ext.config import PDConfig
from vllm_pd_ext.leases.service import LeaseService
from vllm_pd_ext.leases.table import LeaseTable
from vllm_pd_ext.log import get_logger
from vllm_pd_ext.metadata import (
    LayoutProblem,
    PDConnectorMetadata,
    PDHandshakeMetadata,
    PushRecvSpec,
    RecvSpec,
)
from vllm_pd_ext.policy import FailureReason
from vllm_pd_ext.scheduler import bidir
from vllm_pd_ext.scheduler.affinity import bind_engine_core
from vllm_pd_ext.scheduler.bidir import Fallback, KeptTurns
from vllm_pd_ext.scheduler.d_pull import PullConsumer
from vllm_pd_ext.scheduler.d_push import PushConsumer
from vllm_pd_ext.scheduler.heartbeats import HeartbeatSender
from vllm_pd_ext.scheduler.p_push import PushProducer
from vllm_pd_ext.scheduler.p_readback import ReadBackConsumer
from vllm_pd_ext.stats import PDStats
from vllm_pd_ext.wire import auth, telemetry
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.protocol import KVTransferParams, ParamsError, answer_params, decode_params
from vllm_pd_ext.wire.side_channel import SideChannelServer
from vllm_pd_ext.wire.wakeup import IdleWait, should_wait

logger = get_logger(__name__)


@dataclass
class DRequest:
    """D: one request that expects remote KV, from arrival to its end."""

    #: None when its params were refused (``bad`` says why).
    params: KVTransferParams | None
    bad: str = ""
    #: ``update_state_after_alloc`` ran: its load is queued, or not needed.
    allocated: bool = False
    #: A load (or its failure) is queued for the workers; they report it.
    loading: bool = False
    #: The P lease it holds in ``_lease_users`` (engine id, lease key).
    lease: tuple[str, str] | None = None
    #: vLLM finished the request while its load was in flight; the record
    #: goes when the workers report the load.
    ended: bool = False
    #: When it arrived (monotonic): the start of its telemetry's ``kv_ready_ms``.
    arrived: float = 0.0
    #: Its load's telemetry, once the workers reported it (telemetry.py).
    transfer: telemetry.TransferRecord | None = None


class PDScheduler:
    def __init__(self, vllm_config: Any, cfg: PDConfig) -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        if cfg.bind_engine_core:
            bind_engine_core(compat.is_cpu_platform(), compat.omp_threads_bind())
        if cfg.quiet_shm_spin and compat.is_cpu_platform():
            logger.info("PDConnector: %d shared-memory queue reader(s) of the EngineCore wait "
                        "on notifications instead of spinning (quiet_shm_spin)",
                        compat.quiet_shm_spin())
        window = compat.ensure_drain_window(vllm_config, cfg.drain_timeout)
        logger.info("PDConnector: on SIGTERM the EngineCore drains for up to %d s (granted "
                    "leases are served first; drain_timeout / --shutdown-timeout)", window)
        #: Set by vLLM's SIGTERM/SIGINT in the EngineCore: keep stepping
        #: while granted leases are held (has_pending_push_work).
        self.shutting_down = False
        compat.on_engine_shutdown(self._on_engine_shutdown)
        self.engine_id = compat.engine_id(vllm_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        #: Where the side channel listens, and the address peers are told.
        self.bind_host = cfg.side_channel_host
        self.host = cfg.advertised_host
        self.auth = cfg.frame_auth()
        if self.auth is None:
            logger.warning(
                "PDConnector: no shared secret (auth_secret_file, or the environment variable "
                "%s): the side channel and kv_transfer_params are unauthenticated; run only "
                "on an isolated network (docs/security.md)",
                cfg.auth_secret_env or auth.DEFAULT_SECRET_ENV)
        else:
            logger.info("PDConnector: side channel and legs authenticated (%s)",
                        self.auth.keyring.describe())
        #: P: requests whose do_remote_decode leg failed authentication.
        self._unsigned: set[str] = set()
        self.port = compat.side_channel_port(vllm_config, cfg.side_channel_port)
        self.compat = compat.compat_info(vllm_config, cfg.transfer_mode)
        # P's leases; push: D heartbeats from arrival, before P knows the id.
        self.leases = LeaseService(LeaseTable(cfg.lease_duration, time.monotonic),
                                   unknown_heartbeats_expected=cfg.transfer_mode == "push",
                                   owner=self.engine_id)
        self.heartbeats = HeartbeatSender(
            self.engine_id, cfg.effective_heartbeat_interval, cfg.handshake_timeout,
            auth=self.auth)
        self._server: SideChannelServer | None = None
        self._block_pool: Any = None
        # P side: pinned blocks per leased request id.
        self._pinned: dict[str, list[Any]] = {}
        self._stats = PDStats()
        self._reported_heartbeats = 0
        self._reported_late = 0
        self._reported_unauth = 0
        self._reported_wrong = 0
        # D side: one record per request; the step's output for the workers.
        self._d: dict[str, DRequest] = {}
        #: (P engine id, lease key) -> the D request using it.
        self._lease_users: dict[tuple[str, str], str] = {}
        self.pull = PullConsumer(self.block_size, self.tp_size, self.heartbeats)
        #: P: next turns reading a previous turn back from D.
        self.readback = ReadBackConsumer(
            enabled=cfg.bidirectional_kv_xfer, block_size=self.block_size,
            tp_size=self.tp_size, threshold=cfg.kv_recompute_threshold,
            heartbeats=self.heartbeats, count=self._count_fallback)
        self._reported_readback = (0, 0)
        #: D: kept turns (their blocks are in _pinned); sized on bind_gpu_block_pool.
        self.kept = KeptTurns(0)
        self._kept_evicted = False
        if cfg.bidirectional_kv_xfer:
            logger.info("PDConnector: bidirectional KV on: finished turns are kept for %.0f s "
                        "(decoder_kv_blocks_ttl, then renewed by the reader), next turns read "
                        "back >= %d tokens (kv_recompute_threshold)", cfg.decoder_kv_blocks_ttl,
                        cfg.kv_recompute_threshold)
        self._pending_recv: list[RecvSpec] = []
        self._pending_fail: dict[str, tuple[str, str]] = {}
        self.push = cfg.transfer_mode == "push"
        self.producer: PushProducer | None = None
        self.consumer: PushConsumer | None = None
        self._pending_push: list[PushRecvSpec] = []
        if self.push:
            self.producer = PushProducer(self.engine_id, self.compat, self.block_size,
                                         self.tp_size, self.leases, cfg.handshake_timeout,
                                         auth=self.auth)
            self.consumer = PushConsumer(self.engine_id, self.compat, self.host, self.port,
                                         cfg.push_timeout, cfg.handshake_timeout,
                                         write_timeout_s=cfg.transfer_timeout,
                                         queue_timeout_s=cfg.push_queue_timeout,
                                         auth=self.auth)
        #: D, push: sleeps through empty steps while D waits for P (idle_wait.py).
        self.idle: IdleWait | None = None
        if (self.consumer is not None and cfg.push_idle_wait_ms > 0
                and vllm_config.kv_transfer_config.is_kv_consumer):
            self.idle = IdleWait(cfg.push_idle_wait_ms / 1e3)
            self.consumer.on_event = self.idle.wake

    # ---------------------------------------------------------------- startup
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        agents = {}
        orders = {}
        for rank, meta in metadata.items():
            if isinstance(meta, PDHandshakeMetadata):
                agents[int(rank)] = meta.agent
                if meta.order_endpoint:
                    orders[int(rank)] = meta.order_endpoint
        if self.consumer is not None:
            self.consumer.agents = [agents[r] for r in sorted(agents)]
        if self.producer is not None and orders:
            self.producer.bind_workers(orders)
        if self.idle is not None:
            self.idle.connect([m.wake_endpoint for m in metadata.values()
                               if isinstance(m, PDHandshakeMetadata) and m.wake_endpoint])
        self._server = SideChannelServer(
            self.bind_host, self.port, self.engine_id, self.compat, agents, self.leases,
            push=_PushDispatch(self) if self.push else None, auth=self.auth)

    def bind_gpu_block_pool(self, block_pool: Any) -> None:
        self._block_pool = block_pool
        num = int(getattr(block_pool, "num_gpu_blocks", 0) or len(block_pool.blocks))
        self.kept = KeptTurns(int(num * self.cfg.decoder_kv_blocks_budget))

    # ---------------------------------------------------------------- D side
    def on_new_request(self, request: Any) -> None:
        # An idle P does not step: free what D released before this request
        # competes for blocks.
        self._sweep()
        rid = request.request_id
        try:
            params = decode_params(request.kv_transfer_params)
        except ParamsError as exc:
            if isinstance(request.kv_transfer_params, dict) and not request.kv_transfer_params.get(
                    "do_remote_prefill"):
                # Malformed P-leg params are reported in request_finished.
                return
            self._refuse(rid, str(exc))
            return
        if params is not None and (params.do_remote_prefill or params.do_remote_decode
                                   or params.pd_bidirectional):
            problem = self._leg_auth_problem(request.kv_transfer_params)
            if problem is not None:
                self._stats.inc("num_unauthenticated")
                if params.do_remote_prefill:
                    self._refuse(rid, f"unauthenticated kv_transfer_params: {problem}")
                else:
                    self._unsigned.add(rid)
                    logger.error("PDConnector: request %s: unauthenticated kv_transfer_params "
                                 "(%s); its KV is not handed over", rid, problem)
                return
            digest = params.remote_prompt_digest
            if (params.do_remote_prefill and digest and not compat.is_rejection_notice(request)
                    and digest != auth.token_digest(request.prompt_token_ids)):
                self._refuse(rid, "kv_transfer_params come from the prefill of another prompt "
                             "(P's prompt digest differs from this request's): its KV would "
                             "not match")
                return
        if params is None or not params.do_remote_prefill:
            if params is not None and params.is_readback and not params.pd_ext_probe:
                self.readback.arrive(rid, params, list(request.prompt_token_ids))
            if (params is not None and params.do_remote_decode and self.producer is not None
                    and params.mode == "push" and not params.pd_ext_probe
                    and params.pd_request_id):
                # P holds this request from now: D's renewals keep its
                # registration while it queues here.
                self.producer.admit(str(params.pd_request_id))
            return
        if params.mode != self.cfg.transfer_mode:
            self._refuse(rid, f"kv_transfer_params.transfer_mode={params.mode!r} but this engine "
                         f"runs transfer_mode={self.cfg.transfer_mode!r} (give P, D and the proxy "
                         "the same transfer_mode)")
            return
        if params.tp_size != self.tp_size:
            # Never loop over a count from the request: D's own TP size is the
            # rank count, and the handshake refuses a P whose TP size differs.
            self._refuse(rid, f"kv_transfer_params.tp_size={params.tp_size} but this engine runs "
                         f"tensor_parallel_size={self.tp_size} (P and D must use the same TP "
                         "size)")
            return
        lease = (str(params.remote_engine_id), _lease_key(params))
        user = self._lease_users.get(lease)
        if user is not None and user != rid:
            self._refuse(rid, f"kv_transfer_params name P lease {lease[1]} of engine {lease[0]}, "
                         f"which request {user} on this engine is already using (a replayed P "
                         "answer, or n > 1 / best_of: one prefill's KV feeds one decode)")
            return
        self._lease_users[lease] = rid
        self._d[rid] = DRequest(params, lease=lease, arrived=time.monotonic())
        assert params.remote_host is not None and params.remote_port is not None
        self.heartbeats.track(rid, (params.remote_host, params.remote_port), _lease_key(params))
        logger.info("PDConnector: request %s arrived for remote prefill %s on engine %s (%s)",
                    rid, _lease_key(params), params.remote_engine_id, params.mode)

    def _leg_auth_problem(self, raw: Any) -> str | None:
        """Why the proxy's signature on these params does not hold; None if it does.

        The API server's middleware (leg_auth.py) already refused a bad leg
        with a 4xx; this is the EngineCore's own check, so an engine started
        without that middleware still never acts on an unsigned leg.
        """
        if self.auth is None:
            return None
        try:
            auth.verify_leg(self.auth.keyring, raw)
        except auth.AuthError as exc:
            return exc.reason
        return None

    def _refuse(self, rid: str, why: str) -> None:
        self._d[rid] = DRequest(None, bad=why)
        logger.error("PDConnector: request %s: %s; its KV load will fail", rid, why)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        d = self._d.get(request.request_id)
        if d is None or d.allocated:
            if d is None and request.request_id in self.readback:
                planned = self.readback.plan(request.request_id, request.num_prompt_tokens,
                                             num_computed_tokens)
                if planned is not None:
                    return planned
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        rid = request.request_id
        d = self._d.get(rid)
        if d is None and rid in self.readback:
            spec_or_why = self.readback.allocate(rid, compat.new_block_ids(blocks),
                                                 num_external_tokens)
            if isinstance(spec_or_why, RecvSpec):
                self._pending_recv.append(spec_or_why)
            elif isinstance(spec_or_why, str):
                self._pending_fail[rid] = (FailureReason.LAYOUT.value, spec_or_why)
            return
        if d is None or d.allocated:
            return
        d.allocated = True
        if d.params is None:
            if num_external_tokens > 0:
                self._pending_fail[rid] = (FailureReason.BAD_PARAMS.value, d.bad)
                d.loading = True
            return
        params = d.params
        local_blocks = compat.new_block_ids(blocks)
        spec: Any
        if params.mode == "push":
            assert self.consumer is not None  # a push request on a pull engine was refused
            spec = self.consumer.allocate(
                rid, params, request.num_prompt_tokens, num_external_tokens, local_blocks,
                prompt_digest=auth.token_digest(request.prompt_token_ids))
        else:
            spec = self.pull.allocate(rid, params, request.num_prompt_tokens,
                                      num_external_tokens, local_blocks)
        if spec is None or isinstance(spec, LayoutProblem):
            self.heartbeats.untrack(rid)  # P was told it is not needed
        if spec is None:
            return  # everything was in D's prefix cache
        d.loading = True
        if isinstance(spec, LayoutProblem):
            self._pending_fail[rid] = (FailureReason.LAYOUT.value, spec.why)
        elif isinstance(spec, RecvSpec):
            self._pending_recv.append(spec)
        else:
            self._pending_push.append(spec)

    def update_connector_output(self, output: Any) -> None:
        meta = getattr(output, "kv_connector_worker_meta", None)
        if meta is not None:
            self._on_transfer_records(getattr(meta, "records", ()))
        failed = output.failed_recving or ()
        for rid in output.finished_recving or ():
            if self.readback.loaded(rid, rid in failed):
                continue
            d = self._d.get(rid)
            if d is not None:
                d.loading = False
                self._end_lease_use(d)
                if d.ended:
                    del self._d[rid]
            self.heartbeats.untrack(rid)
            if self.consumer is not None:
                self.consumer.finished(rid)

    def _on_transfer_records(self, records: Any) -> None:
        """Complete the workers' telemetry records with what only the scheduler
        knows (where the KV came from, time since arrival, push's registration
        round trip), log each as one line, keep it for the request's answer."""
        now = time.monotonic()
        for rid, rec in telemetry.merge_by_request(list(records)).items():
            d = self._d.get(rid)
            if d is not None and d.params is not None:
                params = d.params
                fill: dict[str, Any] = {"kv_ready_ms": telemetry.ms(now - d.arrived)}
                if not rec.p_engine:
                    fill.update(p_engine=str(params.remote_engine_id),
                                p_addr=f"{params.remote_host}:{params.remote_port}")
                if not rec.remote_request_id:
                    fill["remote_request_id"] = _lease_key(params)
                if params.mode == "push" and self.consumer is not None:
                    register = self.consumer.register_seconds(rid)
                    if register is not None:
                        fill["register_ms"] = telemetry.ms(register)
                rec = d.transfer = msgspec.structs.replace(rec, **fill)
            logger.info("%s", telemetry.log_line(rec))

    # ---------------------------------------------------------------- both
    def build_connector_meta(self, scheduler_output: Any) -> PDConnectorMetadata:
        push_fail: dict[str, tuple[str, str]] = {}
        if self.consumer is not None and self.consumer.num_waiting:
            push_fail = self.consumer.poll()
            for rid in push_fail:
                self.heartbeats.untrack(rid)
        meta = PDConnectorMetadata(
            reqs_to_recv=self._pending_recv, reqs_to_fail=self._pending_fail,
            push_recv=self._pending_push, push_fail=push_fail)
        self._pending_recv, self._pending_fail, self._pending_push = [], {}, []
        self._sweep()
        if self.idle is not None and self.consumer is not None and should_wait(
                int(getattr(scheduler_output, "total_num_scheduled_tokens", 1)),
                self.consumer.num_waiting,
                bool(meta.reqs_to_recv or meta.reqs_to_fail or meta.push_recv or push_fail),
                len(getattr(scheduler_output, "finished_req_ids", ()) or ())):
            self.idle.wait()
        return meta

    def _sweep(self) -> list[str]:
        """Unpin the blocks of released and expired leases (scheduler thread
        only). Runs every step and every arriving request: O(what changed)."""
        if self.producer is not None:
            self.producer.sweep()
        # Push: prefills whose lease expired are forgotten inside the sweep's
        # critical section (a registration in between would match freed blocks).
        result = self.leases.sweep(
            on_expired=self.producer.forget_expired_prefills if self.producer else None)
        if not result.released and not result.expired:
            return []
        kept_expired = 0
        for rid in result.expired:
            if rid in self.kept:
                # A conversation that did not come back: normal, counted apart.
                kept_expired += 1
                logger.info("PDConnector: kept turn %s expired unread; freeing its blocks", rid)
                continue
            logger.warning("PDConnector: lease of request %s expired after %.1f s without "
                           "release by D; freeing its blocks", rid, self.cfg.lease_duration)
        self._stats.inc("num_lease_expiries", len(result.expired) - kept_expired)
        self._stats.inc("num_turns_expired", kept_expired)
        freed = result.released + result.expired
        for rid in freed:
            self.kept.discard(rid)
            # Tail first, as vLLM frees a request's blocks: the prefix stays
            # cached longest.
            self._block_pool.free_blocks(reversed(self._pinned.pop(rid)))
        return freed

    def _on_engine_shutdown(self) -> None:
        # A signal handler: set a flag, nothing else (the busy loop reads it).
        self.shutting_down = True

    def has_pending_push_work(self) -> bool:
        """vLLM keeps a draining EngineCore stepping while this is True.

        Only while shutting down, and only while a granted lease still pins
        blocks: D may yet READ them (pull) or P is WRITING them (push). Each
        step's sweep frees what D released and what expired, so the drain
        ends by the last lease's expiry at the latest. Outside a shutdown the
        engine stays idle between requests as before.
        """
        if self.shutting_down and not self._kept_evicted:
            # Kept turns nobody reads yet would hold the drain for their whole
            # TTL: end them now (a reader already pinning one is served).
            self._kept_evicted = True
            for key in self.kept.oldest_first():
                if self.leases.evict(key):
                    self.kept.discard(key)
        return self.shutting_down and bool(self._pinned)

    def has_pending_block_frees(self) -> bool:
        # Leases D already released free at the next sweep: let vLLM wait for
        # them rather than preempt a running request. O(1).
        return self.leases.has_released()

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        d = self._d.get(rid)
        if d is not None:
            return self._finish_consumer(rid, d, request, block_ids)
        self.readback.finish(rid)
        try:
            params = decode_params(request.kv_transfer_params)
        except ParamsError as exc:
            logger.error("PDConnector: request %s: %s; blocks freed, no KV handed over",
                         rid, exc)
            return False, None
        if rid in self._unsigned:
            self._unsigned.discard(rid)
            return False, None
        if params is None or not params.do_remote_decode:
            if params is not None and params.pd_bidirectional:
                # A turn D prefilled itself (the proxy's local decision).
                return False, self._keep_turn(request, block_ids, params)
            return False, None
        if self.producer is not None and params.mode == "push" and params.pd_request_id:
            self.producer.retire(str(params.pd_request_id))
        identity = KVTransferParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.engine_id,
            remote_host=self.host,
            remote_port=self.port,
            tp_size=self.tp_size,
            transfer_mode=self.cfg.transfer_mode,
        )
        if params.pd_ext_probe:
            return False, answer_params(identity)
        if not compat.is_finished_ok(request) or not block_ids:
            logger.info("PDConnector: prefill %s ended with %s; no KV handed over", rid,
                        request.status)
            if self.producer is not None and params.mode == "push":
                # A D already waiting for this KV learns it now, not at its deadline.
                self.producer.prefill_failed(_lease_key(params), rid, str(request.status))
            return False, None
        if self._block_pool is None:
            raise RuntimeError("PDConnector: vLLM did not bind its block pool "
                               "(bind_gpu_block_pool); this vLLM version is not supported")
        if params.mode != self.cfg.transfer_mode:
            logger.error("PDConnector: prefill %s asks for transfer_mode=%r but this engine runs "
                         "%r; blocks freed, no KV handed over", rid, params.mode,
                         self.cfg.transfer_mode)
            return False, None
        key = _lease_key(params) if self.push else rid
        blocks = [self._block_pool.blocks[i] for i in block_ids]
        try:
            expiry = self.leases.grant(key, num_consumers=self.tp_size)
        except KeyError:
            logger.error("PDConnector: prefill %s: pd_request_id %s is already in use; "
                         "blocks freed, no KV handed over", rid, key)
            return False, None
        self._block_pool.touch(blocks)
        self._pinned[key] = blocks
        self._stats.inc("num_leases_granted")
        logger.info("PDConnector: prefill %s done; lease on %d blocks for %.0f s",
                    rid, len(block_ids), self.cfg.lease_duration)
        digest = auth.token_digest(request.prompt_token_ids)
        if self.producer is not None:
            self.producer.prefill_done(key, rid, list(block_ids),
                                       int(request.num_computed_tokens), digest)
        # vLLM drops its own references now; ours keep the blocks until _sweep.
        return False, answer_params(msgspec.structs.replace(
            identity,
            remote_block_ids=[list(block_ids)],
            remote_request_id=key,
            remote_num_tokens=int(request.num_computed_tokens),
            remote_blocks_expiry_time=time.time() + (expiry - time.monotonic()),
            remote_prompt_digest=digest,
        ))

    def _finish_consumer(self, rid: str, d: DRequest, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        delay, answer = self._finish_consumer_answer(rid, d, request, block_ids)
        if self.cfg.transfer_telemetry_in_response and d.transfer is not None:
            answer = {**(answer or {}), telemetry.PARAMS_KEY: telemetry.to_dict(d.transfer)}
        return delay, answer

    def _finish_consumer_answer(self, rid: str, d: DRequest, request: Any, block_ids: list[int]
                                ) -> tuple[bool, dict[str, Any] | None]:
        params = d.params
        loading = d.loading
        if d.loading:
            # A load in flight keeps its record (and its claim on the lease)
            # until the workers report it (update_connector_output).
            d.ended = True
        else:
            self._end_lease_use(d)
            del self._d[rid]
        if params is None:
            return False, None
        if params.mode == "push":
            assert self.consumer is not None
            if d.loading or not d.allocated:
                # vLLM keeps blocks of a request that waits for remote KV until
                # the worker reports it; the consumer reports it only once P
                # said no WRITE can land any more.
                self.heartbeats.untrack(rid)
                self.consumer.abandon(rid, str(params.pd_request_id),
                                      (str(params.remote_host), int(params.remote_port or 0)),
                                      "request ended on D")
                return False, None
        elif not d.allocated:
            # Ended before its load was scheduled (abort, rejection): free P now.
            self.pull.abandon(rid, params, "request ended on D before its load")
            return False, None
        # If a load is still in flight, vLLM keeps D's blocks until the worker
        # reports the id; heartbeats continue until then.
        if loading or not d.allocated:
            return False, None
        return False, self._keep_turn(request, block_ids, params)

    # ---------------------------------------------------------- multi-turn
    def _keep_turn(self, request: Any, block_ids: list[int], params: KVTransferParams
                   ) -> dict[str, Any] | None:
        """D: keep a finished turn's full blocks for the next turn's P to read
        back; the answer names them (and their hashes), or None."""
        if not bidir.wants_keep(self.cfg.bidirectional_kv_xfer, params.pd_bidirectional):
            return None
        if not compat.is_finished_ok(request) or self._block_pool is None:
            return None
        tokens = compat.kv_ready_token_ids(request)
        num_blocks = min(len(tokens) // self.block_size, len(block_ids))
        if num_blocks == 0:
            return None
        rid = request.request_id
        if not self.kept.admit(num_blocks, self.leases.evict):
            self._stats.inc("num_turns_not_kept")
            logger.info("PDConnector: turn %s not kept: %d blocks do not fit "
                        "decoder_kv_blocks_budget (%d of %d blocks kept, all in use)", rid,
                        num_blocks, self.kept.num_blocks, self.kept.budget_blocks)
            return None
        self._sweep()  # free what the budget just evicted before pinning more
        ids = list(block_ids[:num_blocks])
        try:
            expiry = self.leases.grant(rid, num_consumers=self.tp_size,
                                       duration_s=self.cfg.decoder_kv_blocks_ttl)
        except KeyError:
            return None
        blocks = [self._block_pool.blocks[i] for i in ids]
        self._block_pool.touch(blocks)
        self._pinned[rid] = blocks
        self.kept.add(rid, num_blocks)
        self._stats.inc("num_turns_kept")
        self._stats.inc("kept_blocks", num_blocks)
        logger.info("PDConnector: turn %s kept: %d blocks (%d tokens) for the next turn",
                    rid, num_blocks, num_blocks * self.block_size)
        return answer_params(KVTransferParams(
            do_remote_decode=True,
            do_remote_prefill=False,
            remote_engine_id=self.engine_id,
            remote_host=self.host,
            remote_port=self.port,
            tp_size=self.tp_size,
            remote_block_ids=[ids],
            remote_request_id=rid,
            remote_num_tokens=num_blocks * self.block_size,
            remote_blocks_expiry_time=time.time() + (expiry - time.monotonic()),
            remote_block_hashes=bidir.block_hashes(tokens, self.block_size, num_blocks),
        ))

    def _count_fallback(self, why: Fallback) -> None:
        self._stats.inc(f"readback_fallback_{why.value}")

    def _end_lease_use(self, d: DRequest) -> None:
        if d.lease is not None:
            self._lease_users.pop(d.lease, None)
            d.lease = None

    def get_kv_connector_stats(self) -> PDStats | None:
        if self.producer is not None:
            for wait in self.producer.take_registration_waits():
                self._stats.data["registration_wait_seconds"].append(wait)
            expired = self.producer.num_expired_registrations
            self._stats.inc("num_registration_expiries", expired)
            self.producer.num_expired_registrations -= expired
        counters = self.leases.counters()
        hb, late = counters.num_heartbeats, counters.num_late_messages
        self._stats.inc("num_heartbeats", hb - self._reported_heartbeats)
        self._stats.inc("num_late_messages", late - self._reported_late)
        self._reported_heartbeats, self._reported_late = hb, late
        if self._server is not None:
            refused = self._server.num_unauthenticated
            self._stats.inc("num_unauthenticated", refused - self._reported_unauth)
            self._reported_unauth = refused
        wrong = counters.num_wrong_sender + (
            self.consumer.num_wrong_sender if self.consumer is not None else 0) + (
            self.producer.num_wrong_sender if self.producer is not None else 0)
        self._stats.inc("num_wrong_sender", wrong - self._reported_wrong)
        tokens, loads = self.readback.num_tokens, self.readback.num_loads
        self._stats.inc("readback_tokens", tokens - self._reported_readback[0])
        self._stats.inc("num_readbacks", loads - self._reported_readback[1])
        self._reported_readback = (tokens, loads)
        self._reported_wrong = wrong
        return self._stats.take()

    @property
    def num_pinned_requests(self) -> int:
        return len(self._pinned)

    def shutdown(self) -> None:
        self.heartbeats.close()
        if self.producer is not None:
            self.producer.close()
        if self.consumer is not None:
            self.consumer.close()
        if self.idle is not None:
            self.idle.close()
        if self._server is not None:
            self._server.close()


def _lease_key(params: KVTransferParams) -> str:
    """The id both engines know: the proxy's ``pd_request_id`` in push mode,
    P's request id (``remote_request_id``) in pull mode."""
    if params.mode == "push":
        return str(params.pd_request_id)
    return str(params.remote_request_id)


class _PushDispatch:
    """Routes push side-channel messages to this engine's half."""

    def __init__(self, sched: PDScheduler) -> None:
        self.sched = sched

    def handle(self, msg: proto.Request) -> proto.Reply:
        if isinstance(msg, proto.PushResult):
            assert self.sched.consumer is not None
            return self.sched.consumer.on_result(msg)
        assert self.sched.producer is not None
        return self.sched.producer.handle(msg)

    def on_release(self, msg: proto.LeaseRelease) -> None:
        if self.sched.producer is not None:
            self.sched.producer.on_release(msg)
