"""The two deployments ``vllm-pd-bench compare`` measures, on the same cores.

Role: start, on this host, either deployment of an equal-budget comparison
(seed 004, "Build the Equal-Budget Benchmark Plan"), each engine confined to
its own core with ``taskset`` (every process: API server, engine core,
worker), the same model, ``max_model_len``, KV-cache bytes and dtype:

- ``aggregated``: ``n`` plain vLLM engines (no connector), engine ``i`` on
  core ``cores[i]``; the benchmark client sends each request to the engine
  with the fewest requests in flight. No proxy hop: if anything, this
  favours the baseline.
- ``disaggregated``: P on ``cores[0]``, D on ``cores[1]`` (PDConnector,
  ``transfer_mode`` pull or push, D with ``transfer_telemetry_in_response``)
  behind ``vllm-pd-proxy --transfer-telemetry`` (the proxy is not pinned: it
  is the front door a disaggregated deployment needs).

Lifecycle: ``start()`` launches and waits until every engine serves (their
startups overlap), ``stop()`` ends exactly the processes it started, by PID.
``engine_urls`` lets the benchmark sample the engines' queues. Everything
binds to 127.0.0.1 with ``UCX_NET_DEVICES=lo`` (tools/launch.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_pd_ext.tools.launch import Engine, Proxy, tp_bind

KINDS = ("aggregated", "disaggregated")


@dataclass
class Deployment:
    kind: str
    model: str
    log_dir: Path
    cores: tuple[str, ...] = ("0", "1")
    transfer_mode: str = "pull"
    #: Disaggregated: (P's, D's) tensor-parallel size; a TP=2 engine gets a
    #: core per rank out of ``cores`` (so P and D then share them).
    tp: tuple[int, int] = (1, 1)
    max_model_len: int = 4096
    kv_bytes: int = 1 << 30
    #: More proxy flags (disaggregated).
    proxy_args: list[str] = field(default_factory=list)
    #: More ``kv_connector_extra_config`` for D (disaggregated).
    d_extra: dict[str, Any] = field(default_factory=dict)
    engines: list[Engine] = field(default_factory=list)
    proxy: Proxy | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"deployment kind {self.kind!r}: expected one of {KINDS}")
        if len(self.cores) < 2:
            raise ValueError("an equal-budget comparison needs two cores (--cores 0,1)")
        logs = self.log_dir / self.kind
        extra = (["--hf-overrides", f'{{"max_position_embeddings": {self.max_model_len}}}']
                 if self.max_model_len > 4096 else [])
        common: dict[str, Any] = dict(kv_bytes=self.kv_bytes, max_model_len=self.max_model_len,
                                      taskset=True, extra_args=extra)
        if self.kind == "aggregated":
            self.engines = [Engine(f"agg{i}", self.model, logs, connector=None, role=None,
                                   cpu_bind=core, **common)
                            for i, core in enumerate(self.cores)]
            return
        # Every engine has a core of its own (taskset): P's and D's step-queue
        # readers may spin while they compute, as the aggregated engines'
        # (vLLM's own) do; quieted, each decode step waited for a wake-up.
        mode = {"transfer_mode": self.transfer_mode, "spin_while_computing": True}
        p_tp, d_tp = self.tp
        p = Engine("p", self.model, logs, role="kv_producer", tp_size=p_tp,
                   cpu_bind=tp_bind(p_tp, self.cores[0], self.cores), extra_config=mode,
                   **common)
        d = Engine("d", self.model, logs, role="kv_consumer", tp_size=d_tp,
                   cpu_bind=tp_bind(d_tp, self.cores[1], self.cores),
                   extra_config={**mode, "transfer_telemetry_in_response": True,
                                 **self.d_extra},
                   **common)
        self.engines = [p, d]
        self.proxy = Proxy([p.url], [d.url], logs, args=[
            "--transfer-mode", self.transfer_mode, "--transfer-telemetry",
            # Every request disaggregated: this deployment is the one being
            # judged, not the proxy's conditional rule (whose threshold the
            # comparison calibrates, slo/threshold.py).
            "--local-prefill-threshold", "0",
            # An overloaded point must show as latency and timeouts, not as
            # the proxy's own 503s after 30 s in its admission queue.
            "--queue-timeout", "3600", "--max-queued", "100000", *self.proxy_args])

    @property
    def name(self) -> str:
        if self.kind == "aggregated":
            return self.kind
        tp = "" if self.tp == (1, 1) else f"-tp{self.tp[0]}x{self.tp[1]}"
        return f"disaggregated-{self.transfer_mode}{tp}"

    @property
    def urls(self) -> list[str]:
        """Where the benchmark sends requests."""
        return [self.proxy.url] if self.proxy is not None else [e.url for e in self.engines]

    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def describe(self) -> dict[str, object]:
        return {"kind": self.kind, "name": self.name, "cores": list(self.cores),
                "transfer_mode": self.transfer_mode if self.proxy is not None else None,
                "engines": [{"name": e.name, "core": e.cpu_bind, "role": e.role,
                             "connector": e.connector} for e in self.engines],
                "proxy": self.proxy is not None, "proxy_args": self.proxy_args,
                "max_model_len": self.max_model_len,
                "kv_bytes": self.kv_bytes}

    def start(self, timeout: float = 900.0) -> Deployment:
        try:
            for e in self.engines:
                e.start()
            for e in self.engines:
                e.wait_ready(timeout=timeout)
            if self.proxy is not None:
                self.proxy.start().wait_ready(timeout=60)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for e in self.engines:
            e.stop()
