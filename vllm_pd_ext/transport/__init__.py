"""Transports: one interface (``base.Transport``), NIXL and an in-process fake."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_pd_ext.transport.base import Transport, TransportError, XferState

__all__ = ["Transport", "TransportError", "XferState", "make_nixl_transport"]


def make_nixl_transport(
    agent_name: str, backends: Sequence[str], progress_thread: bool
) -> Transport:
    """Lazy import: only workers load NIXL."""
    from vllm_pd_ext.transport.nixl import NixlTransport

    return NixlTransport(agent_name, backends, progress_thread)
