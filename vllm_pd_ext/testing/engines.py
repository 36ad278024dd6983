"""The local launcher as the tests, the demo and the benchmarks use it.

``Engine``, ``Proxy``, ``running``, ``free_port`` and ``SAFE_ENV`` are
``vllm_pd_ext.tools.launch`` (one definition, shipped for ``vllm-pd-bench
compare``); this module adds what only a source checkout has: ``REPO``, the
checkout's root, under which the harness keeps its models (``.models``),
runs (``.runs``) and the tiny-model builder (``examples/``).
"""

from __future__ import annotations

from pathlib import Path

from vllm_pd_ext.tools.launch import SAFE_ENV, Engine, Proxy, running
from vllm_pd_ext.tools.ports import free_port

__all__ = ["REPO", "SAFE_ENV", "Engine", "Proxy", "free_port", "running"]

REPO = Path(__file__).resolve().parents[2]
