"""Shared setup for the unit tests: loopback-only networking, offline HF."""

from __future__ import annotations

import os

# Must precede any NIXL/UCX import (vLLM may import NIXL lazily).
os.environ["UCX_NET_DEVICES"] = "lo"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import pytest
from pdunit_utils import FakeClock, free_port


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def port() -> int:
    return free_port()
