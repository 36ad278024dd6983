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


def register() -> None:
    """Register ``PDConnector`` with vLLM (idempotent)."""
    from vllm_pd_ext.compat import register_connector

    register_connector(CONNECTOR_NAME, "vllm_pd_ext.connector", CONNECTOR_NAME)
