"""Per-request transfer telemetry: one record per handoff, correlated with the request.

Role: the pure core of what D records for every KV handoff (issue 14 part 3:
"transfer metrics are not correlated with individual requests" is what users
of every peer ask about). Lifecycle of a record:

1. D's worker builds one per load when it ends (``worker/d_pull`` in pull
   mode, ``worker/dispatcher`` in push mode), success or failure, with the phase times
   it measured on its own monotonic clock.
2. It travels to D's scheduler in vLLM's ``KVConnectorWorkerMetadata``
   (``metadata.PDWorkerMetadata``); with TP > 1 the ranks' records of one
   request are merged there (``merge``: bytes and descriptors add up, phase
   times take the slowest rank, a failure wins over success).
3. D's scheduler adds ``kv_ready_ms`` (the request's arrival at D's
   scheduler to its KV reported loaded) and ``sched_ms`` (that arrival to
   the load leaving for the workers), writes it as one structured log
   line (``log_line``), and, with ``transfer_telemetry_in_response``, puts
   it in the final answer's ``kv_transfer_params`` under ``pd_transfer``,
   from where the proxy (``--transfer-telemetry``) and a benchmark read it.

Every time is in milliseconds and every field a client could see is plain
JSON. No vLLM, torch or NIXL here.
"""

from __future__ import annotations

from typing import Any

import msgspec

#: Where a record goes in D's final ``kv_transfer_params``.
PARAMS_KEY = "pd_transfer"
#: The structured log line's prefix; the rest of the line is one JSON object.
LOG_PREFIX = "PDConnector: transfer "

_PHASES = ("handshake_ms", "pin_ms", "read_ms", "register_ms", "write_wait_ms", "worker_ms")


class TransferRecord(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One handoff as D saw it. Phase fields a mode does not have stay None."""

    #: D's request id (vLLM's, which embeds the proxy's X-Request-Id).
    request_id: str
    #: P's request id for this KV (pull: the lease key; push: ``pd_request_id``).
    remote_request_id: str
    #: Which engine sent the KV: its engine id and side-channel address.
    p_engine: str
    p_addr: str
    mode: str
    #: ``ok``, or the load's ``FailureReason`` value (``lease_lost``, ...).
    outcome: str = "ok"
    detail: str = ""
    bytes: int = 0
    #: NIXL descriptors posted (pull: by D; push: by P, not known to D: None).
    descriptors: int | None = None
    blocks: int = 0
    tokens: int = 0
    #: Pull: waiting for (or doing) the handshake with P, once per P and rank.
    handshake_ms: float | None = None
    #: Pull: the pin round trip (P extends and marks the lease being read).
    pin_ms: float | None = None
    #: Pull: the pin ran beside the READ (issue 29), so the handoff waited
    #: for the slower of the two, not their sum.
    pin_with_read: bool | None = None
    #: Pull: no pin; P extended the lease in its answer to D (a concurrent
    #: pull, protocol 10), so the READ left alone.
    pin_in_answer: bool | None = None
    #: Pull: the READ, from its post to the step that saw it complete.
    read_ms: float | None = None
    #: Push: D's registration round trip to P (``PushRegister`` -> reply).
    register_ms: float | None = None
    #: Push: from D's blocks reaching the worker to P's WRITE notification
    #: (P's remaining queue and prefill, then the WRITE).
    write_wait_ms: float | None = None
    #: Seconds left on P's lease when the READ was posted (pull).
    lease_left_s: float | None = None
    #: D's API server and input queue: vLLM stamping the request's
    #: ``arrival_time`` (its renderer, before tokenizing) to D's scheduler
    #: seeing it; both wall-clock reads on D's host.
    api_ms: float | None = None
    #: D's scheduler: the request's arrival to its KV reported loaded.
    kv_ready_ms: float | None = None
    #: Concurrent pull: D's scheduler seeing the request to P's answer
    #: (``PullReady``) reaching D: P's queue and prefill, overlapped.
    #: ``kv_ready - p_wait`` is what the handoff cost D after P was done.
    p_wait_ms: float | None = None
    #: D's scheduler: the request's arrival to its load leaving in the
    #: step's metadata for the workers (the rest of that scheduler pass).
    sched_ms: float | None = None
    #: D's worker (pull): the load reaching the worker to the worker
    #: reporting it (handshake, pin, READ and the wait for a step to report).
    #: ``kv_ready - sched - worker`` is then the two crossings between
    #: scheduler and workers (vLLM's step queues) and the steps around them.
    worker_ms: float | None = None
    #: Worker ranks merged into this record.
    ranks: int = 1


def ms(seconds: float) -> float:
    """Seconds to milliseconds, rounded to microseconds (log lines stay short)."""
    return round(seconds * 1e3, 3)


def merge(a: TransferRecord, b: TransferRecord) -> TransferRecord:
    """Two TP ranks' records of one request: sizes add up, each phase takes
    the slowest rank (the request waits for all of them), the least lease
    left counts, and any rank's failure is the request's outcome."""

    def slowest(x: float | None, y: float | None) -> float | None:
        return y if x is None else x if y is None else max(x, y)

    failed = a if a.outcome != "ok" else b
    out = msgspec.structs.replace(
        a,
        outcome=failed.outcome,
        detail=failed.detail,
        bytes=a.bytes + b.bytes,
        descriptors=(None if a.descriptors is None or b.descriptors is None
                     else a.descriptors + b.descriptors),
        blocks=max(a.blocks, b.blocks),
        tokens=max(a.tokens, b.tokens),
        lease_left_s=(b.lease_left_s if a.lease_left_s is None else a.lease_left_s
                      if b.lease_left_s is None else min(a.lease_left_s, b.lease_left_s)),
        ranks=a.ranks + b.ranks,
    )
    return msgspec.structs.replace(
        out, **{p: slowest(getattr(a, p), getattr(b, p)) for p in _PHASES})


def merge_by_request(records: list[TransferRecord]) -> dict[str, TransferRecord]:
    """The records of one step, one per request (ranks merged)."""
    out: dict[str, TransferRecord] = {}
    for rec in records:
        prev = out.get(rec.request_id)
        out[rec.request_id] = rec if prev is None else merge(prev, rec)
    return out


def to_dict(rec: TransferRecord) -> dict[str, Any]:
    """The record as plain JSON types (for ``kv_transfer_params``)."""
    out: dict[str, Any] = msgspec.to_builtins(rec)
    return out


def log_line(rec: TransferRecord) -> str:
    """One structured line: ``PDConnector: transfer {...}`` (compact JSON)."""
    return LOG_PREFIX + msgspec.json.encode(rec).decode()


def parse_log_line(line: str) -> TransferRecord | None:
    """The record in a log line written by ``log_line`` (anywhere in it), or None."""
    at = line.find(LOG_PREFIX)
    if at < 0:
        return None
    try:
        return msgspec.json.decode(line[at + len(LOG_PREFIX):].strip(), type=TransferRecord)
    except msgspec.ValidationError:
        return None
    except msgspec.DecodeError:
        return None
