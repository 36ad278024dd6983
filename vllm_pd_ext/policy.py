"""What D reports for a failed load, so vLLM's ``kv_load_failure_policy`` applies.

Pure. vLLM decides (``fail`` ends the request with an error, ``recompute``
prefills locally); the connector only reports, in the form vLLM 0.32/0.33
require: the id in ``finished_recving`` *and* ``failed_recving`` (request
level, valid for any number of KV-cache groups). Block-level
``invalid_block_ids`` are collected only when ``single_group`` is asked for;
the worker does not report them, since request-level failure is enough for
vLLM to apply either policy to an asynchronous load.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field


class FailureReason(enum.Enum):
    """Why a load failed; the value is the log/metric label."""

    BAD_PARAMS = "bad_params"
    HANDSHAKE = "handshake"
    INCOMPATIBLE = "incompatible_peer"
    LEASE_LOST = "lease_lost"
    TRANSFER = "transfer_error"
    TIMEOUT = "timeout"
    LAYOUT = "layout_mismatch"
    #: Push: the request ended on D before its KV landed; not a failure, the
    #: report only lets vLLM free the registered blocks.
    ABORTED = "aborted"


@dataclass
class LoadReport:
    """One step's load outcome for the worker to hand to vLLM."""

    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)

    def add_done(self, request_id: str) -> None:
        self.finished_recving.add(request_id)

    def add_failed(
        self, request_id: str, local_block_ids: Iterable[int], single_group: bool = True
    ) -> None:
        self.finished_recving.add(request_id)
        self.failed_recving.add(request_id)
        if single_group:
            self.invalid_block_ids.update(local_block_ids)
