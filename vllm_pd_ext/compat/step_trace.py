"""Opt-in timestamps of each engine step's phases (a diagnostic, issue 29).

With ``VLLM_PD_EXT_STEP_TRACE=<dir>`` in an engine's environment, each of
its vLLM processes (the plugin hook, ``compat/patches.py``'s
``step_trace`` row) wraps the scheduler's and the model runner's step
methods (``TRACED``) and appends one line per call begin and end to
``<dir>/steps-<pid>.log``::

    <time.monotonic()> <pid> <event> B|E [<json: the step's requests>]

Begin lines of the calls that take the step's ``SchedulerOutput``
(``update``, ``execute``) carry ``{"new": [ids], "tokens": {id: n}}``, so
a reader can tell a request's first step from its later ones.
``python -m vllm_pd_ext.tools.step_split <dir>`` turns the files into the
split of a step (schedule, the trip to the worker, vLLM admitting new
requests to its batch, input preparation, the forward, sampling, the trip
back) by the kind of step; ``time.monotonic`` is one clock for every
process of a host.

It exists to answer where D's first step after a KV load goes, against
its decode steps and the collocated engine's. Each event costs a write of
one line (a few microseconds): meant for one request at a time, not for
throughput runs. Off unless the variable is set; never on in CI's engines.

Lifecycle: ``install`` once per process (idempotent); the file opens at
the first event, line-buffered, and closes with the process.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

from vllm_pd_ext import STEP_TRACE_ENV

__all__ = ["STEP_TRACE_ENV", "TRACED", "describe_step", "install"]
#: A step's request list is written up to this many requests (then only
#: their count): the trace is for one request at a time.
MAX_LISTED = 64
#: (class, method, event): what ``install`` wraps, outermost first.
TRACED = (
    ("vllm.v1.core.sched.scheduler.Scheduler", "schedule", "schedule"),
    ("vllm.v1.core.sched.scheduler.Scheduler", "update_from_output", "update"),
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "execute_model", "execute"),
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_update_states", "admit"),
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_prepare_inputs", "prepare"),
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_model_forward", "forward"),
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "sample_tokens", "sample"),
)
#: Events whose first argument is the step's ``SchedulerOutput``.
_WITH_STEP = ("update", "execute")

_installed: list[str] = []
_lock = threading.Lock()


class _Sink:
    """One process's trace file, opened at its first line."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.file: IO[str] | None = None

    def write(self, event: str, edge: str, detail: str = "") -> None:
        line = f"{time.monotonic():.6f} {os.getpid()} {event} {edge}"
        if detail:
            line += " " + detail
        with _lock:
            if self.file is None:
                Path(self.directory).mkdir(parents=True, exist_ok=True)
                self.file = open(  # noqa: SIM115  (closed with the process)
                    Path(self.directory) / f"steps-{os.getpid()}.log", "a", buffering=1)
            self.file.write(line + "\n")


def describe_step(scheduler_output: Any) -> str:
    """``{"new": [...], "tokens": {...}}`` of a ``SchedulerOutput``, as JSON
    (request ids come from clients: JSON quotes whatever they hold)."""
    tokens = dict(getattr(scheduler_output, "num_scheduled_tokens", None) or {})
    new = [r.req_id for r in getattr(scheduler_output, "scheduled_new_reqs", ()) or ()]
    if len(tokens) > MAX_LISTED:
        return json.dumps({"requests": len(tokens), "new_count": len(new),
                           "total": sum(tokens.values())})
    return json.dumps({"new": new, "tokens": tokens})


def _wrap(original: Any, event: str, sink: _Sink) -> Any:
    with_step = event in _WITH_STEP

    # ``updated=()``: the wrapper takes no markers of other patches from
    # ``original`` (they test for them); ``__wrapped__`` keeps the probes'
    # inspect.getsource reading vLLM's code.
    @functools.wraps(original, updated=())
    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        sink.write(event, "B", describe_step(args[0]) if with_step and args else "")
        try:
            return original(self, *args, **kwargs)
        finally:
            sink.write(event, "E")

    return traced


def install(directory: str) -> list[str]:
    """Wrap every method in ``TRACED`` (once per process); the events wrapped."""
    import importlib

    if _installed:
        return list(_installed)
    sink = _Sink(directory)
    for path, method, event in TRACED:
        module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        setattr(cls, method, _wrap(getattr(cls, method), event, sink))
        _installed.append(event)
    return list(_installed)
