"""The scheduler half of PDConnector (EngineCore process): a dispatcher.

It receives vLLM's scheduler-side calls, decodes each request's leg once
(``legs.decode_leg``, in ``on_new_request``) and hands the request to the
role that owns it. The transfer mode is resolved once, at construction:

- P (``Leg.P_HANDOFF``): at ``request_finished`` of a prefill that ended
  well, the mode's producer lends its blocks (``p_pull.PullProducer``: D
  reads them; ``p_push.PushProducer``: P writes them into D's). A P leg that
  names D's kept turn reads it back first (``p_readback``).
- D (``Leg.D_LOAD``): ``d_requests.DRequests`` carries the request from
  arrival to end; the mode's consumer (``d_pull`` / ``d_push``) pairs D's
  blocks with P's.
- D, multi-turn: a finished turn is kept for the next one (``d_keep``);
  when vLLM runs short of blocks, unread kept turns end first
  (``has_pending_block_frees``, vLLM's question before it preempts; and
  ``_relieve_waiting`` for a waiting request whose blocks do not fit).

One ``leases.lender.BlockLender`` owns every lent block (P's leases, D's kept
turns); ``_sweep`` frees released and expired ones on every step and every
arriving request, always on this thread. Nothing here does network I/O on
the step thread: peers are reached through outboxes and the side channel's
own thread. Process-wide setup (vLLM patches, CPU affinity) is not done
here but by the facade, through ``compat.patches``.
"""

from __future__ import annotations

import time
from typing import Any

from vllm_pd_ext import compat
from vllm_pd_ext.config import PDConfig
from vllm_pd_ext.leases.lender import BlockLender
from vllm_pd_ext.leases.service import LeaseService
from vllm_pd_ext.leases.table import LeaseTable
from vllm_pd_ext.log import get_logger
from vllm_pd_ext.metadata import PDConnectorMetadata, PDHandshakeMetadata, PDWorkerMetadata
from vllm_pd_ext.policy import FailureReason
from vllm_pd_ext.scheduler import bidir
from vllm_pd_ext.scheduler.counters import SchedulerCounters
from vllm_pd_ext.scheduler.d_keep import TurnKeeper
from vllm_pd_ext.scheduler.d_landing import LandingView
from vllm_pd_ext.scheduler.d_pull import PullConsumer
from vllm_pd_ext.scheduler.d_pull_wait import PullWaits
from vllm_pd_ext.scheduler.d_push import PushConsumer
from vllm_pd_ext.scheduler.d_requests import DMode, DRequests
from vllm_pd_ext.scheduler.heartbeats import HeartbeatSender
from vllm_pd_ext.scheduler.legs import DecodedLeg, Leg, decode_leg
from vllm_pd_ext.scheduler.p_handover import PMode, hand_over
from vllm_pd_ext.scheduler.p_pull import PullProducer
from vllm_pd_ext.scheduler.p_push import PushProducer
from vllm_pd_ext.scheduler.p_readback import ReadBackConsumer
from vllm_pd_ext.stats import PDStats
from vllm_pd_ext.wire import auth
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.protocol import KVTransferParams, TransferMode
from vllm_pd_ext.wire.pump_bell import BellRinger
from vllm_pd_ext.wire.side_channel import SideChannelServer
from vllm_pd_ext.wire.wakeup import IdleWait, should_wait

logger = get_logger(__name__)

#: Promoted loads whose workers' report is awaited, at most (``_take_claimed``).
MAX_CLAIMED = 65536


class PDScheduler:
    def __init__(self, vllm_config: Any, cfg: PDConfig) -> None:
        self.cfg = cfg
        self.mode = cfg.transfer_mode
        self.engine_id = compat.engine_id(vllm_config)
        self._kv_config = vllm_config.kv_transfer_config
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        #: Set by vLLM's SIGTERM/SIGINT (``compat.patches``): keep stepping
        #: while granted leases are held (``has_pending_push_work``).
        self.shutting_down = False
        #: Where the side channel listens, and the address peers are told.
        self.bind_host = cfg.side_channel_host
        self.host = cfg.advertised_host
        self.port = compat.side_channel_port(vllm_config, cfg.side_channel_port)
        self.auth = cfg.frame_auth()
        _log_auth(self.auth, cfg)
        self.compat = compat.compat_info(vllm_config, self.mode)
        #: This engine as a KV source, the base of every answer it gives.
        self.identity = KVTransferParams(
            do_remote_prefill=True, do_remote_decode=False, remote_engine_id=self.engine_id,
            remote_host=self.host, remote_port=self.port, tp_size=self.tp_size,
            transfer_mode=self.mode.value)
        push = self.mode is TransferMode.PUSH
        # Push: D heartbeats from arrival, before P knows the id.
        self.leases = LeaseService(LeaseTable(cfg.lease_duration, time.monotonic),
                                   unknown_heartbeats_expected=push, owner=self.engine_id)
        self.lender = BlockLender(self.leases)
        self.heartbeats = HeartbeatSender(
            self.engine_id, cfg.effective_heartbeat_interval, cfg.handshake_timeout,
            auth=self.auth)
        self._stats = PDStats()
        self.keeper = TurnKeeper(cfg, self.lender, self.identity, self.block_size, self._stats,
                                 legs_signed=self.auth is not None,
                                 is_shutting_down=lambda: self.shutting_down)
        self.readback = ReadBackConsumer(
            enabled=cfg.bidirectional_kv_xfer, block_size=self.block_size,
            tp_size=self.tp_size, threshold=cfg.kv_recompute_threshold,
            heartbeats=self.heartbeats,
            count=lambda why: self._stats.inc(f"readback_fallback_{why.value}"))
        self.producer: PushProducer | None = None
        self.consumer: PushConsumer | None = None
        #: Pull: P's half (concurrent pull's waits are answered there).
        self.pull_producer: PullProducer | None = None
        #: Pull, D: concurrent pull legs parked until P's answer (d_pull_wait.py).
        self.pull_waits: PullWaits | None = None
        self.p_mode: PMode
        d_mode: DMode
        if push:
            self.p_mode = self.producer = PushProducer(
                self.engine_id, self.compat, self.block_size, self.tp_size, self.leases,
                cfg.handshake_timeout, auth=self.auth, lender=self.lender)
            d_mode = self.consumer = PushConsumer(
                self.engine_id, self.compat, self.host, self.port, cfg.push_timeout,
                cfg.handshake_timeout, write_timeout_s=cfg.transfer_timeout,
                queue_timeout_s=cfg.push_queue_timeout, auth=self.auth)
            # A lease P reports expired ends D's wait for its WRITE early.
            self.heartbeats.on_expired = self.consumer.lease_expired
        else:
            self.p_mode = self.pull_producer = PullProducer(
                self.lender, self.tp_size, self.engine_id, cfg.handshake_timeout,
                auth=self.auth)
            d_mode = PullConsumer(self.block_size, self.tp_size, self.heartbeats)
            # push_timeout / push_queue_timeout bound a concurrent pull's
            # wait for P as they bound push's wait for P's WRITE.
            self.pull_waits = PullWaits(self.engine_id, self.host, self.port, cfg.push_timeout,
                                        cfg.push_queue_timeout, cfg.handshake_timeout,
                                        auth=self.auth)
        self.d = DRequests(mode=self.mode, tp_size=self.tp_size, mode_half=d_mode,
                           heartbeats=self.heartbeats,
                           keep_turn=lambda r, ids, p: self.keeper.keep(r, ids, p, self._sweep),
                           telemetry_in_answer=cfg.transfer_telemetry_in_response,
                           waits=self.pull_waits)
        #: P's requests, by id, from arrival to ``request_finished`` (D's are in ``d``).
        self._legs: dict[str, DecodedLeg] = {}
        #: This step's workers reported a KV load ended (``take_loads_reported``).
        self._loads_reported = False
        #: ``pd_seed_pending`` requests that cannot continue after P's token
        #: #1 -> why; vLLM ends them with an error (``take_requests_to_fail``).
        self._to_fail: dict[str, str] = {}
        self.vocab_size = compat.vocab_size(vllm_config)
        #: This step's waiting requests vLLM asked about and has not allocated
        #: yet: the blocks each needs (``get_num_new_matched_tokens``).
        self._unallocated: dict[str, int] = {}
        self._server: SideChannelServer | None = None
        self._counters = SchedulerCounters()
        #: D, push: sleeps through empty steps while D waits for P (wire/wakeup.py).
        self.idle: IdleWait | None = None
        #: Speeds up the workers' progress pumps while a peer works with us
        #: (transfer targets only; wire/pump_bell.py).
        self.ringer: BellRinger | None = None
        if (self.consumer is not None and cfg.push_idle_wait_ms > 0
                and vllm_config.kv_transfer_config.is_kv_consumer):
            self.idle = IdleWait(cfg.push_idle_wait_ms / 1e3)
            self.consumer.on_event = self.idle.wake
        elif (self.pull_waits is not None and cfg.push_idle_wait_ms > 0
              and vllm_config.kv_transfer_config.is_kv_consumer):
            # A concurrent pull D parks its legs through P's prefill: the
            # same empty steps as push's wait (and the same CPU taken from
            # P on a shared host); P's answer wakes it.
            self.idle = IdleWait(cfg.push_idle_wait_ms / 1e3)
            self.pull_waits.on_event = self.idle.wake
        #: D, push: pushes seen landing before the workers report them
        #: (``enable_landing``, by the ``same_step_landing`` patch; d_landing.py).
        self.landing: LandingView | None = None
        #: Loads promoted from the landing view -> when; their workers'
        #: report is taken out of the step's output (``_take_claimed``).
        self._claimed: dict[str, float] = {}
        #: This step already slept before ``schedule()``.
        self._waited = False
        #: Concurrent pull, ``same_step_landing``: an idle D sleeps before
        #: ``schedule()``, not after planning an empty step (``_wait_for_p``).
        self._pull_wait_first = False
        #: Loads promoted from the landing view since start (the stats'
        #: ``num_landed_before_step`` counts them per interval).
        self.num_landed_before_step = 0

    # ---------------------------------------------------------------- startup
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        mine = {int(r): m for r, m in metadata.items() if isinstance(m, PDHandshakeMetadata)}
        agents = {rank: meta.agent for rank, meta in mine.items()}
        if self.consumer is not None:
            self.consumer.agents = [agents[r] for r in sorted(agents)]
        orders = {rank: m.order_endpoint for rank, m in mine.items() if m.order_endpoint}
        if self.producer is not None and orders:
            self.producer.bind_workers(orders)
        if self.idle is not None:
            self.idle.connect([m.wake_endpoint for m in mine.values() if m.wake_endpoint])
        bells = [m.pump_endpoint for _, m in sorted(mine.items()) if m.pump_endpoint]
        if bells:
            self.ringer = BellRinger(bells)
        self._server = SideChannelServer(
            self.bind_host, self.port, self.engine_id, self.compat, agents, self.leases,
            push=_PushDispatch(self) if self.producer is not None else None, auth=self.auth,
            on_activity=self.ringer.ring if self.ringer is not None else None,
            pull=_PullDispatch(self) if self.pull_producer is not None else None)
        self._is_producer = bool(getattr(self._kv_config, "is_kv_producer", True))

    def enable_landing(self) -> bool:
        """Turn on what runs before vLLM's ``schedule()`` (the
        ``same_step_landing`` patch): push's landing view, or a concurrent
        pull D's wait for P's answer there; False where D has no idle wait."""
        if self.idle is None:
            return False
        if self.consumer is None:
            # Concurrent pull: nothing lands unseen (D starts its READs
            # itself); only the idle wait moves, so P's answer is allocated
            # and its READ starts in the step it wakes (_wait_for_p).
            self._pull_wait_first = True
            return True
        if self.landing is None:
            self.landing = LandingView(self.tp_size)
        self.idle.keep_forwarded = True
        return True

    def bind_gpu_block_pool(self, block_pool: Any) -> None:
        self.lender.bind(compat.check_block_pool(block_pool))
        self.keeper.bind(compat.num_blocks(block_pool))

    def on_engine_shutdown(self) -> None:
        # A signal handler: set a flag, nothing else (the busy loop reads it).
        self.shutting_down = True

    # ---------------------------------------------------------------- arrival
    def on_new_request(self, request: Any) -> None:
        # An idle P does not step: free what D released before this request
        # competes for blocks.
        self._sweep()
        rid = request.request_id
        leg = decode_leg(request.kv_transfer_params, self.auth,
                         compat.sibling_group(rid))
        if leg.unauthenticated:
            self._stats.inc("num_unauthenticated")
        if leg.kind is Leg.D_LOAD:
            self.d.arrive(rid, leg, request)
            return
        if leg.kind is Leg.NONE:
            return
        self._legs[rid] = leg
        if leg.refused and leg.kind is not Leg.MALFORMED:
            logger.error("PDConnector: request %s: %s; its KV is not handed over", rid,
                         leg.problem)
        if leg.refused or leg.kind is not Leg.P_HANDOFF:
            return
        params = leg.params
        assert params is not None
        if params.is_readback:
            self.readback.arrive(rid, params, list(request.prompt_token_ids),
                                 bidir.hash_scope(*compat.cache_scope(request)))
        if params.mode is self.mode:
            # Push: P holds this request from now; D's renewals keep its
            # registration while it queues here.
            self.p_mode.admit(self.p_mode.lease_key(rid, params))

    # ---------------------------------------------------------------- the step
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        # (None, False): not yet known, vLLM asks again next step.
        matched: tuple[int | None, bool] | None = self.d.matched_tokens(
            request, num_computed_tokens)
        if matched is None and request.request_id in self.readback:
            matched = self.readback.plan(request.request_id, request.num_prompt_tokens,
                                         num_computed_tokens)
        if len(self.keeper.kept) and matched != (None, False):
            # vLLM allocates next; if it does not, the step's end sees why.
            self._unallocated[request.request_id] = -(
                -(int(request.num_tokens) - num_computed_tokens) // self.block_size)
        return matched if matched is not None else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        rid = request.request_id
        self._unallocated.pop(rid, None)
        if rid in self.d:
            self.d.allocate(request, compat.new_block_ids(blocks), num_external_tokens)
        elif rid in self.readback:
            spec = self.readback.allocate(rid, compat.new_block_ids(blocks),
                                          num_external_tokens)
            if isinstance(spec, str):
                self.d.out.fail[rid] = (FailureReason.LAYOUT.value, spec)
            elif spec is not None:
                self.d.out.recv.append(spec)

    # ----------------------------------------------- landing before the report
    def before_schedule(self, scheduler: Any) -> None:
        """Before vLLM's ``schedule()`` (the ``same_step_landing`` patch): an
        idle D sleeps here until a push lands (its step is then planned with
        the request in it), and every push the workers' forwarded
        notifications show landed on every rank is promoted now."""
        if self.idle is None:
            return
        if self.landing is None:
            if self._pull_wait_first:
                self._wait_for_p(scheduler, self.idle)
            return
        try:
            self._land_before_schedule(scheduler, self.landing, self.idle)
        except Exception:
            # A bug here must not end the EngineCore: every load then waits
            # for its workers' report, as without the key (what was already
            # promoted keeps its report taken out: ``_claimed``).
            logger.exception("PDConnector: same-step landing failed; turned off, loads wait "
                             "for the workers' report")
            self.landing = None
            self.idle.keep_forwarded = False

    def _wait_for_p(self, scheduler: Any, idle: IdleWait) -> None:
        """Concurrent pull: an idle D whose only work is parked legs sleeps
        here, so when P's answer wakes it this very ``schedule()`` allocates
        the request and its READ leaves with this step; slept after
        planning, the empty step planned first must cross to the workers
        and back before the next ``schedule()`` (1 to 2 ms on our CPU
        hosts). The sleep's bounds are the same as there."""
        self._waited = False
        waits = self.pull_waits
        try:
            if (waits is None or not self._num_waiting() or waits.has_news
                    or self.d.out.busy or self._to_fail or self.d.to_fail
                    or not compat.only_waits_for_remote_kv(scheduler, parked=waits)):
                return
        except Exception:
            # A vLLM internal moved: sleep after planning, as without the key.
            logger.exception("PDConnector: the wait before schedule() failed; turned off")
            self._pull_wait_first = False
            return
        idle.wait()
        self._waited = True

    def _land_before_schedule(self, scheduler: Any, landing: LandingView, idle: IdleWait
                              ) -> None:
        self._waited = False
        if (self.consumer is not None and self.consumer.num_waiting and not self.d.out.busy
                and not self._to_fail and compat.only_waits_for_remote_kv(scheduler)):
            idle.wait()
            self._waited = True
        else:
            idle.drain()
        for rank, notifs in idle.take_forwarded():
            landing.feed(rank, notifs)
        now = time.monotonic()
        for seen in landing.collect(now):
            rid = seen.spec.request_id
            # The check comes first: ``land_seen`` changes the request.
            if not compat.waits_for_remote_kv(scheduler, rid):
                continue
            if self.d.land_seen(rid, seen.seed, self.vocab_size):
                compat.promote_landed(scheduler, rid)
                self._claimed[rid] = now
                self.num_landed_before_step += 1
                self._stats.inc("num_landed_before_step")
        if len(self._claimed) > MAX_CLAIMED:
            # Each claimed load's report comes in the step it was claimed
            # in; one that never does is not worth unbounded memory.
            for rid in list(self._claimed)[:len(self._claimed) - MAX_CLAIMED]:
                del self._claimed[rid]

    def before_update_from_output(self, output: Any) -> None:
        """Before vLLM finishes the step's requests: their transfer records
        are in before a request that ends in this step answers."""
        self._take_worker_meta(output)

    def _take_worker_meta(self, output: Any) -> None:
        meta = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(meta, PDWorkerMetadata):
            return
        # Emptied once read: read twice, a record's bytes would count twice.
        seeds, meta.seeds = meta.seeds, {}
        records, meta.records = meta.records, []
        self.d.on_seeds(dict(seeds))
        self.d.on_records(list(records))

    def _take_claimed(self, output: Any) -> None:
        """The workers' report of loads already promoted from the landing
        view: vLLM must not see it (for a running request it asserts; for
        one that finished it would free its blocks twice)."""
        for name in ("finished_recving", "failed_recving"):
            ids = getattr(output, name, None)
            if not ids:
                continue
            for rid in [r for r in ids if r in self._claimed]:
                ids.discard(rid)
                if name == "failed_recving":
                    logger.error("PDConnector: request %s was seen landed on every rank but a "
                                 "worker reported its load failed; it already runs", rid)
                    continue
                del self._claimed[rid]

    def update_connector_output(self, output: Any) -> None:
        self._take_worker_meta(output)
        if self._claimed:
            self._take_claimed(output)
        failed = output.failed_recving or ()
        if self.landing is not None:
            for rid in [*(output.finished_recving or ()), *failed]:
                self.landing.forget(rid)
        if output.finished_recving:
            self._loads_reported = True
        for rid in output.finished_recving or ():
            if not self.readback.loaded(rid, rid in failed):
                problem = self.d.seed_problem(rid, rid in failed, self.vocab_size)
                if problem is not None:
                    logger.error("PDConnector: request %s cannot continue after P's token #1: "
                                 "%s; it ends with an error (the proxy continues it "
                                 "elsewhere)", rid, problem)
                    self._to_fail[rid] = problem
                    self._stats.inc("num_seed_failures")
                self.d.reported(rid)

    def build_connector_meta(self, scheduler_output: Any) -> PDConnectorMetadata:
        # A new step: a report of the last one that no yield consumed (the
        # step ran the model, so the loop did not pause) must not skip a later one.
        self._loads_reported = False
        push_fail = self.d.poll()
        out = self.d.take_step()
        if self.landing is not None:
            now = time.monotonic()
            for spec in out.push:
                self.landing.expect(spec, now)
            for rid in push_fail:
                self.landing.forget(rid)
        waited, self._waited = self._waited, False
        meta = PDConnectorMetadata(
            reqs_to_recv=out.recv, reqs_to_fail=out.fail, push_recv=out.push,
            push_fail=push_fail,
            idle=int(getattr(scheduler_output, "total_num_scheduled_tokens", 1)) == 0)
        if self._unallocated:
            self._relieve_waiting()
        self._sweep()
        if self.ringer is not None and self.consumer is not None and self.consumer.num_waiting:
            # P's WRITEs may land any time now: the pump collects their notifications.
            self.ringer.ring()
        if not waited and self.idle is not None and should_wait(
                int(getattr(scheduler_output, "total_num_scheduled_tokens", 1)),
                self._num_waiting(),
                bool(out.recv or out.fail or out.push or push_fail or self.d.to_fail),
                len(getattr(scheduler_output, "finished_req_ids", ()) or ())):
            self.idle.wait()
        return meta

    def _num_waiting(self) -> int:
        """Requests D waits for P on: push's registrations, concurrent pull's
        parked legs; 0 while a pull load is in flight (its worker reports
        it only in a step, which an idle wait would delay)."""
        if self.consumer is not None:
            return self.consumer.num_waiting
        if self.pull_waits is None or not self.pull_waits.num_parked or self.d.num_loading():
            return 0
        return self.pull_waits.num_parked

    def take_requests_to_fail(self) -> dict[str, str]:
        """The ``pd_seed_pending`` requests vLLM must end with an error now,
        whatever its ``kv_load_failure_policy`` (a recompute would sample
        token #1 again: the client has P's). Taken once, by the
        ``fail_seed_requests`` patch, right after the step's output was
        processed and before the next ``schedule()`` could promote them."""
        out, self._to_fail = self._to_fail, {}
        if self.d.to_fail:
            self._stats.inc("num_seed_failures", len(self.d.to_fail))
            out.update(self.d.to_fail)
            self.d.to_fail = {}
        return out

    def take_loads_reported(self) -> bool:
        """True once after a step whose workers reported a KV load ended
        (done or failed): the next step has work with it, so the EngineCore
        need not pause first (``compat.engine.skip_idle_yield_when``)."""
        reported, self._loads_reported = self._loads_reported, False
        # A concurrent pull's answer from P: the next step allocates its
        # blocks and starts the READ.
        return reported or (self.pull_waits is not None and self.pull_waits.has_news)

    def _sweep(self) -> None:
        """Free the blocks of released and expired leases (this thread only).
        Runs every step and every arriving request: O(what changed)."""
        self.p_mode.sweep()
        # Push: prefills whose lease expired are forgotten inside the sweep's
        # critical section (a registration in between would match freed blocks).
        result = self.lender.sweep(on_expired=self.p_mode.forget_expired)
        if not result.released and not result.expired:
            return
        turns = self.keeper.forget(result.released + result.expired, result.expired)
        expired = [key for key in result.expired if key not in turns]
        for key in expired:
            logger.warning("PDConnector: lease of request %s expired after %.1f s without "
                           "release by D; freeing its blocks", key, self.cfg.lease_duration)
        self._stats.inc("num_lease_expiries", len(expired))

    def has_pending_push_work(self) -> bool:
        """vLLM keeps a draining EngineCore stepping while this is True.

        Only while shutting down, and only while a granted lease still pins
        blocks: D may yet READ them (pull) or P is WRITING them (push). Each
        step's sweep frees what D released and what expired, so the drain
        ends by the last lease's expiry at the latest. Outside a shutdown the
        engine stays idle between requests as before.
        """
        if not self.shutting_down:
            return False
        self.keeper.evict_unread()
        return len(self.lender) > 0

    def has_pending_block_frees(self) -> bool:
        """vLLM asks this when a running request got no block, before it
        preempts one. Leases D already released free at the next sweep: let
        vLLM wait for them rather than preempt. Else unread kept turns end
        now (they free at this step's sweep), so vLLM waits a step for their
        blocks instead of preempting. O(1) without kept turns."""
        if self.lender.has_pending_frees():
            return True
        return len(self.keeper.kept) > 0 and self.keeper.relieve(1) > 0

    def _relieve_waiting(self) -> None:
        """The step's end: a waiting request vLLM asked about and did not
        allocate, whose blocks exceed the free ones, waits for blocks that
        unread kept turns hold: end those first (oldest first, freed by the
        sweep that follows), rather than queue the request until they expire."""
        need = max(self._unallocated.values())
        self._unallocated.clear()
        short = need - self.lender.num_free_blocks()
        if short > 0 and len(self.keeper.kept):
            self.keeper.relieve(short)

    # ---------------------------------------------------------------- the end
    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        if self.landing is not None:
            self.landing.forget(rid)
        d_answer = self.d.finish(rid, request, block_ids)
        if d_answer is not None:
            return d_answer
        self.readback.finish(rid)
        leg = self._legs.pop(rid, None)
        if leg is None:
            return False, None
        if leg.kind is Leg.MALFORMED:
            logger.error("PDConnector: request %s: %s; blocks freed, no KV handed over",
                         rid, leg.problem)
            return False, None
        if leg.refused:
            return False, None  # unsigned: logged at arrival
        assert leg.params is not None
        if leg.kind is Leg.LOCAL_TURN:
            # A turn D prefilled itself (the proxy's local decision).
            return False, self.keeper.keep(request, block_ids, leg.params, self._sweep)
        # vLLM drops its own references now; the lender's keep the blocks.
        return False, hand_over(self.p_mode, self.identity, request, block_ids, leg.kind,
                                leg.params, self._stats, self.cfg.lease_duration)

    # ---------------------------------------------------------------- stats, end
    def get_kv_connector_stats(self) -> PDStats | None:
        self._counters.collect(self._stats, self.leases, self._server, self.producer,
                               self.consumer, self.readback)
        return self._stats.take()

    @property
    def num_pinned_requests(self) -> int:
        return len(self.lender)

    def shutdown(self) -> None:
        self.heartbeats.close()
        if self.producer is not None:
            self.producer.close()
        if self.consumer is not None:
            self.consumer.close()
        if self.idle is not None:
            self.idle.close()
        if self.pull_producer is not None:
            self.pull_producer.close()
        if self.pull_waits is not None:
            self.pull_waits.close()
        if self._server is not None:
            self._server.close()
        if self.ringer is not None:
            self.ringer.close()


def _log_auth(frame_auth: auth.FrameAuth | None, cfg: PDConfig) -> None:
    if frame_auth is None:
        logger.warning(
            "PDConnector: no shared secret (auth_secret_file, or the environment variable "
            "%s): the side channel and kv_transfer_params are unauthenticated; run only "
            "on an isolated network (docs/security.md)",
            cfg.auth_secret_env or auth.DEFAULT_SECRET_ENV)
    else:
        logger.info("PDConnector: side channel and legs authenticated (%s)",
                    frame_auth.keyring.describe())


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


class _PullDispatch:
    """Routes concurrent pull's side-channel messages: D's waits and
    cancels to this engine's P half, P's answers to its D half."""

    def __init__(self, sched: PDScheduler) -> None:
        self.sched = sched

    def handle(self, msg: proto.Request) -> proto.Reply:
        if isinstance(msg, proto.PullReady):
            assert self.sched.pull_waits is not None
            return self.sched.pull_waits.handle(msg)
        assert self.sched.pull_producer is not None
        if not self.sched._is_producer:
            # A hostile or confused peer: a decode-only engine holds no prefills.
            return proto.ErrorReply(proto.ErrorCode.NOT_PRODUCER, f"engine "
                                    f"{self.sched.engine_id} is not a KV producer")
        return self.sched.pull_producer.handle(msg)
