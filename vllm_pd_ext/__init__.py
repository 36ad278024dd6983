"""vllm-pd-ext: prefill/decode disaggregation for vLLM over NIXL.

``register()`` is the ``vllm.general_plugins`` entry point: it registers the
``PDConnector`` name with vLLM's connector factory, in every vLLM process,
and tolerates being called more than once. Nothing here imports vLLM, torch
or NIXL at module import time.

Where things are (docs/architecture.md draws the map): ``connector.py`` is
the facade vLLM instantiates, over the ``scheduler/`` and ``worker/`` halves
(one module per side and transfer mode); ``wire/`` holds what crosses a
process boundary, ``leases/`` who holds lent blocks, ``transport/`` how
bytes move (NIXL, and a fake), ``compat/`` the only door to vLLM. The
API-server middlewares are ``drain.py`` and ``leg_auth.py``. ``tools/`` and
``testing/`` ship beside the connector, which never imports them.
"""

from __future__ import annotations

__version__ = "0.1.0"
CONNECTOR_NAME = "PDConnector"
#: Set to 1 in an engine's environment: its processes quiet vLLM's
#: shared-memory queue readers though it loads no connector of ours
#: (``compat/patches.py``, ``quiet_shm_spin_everywhere``).
QUIET_SPIN_ENV = "VLLM_PD_EXT_QUIET_SHM_SPIN"
#: Set to a folder in an engine's environment: its processes time each
#: step's phases into it (``compat/step_trace.py``; a diagnostic).
STEP_TRACE_ENV = "VLLM_PD_EXT_STEP_TRACE"


def register() -> None:
    """Register ``PDConnector`` with vLLM (idempotent); with
    ``VLLM_PD_EXT_QUIET_SHM_SPIN=1``, also quiet vLLM's shared-memory queue
    readers in this process, for engines that load no connector of ours;
    with ``VLLM_PD_EXT_STEP_TRACE=<dir>``, time each step's phases into
    that folder (``compat/step_trace.py``, any engine).
    In ``vllm serve``'s own process, which starts several API servers with
    ``--api-server-count N``, give its SIGTERM the drain window
    (``compat/serve_parent.py``): vLLM loads plugins there while it builds
    its parser, before it reads the arguments."""
    import os

    from vllm_pd_ext.compat import register_connector, serve_parent

    register_connector(CONNECTOR_NAME, "vllm_pd_ext.connector", CONNECTOR_NAME)
    if os.environ.get(QUIET_SPIN_ENV) == "1" or os.environ.get(STEP_TRACE_ENV):
        from vllm_pd_ext.compat import patches

        patches.apply_once(patches.Process.PLUGIN)
    if serve_parent.is_serve_parent():
        from vllm_pd_ext.compat import patches

        patches.apply_once(patches.Process.SERVE_PARENT)
