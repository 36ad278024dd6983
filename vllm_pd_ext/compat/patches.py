"""Every patch of vLLM internals (and every vLLM internal we rely on), in one table.

Each ``Patch`` names its target inside vLLM, the vLLM versions it was written
for, the processes it belongs to and why it exists. Lifecycle:

1. ``apply(process, ctx)`` is the one explicit call per process (the
   EngineCore: the connector's scheduler half; a worker: its
   ``register_kv_caches``; the API server: our middlewares; ``vllm serve``'s
   own process: the plugin hook, ``register``). For each patch
   of that process it first runs ``probe()`` (is the target where the patch
   expects it?), then ``apply`` if the patch changes something, and logs one
   line: applied, checked (an internal we only rely on), or skipped with the
   reason (turned off in ``kv_connector_extra_config``, not this platform).
2. A patch whose target moved is never applied blind: it is skipped with an
   ERROR naming what moved, and the engine runs as a vLLM without that
   adaptation would (slower, or without the feature, as the line says).
   ``tests/component/test_vllm_patches.py`` probes every entry against the
   installed vLLM, so a moved target fails CI before it reaches production.

Adding a patch: write its probe and its apply here, add the row to
``PATCHES``, and the test covers it.
"""

from __future__ import annotations

import enum
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from vllm_pd_ext import QUIET_SPIN_ENV
from vllm_pd_ext.compat import (
    VLLM_VERSION,
    is_cpu_platform,
    omp_threads_bind,
    serve_parent,
    step_trace,
)
from vllm_pd_ext.compat import engine as engine_patches
from vllm_pd_ext.compat import serving as serving_patches
from vllm_pd_ext.compat.affinity import bind_engine_core
from vllm_pd_ext.log import get_logger

logger = get_logger(__name__)


class Process(enum.Enum):
    API_SERVER = "API server"
    ENGINE_CORE = "EngineCore"
    WORKER = "worker"
    #: Any vLLM process, from the plugin hook (``vllm_pd_ext.register``),
    #: with or without our connector.
    PLUGIN = "plugin hook"
    #: ``vllm serve``'s own process (the parent of several API servers),
    #: from the plugin hook.
    SERVE_PARENT = "vllm serve parent"


class Skip(Exception):
    """Raised by a patch's ``apply`` that does not apply here; the message says why."""


@dataclass
class Context:
    """What the patches of one process need."""

    #: The connector's ``PDConfig`` (switches such as ``quiet_shm_spin``).
    cfg: Any = None
    vllm_config: Any = None
    #: EngineCore: called on vLLM's SIGTERM/SIGINT (``engine_shutdown_hook``).
    on_shutdown: Callable[[], None] | None = None
    #: EngineCore: True once after a step reported a KV load done
    #: (``skip_idle_yield``).
    loads_reported: Callable[[], bool] | None = None
    #: EngineCore: turn on the scheduler half's work before ``schedule()``
    #: (push's landing view, concurrent pull's wait for P's answer); False
    #: where it has none (not a D with ``push_idle_wait_ms`` > 0).
    enable_landing: Callable[[], bool] | None = None


@dataclass(frozen=True)
class Patch:
    name: str
    #: What it changes or relies on inside vLLM.
    target: str
    #: vLLM versions it was written for (prefixes of ``vllm.__version__``).
    versions: tuple[str, ...]
    processes: tuple[Process, ...]
    why: str
    #: None if the target is where this patch expects it, else what moved.
    probe: Callable[[], str | None]
    #: Changes vLLM and returns a detail for the log, or raises ``Skip``;
    #: None for an internal we only rely on (probed, never changed).
    apply: Callable[[Context], str] | None = None


@dataclass(frozen=True)
class Outcome:
    name: str
    #: "applied", "checked", "skipped" or "moved".
    status: str
    detail: str


# --------------------------------------------------------------------------- probes
def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _import(path: str) -> Any:
    """``module.attr.attr`` -> the object; raises ``LookupError`` naming the part."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                raise LookupError(f"{path}: no {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise LookupError(f"{path}: no such module")


def _needs(path: str, *snippets: str) -> Callable[[], str | None]:
    """A probe: ``path`` exists and its source contains every snippet."""
    def probe() -> str | None:
        try:
            obj = _import(path)
        except LookupError as exc:
            return str(exc)
        text = _source(obj)
        missing = [s for s in snippets if s not in text]
        return f"{path} no longer contains {missing}" if missing else None
    return probe


def _needs_once(path: str, snippet: str) -> Callable[[], str | None]:
    """A probe: ``path``'s source contains ``snippet`` exactly once."""
    def probe() -> str | None:
        try:
            obj = _import(path)
        except LookupError as exc:
            return str(exc)
        n = _source(obj).count(snippet)
        return None if n == 1 else f"{path} contains {snippet!r} {n} times, not once"
    return probe


def _has_field(path: str, name: str) -> Callable[[], str | None]:
    def probe() -> str | None:
        try:
            cls = _import(path)
        except LookupError as exc:
            return str(exc)
        names = {f.name for f in fields(cls)} if is_dataclass(cls) else set(dir(cls))
        return None if name in names else f"{path} has no field {name!r}"
    return probe


def _when_env(name: str, probe: Callable[[], str | None]) -> Callable[[], str | None]:
    """A probe run only when ``name`` is set in the environment: an opt-in
    patch whose probe would import modules this process may never load
    (vLLM's model runner, in an API server). The tests set it."""
    import os

    def gated() -> str | None:
        return probe() if os.environ.get(name) else None
    return gated


def _all(*probes: Callable[[], str | None]) -> Callable[[], str | None]:
    def probe() -> str | None:
        found = [p() for p in probes]
        moved = [m for m in found if m]
        return "; ".join(moved) if moved else None
    return probe


# -------------------------------------------------------------------------- applies
def _apply_quiet_shm_spin(ctx: Context) -> str:
    if ctx.cfg is not None and not ctx.cfg.quiet_shm_spin:
        raise Skip("quiet_shm_spin is false")
    if not is_cpu_platform():
        raise Skip("not a CPU platform")
    spin = bool(ctx.cfg is not None and ctx.cfg.spin_while_computing)
    n = engine_patches.quiet_shm_spin(spin_while_computing=spin)
    return (f"{n} shared-memory queue reader(s) wait on notifications instead of spinning"
            + (", except while the engine's steps compute (spin_while_computing)"
               if spin else ""))


def _apply_quiet_new_readers(ctx: Context) -> str:
    import os

    if os.environ.get(QUIET_SPIN_ENV) != "1":
        raise Skip(f"{QUIET_SPIN_ENV} is not 1")
    if not is_cpu_platform():
        raise Skip("not a CPU platform")
    engine_patches.quiet_new_shm_readers()
    return "shared-memory queue readers created from now on wait on notifications"


def _apply_step_trace(ctx: Context) -> str:
    import os

    directory = os.environ.get(step_trace.STEP_TRACE_ENV, "")
    if not directory:
        raise Skip(f"{step_trace.STEP_TRACE_ENV} is not set")
    events = step_trace.install(directory)
    return f"step phases ({', '.join(events)}) timed into {directory}/steps-<pid>.log"


def _apply_shutdown_hook(ctx: Context) -> str:
    if ctx.on_shutdown is None:
        raise Skip("no callback")
    if threading.current_thread() is not threading.main_thread():
        raise Skip("not on the main thread")
    if not engine_patches.on_engine_shutdown(ctx.on_shutdown):
        raise Skip("vLLM's EngineCore signal handler is not installed in this process")
    return "SIGTERM/SIGINT also tell the connector (granted leases keep a drain stepping)"


def _apply_skip_idle_yield(ctx: Context) -> str:
    if ctx.loads_reported is None:
        raise Skip("no callback")
    if not engine_patches.skip_idle_yield_when(ctx.loads_reported):
        raise Skip("already applied in this process")
    return ("the EngineCore's 1 ms idle yield is skipped after a step that reported a KV "
            "load done (the next step computes with it)")


def _apply_fail_seed_requests(ctx: Context) -> str:
    # Every mode: a pull D refuses a pd_seed_pending leg, which must end in
    # an error too.
    if not engine_patches.fail_seed_requests():
        raise Skip("already applied in this process")
    return ("a leg sent before token #1 that cannot continue after it ends with an "
            "error, whatever kv_load_failure_policy (never samples token #1 again)")


def _apply_same_step_landing(ctx: Context) -> str:
    if ctx.cfg is not None and not ctx.cfg.same_step_landing:
        raise Skip("same_step_landing is false")
    if ctx.enable_landing is None or not ctx.enable_landing():
        raise Skip("not a D with push_idle_wait_ms > 0")
    engine_patches.same_step_landing()
    return ("a push D schedules a request in the step its scheduler sees the KV land "
            "(the workers' forwarded notifications), a step before the workers' report; "
            "a concurrent pull D waits for P's answer before schedule(), so its READ "
            "starts in the step the answer wakes")


def _apply_drain_window(ctx: Context) -> str:
    window = engine_patches.ensure_drain_window(ctx.vllm_config, ctx.cfg.drain_timeout)
    return (f"on SIGTERM the EngineCore drains for up to {window} s (granted leases are "
            "served first; drain_timeout / --shutdown-timeout)")


def _apply_serve_parent(ctx: Context) -> str:
    if not serve_parent.is_serve_parent():
        raise Skip("not vllm serve's own process")
    serve_parent.serve_with_drain_window()
    return ("with several API servers, SIGTERM drains them and the engines for up to "
            "drain_timeout (--shutdown-timeout, when 0)")


def _apply_affinity(ctx: Context) -> str:
    if not ctx.cfg.bind_engine_core:
        raise Skip("bind_engine_core is false")
    cores = bind_engine_core(is_cpu_platform(), omp_threads_bind())
    if cores is None:
        raise Skip("not CPU, or VLLM_CPU_OMP_THREADS_BIND is not one explicit core list "
                   "that narrows this process's cores")
    return f"EngineCore bound to cores {','.join(map(str, sorted(cores)))}"


def _apply_stream_params(ctx: Context) -> str:
    serving_patches.stream_kv_transfer_params()
    return "streamed answers carry kv_transfer_params in their finishing chunk"


_V = ("0.32", "0.33")
_SHM = "vllm.distributed.device_communicators.shm_broadcast"
_SERVING = "vllm.entrypoints.openai"

PATCHES: tuple[Patch, ...] = (
    Patch(
        "quiet_shm_spin", f"{_SHM}.MessageQueue readers (SpinCondition.busy_loop_s, .wait)",
        _V, (Process.ENGINE_CORE, Process.WORKER),
        "a reader busy-waits 1 s after every message; on CPU, P and D share cores and the "
        "spinners starved the other engine (issue 11's soak)",
        _all(_needs(f"{_SHM}.SpinCondition.__init__", "busy_loop_s", "last_read", "poller",
                    "local_notify_socket"),
             _needs(f"{_SHM}.SpinCondition", "def wait"),
             _needs(f"{_SHM}.MessageQueue", "_spin_condition")),
        _apply_quiet_shm_spin),
    Patch(
        "quiet_shm_spin_everywhere", f"{_SHM}.SpinCondition.__init__ (readers created later)",
        _V, (Process.PLUGIN,),
        "an engine without our connector (a collocated engine, vLLM's own NixlConnector) "
        "sharing a CPU host spins 1 s after every message too; the tests' reference engine "
        f"spent about one CPU-second per request so ({QUIET_SPIN_ENV}=1 quiets it)",
        _all(_needs(f"{_SHM}.SpinCondition.__init__", "busy_loop_s", "is_reader", "poller",
                    "local_notify_socket"),
             _needs(f"{_SHM}.SpinCondition", "def wait")),
        _apply_quiet_new_readers),
    Patch(
        "step_trace", ", ".join(f"{c.rpartition('.')[2]}.{m}" for c, m, _ in step_trace.TRACED)
        + " (wrapped: a timestamp at each call's begin and end)",
        _V, (Process.PLUGIN,),
        f"opt-in ({step_trace.STEP_TRACE_ENV}=<dir>): where a step's time goes, e.g. D's "
        "first step after a KV load against its decode steps (issue 29)",
        _when_env(step_trace.STEP_TRACE_ENV, _all(
            *(_needs(f"{c}.{m}", f"def {m}(") for c, m, _ in step_trace.TRACED),
            _needs("vllm.v1.core.sched.output.SchedulerOutput", "num_scheduled_tokens",
                   "scheduled_new_reqs"))),
        _apply_step_trace),
    Patch(
        "engine_shutdown_hook", "vllm.v1.engine.core SIGTERM/SIGINT handler (chained)",
        _V, (Process.ENGINE_CORE,),
        "vLLM decides a draining engine's work from its own queues; the connector's leased "
        "blocks must count too (PDScheduler.has_pending_push_work)",
        _needs("vllm.v1.engine.core", "signal.signal(signal.SIGTERM",
               "signal.signal(signal.SIGINT"),
        _apply_shutdown_hook),
    Patch(
        "skip_idle_yield", "vllm.v1.engine.core.EngineCoreProc._process_engine_step (its "
        "time.sleep(0.001) after a step without a model run)",
        _V, (Process.ENGINE_CORE,),
        "after the step that reports a KV load done, the 1 ms yield only delays the step that "
        "computes with it (issue 29: the gap between token #1 and token #2)",
        # The patch swaps the module's ``time``: that yield must be its only sleep.
        _all(_needs("vllm.v1.engine.core", "import time"),
             _needs_once("vllm.v1.engine.core", "time.sleep("),
             _needs("vllm.v1.engine.core.EngineCoreProc._process_engine_step",
                    "if not model_executed and self.scheduler.has_requests():",
                    "time.sleep(0.001)")),
        _apply_skip_idle_yield),
    Patch(
        "fail_seed_requests", "vllm.v1.core.sched.scheduler.Scheduler.update_from_output "
        "(wrapped: finish_requests(FINISHED_ERROR) for the connector's doomed requests)",
        _V, (Process.ENGINE_CORE,),
        "a D leg sent beside P's (pd_seed_pending, issue 29; push or pull) must end with an error, "
        "not recompute, when token #1 does not come with the KV: the client has it already",
        _all(_needs("vllm.v1.core.sched.scheduler.Scheduler.update_from_output",
                    "engine_core_outputs = {", "return engine_core_outputs",
                    "self._update_from_kv_xfer_finished(kv_connector_output)"),
             _needs("vllm.v1.core.sched.scheduler.Scheduler.finish_requests",
                    "RequestStatus.is_finished(finished_status)"),
             _needs("vllm.v1.core.sched.scheduler.Scheduler._update_from_kv_xfer_finished",
                    "self.connector.update_connector_output(kv_connector_output)"),
             _needs("vllm.v1.engine.EngineCoreOutput", "finish_reason", "trace_headers")),
        _apply_fail_seed_requests),
    Patch(
        "same_step_landing", "vllm.v1.core.sched.scheduler.Scheduler.schedule and "
        ".update_from_output (wrapped: the connector's before_schedule / "
        "before_update_from_output first); Scheduler.finished_recving_kv_req_ids",
        _V, (Process.ENGINE_CORE,),
        "an idle push D learned a load landed only from the output of an empty step run "
        "for it, and computed with it in the step after: two crossings to its workers "
        "between the KV landing and token #2; an idle concurrent pull D woken by P's "
        "answer after planning an empty step ran it before allocating (issue 29)",
        _all(_needs("vllm.v1.core.sched.scheduler.Scheduler._handle_blocked_waiting_request",
                    "RequestStatus.WAITING_FOR_REMOTE_KVS",
                    "if request_id not in self.finished_recving_kv_req_ids:",
                    "self._update_waiting_for_remote_kv(request)"),
             _needs("vllm.v1.core.sched.scheduler.Scheduler._update_from_kv_xfer_finished",
                    "self.connector.update_connector_output(kv_connector_output)",
                    "for req_id in kv_connector_output.finished_recving or ():",
                    "self.finished_recving_kv_req_ids.add(req_id)"),
             _needs("vllm.v1.core.sched.scheduler.Scheduler.update_from_output",
                    "kv_connector_output = model_runner_output.kv_connector_output",
                    "self._free_request(request)",
                    "self._update_from_kv_xfer_finished(kv_connector_output)"),
             _needs("vllm.v1.core.sched.scheduler.Scheduler.__init__", "self.running",
                    "self.waiting", "self.finished_recving_kv_req_ids",
                    "self.failed_recving_kv_req_ids", "self.finished_req_ids"),
             _needs("vllm.v1.core.sched.scheduler.Scheduler.schedule",
                    "def schedule(self")),
        _apply_same_step_landing),
    Patch(
        "drain_window", "VllmConfig.shutdown_timeout (set when 0)",
        _V, (Process.ENGINE_CORE,),
        "vLLM's default 0 aborts every request on SIGTERM, cutting a D's READ of a lease P "
        "granted",
        _has_field("vllm.config.VllmConfig", "shutdown_timeout"),
        _apply_drain_window),
    Patch(
        "serve_parent_drain_window",
        "vllm.entrypoints.cli.serve.run_multi_api_server (args.shutdown_timeout set when 0)",
        _V, (Process.SERVE_PARENT,),
        "with --api-server-count > 1 the parent's SIGTERM killed the API servers and the "
        "engines at once (its shutdown_timeout 0), before any drain",
        _all(_needs("vllm.entrypoints.cli.serve.run_multi_api_server", "from_cli_args(args)",
                    "vllm_config.shutdown_timeout", "api_server_manager.shutdown(timeout="),
             _needs("vllm.entrypoints.cli.serve.ServeSubcommand.cmd",
                    "run_multi_api_server(args)")),
        _apply_serve_parent),
    Patch(
        "api_server_count", "ParallelConfig._api_process_count, _api_process_rank",
        _V, (Process.API_SERVER,),
        "POST /pd/drain on one API server of several drains them all through vLLM's parent "
        "(compat.serve_parent)",
        _all(_has_field("vllm.config.ParallelConfig", "_api_process_count"),
             _has_field("vllm.config.ParallelConfig", "_api_process_rank"))),
    Patch(
        "engine_core_affinity", "VLLM_CPU_OMP_THREADS_BIND (vLLM CPU's worker cores)",
        _V, (Process.ENGINE_CORE,),
        "the EngineCore floats over every core and took the other engine's (issue 10)",
        _needs("vllm.envs", "VLLM_CPU_OMP_THREADS_BIND"),
        _apply_affinity),
    Patch(
        "block_pool",
        "vllm.v1.core.block_pool.BlockPool (blocks, touch, free_blocks, get_num_free_blocks)",
        _V, (Process.ENGINE_CORE,),
        "P pins a finished prefill's blocks itself instead of vLLM's delayed free, which "
        "keeps an idle P stepping (leases.lender); D's kept turns give blocks back when "
        "vLLM runs short (scheduler.d_keep)",
        _all(_needs("vllm.v1.core.block_pool.BlockPool.__init__", "self.blocks"),
             _needs("vllm.v1.core.block_pool.BlockPool", "def touch", "def free_blocks",
                    "def get_num_free_blocks"))),
    Patch(
        "connector_registry", "KVConnectorFactory.register_connector",
        _V, (Process.API_SERVER, Process.ENGINE_CORE, Process.WORKER),
        "the plugin entry point registers PDConnector by name (compat.register_connector)",
        _needs("vllm.distributed.kv_transfer.kv_connector.factory.KVConnectorFactory",
               "def register_connector", "is already registered")),
    Patch(
        "stream_kv_transfer_params",
        f"{_SERVING}.completion.serving.OpenAIServingCompletion.completion_stream_generator, "
        f"{_SERVING}.chat_completion.serving.OpenAIServingChat.chat_completion_stream_generator",
        _V, (Process.API_SERVER,),
        "multi-turn needs D's kept-turn params in streamed answers too, as newer vLLM sends",
        serving_patches.probe_stream_generators,
        _apply_stream_params),
    Patch(
        "api_server_sigint", "vllm.entrypoints.launchers.launcher.serve_http signal handlers",
        _V, (Process.API_SERVER,),
        "the drain middleware takes SIGTERM and, once drained, hands over with SIGINT, which "
        "vLLM's API server must treat as SIGTERM",
        _needs("vllm.entrypoints.launchers.launcher.serve_http",
               "add_signal_handler(signal.SIGINT", "add_signal_handler(signal.SIGTERM")),
    Patch(
        "argv_kv_transfer_config", "the API server's --kv-transfer-config (sys.argv)",
        _V, (Process.API_SERVER,),
        "the middlewares have no connector instance and read its extra config from argv",
        _has_field("vllm.engine.arg_utils.EngineArgs", "kv_transfer_config")),
)

_once: dict[Process, list[Outcome]] = {}
_once_lock = threading.Lock()


def apply(process: Process, ctx: Context | None = None) -> list[Outcome]:
    """Apply (or check) every patch of ``process``; one log line each.

    Called once by each object that owns a process's setup: the scheduler
    half (EngineCore), the worker half (each worker). Applying twice is
    harmless (each patch is idempotent) but logs twice.
    """
    ctx = ctx or Context()
    return [_apply_one(patch, process, ctx) for patch in PATCHES if process in patch.processes]


def apply_once(process: Process, ctx: Context | None = None) -> list[Outcome]:
    """``apply``, at most once per process: the API server builds one instance
    of each of our middlewares, and either may be configured alone."""
    with _once_lock:
        if process not in _once:
            _once[process] = apply(process, ctx)
        return _once[process]


def _apply_one(patch: Patch, process: Process, ctx: Context) -> Outcome:
    written = "/".join(patch.versions)
    moved = patch.probe()
    if moved is not None:
        logger.error("PDConnector: vLLM patch %s skipped: written for vLLM %s, and in vLLM %s "
                     "its target moved (%s); running without it (%s)", patch.name, written,
                     VLLM_VERSION, moved, patch.why)
        return Outcome(patch.name, "moved", moved)
    if not VLLM_VERSION.startswith(patch.versions):
        logger.warning("PDConnector: vLLM patch %s was written for vLLM %s, this is %s; its "
                       "target is still in place", patch.name, written, VLLM_VERSION)
    if patch.apply is None:
        logger.debug("PDConnector: vLLM internal %s checked (%s)", patch.name, patch.target)
        return Outcome(patch.name, "checked", patch.target)
    try:
        detail = patch.apply(ctx)
    except Skip as exc:
        logger.info("PDConnector: vLLM patch %s skipped in the %s: %s", patch.name,
                    process.value, exc)
        return Outcome(patch.name, "skipped", str(exc))
    logger.info("PDConnector: vLLM patch %s applied in the %s: %s", patch.name,
                process.value, detail)
    return Outcome(patch.name, "applied", detail)


def probe_all() -> dict[str, str | None]:
    """Every patch's probe against the installed vLLM (changes nothing)."""
    return {patch.name: patch.probe() for patch in PATCHES}


__all__ = ["PATCHES", "Context", "Outcome", "Patch", "Process", "Skip", "apply", "apply_once",
           "probe_all"]
