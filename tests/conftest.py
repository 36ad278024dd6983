"""Suite-wide setup: loopback-only UCX and vLLM, no Hub access, shared helpers.

The suite is laid out by weight (tests/README.md): ``pure/`` (no threads,
sockets or vLLM), ``component/`` (real ZMQ, threads, the fake transport),
``scheduler/`` (real vLLM ``Scheduler``s), ``transport/`` (real NIXL),
``proxy/`` (real HTTP, fake engines) and ``e2e/`` (real engines). Helpers
shared across them live in ``support/``, put on ``sys.path`` here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Must precede any NIXL/UCX import (vLLM may import NIXL lazily).
os.environ["UCX_NET_DEVICES"] = "lo"
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

sys.path.insert(0, str(Path(__file__).parent / "support"))

import pytest
from pdunit_utils import FakeClock, free_port


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def port() -> int:
    return free_port()
