"""D: the requests that load their prompt's KV from P, from arrival to end.

Runs on D's scheduler thread (EngineCore process), called by the dispatcher
for every ``Leg.D_LOAD`` request. Lifecycle of one request (its
``load_state.LoadState`` in brackets):

1. ``arrive`` (``on_new_request``): the params were decoded once
   (``legs.decode_leg``); here they are checked against this engine (prompt
   digest, transfer mode, TP size, a P lease another live request already
   uses, for a rejection notice). A refused request keeps a record without
   params: its load fails with ``bad_params``. Otherwise heartbeats to P
   start at once. [WAITING] A concurrent pull leg (``is_pull_wait``: sent
   beside P's, naming no blocks) is parked instead (``d_pull_wait``): it
   loads nothing until P's ``PullReady`` came, then continues as a
   sequential pull leg with P's params and token #1. A request naming a lease another live request
   uses (the ``n`` > 1 children vLLM makes of one client request) follows
   that leader: it waits, loads nothing, and once the leader's load is over
   it leaves this book and computes what the prefix cache lacks (for a
   sibling, less than a block: the load filled the cache).
2. ``matched_tokens`` (``get_num_new_matched_tokens``): every prompt token
   D does not hold is loaded asynchronously (a parked request: not known
   yet, vLLM asks again next step; a wait that failed ends the request
   with an error, ``to_fail``).
3. ``allocate`` (``update_state_after_alloc``): the mode's consumer
   (``d_pull.PullConsumer`` or ``d_push.PushConsumer``) pairs D's fresh
   blocks with P's; the spec (or the failure) goes into this step's payload.
   [LOADING, or READY when D's prefix cache held everything]
4. ``reported`` (``update_connector_output``): the workers reported the load,
   done or failed; heartbeats stop. [READY]
5. ``finish`` (``request_finished``): a request that never loaded releases
   P's lease; a finished turn may be kept for the next one (``d_keep``).
   A load still in flight keeps the record until step 4. [ENDED]
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from vllm_pd_ext import compat
from vllm_pd_ext.log import get_logger
from vllm_pd_ext.policy import FailureReason
from vllm_pd_ext.scheduler.d_pull_wait import PullWaits
from vllm_pd_ext.scheduler.heartbeats import HeartbeatSender
from vllm_pd_ext.scheduler.legs import DecodedLeg
from vllm_pd_ext.scheduler.load_state import Load, LoadState
from vllm_pd_ext.wire import auth, telemetry
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.protocol import KVTransferParams, ParamsError, TransferMode, decode_params
from vllm_pd_ext.wire.specs import LayoutProblem, PushRecvSpec, RecvSpec, monotonic_clock_id

logger = get_logger(__name__)


class DMode(Protocol):
    """D's half of one transfer mode (``d_pull.PullConsumer``, ``d_push.PushConsumer``)."""

    def allocate(self, rid: str, params: KVTransferParams, num_prompt_tokens: int,
                 num_external_tokens: int, local_blocks: list[int], prompt_digest: str = ""
                 ) -> RecvSpec | PushRecvSpec | LayoutProblem | None: ...

    def end(self, rid: str, params: KVTransferParams, state: LoadState) -> None:
        """vLLM finished the request before its load (``state`` WAITING) or
        while it is in flight (LOADING; the workers still report it)."""

    def loaded(self, rid: str) -> None:
        """The workers reported the request's load (done or failed)."""

    def poll(self) -> dict[str, tuple[str, str]]:
        """Loads that must be reported failed this step: id -> (reason, detail)."""

    def register_seconds(self, rid: str) -> float | None: ...

    @property
    def num_waiting(self) -> int:
        """Requests whose KV this half still waits for (``poll`` has work)."""


def p_prompt(request: Any, params: KVTransferParams) -> list[int]:
    """The part of D's prompt that P prefilled: all of it, less the tokens P
    sampled and the proxy seeded after it (``pd_seeded_tokens``)."""
    ids = list(request.prompt_token_ids or ())
    return ids[:len(ids) - params.pd_seeded_tokens]


def lease_key(params: KVTransferParams) -> str:
    """The id both engines know the lease by: the proxy's ``pd_request_id`` in
    push mode, P's request id (``remote_request_id``) in pull mode."""
    if params.mode is TransferMode.PUSH:
        return str(params.pd_request_id)
    return str(params.remote_request_id)


#: Ended leases remembered for late ``n`` siblings (a few seconds' worth).
MAX_ENDED_LEASES = 1024


@dataclass
class DRequest(Load):
    #: None when its params were refused (``bad`` says why).
    params: KVTransferParams | None
    bad: str = ""
    #: The P lease it holds in ``DRequests.lease_users`` (engine id, lease key).
    lease: tuple[str, str] | None = None
    #: When it arrived (monotonic): the start of its telemetry's ``kv_ready_ms``.
    arrived: float = 0.0
    #: When its load left in a step's metadata (``take_step``); 0: not yet.
    dispatched: float = 0.0
    #: D's API server stamping the request to this scheduler seeing it, s
    #: (None: not known).
    api_s: float | None = None
    #: Its load's telemetry, once the workers reported it.
    transfer: telemetry.TransferRecord | None = None
    #: A follower: the request whose load from the same P lease it waits for
    #: (``n`` > 1 siblings). It never loads, heartbeats or releases itself.
    leader: str = ""
    #: ``pd_seed_pending``: P's token #1 comes with the KV and is appended to
    #: the prompt before the first step; without it the request must end in
    #: an error (the client has token #1 already: D may not sample it again).
    seed_pending: bool = False
    #: The token #1 P's notification carried (-1: none yet).
    seed: int = -1
    #: When the scheduler saw its push land (``land_seen``; monotonic), before
    #: the workers' record of it came: its telemetry's ``kv_ready_ms`` ends there.
    landed_at: float = 0.0
    #: vLLM's request (``seed_pending`` only: the seed is appended to it).
    request: Any = None
    #: Concurrent pull: waiting for P's ``PullReady`` (``d_pull_wait``);
    #: ``params`` are the proxy's leg until it came, P's answer after.
    parked: bool = False
    #: Concurrent pull: when P's answer reached this engine (monotonic).
    ready_at: float = 0.0
    #: Concurrent pull: until when P's answer guarantees its blocks (this
    #: host's monotonic clock; 0: not known, the worker pins).
    valid_until: float = 0.0


@dataclass
class StepOut:
    """What this step's payload carries to the workers."""

    recv: list[RecvSpec] = field(default_factory=list)
    push: list[PushRecvSpec] = field(default_factory=list)
    fail: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def busy(self) -> bool:
        return bool(self.recv or self.push or self.fail)


def tp_size_problem(p_tp: int, d_tp: int) -> str:
    """Why a P answer from an engine with TP size ``p_tp`` cannot load
    here ("" if it may: the handshake, or push's registration, then checks
    P's real sharding against ours, ``tp_slices.plan``)."""
    if p_tp % d_tp and d_tp % p_tp:
        return (f"kv_transfer_params.tp_size={p_tp} but this engine runs tensor_parallel_size="
                f"{d_tp}: one must divide the other")
    return ""


class DRequests:
    def __init__(self, *, mode: TransferMode, tp_size: int, mode_half: DMode,
                 heartbeats: HeartbeatSender, keep_turn: Callable[..., dict[str, Any] | None],
                 telemetry_in_answer: bool, waits: PullWaits | None = None) -> None:
        self.mode = mode
        self.tp_size = tp_size
        self.mode_half = mode_half
        self.heartbeats = heartbeats
        self._keep_turn = keep_turn
        self._telemetry_in_answer = telemetry_in_answer
        self._reqs: dict[str, DRequest] = {}
        #: (P engine id, lease key) -> the D request using it.
        self.lease_users: dict[tuple[str, str], str] = {}
        #: Leases whose user ended, -> (its sibling group, its id), newest last,
        #: at most ``MAX_ENDED_LEASES``: an ``n`` child vLLM adds after its
        #: first sibling already finished must not load (P is done with it).
        self._ended: dict[tuple[str, str], tuple[str, str]] = {}
        self.out = StepOut()
        #: Concurrent pull's parked requests (pull mode only).
        self.waits = waits
        #: Parked requests whose wait failed -> why: vLLM must end them with
        #: an error (the client has P's token #1; ``take_requests_to_fail``).
        self.to_fail: dict[str, str] = {}

    def __contains__(self, rid: object) -> bool:
        return rid in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def num_loading(self) -> int:
        """Loads in flight (O(n): asked only in steps that schedule nothing)."""
        return sum(1 for d in self._reqs.values() if d.state is LoadState.LOADING)

    # ---------------------------------------------------------------- arrival
    def arrive(self, rid: str, leg: DecodedLeg, request: Any) -> None:
        params = leg.params
        if leg.refused or params is None:
            self._refuse(rid, leg.problem)
            return
        pending = params.pd_seed_pending
        parked = params.is_pull_wait
        if pending and (params.pd_seeded_tokens or not (
                params.mode is TransferMode.PUSH or (parked and self.waits is not None))):
            self._refuse(rid, "kv_transfer_params.pd_seed_pending needs no pd_seeded_tokens and "
                         "transfer_mode 'push' (token #1 comes with P's WRITE), or a pull leg "
                         "naming no blocks on a pull engine (token #1 comes with P's answer)",
                         True)
            return
        if params.pd_seeded_tokens and params.pd_seeded_tokens >= len(
                request.prompt_token_ids or ()):
            self._refuse(rid, f"kv_transfer_params.pd_seeded_tokens={params.pd_seeded_tokens} "
                         f"leaves no prompt for P's KV (the prompt has "
                         f"{len(request.prompt_token_ids)} tokens)")
            return
        digest = params.remote_prompt_digest
        if (digest and not compat.is_rejection_notice(request)
                and digest != auth.token_digest(p_prompt(request, params))):
            self._refuse(rid, "kv_transfer_params come from the prefill of another prompt "
                         "(P's prompt digest differs from this request's): its KV would "
                         "not match")
            return
        if params.mode is not self.mode:
            self._refuse(rid, f"kv_transfer_params.transfer_mode={params.mode.value!r} but this "
                         f"engine runs transfer_mode={self.mode.value!r} (give P, D and the "
                         "proxy the same transfer_mode)")
            return
        if params.tp_size != self.tp_size:
            # Never loop over a count from the request: D's own TP size is the
            # rank count; the handshake checks P's real sharding (tp_slices).
            problem = tp_size_problem(params.tp_size, self.tp_size)
            if problem:
                self._refuse(rid, problem)
                return
        key = lease_key(params)
        lease = (str(params.remote_engine_id), key)
        user = self.lease_users.get(lease)
        ended = self._ended.get(lease)
        if pending and (user is not None or ended is not None) and (
                not compat.is_rejection_notice(request)):
            # Only the request that registered gets token #1 from P; a
            # sibling would have to sample its own, which the client has.
            self._refuse(rid, f"kv_transfer_params.pd_seed_pending names P lease {key}, "
                         "which another request on this engine uses (n > 1?)", True)
            return
        if (user is None and ended is not None and ended[0] == compat.sibling_group(rid)
                and not compat.is_rejection_notice(request)):
            # A late sibling: vLLM adds the children one by one, and the first
            # one's load (even its whole decode) may be over before the next
            # arrives. It loads nothing: a follower of a leader that is gone
            # is an ordinary request at its first step (prefix cache, else
            # it computes the prompt itself).
            self._reqs[rid] = DRequest(params, leader=ended[1])
            logger.info("PDConnector: request %s shares the KV load of request %s, which "
                        "already ended (remote prefill %s)", rid, ended[1], key)
            return
        if user is not None and user != rid and not compat.is_rejection_notice(request):
            # A second live request on one lease: the ``n``/``best_of``
            # children vLLM fans out of one request share their parent's
            # params (push params carry no digest: the proxy made them). One
            # load feeds them all: this one never reads P, it waits for that
            # load and then computes what D's prefix cache lacks, which is
            # less than a block for a sibling (the cache is keyed by tokens:
            # another prompt, say a replayed answer, simply computes itself).
            self._reqs[rid] = DRequest(params, leader=user)
            logger.info("PDConnector: request %s shares the KV load of request %s "
                        "(remote prefill %s): it waits for that load", rid, user, key)
            return
        if user is not None and user != rid:
            self._refuse(rid, f"kv_transfer_params name P lease {key} of engine {lease[0]}, "
                         f"which request {user} on this engine is already using")
            return
        self.lease_users[lease] = rid
        self._reqs[rid] = DRequest(params, lease=lease, arrived=time.monotonic(),
                                   api_s=compat.since_api_arrival(request),
                                   seed_pending=pending,
                                   request=request if pending else None, parked=parked)
        assert params.remote_host is not None and params.remote_port is not None
        if parked:
            assert self.waits is not None
            # No lease on P yet: heartbeats start with P's answer.
            self.waits.park(rid, params)
            return
        self.heartbeats.track(rid, (params.remote_host, params.remote_port), key)
        logger.info("PDConnector: request %s arrived for remote prefill %s on engine %s (%s)",
                    rid, key, params.remote_engine_id, params.mode.value)

    def _refuse(self, rid: str, why: str, seed_pending: bool = False) -> None:
        self._reqs[rid] = DRequest(None, bad=why, seed_pending=seed_pending)
        logger.error("PDConnector: request %s: %s; its KV load will fail", rid, why)

    # ---------------------------------------------------------------- the load
    def matched_tokens(self, request: Any, num_computed_tokens: int
                       ) -> tuple[int | None, bool] | None:
        """vLLM's ``get_num_new_matched_tokens`` answer; None: not a D request.

        A follower answers ``(None, False)`` (vLLM skips it this step) while
        its leader's load is pending; then it leaves this book and is an
        ordinary request: vLLM's prefix cache now holds the prompt's whole
        blocks, and it computes only the rest (less than a block).
        """
        rid = request.request_id
        d = self._reqs.get(rid)
        if d is None:
            return None
        if d.leader:
            leader = self._reqs.get(d.leader)
            if leader is not None and not leader.leader and leader.state in (
                    LoadState.WAITING, LoadState.LOADING):
                return None, False
            del self._reqs[rid]
            return 0, False
        if d.parked and not self._unpark(request, d):
            return None, False
        if d.state is not LoadState.WAITING:
            return 0, False
        # P's KV covers its prompt; seeded tokens after it are D's to compute.
        seeded = d.params.pd_seeded_tokens if d.params is not None else 0
        count = request.num_prompt_tokens - seeded - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _unpark(self, request: Any, d: DRequest) -> bool:
        """A parked request: True once P's answer came and checked out
        (``d.params`` are P's now, heartbeats run); False while it waits or
        when its wait failed (then it is in ``to_fail``)."""
        rid = request.request_id
        if rid in self.to_fail:
            return False
        assert self.waits is not None and d.params is not None
        wait = self.waits.take(rid)
        if wait is None:
            return False
        ready = wait.ready
        problem = wait.failed
        if not problem and ready is not None and not ready.ok:
            problem = f"P reports no KV: {ready.detail}"
        params = None
        if not problem and ready is not None:
            problem, params = self._answer_params(request, d.params, ready)
        if problem or params is None or ready is None:
            self.fail_parked(rid, problem or "no answer from P")
            return False
        leg = d.params
        d.params, d.parked, d.seed, d.ready_at = params, False, ready.first_token, wait.ready_at
        d.valid_until = wait.valid_until
        assert leg.remote_host is not None and leg.remote_port is not None and d.lease
        self.heartbeats.track(rid, (leg.remote_host, leg.remote_port), d.lease[1])
        return True

    def fail_parked(self, rid: str, why: str) -> None:
        """A parked request's wait failed: vLLM ends it with an error."""
        logger.error("PDConnector: request %s: %s; it ends with an error (the client has P's "
                     "token #1; the proxy continues it elsewhere)", rid, why)
        self.to_fail[rid] = why

    def _answer_params(self, request: Any, leg: KVTransferParams, ready: proto.PullReady
                       ) -> tuple[str, KVTransferParams | None]:
        """P's answer in ``ready``, checked as a sequential pull leg's params
        are (and against the leg: the same P, this wait's id): ("", params)
        or (why not, None)."""
        p = ready.params
        if p is None:
            return "P's answer carried no kv_transfer_params", None
        try:
            decode_params(msgspec.to_builtins(p))
        except ParamsError as exc:
            return f"P's answer: {exc}", None
        if (p.remote_engine_id, p.remote_request_id, p.remote_host, p.remote_port) != (
                leg.remote_engine_id, leg.pd_request_id, leg.remote_host, leg.remote_port):
            return (f"P's answer names engine {p.remote_engine_id} at {p.remote_host}:"
                    f"{p.remote_port}, lease {p.remote_request_id}; the leg named engine "
                    f"{leg.remote_engine_id} at {leg.remote_host}:{leg.remote_port}, "
                    f"{leg.pd_request_id}"), None
        if p.mode is not TransferMode.PULL or not p.do_remote_prefill:
            return f"P's answer is not a pull answer (transfer_mode={p.transfer_mode!r})", None
        problem = tp_size_problem(p.tp_size, self.tp_size) if p.tp_size != self.tp_size else ""
        if problem:
            return problem, None
        if p.remote_prompt_digest != auth.token_digest(list(request.prompt_token_ids or ())):
            return ("P's answer comes from the prefill of another prompt (P's prompt digest "
                    "differs from this request's): its KV would not match"), None
        if ready.first_token < 0:
            return "P's answer carried no token #1", None
        return "", msgspec.structs.replace(
            p, pd_request_id=leg.pd_request_id, pd_seed_pending=True,
            pd_bidirectional=leg.pd_bidirectional, pd_sig=None)

    def allocate(self, request: Any, local_blocks: list[int], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: queue its load (or its failure)."""
        rid = request.request_id
        d = self._reqs.get(rid)
        if d is None or d.state is not LoadState.WAITING:
            return
        if d.params is None:
            # Claimed tokens must be reported (failed), or vLLM waits forever.
            d.allocate(loading=num_external_tokens > 0)
            if d.in_flight:
                self.out.fail[rid] = (FailureReason.BAD_PARAMS.value, d.bad)
            return
        p_tokens = p_prompt(request, d.params)
        spec = self.mode_half.allocate(
            rid, d.params, len(p_tokens), num_external_tokens, local_blocks,
            prompt_digest=auth.token_digest(p_tokens))
        d.allocate(loading=spec is not None)
        if spec is None or isinstance(spec, LayoutProblem):
            self.heartbeats.untrack(rid)  # P was told it is not needed
        if isinstance(spec, LayoutProblem):
            self.out.fail[rid] = (FailureReason.LAYOUT.value, spec.why)
        elif isinstance(spec, RecvSpec):
            if d.valid_until:
                # P's answer extended the lease: the worker reads unpinned.
                spec = dataclasses.replace(spec, valid_until=d.valid_until,
                                           clock=monotonic_clock_id())
            self.out.recv.append(spec)
        elif isinstance(spec, PushRecvSpec):
            self.out.push.append(spec)

    def take_step(self) -> StepOut:
        out, self.out = self.out, StepOut()
        if out.recv or out.push:
            now = time.monotonic()
            rids = [s.request_id for s in out.recv] + [s.request_id for s in out.push]
            for rid in rids:
                d = self._reqs.get(rid)
                if d is not None and not d.dispatched:
                    d.dispatched = now
        return out

    def poll(self) -> dict[str, tuple[str, str]]:
        """Push waits that ended without the KV this step (pull: none; a
        concurrent pull's parked requests whose wait failed go to ``to_fail``)."""
        if self.waits is not None and self.waits.num_parked:
            for rid, why in self.waits.poll().items():
                self.fail_parked(rid, why)
        if not self.mode_half.num_waiting:
            return {}
        failed = self.mode_half.poll()
        for rid in failed:
            self.heartbeats.untrack(rid)
        return failed

    def on_seeds(self, seeds: dict[str, int]) -> None:
        """Token #1 of pushes that carried one (the workers' metadata; a
        rank's may come a step before the load's report, which waits for
        every rank)."""
        for rid, seed in seeds.items():
            d = self._reqs.get(rid)
            if d is not None and d.seed_pending:
                d.seed = seed

    def seed_problem(self, rid: str, failed: bool, vocab_size: int) -> str | None:
        """Before ``reported``: a ``pd_seed_pending`` request's token #1 goes
        into its prompt now; why it cannot (the request must then end with
        an error, never sample token #1 itself); None: nothing to do or done."""
        d = self._reqs.get(rid)
        if d is None or not d.seed_pending or d.state is not LoadState.LOADING:
            return None
        if failed:
            return f"its KV load failed{': ' + d.bad if d.bad else ''}"
        if d.seed < 0:
            return "P's WRITE notification carried no token #1"
        if vocab_size and d.seed >= vocab_size:
            return f"P's token #1 ({d.seed}) is outside this model's vocabulary ({vocab_size})"
        try:
            compat.append_prompt_token(d.request, d.seed)
        except RuntimeError as exc:
            return str(exc)
        return None

    def land_seen(self, rid: str, seed: int, vocab_size: int) -> bool:
        """The scheduler saw ``rid``'s push land on every rank
        (``d_landing.LandingView``): end its load here as the workers'
        report would, with P's token #1 appended. False (nothing changed)
        where the report must decide: not a load in flight, or token #1
        missing or out of range (the report then fails the request)."""
        d = self._reqs.get(rid)
        if d is None or d.state is not LoadState.LOADING or d.leader:
            return False
        if d.seed_pending:
            if seed < 0 or (vocab_size and seed >= vocab_size):
                return False
            d.seed = seed
            if self.seed_problem(rid, False, vocab_size) is not None:
                return False
        d.landed_at = time.monotonic()
        self.reported(rid)
        return True

    def reported(self, rid: str) -> None:
        """The workers reported ``rid``'s load (done or failed)."""
        d = self._reqs.get(rid)
        if d is not None:
            if d.in_flight and d.reported():
                del self._reqs[rid]
            self._end_lease_use(d)
        self.heartbeats.untrack(rid)
        self.mode_half.loaded(rid)
        if self.waits is not None:
            self.waits.forget(rid)

    def on_records(self, records: list[telemetry.TransferRecord]) -> None:
        """Complete the workers' telemetry records with what only the scheduler
        knows (where the KV came from, time since arrival, push's registration
        round trip), log each as one line, keep it for the request's answer."""
        now = time.monotonic()
        for rid, rec in telemetry.merge_by_request(records).items():
            d = self._reqs.get(rid)
            if d is not None and d.transfer is not None:
                # Another TP rank's record, reported in an earlier step.
                rec = telemetry.merge(d.transfer, rec)
            if d is not None and d.params is not None:
                params = d.params
                fill: dict[str, Any] = {
                    "kv_ready_ms": telemetry.ms((d.landed_at or now) - d.arrived)}
                if d.dispatched:
                    fill["sched_ms"] = telemetry.ms(d.dispatched - d.arrived)
                if d.ready_at:
                    fill["p_wait_ms"] = telemetry.ms(d.ready_at - d.arrived)
                if d.api_s is not None:
                    fill["api_ms"] = telemetry.ms(d.api_s)
                if not rec.p_engine:
                    fill.update(p_engine=str(params.remote_engine_id),
                                p_addr=f"{params.remote_host}:{params.remote_port}")
                if not rec.remote_request_id:
                    fill["remote_request_id"] = lease_key(params)
                register = self.mode_half.register_seconds(rid)
                if register is not None:
                    fill["register_ms"] = telemetry.ms(register)
                rec = d.transfer = msgspec.structs.replace(rec, **fill)
            logger.info("%s", telemetry.log_line(rec))

    # ---------------------------------------------------------------- the end
    def finish(self, rid: str, request: Any, block_ids: list[int]
               ) -> tuple[bool, dict[str, Any] | None] | None:
        """vLLM's ``request_finished`` answer for a D request; None: not ours."""
        d = self._reqs.get(rid)
        if d is None:
            return None
        if d.leader:  # ended while waiting for its leader: nothing of it is anywhere
            del self._reqs[rid]
            return False, None
        answer = self._finish(rid, d, request, block_ids)
        if self._telemetry_in_answer and d.transfer is not None:
            answer = {**(answer or {}), telemetry.PARAMS_KEY: telemetry.to_dict(d.transfer)}
        # Never (True, ...): vLLM frees D's blocks itself (after the workers
        # reported a load in flight).
        return False, answer

    def _finish(self, rid: str, d: DRequest, request: Any, block_ids: list[int]
                ) -> dict[str, Any] | None:
        self.to_fail.pop(rid, None)
        if d.parked:
            # Ended before P's answer was taken: P drops the wait, and
            # frees the blocks it may already have lent for it.
            assert self.waits is not None and d.params is not None
            self._end_lease_use(d)
            del self._reqs[rid]
            self.waits.cancel(rid, (str(d.params.remote_host), int(d.params.remote_port or 0)),
                              "request ended on D before P's answer")
            return None
        before = d.state
        if d.end():
            self._end_lease_use(d)
            del self._reqs[rid]
        if d.params is None:
            return None
        if before in (LoadState.WAITING, LoadState.LOADING):
            # The load never started, or is in flight: no turn to keep. The
            # mode half frees P's side (or, push, stops P's WRITE first).
            if before is LoadState.WAITING or self.mode is TransferMode.PUSH:
                self.heartbeats.untrack(rid)
            self.mode_half.end(rid, d.params, before)
            if before is LoadState.WAITING and self.waits is not None:
                self.waits.forget(rid)
            return None
        return self._keep_turn(request, block_ids, d.params)

    def _end_lease_use(self, d: DRequest) -> None:
        if d.lease is not None:
            rid = self.lease_users.pop(d.lease, None)
            if rid is not None:
                self._ended.pop(d.lease, None)
                self._ended[d.lease] = (compat.sibling_group(rid), rid)
                while len(self._ended) > MAX_ENDED_LEASES:
                    del self._ended[next(iter(self._ended))]
            d.lease = None
