"""The chaos soak's pure core: the seeded fault schedule, the workload, the
per-request verdict and the summary table (``soak.py`` runs them).

Pure: no vLLM, torch or NIXL, no I/O; unit-tested in tests/pure/test_soak_plan.py.

A schedule is a list of ``Fault``s in firing order. Faults that take an
engine away (kill, stop, partition) never overlap one another, so at most
one engine is down at any moment and the soak measures recovery from one
fault, not from a pile-up; client-side faults (disconnects, the abort
burst, the malformed D leg) are placed in the same sequence. Every class
fires at least once, in a seeded random order.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


class FaultKind(enum.StrEnum):
    KILL = "kill"  # SIGKILL an engine, restart it on the same ports
    STOP = "stop"  # SIGSTOP an engine for longer than a lease, then SIGCONT
    PARTITION_SHORT = "partition_short"  # veth down for less than a lease
    PARTITION_LONG = "partition_long"  # veth down for longer than a lease
    DISCONNECT_MID = "disconnect_mid"  # a client closes a stream after its first chunk
    DISCONNECT_EARLY = "disconnect_early"  # a client closes before the first byte
    ABORT_BURST = "abort_burst"  # 50 requests at once, all closed together
    MALFORMED_D_LEG = "malformed_d_leg"  # garbage kv_transfer_params straight to a D
    #: The rolling-restart scenario: SIGTERM (drain), wait for the exit,
    #: restart on the same ports, wait until the proxy routes to it again.
    DRAIN_RESTART = "drain_restart"

    @property
    def takes_engine(self) -> bool:
        return self in ENGINE_FAULTS


ENGINE_FAULTS = frozenset({FaultKind.KILL, FaultKind.STOP, FaultKind.PARTITION_SHORT,
                           FaultKind.PARTITION_LONG, FaultKind.DRAIN_RESTART})
#: A partition needs each engine in its own network namespace (netns.py).
PARTITIONS = frozenset({FaultKind.PARTITION_SHORT, FaultKind.PARTITION_LONG})
#: What a chaos soak on 127.0.0.1 can fire (the drain belongs to the rolling scenario).
LOOPBACK_FAULTS = tuple(k for k in FaultKind
                        if k not in PARTITIONS and k is not FaultKind.DRAIN_RESTART)
#: What a chaos soak with --netns can fire.
NETNS_FAULTS = tuple(k for k in FaultKind if k is not FaultKind.DRAIN_RESTART)


@dataclass(frozen=True)
class Fault:
    at_s: float  # after the load started
    kind: FaultKind
    target: str | None  # engine name (engine faults, the malformed leg's D)
    duration_s: float  # how long the engine stays away; 0 for client faults


def make_schedule(seed: int, engines: Sequence[str], decodes: Sequence[str], lease_s: float,
                  count: int, first_s: float = 3.0, gap_s: tuple[float, float] = (2.0, 6.0),
                  kinds: Sequence[FaultKind] | None = None) -> list[Fault]:
    """``count`` faults (at least one of each of ``kinds``), spaced by a random gap.

    ``at_s`` is a lower bound: the runner fires a fault only once the
    previous engine fault has healed (a restart takes as long as it takes),
    and keeps the drawn gap after it.
    """
    kinds = list(kinds if kinds is not None else NETNS_FAULTS)
    if count < len(kinds):
        raise ValueError(f"count={count}: every one of the {len(kinds)} fault classes "
                         "fires at least once")
    rng = random.Random(seed)
    order = kinds + [rng.choice(kinds) for _ in range(count - len(kinds))]
    rng.shuffle(order)
    faults: list[Fault] = []
    t = first_s
    for kind in order:
        target: str | None = None
        duration = 0.0
        if kind.takes_engine:
            target = rng.choice(list(engines))
            duration = {FaultKind.KILL: 0.0,
                        FaultKind.STOP: lease_s * rng.uniform(1.3, 1.8),
                        FaultKind.PARTITION_SHORT: lease_s * rng.uniform(0.2, 0.5),
                        FaultKind.PARTITION_LONG: lease_s * rng.uniform(1.3, 1.8)}[kind]
        elif kind is FaultKind.MALFORMED_D_LEG:
            target = rng.choice(list(decodes))
        faults.append(Fault(round(t, 3), kind, target, round(duration, 3)))
        t += duration + rng.uniform(*gap_s)
    return faults


def rolling_schedule(engines: Sequence[str], rounds: int = 1, first_s: float = 5.0,
                     gap_s: float = 5.0) -> list[Fault]:
    """Restart every engine in turn, ``rounds`` times: the rolling-restart scenario.

    Each restart waits for the previous one to be back in rotation (the
    runner's "healed"), then ``gap_s`` of traffic on the full topology.
    """
    if rounds < 1 or not engines:
        raise ValueError("at least one round over at least one engine")
    faults = []
    t = first_s
    for _ in range(rounds):
        for name in engines:
            faults.append(Fault(round(t, 3), FaultKind.DRAIN_RESTART, name, 0.0))
            t += gap_s
    return faults


@dataclass(frozen=True)
class Job:
    rid: str
    prompt: list[int]
    stream: bool
    shared_prefix: int | None  # index of the prefix it starts with, if any


def make_workload(seed: int, n: int, block: int = 128, max_blocks: int = 3,
                  prefixes: int = 3, shared_fraction: float = 0.3,
                  vocab: tuple[int, int] = (10, 3000)) -> list[Job]:
    """``n`` prompts of 1..``max_blocks`` blocks; some start with one of a few
    shared prefixes (whole blocks, so prefix caching can hit), half stream."""
    rng = random.Random(seed)

    def tokens(k: int) -> list[int]:
        return [rng.randrange(*vocab) for _ in range(k)]

    pool = [tokens(block * rng.randrange(1, max_blocks)) for _ in range(prefixes)]
    jobs = []
    for i in range(n):
        if pool and rng.random() < shared_fraction:
            k = rng.randrange(len(pool))
            room = max_blocks * block - len(pool[k])
            prompt = pool[k] + tokens(rng.randrange(1, room + 1))
            jobs.append(Job(f"soak-{seed}-{i}", prompt, rng.random() < 0.5, k))
        else:
            prompt = tokens(rng.randrange(1, max_blocks * block + 1))
            jobs.append(Job(f"soak-{seed}-{i}", prompt, rng.random() < 0.5, None))
    return jobs


class Verdict(enum.StrEnum):
    EQUAL = "equal"
    CLEAN_ERROR = "clean_error"  # an HTTP error status or an error event, in time
    HANG = "hang"  # no complete answer within the deadline
    WRONG = "wrong"  # a 200 whose tokens are not the reference's
    #: A stream that ended without [DONE] and without an error event, or a
    #: connection closed before a status line or a complete body.
    TRUNCATED = "truncated"


#: Verdicts the soak accepts.
ACCEPTED = frozenset({Verdict.EQUAL, Verdict.CLEAN_ERROR})


@dataclass
class Result:
    """What the client saw for one request (filled in by the runner)."""

    rid: str
    started_s: float
    ended_s: float = 0.0
    status: int | None = None  # HTTP status; None: no response in time / connection failed
    tokens: list[int] | None = None
    error: str | None = None  # the error the client was given (body or error event)
    detail: str = ""  # what broke on the client's side (diagnostics only)
    timed_out: bool = False  # the client's deadline passed first
    done_marker: bool = False  # streams: saw [DONE]
    stream: bool = False
    near_tie: bool = False  # tokens differ from the reference but the oracle accepts them
    verdict: Verdict | None = None
    prefill: str | None = None  # the engines that served it (from the proxy's access log)
    decode: str | None = None


def classify(r: Result, want: Sequence[int]) -> Verdict:
    """The soak's oracle for one request (see the module docstring of soak.py)."""
    if r.timed_out:
        return Verdict.HANG
    if r.status is None:
        # The connection closed before any status line: the client was told nothing.
        return Verdict.TRUNCATED
    if r.status != 200:
        return Verdict.CLEAN_ERROR
    if r.stream:
        if r.error is not None:
            return Verdict.CLEAN_ERROR
        if not r.done_marker:
            return Verdict.TRUNCATED
    if r.tokens is None:
        return Verdict.TRUNCATED
    if list(r.tokens) == list(want) or r.near_tie:
        return Verdict.EQUAL
    return Verdict.WRONG


@dataclass
class FaultRecord:
    fault: Fault
    fired_s: float = 0.0
    healed_s: float = 0.0
    in_flight: list[str] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)  # verdict -> count, of in_flight
    recovery_s: float | None = None
    note: str = ""

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["fault"]["kind"] = str(self.fault.kind)
        return out


def recovery(rec: FaultRecord, results: Iterable[Result]) -> float | None:
    """Seconds from the fault's firing to the end of the first good handoff
    that started after it healed (for an engine fault: one that went through
    that engine); None if there was none."""
    ends = [r.ended_s for r in results
            if r.verdict is Verdict.EQUAL and r.started_s >= rec.healed_s
            and (not rec.fault.kind.takes_engine
                 or rec.fault.target in (r.prefill, r.decode))]
    return round(min(ends) - rec.fired_s, 3) if ends else None


def summary_row(results: Sequence[Result], leaked_blocks: int,
                records: Sequence[FaultRecord]) -> dict[str, Any]:
    counts = {v: sum(1 for r in results if r.verdict is v) for v in Verdict}
    recs = [r.recovery_s for r in records if r.recovery_s is not None]
    return {"requests": len(results), "equal": counts[Verdict.EQUAL],
            "clean errors": counts[Verdict.CLEAN_ERROR], "hangs": counts[Verdict.HANG],
            "wrong": counts[Verdict.WRONG], "truncated": counts[Verdict.TRUNCATED],
            "leaked blocks": leaked_blocks,
            "max recovery s": max(recs) if recs else None,
            "faults without recovery": sum(1 for r in records if r.recovery_s is None)}


def table(row: dict[str, Any]) -> str:
    heads = list(row)
    cells = ["-" if row[h] is None else (f"{row[h]:.1f}" if isinstance(row[h], float)
                                          else str(row[h])) for h in heads]
    return ("| " + " | ".join(heads) + " |\n|" + "|".join("---:" for _ in heads) + "|\n| "
            + " | ".join(cells) + " |")
