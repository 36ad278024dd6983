"""vllm-pd-ext: prefill/decode disaggregation for vLLM over NIXL.

``register()`` is the ``vllm.general_plugins`` entry point: it registers the
``PDConnector`` name with vLLM's connector factory, in every vLLM process,
and tolerates being called more than once. Nothing here imports vLLM, torch
or NIXL at module import time.
"""

from __future__ import annotations

__version__ = "0.1.0"
CONNECTOR_NAME = "PDConnector"


def register() -> None:
    """Register ``PDConnector`` with vLLM (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "vllm_pd_ext.connector", CONNECTOR_NAME)
