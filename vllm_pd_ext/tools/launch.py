"""Start and stop local vLLM OpenAI servers and a ``vllm-pd-proxy`` for them.

Who uses it: ``vllm-pd-bench compare`` (``tools/slo/deploy.py``), and the
test harness, the demo and the benchmarks of a source checkout (through
``vllm_pd_ext.testing.engines``). It assumes no source checkout: every
child runs in the caller's current directory (so a relative ``--model``
path means what the caller meant) and needs only the installed packages
(vLLM for an engine, this package for its middlewares and the proxy).

Lifecycle of an ``Engine`` (a ``Proxy`` is the same, minus the drain):

1. ``start()``: one ``python -m vllm.entrypoints.openai.api_server``
   process group, in its own session, bound to 127.0.0.1 with
   ``UCX_NET_DEVICES=lo`` (``SAFE_ENV``), or, given a ``NetHost``, inside
   that host on its address; output goes to ``<log_dir>/<name>.log``;
2. ``wait_ready()`` polls ``/health`` and fails fast, quoting the log tail,
   if the process dies (starting again on fresh ports when another process
   took one of ours between the pick and the bind);
3. ``stop()`` (or ``kill``/``drain``) ends exactly the processes it started,
   by PID and process group, never by name.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from vllm_pd_ext.tools.ports import free_port


class NetHost(Protocol):
    """Where an engine runs instead of 127.0.0.1 here: a network namespace
    with its own address (``vllm_pd_ext.testing.netns.Host`` is one)."""

    addr: str

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside the host."""
        ...

    def env(self) -> dict[str, str]:
        """Environment an engine inside the host needs (UCX device, addresses)."""
        ...


SAFE_ENV = {
    "UCX_NET_DEVICES": "lo",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
}


def keep_previous_log(path: Path) -> Path | None:
    """Move an earlier process's log at ``path`` aside (``<stem>.1.log``,
    ``.2``, ...: the first free name) before a new process of the same name
    writes there; returns where it went. A later engine set reusing a name
    in one log folder used to overwrite the log of a failure."""
    if not path.exists():
        return None
    for n in itertools.count(1):
        aside = path.with_name(f"{path.stem}.{n}{path.suffix}")
        if not aside.exists():
            path.replace(aside)
            return aside
    raise AssertionError("unreachable")


def parse_tp_pair(text: str, max_tp: int = 2) -> tuple[int, int]:
    """``--tp P,D`` of the demo, the soak and ``vllm-pd-bench``: P's and D's
    tensor-parallel sizes, each at most ``max_tp`` (a core per rank)."""
    try:
        p_tp, d_tp = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--tp takes P,D (e.g. 1,2), got {text!r}") from None
    if not (1 <= p_tp <= max_tp and 1 <= d_tp <= max_tp):
        raise ValueError(f"--tp {text}: each size must be 1..{max_tp} here (one core per rank)")
    return p_tp, d_tp


def tp_bind(tp: int, alone: str, cores: tuple[str, ...] = ("0", "1")) -> str:
    """The ``cpu_bind`` of an engine with ``tp`` ranks: its own core
    ``alone`` at TP=1, else one of ``cores`` per rank (``"0|1"``)."""
    if tp == 1:
        return alone
    if tp > len(cores):
        raise ValueError(f"TP={tp} needs {tp} cores, have {len(cores)} ({','.join(cores)})")
    return "|".join(cores[:tp])


@dataclass
class Engine:
    """One vLLM OpenAI server: ``connector="PDConnector"`` with ``role`` for a
    P or a D, ``connector=None`` for a plain engine (the aggregated baseline),
    or another connector name (vLLM's own, on the CPU buffer)."""

    name: str
    model: str
    log_dir: Path
    connector: str | None = "PDConnector"
    role: str | None = "kv_producer"
    extra_config: dict[str, Any] = field(default_factory=dict)
    failure_policy: str | None = None
    port: int = 0
    side_channel_port: int = 0
    kv_bytes: int = 256 << 20
    cpu_bind: str | None = None
    max_model_len: int = 2048
    #: Tensor parallelism (``--tensor-parallel-size``); on CPU give each rank
    #: its cores in ``cpu_bind`` with ``|`` (``"0|1"``: one core per rank).
    tp_size: int = 1
    #: The tests' equality oracle takes its near-tie epsilon from this.
    dtype: str = "bfloat16"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    #: Run inside this host (a network namespace, testing/netns.py), bound to
    #: its address, with its environment; None: 127.0.0.1 here.
    host: NetHost | None = None
    #: Confine every process of the engine (API server, engine core, worker)
    #: to ``cpu_bind`` with taskset, as a cpuset would; else only the
    #: worker's OpenMP threads are bound (VLLM_CPU_OMP_THREADS_BIND).
    taskset: bool = False
    #: ``"cpu"`` (vLLM's CPU build: a fixed KV size in bytes, OpenMP binding)
    #: or ``"cuda"``: the KV cache is ``gpu_memory_utilization`` of the GPUs
    #: in ``cuda_devices`` (``CUDA_VISIBLE_DEVICES``), with no CPU-only flag.
    device: str = "cpu"
    gpu_memory_utilization: float = 0.9
    cuda_devices: str | None = None
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"engine {self.name}: device {self.device!r} is not cpu or cuda")
        if self.tp_size < 1:
            raise ValueError(f"engine {self.name}: tp_size {self.tp_size} must be >= 1")
        ranks = len(self.cpu_bind.split("|")) if self.cpu_bind and "|" in self.cpu_bind else 1
        if self.device == "cpu" and self.tp_size > 1 and ranks != self.tp_size:
            # vLLM CPU's default "auto" binding asserts one NUMA node per
            # rank, which a one-node host does not have.
            raise ValueError(f"engine {self.name}: tp_size {self.tp_size} on CPU needs one core "
                             f"set per rank in cpu_bind (e.g. '0|1'), got {self.cpu_bind!r}")
        self.port = self.port or free_port()
        self.side_channel_port = self.side_channel_port or free_port()
        self.log_path = self.log_dir / f"{self.name}.log"

    @property
    def addr(self) -> str:
        return self.host.addr if self.host is not None else "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", self.addr, "--port", str(self.port),
            "--max-model-len", str(self.max_model_len), "--enforce-eager",
            "--dtype", self.dtype,
        ]
        if self.device == "cuda":
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        else:
            cmd += ["--kv-cache-memory-bytes", str(self.kv_bytes)]
        cmd += ["--max-num-seqs", "32"]
        if self.tp_size > 1:
            cmd += ["--tensor-parallel-size", str(self.tp_size)]
        if self.connector is not None:
            kv: dict[str, Any] = {"kv_connector": self.connector, "kv_role": self.role}
            if self.connector == "PDConnector":
                extra = {"side_channel_host": self.addr,
                         "side_channel_port": self.side_channel_port}
                extra.update(self.extra_config)
                kv["kv_connector_extra_config"] = extra
                # SIGTERM and POST /pd/drain drain the engine (vllm_pd_ext/drain.py).
                cmd += ["--middleware", "vllm_pd_ext.drain.DrainMiddleware",
                        # 4xx for a leg the proxy did not sign (with a secret).
                        "--middleware", "vllm_pd_ext.leg_auth.LegAuthMiddleware"]
            else:
                kv["kv_buffer_device"] = self.device
                if self.extra_config:
                    kv["kv_connector_extra_config"] = self.extra_config
            if self.failure_policy:
                kv["kv_load_failure_policy"] = self.failure_policy
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        cmd += self.extra_args
        if self.taskset and self.cpu_bind is not None and self.device == "cpu":
            # One set per TP rank ("0|1"): the engine's processes get them all.
            cmd = ["taskset", "-c", self.cpu_bind.replace("|", ","), *cmd]
        return self.host.wrap(cmd) if self.host is not None else cmd

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The child's environment: ``base`` (this process's by default), our
        safe settings, the side-channel port, the device's, the host's, ``env``."""
        env = dict(os.environ if base is None else base)
        env.update(SAFE_ENV)
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        if self.device == "cuda":
            if self.cuda_devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = self.cuda_devices
        elif self.cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        if self.host is not None:
            env.update(self.host.env())
        env.update(self.env)
        return env

    def start(self, append: bool = False) -> Engine:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = self.environment()
        # append=True (the soak's restart after a kill) keeps the crashed run's log.
        if not append:
            keep_previous_log(self.log_path)
        log = open(self.log_path, "ab" if append else "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        log.close()
        return self

    def wait_ready(self, timeout: float = 240.0, retries: int = 2) -> Engine:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if retries > 0 and "Address already in use" in self.log_text():
                    # Another process took a port between our pick and the
                    # engine's bind: start again on fresh ports.
                    retries -= 1
                    self.port, self.side_channel_port = free_port(), free_port()
                    self.start()
                    continue
                raise RuntimeError(f"engine {self.name} exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"engine {self.name} not ready in {timeout:.0f} s:\n"
                           + self.log_tail())

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-n:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group we started (SIGKILL simulates a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def drain(self, timeout: float = 150.0) -> int:
        """SIGTERM to the API server alone, as an orchestrator sends it (the
        EngineCore hears of it from the API server); waits for the exit and
        returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
        code = self.proc.wait(timeout=timeout)
        # Reap what the drained engine left of its process group, if anything.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return code

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None:
            return
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            self.proc.wait(timeout=10)
        # Reap stragglers of our own process group (a defunct worker can linger).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    # ------------------------------------------------------------- HTTP
    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        return post_json(self.url + path, body, timeout, headers)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples summed over labels except ``source``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
            if not m:
                continue
            name, labels, value = m.group(1), m.group(2) or "", m.group(3)
            src = re.search(r'source="([^"]+)"', labels)
            key = f"{name}[{src.group(1)}]" if src else name
            out[key] = out.get(key, 0.0) + float(value)
        return out


@dataclass
class Proxy:
    """``vllm-pd-proxy`` as a subprocess on 127.0.0.1 (same contract as Engine)."""

    prefill: list[str]
    decode: list[str]
    log_dir: Path
    port: int = 0
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.log_path = self.log_dir / "proxy.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Proxy:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "vllm_pd_proxy.cli", "--host", "127.0.0.1",
               "--port", str(self.port)]
        for url in self.prefill:
            cmd += ["--prefill", url]
        for url in self.decode:
            cmd += ["--decode", url]
        if "--local-prefill-threshold" not in self.args:
            # Tests and benchmarks measure handoffs: every request disaggregated
            # unless one asks for the proxy's conditional default.
            cmd += ["--local-prefill-threshold", "0"]
        keep_previous_log(self.log_path)
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(cmd + self.args, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **self.env})
        log.close()
        return self

    def wait_ready(self, timeout: float = 30.0) -> Proxy:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("proxy exited:\n" + self.log_path.read_text())
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        raise TimeoutError("proxy not healthy:\n" + self.log_path.read_text())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        return post_json(self.url + path, body, timeout, headers)


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0,
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """POST ``body`` as JSON; the status and the JSON answer (an error page
    that is no JSON comes back as ``{"error": text}``)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            return exc.code, json.loads(text)
        except json.JSONDecodeError:
            return exc.code, {"error": text}


@contextlib.contextmanager
def running(*engines: Engine) -> Iterator[None]:
    """Start engines together (their startups overlap), wait until all serve,
    and stop every one of them on exit, whatever happened."""
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
        yield
    finally:
        for e in engines:
            e.stop()
