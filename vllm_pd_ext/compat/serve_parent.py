"""Drain with several API servers (``vllm serve --api-server-count N``, see ``patches``).

With N > 1 (vLLM's default when data-parallel > 1) ``vllm serve`` stays a
parent process (``vllm.entrypoints.cli.serve.run_multi_api_server``) that
starts N API servers and the EngineCores. On SIGTERM that parent gives
every child ``--shutdown-timeout`` seconds (API servers first, then the
engines with what is left) and then kills what remains: with vLLM's default
0 it killed API servers and engines at once, before any drain.

- ``serve_with_drain_window`` (the parent, from the plugin hook): before
  vLLM builds its config, a ``vllm serve`` with our connector and the drain
  middleware gets ``shutdown_timeout = drain_timeout`` when it is 0. The
  parent's SIGTERM then reaches each API server (each drains what it
  admitted: ``drain.py``) and then the EngineCores, which serve their leases
  in the time left. The API servers inherit the value, which tells them the
  parent drains (``parent_drains``).
- ``api_servers`` / ``sigterm_vllm_parent`` (an API server): ``POST /pd/drain``
  reaches one API server of N; it asks the parent to drain all of them.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import signal
import sys
from typing import Any

from vllm_pd_ext.log import get_logger

logger = get_logger(__name__)

SERVE_MODULE = "vllm.entrypoints.cli.serve"
DRAIN_MIDDLEWARE = "vllm_pd_ext.drain.DrainMiddleware"
DEFAULT_DRAIN_TIMEOUT_S = 120.0


def is_serve_parent() -> bool:
    """This process is vLLM's ``vllm serve`` CLI (not one of its children)."""
    return SERVE_MODULE in sys.modules and multiprocessing.parent_process() is None


def parent_drain_window(args: Any) -> int | None:
    """Give the parent of several API servers a drain window; returns it.

    ``args`` is ``vllm serve``'s parsed namespace. None (and nothing changed)
    when the engine does not run our connector with the drain middleware or
    ``drain_timeout`` is 0; a ``--shutdown-timeout`` you set wins.
    """
    kv = getattr(args, "kv_transfer_config", None)
    if kv is None or getattr(kv, "kv_connector", None) != "PDConnector":
        return None
    if DRAIN_MIDDLEWARE not in (getattr(args, "middleware", None) or []):
        logger.info("PDConnector: vllm serve without %s: SIGTERM aborts at once, as vLLM's "
                    "default (no drain)", DRAIN_MIDDLEWARE)
        return None
    current = int(getattr(args, "shutdown_timeout", 0) or 0)
    if current > 0:
        return current
    timeout = _drain_timeout(getattr(kv, "kv_connector_extra_config", None) or {})
    if timeout <= 0:
        return None
    args.shutdown_timeout = max(1, math.ceil(timeout))
    return int(args.shutdown_timeout)


def _drain_timeout(extra: Any) -> float:
    # The connector validates the key and refuses to start on a bad one.
    try:
        value = float(extra.get("drain_timeout", DEFAULT_DRAIN_TIMEOUT_S))
    except (AttributeError, TypeError, ValueError):
        return DEFAULT_DRAIN_TIMEOUT_S
    return value if value >= 0 else DEFAULT_DRAIN_TIMEOUT_S


def serve_with_drain_window() -> bool:
    """Wrap ``run_multi_api_server`` so that it gets ``parent_drain_window``
    first; False if already wrapped. Only where the CLI module is loaded."""
    serve: Any = sys.modules[SERVE_MODULE]
    run = serve.run_multi_api_server
    if getattr(run, "_pd_ext_drain", False):
        return False

    @functools.wraps(run)
    def run_multi_api_server(args: Any) -> Any:
        window = parent_drain_window(args)
        if window is not None:
            logger.info("PDConnector: %d API servers: SIGTERM to this process (pid %d) drains "
                        "them and then the engines, for up to %d s in all (--shutdown-timeout)",
                        getattr(args, "api_server_count", 0) or 0, os.getpid(), window)
        return run(args)

    run_multi_api_server._pd_ext_drain = True  # type: ignore[attr-defined]
    serve.run_multi_api_server = run_multi_api_server
    return True


def api_servers(vllm_config: Any) -> tuple[int, int]:
    """(how many API servers share this engine, this one's index)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    count = int(getattr(parallel, "_api_process_count", 1) or 1)
    rank = int(getattr(parallel, "_api_process_rank", 0) or 0)
    return count, rank


def parent_drains(vllm_config: Any) -> bool:
    """Whether the parent of several API servers gives SIGTERM a window
    (its ``shutdown_timeout``, which the API servers inherit) rather than
    killing them and the engines at once."""
    return int(getattr(vllm_config, "shutdown_timeout", 0) or 0) > 0


def sigterm_vllm_parent() -> int | None:
    """SIGTERM to the ``vllm serve`` parent of this API server; its pid, or
    None when this process has no live multiprocessing parent (never pid 1:
    an orphan's parent is init)."""
    parent = multiprocessing.parent_process()
    ppid = os.getppid()
    if parent is None or parent.pid != ppid or ppid <= 1:
        return None
    os.kill(ppid, signal.SIGTERM)
    return ppid
