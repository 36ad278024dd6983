"""``kv_connector_extra_config`` for PDConnector: every key, validated once.

Pure (no vLLM import). ``PDConfig.from_extra_config`` is called by both
halves at construction; an unknown key or a bad value raises ``ConfigError``
naming the key and the accepted values, which stops the engine at startup.
docs/configuration.md documents the same table.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from vllm_pd_ext.wire.auth import FrameAuth, Keyring, SecretError
from vllm_pd_ext.wire.protocol import TRANSFER_MODES, TransferMode


class ConfigError(ValueError):
    """Invalid ``kv_connector_extra_config``."""


MIN_LEASE_S = 2.0
NIXL_BACKENDS = ("UCX", "GDS", "GDS_MT", "POSIX", "LIBFABRIC", "OBJ", "MOONCAKE")


@dataclass(frozen=True)
class PDConfig:
    transfer_mode: TransferMode = TransferMode.PULL
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5600
    #: Seconds P holds a finished prefill's blocks without news from D.
    lease_duration: float = 30.0
    #: Seconds between D's heartbeats; default lease_duration / 6.
    heartbeat_interval: float | None = None
    #: Seconds D waits for one request's KV (handshake, pin, READs) before
    #: reporting a failed load.
    transfer_timeout: float = 30.0
    #: Push: seconds D waits for P's WRITE without P confirming that it holds
    #: the request (queued or prefilling); the registration's ``ttl`` on P.
    push_timeout: float = 60.0
    #: Push, D: the longest D waits for P's WRITE while P keeps confirming
    #: the request is queued there.
    push_queue_timeout: float = 600.0
    #: Push, D: the longest one engine step with nothing to do sleeps while D
    #: waits for pushed KV (a notification ends it at once); 0 disables.
    push_idle_wait_ms: float = 10.0
    #: D (needs ``push_idle_wait_ms`` > 0). Push: the scheduler sees a push
    #: land from the notifications its workers forward and schedules the
    #: request in that very step, before the workers' report. Concurrent
    #: pull: an idle D sleeps before ``schedule()``, so P's answer is
    #: allocated and its READ starts in the step it wakes. A patch of
    #: ``Scheduler.schedule`` (issue 29). Off by default: on our CPU hosts
    #: neither shortened the gap between token #1 and token #2 (docs/slo.md).
    same_step_landing: bool = False
    #: Pull, D: the longest one engine step that computes nothing waits for
    #: the loads in flight, so one that ends is reported in that step; 0 disables.
    pull_report_wait_ms: float = 2.0
    #: Seconds for one side-channel round trip (handshake, pin).
    handshake_timeout: float = 5.0
    nixl_backends: tuple[str, ...] = ("UCX",)
    #: NIXL's progress thread burns a core per agent on CPU; off by default.
    nixl_progress_thread: bool = False
    #: Period of the worker's NIXL progress pump on engines that serve KV
    #: (producer/both) when the progress thread is off; 0 disables it.
    nixl_progress_interval_ms: float = 1.0
    #: Back a host-memory KV cache with transparent huge pages (madvise
    #: MADV_COLLAPSE); about doubles same-host READ speed.
    kv_huge_pages: bool = True
    #: CPU: confine the EngineCore process to the workers' explicit
    #: VLLM_CPU_OMP_THREADS_BIND cores (affinity.py).
    bind_engine_core: bool = True
    #: CPU: vLLM's shared-memory queues between EngineCore and workers wait
    #: on their notification instead of spinning for 1 s after every
    #: message (compat.quiet_shm_spin).
    quiet_shm_spin: bool = True
    #: CPU, with quiet_shm_spin: the quieted readers spin as vLLM's do while
    #: the engine's steps compute (issue 29: the notification's wake-up cost
    #: each decode step 0.4 to 3.8 ms). For engines on cores of their own only.
    spin_while_computing: bool = False
    #: Seconds a drain (SIGTERM or POST /pd/drain, drain.py) may take in all:
    #: the engine refuses new requests, answers the admitted ones, serves
    #: the leases it granted in what is left, then exits. Also vLLM's
    #: --shutdown-timeout when that is 0 (in vllm serve's parent of several
    #: API servers too); 0 here keeps vLLM's abort-at-once.
    drain_timeout: float = 120.0
    #: The address P advertises to D and to the proxy for its side channel;
    #: default side_channel_host. Needed when that binds 0.0.0.0 or ::.
    side_channel_advertise_host: str | None = None
    #: A file holding the shared secret(s) that sign every side-channel
    #: frame and every leg (auth.py); wins over auth_secret_env.
    auth_secret_file: str | None = None
    #: The environment variable holding the shared secret(s); default
    #: VLLM_PD_AUTH_SECRET. Never the secret itself: vLLM logs this config.
    auth_secret_env: str | None = None
    #: Seconds a signed frame's or leg's timestamp may be off this host's clock.
    auth_window_s: float = 30.0
    #: Multi-turn (scheduler/bidir.py): D keeps a finished turn's blocks under a lease
    #: and P reads the matching prefix back on the next turn. Both engines.
    bidirectional_kv_xfer: bool = False
    #: P reads back from D only when that saves at least this many prompt
    #: tokens (docs/benchmarks.md, "Multi-turn": below it a read costs more
    #: than it saves).
    kv_recompute_threshold: int = 64
    #: D: seconds a finished turn's blocks wait for the next turn's P; once
    #: P holds that turn, its heartbeats renew the lease like any other.
    decoder_kv_blocks_ttl: float = 480.0
    #: D: at most this fraction of D's KV blocks is kept for next turns; the
    #: least recently kept that no P is reading go first.
    decoder_kv_blocks_budget: float = 0.25
    #: D: put each request's transfer record (wire/telemetry.py) in its final
    #: answer's kv_transfer_params as ``pd_transfer``, for the proxy and
    #: benchmarks. It is always logged; off by default because it names P.
    transfer_telemetry_in_response: bool = False
    _extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def effective_heartbeat_interval(self) -> float:
        if self.heartbeat_interval is not None:
            return self.heartbeat_interval
        return self.lease_duration / 6.0

    @property
    def advertised_host(self) -> str:
        """The side-channel address peers are told (checked in from_extra_config)."""
        return self.side_channel_advertise_host or self.side_channel_host

    def load_keyring(self, environ: Mapping[str, str] | None = None) -> Keyring | None:
        """The shared secret(s), or None (unauthenticated: isolated networks only)."""
        try:
            return Keyring.load(self.auth_secret_env, self.auth_secret_file, environ)
        except SecretError as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc}") from None

    def frame_auth(self, environ: Mapping[str, str] | None = None) -> FrameAuth | None:
        """Side-channel frame signing for this process; None without a secret."""
        keyring = self.load_keyring(environ)
        return None if keyring is None else FrameAuth(keyring, self.auth_window_s)

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls) if not f.name.startswith("_")]

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> PDConfig:
        extra = dict(extra or {})
        known = cls.keys()
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config: unknown key(s) {unknown}; "
                f"accepted keys: {', '.join(known)}"
            )
        values: dict[str, Any] = {}
        for key, raw in extra.items():
            values[key] = _VALIDATORS[key](key, raw)
        cfg = cls(**values)
        if cfg.lease_duration < MIN_LEASE_S:
            raise ConfigError(
                f"kv_connector_extra_config.lease_duration={cfg.lease_duration}: must be >= "
                f"{MIN_LEASE_S} s (D needs a safety margin to pin a lease before reading)"
            )
        if cfg.effective_heartbeat_interval >= cfg.lease_duration:
            raise ConfigError(
                "kv_connector_extra_config.heartbeat_interval must be shorter than "
                f"lease_duration ({cfg.effective_heartbeat_interval} >= {cfg.lease_duration})"
            )
        if _unspecified(cfg.advertised_host):
            raise ConfigError(
                f"kv_connector_extra_config: the side channel would be advertised as "
                f"{cfg.advertised_host!r}, which no peer can connect to; set "
                "side_channel_advertise_host to this engine's address on the KV network "
                "(side_channel_host may stay 0.0.0.0 to bind every interface)")
        return cfg


def extra_config_from_argv(argv: list[str]) -> dict[str, Any] | None:
    """``kv_connector_extra_config`` from a ``vllm serve`` command line (the
    API server's middlewares have no connector instance and read the same
    JSON); None when absent or not JSON (the connector then reports it)."""
    for i, arg in enumerate(argv):
        raw = None
        if arg == "--kv-transfer-config" and i + 1 < len(argv):
            raw = argv[i + 1]
        elif arg.startswith("--kv-transfer-config="):
            raw = arg.split("=", 1)[1]
        if raw is None:
            continue
        try:
            extra = json.loads(raw).get("kv_connector_extra_config") or {}
        except (ValueError, AttributeError):
            return None
        return extra if isinstance(extra, dict) else None
    return None


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _optional_str(key: str, raw: Any) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or not raw or len(raw) > 4096:
        raise ConfigError(f"kv_connector_extra_config.{key}={raw!r}: expected a non-empty "
                          "string")
    return raw


def _env_name(key: str, raw: Any) -> str | None:
    if raw is not None and (not isinstance(raw, str)
                            or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", raw)):
        raise ConfigError(f"kv_connector_extra_config.{key}={raw!r}: expected the NAME of an "
                          "environment variable (e.g. VLLM_PD_AUTH_SECRET), never the secret")
    return raw


def _optional_host(key: str, raw: Any) -> str | None:
    return None if raw is None else _host(key, raw)


def _transfer_mode(key: str, raw: Any) -> TransferMode:
    if raw not in TRANSFER_MODES:
        raise ConfigError(
            f"kv_connector_extra_config.{key}={raw!r}: accepted values: "
            f"{', '.join(TRANSFER_MODES)}"
        )
    return TransferMode(raw)


def _host(key: str, raw: Any) -> str:
    if not isinstance(raw, str) or not raw:
        raise ConfigError(f"kv_connector_extra_config.{key}={raw!r}: expected an IP address")
    if raw != "localhost":
        try:
            ipaddress.ip_address(raw)
        except ValueError:
            raise ConfigError(
                f"kv_connector_extra_config.{key}={raw!r}: expected an IP address "
                "(e.g. 127.0.0.1) or 'localhost'"
            ) from None
    return raw


def _port(key: str, raw: Any) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 < raw < 65536:
        raise ConfigError(f"kv_connector_extra_config.{key}={raw!r}: expected an integer 1..65535")
    return raw


def _positive(key: str, raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not raw > 0:
        raise ConfigError(f"kv_connector_extra_config.{key}={raw!r}: expected a number > 0")
    return float(raw)


def _non_negative(key: str, raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or raw < 0:
        raise ConfigError(f"kv_connector_extra_config.{key}={raw!r}: expected a number >= 0")
    return float(raw)


def _count(key: str, raw: Any) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise ConfigError(f"kv_connector_extra_config.{key}={raw!r}: expected an integer >= 0")
    return raw


def _fraction(key: str, raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not 0 < raw <= 1:
        raise ConfigError(f"kv_connector_extra_config.{key}={raw!r}: expected a number in "
                          "(0, 1]")
    return float(raw)


def _ttl(key: str, raw: Any) -> float:
    value = _positive(key, raw)
    if value > 3600:
        raise ConfigError(f"kv_connector_extra_config.{key}={raw!r}: at most 3600 s")
    return value


def _bool(key: str, raw: Any) -> bool:
    if not isinstance(raw, bool):
        raise ConfigError(f"kv_connector_extra_config.{key}={raw!r}: expected true or false")
    return raw


def _backends(key: str, raw: Any) -> tuple[str, ...]:
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list | tuple) or not raw or not all(isinstance(b, str) for b in raw):
        raise ConfigError(
            f"kv_connector_extra_config.{key}={raw!r}: expected a non-empty list of "
            f"NIXL backend names ({', '.join(NIXL_BACKENDS)})"
        )
    bad = [b for b in raw if b not in NIXL_BACKENDS]
    if bad:
        raise ConfigError(
            f"kv_connector_extra_config.{key}: unknown backend(s) {bad}; "
            f"accepted values: {', '.join(NIXL_BACKENDS)}"
        )
    return tuple(raw)


_VALIDATORS: dict[str, Any] = {
    "transfer_mode": _transfer_mode,
    "side_channel_host": _host,
    "side_channel_port": _port,
    "lease_duration": _positive,
    "heartbeat_interval": _positive,
    "transfer_timeout": _positive,
    "push_timeout": _positive,
    "push_queue_timeout": _positive,
    "push_idle_wait_ms": _non_negative,
    "same_step_landing": _bool,
    "pull_report_wait_ms": _non_negative,
    "handshake_timeout": _positive,
    "nixl_backends": _backends,
    "nixl_progress_thread": _bool,
    "kv_huge_pages": _bool,
    "bind_engine_core": _bool,
    "quiet_shm_spin": _bool,
    "spin_while_computing": _bool,
    "drain_timeout": _non_negative,
    "nixl_progress_interval_ms": _non_negative,
    "side_channel_advertise_host": _optional_host,
    "auth_secret_file": _optional_str,
    "auth_secret_env": _env_name,
    "auth_window_s": _positive,
    "bidirectional_kv_xfer": _bool,
    "kv_recompute_threshold": _count,
    "decoder_kv_blocks_ttl": _ttl,
    "decoder_kv_blocks_budget": _fraction,
    "transfer_telemetry_in_response": _bool,
}
