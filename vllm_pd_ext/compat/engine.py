"""Patches of the EngineCore's and the workers' internals (see ``patches``).

- ``quiet_shm_spin``: vLLM's shared-memory queue readers sleep on their
  notification instead of spinning for 1 s after every message
  (``quiet_new_shm_readers``: those created later, in a process without
  our connector);
- ``on_engine_shutdown``: the connector hears vLLM's SIGTERM/SIGINT;
- ``ensure_drain_window``: a SIGTERM drains (``shutdown_timeout``).

Applied only through ``patches.apply``, which probes each target first.
"""

from __future__ import annotations

import functools
import math
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

#: How long a quieted reader sleeps before it looks at the queue again:
#: 1 ms within 100 ms of its last message (the engine is stepping), 10 ms
#: after that (idle: 100 wake-ups a second, well under 1% of a core).
QUIET_POLL_MS = (1, 10)
QUIET_ACTIVE_S = 0.1
#: With ``spin_while_computing`` (opt-in), a quieted reader spins as vLLM's
#: do (``sched_yield``, within vLLM's busy window after its last message)
#: while this process's engine ran the model less than ``MODEL_SPIN_S`` ago
#: (``note_model_step``): the notification's wake-up cost each decode step
#: 0.4 to 3.8 ms on our CPU host (D's ITL 6.4 to 9.3 ms against 5.4 to 6.4
#: for a plain engine, tiny model, one core). Off by default: a spinning
#: reader stays runnable, and where engines share cores (the CI's two lanes
#: on two cores) a spinning D is suspected of starving its P for 10 s in
#: one CI run. Short naps instead of the spin did not help (D's ITL 8.1 to
#: 8.3 ms). Longer than a step, so the reader waiting for a step's answer
#: spins through it.
MODEL_SPIN_S = 0.25
#: Whether the quieted readers spin while the model runs (``quiet_shm_spin``).
_spin_while_computing = [False]
#: ``time.monotonic()`` of this process's last step that ran the model.
_last_model_step = [-math.inf]


def note_model_step(runs_model: bool) -> None:
    """The connector saw a step begin (``runs_model``: it computes tokens;
    else an empty step, e.g. one that only moves KV), or a step report a
    finished load (``True``: the next step computes that request). Called
    once per step in the EngineCore and in each worker."""
    if runs_model:
        _last_model_step[0] = time.monotonic()


def quiet_shm_spin(spin_while_computing: bool = False) -> int:
    """Stop this process's readers of vLLM's shared-memory message queues
    from spinning; returns how many readers were changed.

    vLLM's ``MessageQueue`` reader busy-waits with ``sched_yield`` for 1 s
    after every message (``SpinCondition.busy_loop_s``) before it sleeps on
    the queue's ZMQ notification. An engine with connector work pending
    steps back to back, so its worker (reading the step RPCs) and its
    EngineCore (reading the answers) never stop spinning. On CPU, where P
    and D may share cores, those spinners took a whole core from the other
    engine's EngineCore: a push P with a finished prefill got 4 ms of CPU in
    7 s and its side channel stopped answering (issue 11's soak).

    With ``spin_while_computing``, a quieted reader spins as vLLM's does
    while its engine's steps run the model (``MODEL_SPIN_S``). Otherwise it
    sleeps in ``poll`` on the notification socket, but for at most
    ``QUIET_POLL_MS`` at a time: the notifications alone are not
    enough (with ``busy_loop_s = 0`` and nothing else, about one request in
    two stalled 5 s, until the reader's own timeout: a wake-up went
    missing, which vLLM's spin normally hides). The queue is checked again
    after every poll, so a missed notification costs at most 1 ms while the
    engine steps and 10 ms for the first message after an idle spell.
    Found by scanning the process's objects once (the queues are private to
    vLLM's executor); vLLM-version specific, hence here.
    """
    import gc

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    _spin_while_computing[0] = spin_while_computing
    changed = 0
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which lazy
        # module proxies answer with deprecation warnings.
        if not issubclass(type(obj), MessageQueue):
            continue
        spin = getattr(obj, "_spin_condition", None)
        if spin is None or not getattr(spin, "is_reader", False) or not spin.busy_loop_s:
            continue
        _quiet(spin)
        changed += 1
    return changed


def quiet_new_shm_readers() -> bool:
    """Quiet (as ``quiet_shm_spin``) every reader of vLLM's shared-memory
    queues this process creates from now on; False if already done.

    For processes that load no connector of ours, from the plugin hook
    (``register``), which vLLM calls in the EngineCore and in each worker
    before they build their queues.
    """
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    init = SpinCondition.__init__
    if getattr(init, "_pd_ext_quiet", False):
        return False

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if getattr(self, "is_reader", False) and self.busy_loop_s:
            _quiet(self)

    __init__._pd_ext_quiet = True  # type: ignore[attr-defined]
    SpinCondition.__init__ = __init__  # type: ignore[method-assign]
    return True


def _quiet(spin: Any) -> None:
    """Make one reader's ``SpinCondition`` sleep on the notification instead
    of spinning (with ``spin_while_computing``: except while the model runs)."""
    import zmq
    from vllm.distributed.device_communicators import shm_broadcast

    busy_s = spin.busy_loop_s

    def wait(timeout_ms: int | None = None, _spin: Any = spin) -> None:
        now = time.monotonic()
        if (_spin_while_computing[0] and now - _last_model_step[0] < MODEL_SPIN_S
                and now - _spin.last_read <= busy_s):
            # vLLM's own yield (looked up per call: the tests count it).
            shm_broadcast.sched_yield()  # type: ignore[attr-defined,no-untyped-call]
            return
        active = now - _spin.last_read < QUIET_ACTIVE_S
        limit = QUIET_POLL_MS[0] if active else QUIET_POLL_MS[1]
        if timeout_ms is not None:
            limit = min(limit, timeout_ms)
        events = dict(_spin.poller.poll(timeout=limit))
        if _spin.local_notify_socket in events:
            # CONFLATE keeps only the last notification: one read empties it.
            _spin.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)

    spin.busy_loop_s = 0
    spin.wait = wait


def ensure_drain_window(vllm_config: Any, drain_timeout_s: float) -> int:
    """Give vLLM's shutdown a drain window; returns the window in seconds.

    vLLM's EngineCore drains on SIGTERM only with ``--shutdown-timeout`` > 0
    (its default 0 aborts every request at once, which would cut a D's READ
    of a lease P granted). While draining it keeps stepping as long as it has
    work, and the connector counts as work while a granted lease still pins
    blocks (``on_engine_shutdown``, ``PDScheduler.has_pending_push_work``).
    A window the user set wins.

    Two callers: the EngineCore (the connector, at start: ``drain_timeout``,
    which puts vLLM's shutdown in drain mode) and the API server at the
    drain's hand-over (``drain.py``: what is left of ``drain_timeout``, so
    the whole drain stays within it; that value is how long the API server
    waits for its EngineCore before killing it).
    """
    current = int(getattr(vllm_config, "shutdown_timeout", 0) or 0)
    if current == 0 and drain_timeout_s > 0:
        current = max(1, math.ceil(drain_timeout_s))
        vllm_config.shutdown_timeout = current
    return current


def on_engine_shutdown(callback: Callable[[], None]) -> bool:
    """Call ``callback`` when this EngineCore process is told to shut down.

    vLLM's EngineCore installs its SIGTERM/SIGINT handler before it builds
    the scheduler (and so the connector), on the main thread; this chains
    ``callback`` in front of it. The connector needs to know, because vLLM
    decides whether a draining engine still has work from its own queues,
    and a P's leased blocks are held by the connector, not by vLLM's
    requests (``PDScheduler.has_pending_push_work``). Returns False (and
    changes nothing) off the main thread or when the handler is not vLLM's.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    chained = False
    for sig in (signal.SIGTERM, signal.SIGINT):
        prev = signal.getsignal(sig)
        if not callable(prev) or not getattr(prev, "__module__", "").startswith("vllm."):
            continue

        def handler(signum: int, frame: Any, prev: Callable[..., Any] = prev) -> None:
            try:
                callback()
            finally:
                prev(signum, frame)

        signal.signal(sig, handler)
        chained = True
    return chained


#: The pause vLLM's EngineCore loop takes after a step that ran no model
#: while requests remain (``EngineCore._process_engine_step``).
IDLE_YIELD_S = 0.001


class _LoopTime:
    """``time`` as vLLM's EngineCore module sees it, except that the idle
    yield after a step is skipped when ``work_ready()`` says the next step
    has work (one call per yield). Everything else is the real module."""

    def __init__(self, real: Any, work_ready: Callable[[], bool]) -> None:
        self._real = real
        self._work_ready = work_ready

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def sleep(self, seconds: float) -> None:
        if seconds == IDLE_YIELD_S and self._work_ready():
            return
        self._real.sleep(seconds)


def skip_idle_yield_when(work_ready: Callable[[], bool]) -> bool:
    """Let this EngineCore skip its 1 ms idle yield when ``work_ready()``;
    False if already done.

    After a step that ran no model while requests remain (on D: a request
    waiting for its KV), vLLM sleeps 1 ms "to allow background transfer
    threads to make progress". When that very step reported a load done,
    the next step has work: the request whose KV just arrived computes its
    first token, and the sleep only delays it (by 1.06 ms on our CPU host,
    between the load's report and the step that uses it). The connector
    answers ``work_ready`` (``PDScheduler.take_loads_reported``); every
    other yield is kept. vLLM-version specific, hence here: the module's
    ``time`` is replaced, which no other code of that module would notice.
    """
    import vllm.v1.engine.core as core

    real = vars(core)["time"]
    if isinstance(real, _LoopTime):
        return False
    # The module's only time.sleep is that yield (patches.py probes it).
    setattr(core, "time", _LoopTime(real, work_ready))  # noqa: B010 - not exported
    return True


def fail_seed_requests() -> bool:
    """After each step's ``Scheduler.update_from_output``, end with an error
    the requests the connector names (``take_requests_to_fail``); False if
    already done in this process.

    A D leg sent before P's token #1 existed (``pd_seed_pending``) continues
    after that token, which the client already has: it can never sample
    token #1 itself. When the token does not come (the load failed, P sent
    none), vLLM's ``recompute`` policy would do exactly that, and ``fail``
    is one engine-wide switch; so these requests end as ``fail`` ends them:
    ``finish_requests(FINISHED_ERROR)`` and an output with the ``error``
    finish reason, which the proxy turns into a continuation elsewhere.

    It runs after the step's output was processed (the load's report made
    the request schedulable) and before the next ``schedule()``: the
    request never runs a step. Its blocks are freed at once, which is
    safe: the connector names a request only once its load was reported,
    when no transfer can write into its blocks any more.
    """
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import RequestStatus

    original = Scheduler.update_from_output
    if getattr(original, "_pd_fail_seed_requests", False):
        return False

    # ``wraps``: the probe (inspect.getsource unwraps) still reads vLLM's code.
    @functools.wraps(original)
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any
                           ) -> Any:
        outputs = original(self, scheduler_output, model_runner_output)
        take = getattr(self.connector, "take_requests_to_fail", None)
        doomed = take() if take is not None else None
        if not doomed:
            return outputs
        for request in self.finish_requests(list(doomed), RequestStatus.FINISHED_ERROR):
            eco = outputs.get(request.client_index)
            if eco is None:
                eco = outputs[request.client_index] = EngineCoreOutputs()
            eco.outputs.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[],
                finish_reason=request.get_finished_reason(), events=request.take_events(),
                trace_headers=request.trace_headers))
        return outputs

    update_from_output._pd_fail_seed_requests = True  # type: ignore[attr-defined]
    Scheduler.update_from_output = update_from_output  # type: ignore[method-assign]
    return True


def same_step_landing() -> bool:
    """Let the connector act before each ``Scheduler.schedule`` and before
    each ``Scheduler.update_from_output``; False if already done here.

    ``schedule``: the connector's ``before_schedule(scheduler)`` sleeps an
    idle D's step there rather than after it was planned, and promotes the
    pushes it saw land (``promote_landed``), so their first step runs in
    this very step (``scheduler/d_landing.py``). ``update_from_output``: its
    ``before_update_from_output(kv_connector_output)`` reads the workers'
    metadata before vLLM finishes the step's requests, so a request that
    ends in the step its load was reported in still answers with its
    transfer record.
    """
    from vllm.v1.core.sched.scheduler import Scheduler

    original_schedule = Scheduler.schedule
    if getattr(original_schedule, "_pd_same_step_landing", False):
        return False
    original_update = Scheduler.update_from_output

    @functools.wraps(original_schedule)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        hook = getattr(self.connector, "before_schedule", None)
        if hook is not None:
            hook(self)
        return original_schedule(self, *args, **kwargs)

    @functools.wraps(original_update)
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        hook = getattr(self.connector, "before_update_from_output", None)
        output = getattr(model_runner_output, "kv_connector_output", None)
        if hook is not None and output is not None:
            hook(output)
        return original_update(self, scheduler_output, model_runner_output)

    schedule._pd_same_step_landing = True  # type: ignore[attr-defined]
    Scheduler.schedule = schedule  # type: ignore[method-assign]
    Scheduler.update_from_output = update_from_output  # type: ignore[method-assign]
    return True

