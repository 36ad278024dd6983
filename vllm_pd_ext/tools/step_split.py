"""Where an engine step's time goes, from ``VLLM_PD_EXT_STEP_TRACE`` files.

Role: read the per-process files ``compat/step_trace.py`` writes (one
engine's folder), pair the EngineCore's events with one worker's, cut them
into steps (``schedule`` begin to ``update`` end) and print, per kind of
step, the median of each phase in milliseconds::

    python -m vllm_pd_ext.tools.step_split .runs/idle-ab/tiny-300-push/steps/d

Kinds, for steps that compute exactly one request (the trace is meant for
one request at a time; steps of several requests count as ``batch``):

- ``first, 1 token``: the request's first step computes one token: D's
  step after a KV load (token #2 when token #1 came from P), or a prompt
  all in the prefix cache but its last token;
- ``first, prefill``: the request's first step computes its prompt (or
  its first chunk);
- ``prefill chunk``: a later step of a prompt longer than one step takes;
- ``second``: its first one-token step after its first step and any
  prefill chunks (the collocated engine's token #2; D's token #3);
- ``later``: its one-token steps after that.

Phases: ``schedule``; ``to worker`` (the step's trip to the worker and its
wake-up); ``admit`` (vLLM's ``_update_states``: new requests join the
persistent batch); ``prepare`` (``_prepare_inputs``); ``to forward`` (the
rest before the forward: attention metadata, the connector's
``start_load_kv``); ``forward``; ``after forward`` (the connector's
``wait_for_save``/``get_finished``, the hidden states' logits); ``to
sample``, ``sample``, ``back`` (to the EngineCore's ``update_from_output``),
``update``; ``step`` (all of it); ``idle before`` (since the last step's
end). Pure functions below ``main``; tested in ``tests/pure/test_step_split.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: (name, from (event, edge), to (event, edge)); ``idle before`` is separate.
PHASES: tuple[tuple[str, tuple[str, str], tuple[str, str]], ...] = (
    ("schedule", ("schedule", "B"), ("schedule", "E")),
    ("to worker", ("schedule", "E"), ("execute", "B")),
    ("admit", ("admit", "B"), ("admit", "E")),
    ("prepare", ("prepare", "B"), ("prepare", "E")),
    ("to forward", ("prepare", "E"), ("forward", "B")),
    ("forward", ("forward", "B"), ("forward", "E")),
    ("after forward", ("forward", "E"), ("execute", "E")),
    ("to sample", ("execute", "E"), ("sample", "B")),
    ("sample", ("sample", "B"), ("sample", "E")),
    ("back", ("sample", "E"), ("update", "B")),
    ("update", ("update", "B"), ("update", "E")),
    ("step", ("schedule", "B"), ("update", "E")),
)
KINDS = ("first, 1 token", "first, prefill", "prefill chunk", "second", "later", "batch")


@dataclass(frozen=True)
class Event:
    t: float
    pid: int
    name: str
    edge: str
    detail: dict[str, Any] | None = None


@dataclass
class Step:
    #: (event, edge) -> its first time within the step.
    marks: dict[tuple[str, str], float] = field(default_factory=dict)
    #: request id -> tokens computed in this step.
    tokens: dict[str, int] = field(default_factory=dict)
    new: tuple[str, ...] = ()
    idle_before_s: float | None = None
    kind: str = ""

    def phase_ms(self, start: tuple[str, str], end: tuple[str, str]) -> float | None:
        if start not in self.marks or end not in self.marks:
            return None
        return (self.marks[end] - self.marks[start]) * 1000.0


def parse_line(line: str) -> Event | None:
    """One trace line, or None for anything else (a torn last line)."""
    parts = line.rstrip("\n").split(" ", 4)
    if len(parts) < 4 or parts[3] not in ("B", "E"):
        return None
    try:
        t, pid = float(parts[0]), int(parts[1])
        detail = json.loads(parts[4]) if len(parts) == 5 else None
    except ValueError:
        return None
    return Event(t, pid, parts[2], parts[3], detail if isinstance(detail, dict) else None)


def read_folder(folder: Path) -> dict[int, list[Event]]:
    """Every ``steps-<pid>.log`` of one engine: pid -> its events."""
    found: dict[int, list[Event]] = defaultdict(list)
    for path in sorted(folder.glob("steps-*.log")):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                ev = parse_line(line)
                if ev is not None:
                    found[ev.pid].append(ev)
    return dict(found)


def pick_processes(by_pid: dict[int, list[Event]]) -> tuple[list[int], str]:
    """The EngineCore's pid(s) and one worker's (the lowest pid; with
    tensor parallelism every rank runs the same phases), and a note."""
    sched = sorted(p for p, evs in by_pid.items() if any(e.name == "schedule" for e in evs))
    workers = sorted(p for p, evs in by_pid.items() if any(e.name == "execute" for e in evs))
    if not sched or not workers:
        raise ValueError("the trace has no EngineCore or no worker events (was "
                         "VLLM_PD_EXT_STEP_TRACE set for the engine?)")
    chosen = sorted(set(sched) | {workers[0]})
    note = f"EngineCore pid {', '.join(map(str, sched))}, worker pid {workers[0]}"
    if len(workers) > 1:
        note += f" (of {len(workers)} workers)"
    return chosen, note


def cut_steps(events: list[Event]) -> list[Step]:
    """Steps from one EngineCore's and one worker's events, merged in time."""
    steps: list[Step] = []
    cur: Step | None = None
    last_end: float | None = None
    for ev in sorted(events, key=lambda e: e.t):
        if ev.name == "schedule" and ev.edge == "B":
            cur = Step(idle_before_s=None if last_end is None else ev.t - last_end)
        if cur is None:
            continue
        cur.marks.setdefault((ev.name, ev.edge), ev.t)
        if ev.edge == "B" and ev.detail is not None and not cur.tokens:
            raw = ev.detail.get("tokens")
            if isinstance(raw, dict):
                cur.tokens = {str(k): int(v) for k, v in raw.items()
                              if isinstance(v, int) and not isinstance(v, bool)}
            new = ev.detail.get("new")
            if isinstance(new, list):
                cur.new = tuple(str(r) for r in new)
        if ev.name == "update" and ev.edge == "E":
            steps.append(cur)
            last_end = ev.t
            cur = None
    return steps


def classify(steps: list[Step]) -> list[Step]:
    """Set each computing step's ``kind`` (see the module docstring); steps
    that compute nothing keep ``""``."""
    decoded: set[str] = set()  # requests whose "second" step was seen
    for step in steps:
        if not step.tokens:
            continue
        if len(step.tokens) > 1:
            step.kind = "batch"
            decoded.update(rid for rid, n in step.tokens.items() if n == 1)
            continue
        ((rid, n),) = step.tokens.items()
        if rid in step.new:
            step.kind = "first, 1 token" if n == 1 else "first, prefill"
        elif n > 1:
            step.kind = "prefill chunk"  # a long prompt's prefill goes on
        elif rid not in decoded:
            step.kind = "second"
            decoded.add(rid)
        else:
            step.kind = "later"
    return steps


def split(steps: list[Step]) -> dict[str, dict[str, float | int | None]]:
    """Kind -> {"steps": count, phase: median ms, "idle before": median ms}."""
    out: dict[str, dict[str, float | int | None]] = {}
    for kind in KINDS:
        chosen = [s for s in steps if s.kind == kind]
        if not chosen:
            continue
        row: dict[str, float | int | None] = {"steps": len(chosen)}
        for name, start, end in PHASES:
            vals = [v for v in (s.phase_ms(start, end) for s in chosen) if v is not None]
            row[name] = statistics.median(vals) if vals else None
        idle = [s.idle_before_s * 1000.0 for s in chosen if s.idle_before_s is not None]
        row["idle before"] = statistics.median(idle) if idle else None
        out[kind] = row
    return out


def split_folder(folder: Path) -> tuple[dict[str, dict[str, float | int | None]], str]:
    by_pid = read_folder(folder)
    pids, note = pick_processes(by_pid)
    events = [e for p in pids for e in by_pid[p]]
    return split(classify(cut_steps(events))), note


def table(rows: Mapping[str, Mapping[str, float | int | None]]) -> str:
    """A markdown table: a row per kind, a column per phase."""
    cols = ["steps", *(name for name, _, _ in PHASES), "idle before"]
    head = "| " + " | ".join(["step", *cols]) + " |"
    lines = [head, "|---|" + "---:|" * len(cols)]
    for kind, row in rows.items():
        cells = []
        for c in cols:
            v = row.get(c)
            cells.append("" if v is None else (str(v) if c == "steps" else f"{v:.2f}"))
        lines.append("| " + " | ".join([kind, *cells]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path,
                   help="an engine's VLLM_PD_EXT_STEP_TRACE folder (several: a table each)")
    args = p.parse_args(argv)
    status = 0
    for folder in args.folders:
        try:
            rows, note = split_folder(folder)
        except ValueError as exc:
            print(f"{folder}: {exc}", file=sys.stderr)
            status = 1
            continue
        print(f"{folder} ({note}), medians in ms:")
        print(table(rows))
        print()
    return status


if __name__ == "__main__":
    sys.exit(main())
