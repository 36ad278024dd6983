"""What D's scheduler half asks its workers to load, one step at a time.

Pure dataclasses (no vLLM import): the scheduler's role modules build them,
``metadata.PDConnectorMetadata`` carries them to the workers inside vLLM's
step payload (pickled), and the workers' role modules consume them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

#: The kernel's id of this boot: processes that read the same one share
#: CLOCK_MONOTONIC (``time.monotonic``), containers on one host included.
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


@functools.cache
def monotonic_clock_id() -> str:
    """Which ``time.monotonic`` clock this process reads: its host's boot
    id; "" where it cannot be read (then no time crosses processes)."""
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            return f.read(64).strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class RecvSpec:
    """One request whose prompt KV this engine must READ from a peer (D from
    P in pull mode; P from D when reading a kept turn back)."""

    request_id: str
    local_block_ids: list[int]
    #: The peer's block ids matching ``local_block_ids`` one to one (this
    #: engine's prefix-cache hit already cut off the front).
    remote_block_ids: list[int]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int
    num_tokens: int
    #: Bidirectional: P reads a previous turn's KV back from D (same READ,
    #: counted apart in the metrics).
    readback: bool = False
    #: Concurrent pull: P's answer extended the lease and said for how long,
    #: so the blocks stay P's until then, on the ``time.monotonic`` clock
    #: named by ``clock`` (the scheduler's ``monotonic_clock_id``); the
    #: worker reads without a pin while enough of it is left, if it reads
    #: the same clock (a worker on another node, with multi-node TP, does
    #: not). 0: not known, the worker pins.
    valid_until: float = 0.0
    clock: str = ""


@dataclass(frozen=True)
class PushRecvSpec:
    """One D request whose prompt KV P will write into ``local_block_ids``."""

    request_id: str
    pd_request_id: str
    local_block_ids: list[int]
    num_tokens: int
    #: The registration's ``notif_token``: only P's notification carries it.
    notif_token: str = ""
    #: The notification must carry P's token #1 (``pd_seed_pending``); one
    #: without it fails the load.
    want_seed: bool = False


@dataclass(frozen=True)
class LayoutProblem:
    """Why D's blocks cannot take P's KV (scheduler half, either mode); the
    load fails with ``layout_mismatch``."""

    why: str
