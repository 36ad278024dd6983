"""Proxy configuration: one frozen dataclass shared by the CLI, the app and tests.

Lifecycle: built once (by :mod:`vllm_pd_proxy.cli` from argv, or directly by
tests/benchmarks), validated by :meth:`ProxyConfig.validated`, then passed to
``create_app``. Nothing mutates it afterwards; runtime state lives in the
objects ``create_app`` builds from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from vllm_pd_ext.wire.auth import Keyring
from vllm_pd_ext.wire.protocol import TRANSFER_MODES, TransferMode

__all__ = ["TRANSFER_MODES", "ConfigError", "ProxyConfig", "TransferMode", "normalize_url"]


class ConfigError(ValueError):
    """An invalid combination of settings; the CLI turns it into a usage error."""


def normalize_url(url: str) -> str:
    """Return ``url`` as ``scheme://host:port`` without a trailing slash.

    A bare ``host:port`` gets ``http://`` so ``--prefill 127.0.0.1:8100`` works.
    """
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"backend URL {url!r} is not an http(s)://host:port URL")
    if parts.path not in ("", "/"):
        # Engines are addressed by their root; the proxy appends /v1/... itself.
        raise ConfigError(f"backend URL {url!r} must not carry a path (got {parts.path!r})")
    return url


#: The measured break-even (docs/slo.md, ``vllm-pd-bench threshold``): on our
#: 2-core CPU machines with the bench model and the seed's 200 ms ITL cutoff, a
#: local prefill of more uncached tokens than this stalls D's streams past the
#: cutoff (300-token prompts already justified disaggregation there). On GPUs
#: prefill is much faster and the break-even higher: re-derive it.
DEFAULT_LOCAL_PREFILL_THRESHOLD = 272


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Every tunable of the proxy; defaults match the documented CLI defaults."""

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    transfer_mode: TransferMode = TransferMode.PULL
    routing: str = "least-loaded"
    # Conditional disaggregation: requests whose *uncached* prompt tokens (the
    # prompt minus what the chosen decode engine probably caches) are below
    # this are prefilled on the decode engine itself. 0 disables it.
    local_prefill_threshold: int = DEFAULT_LOCAL_PREFILL_THRESHOLD
    # The proxy's memory of each decode engine's prefix cache: chunks of this
    # many tokens, at most prefix_cache_size chunks per engine (LRU).
    prefix_chunk_tokens: int = 32
    prefix_cache_size: int = 65536
    # Load term: when every prefill engine has this many P legs in flight,
    # prefill locally whatever the length (Dynamo's max_prefill_queue_size).
    # 0 disables it.
    max_prefill_queue: int = 0
    # Superseded by the chunk memory; accepted for old command lines.
    prefix_aware_len: int = 0
    # Retries of the prefill leg on another prefill engine (502/503/504 or a
    # failed connect, before anything went to D or the client).
    prefill_retries: int = 1
    # Request migration (vllm_pd_proxy.migration): how many times one
    # request may go on elsewhere after an engine failed it (0: never), and
    # the seconds after its arrival past which none starts (0: no deadline).
    max_migrations: int = 2
    request_deadline: float = 0.0
    # Token #1 from P (vllm_pd_proxy.first_token): the client gets P's first
    # token when P answers, and D continues from token #2.
    first_token_from_prefill: bool = True
    # Token #1 from P with D's leg beside P's, in both modes: token #1
    # comes with the KV (push: P's WRITE notification; pull: P's message on
    # the side channel), so D's API server and queue overlap P's prefill
    # (vllm_pd_proxy.dispatch, issue 29 item 2).
    concurrent_dispatch: bool = True
    # Back-pressure (vllm_pd_proxy.admission): P legs in flight per prefill
    # engine (0: no cap), requests waiting for a slot, and how long one waits.
    max_inflight_per_prefill: int = 16
    max_queued: int = 1024
    queue_timeout: float = 30.0
    connect_timeout: float = 10.0
    prefill_timeout: float = 300.0
    decode_timeout: float = 600.0
    stream_idle_timeout: float = 120.0
    health_interval: float = 5.0
    health_timeout: float = 5.0
    max_connections: int = 1024
    max_connections_per_backend: int = 0
    # Below uvicorn's default keep-alive (5 s, vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
    # so the proxy never reuses a socket the engine is about to close.
    keepalive_timeout: float = 4.0
    # Long prompts (and base64 images) exceed aiohttp's 1 MiB default.
    max_request_bytes: int = 64 * 1024 * 1024
    # All client request bodies held at once: 16 maximal requests, or many
    # thousands of ordinary ones; above it new requests get 503.
    max_total_body_bytes: int = 1024 * 1024 * 1024
    # Longest partial SSE event held back while relaying D's stream. vLLM's
    # events are KBs, but prompt_logprobs of a long prompt come in one event.
    max_sse_event_bytes: int = 16 * 1024 * 1024
    # Prompts of one batched /v1/completions request, each its own P/D
    # handoff (vllm_pd_proxy.batch); more get 400.
    max_batch_prompts: int = 64
    # Sent as "Authorization: Bearer <key>" on the proxy's own calls (health,
    # identity probes) to engines started with --api-key. repr=False: the
    # config may be logged or printed, the key must not be.
    backend_api_key: str | None = field(default=None, repr=False)
    # The shared secret(s) that sign every leg's kv_transfer_params
    # (vllm_pd_ext.wire.auth); None: legs unsigned (isolated networks only).
    auth: Keyring | None = field(default=None, repr=False)
    # Multi-turn (vllm_pd_proxy.conversations): D keeps each turn's KV and the
    # next turn's P reads it back; conversations remembered, and for how long.
    multi_turn: bool = False
    multi_turn_store_size: int = 100_000
    multi_turn_store_mib: int = 256
    multi_turn_ttl: float = 450.0
    session_header: str = "X-Session-Id"
    # The next turn stays on its D while that D has at most this many more
    # requests in flight than the least loaded routable D.
    multi_turn_affinity_slack: int = 8
    # Per-request telemetry (vllm_pd_proxy.telemetry): leg timings and D's
    # transfer record in each answer (pd_telemetry); spans over OpenTelemetry.
    transfer_telemetry: bool = False
    otel: bool = False

    @property
    def probes_identity(self) -> bool:
        """Whether the proxy must know each prefill engine's identity before
        its legs leave: push always; pull only when D's leg may go beside
        P's (``concurrent_dispatch`` with token #1 from P), so that a
        sequential pull never costs P a probe's forward step."""
        if self.transfer_mode == TransferMode.PUSH:
            return True
        return self.concurrent_dispatch and self.first_token_from_prefill

    def validated(self) -> ProxyConfig:
        """Return a copy with normalized URLs; raise ConfigError on bad values."""
        if not self.prefill:
            raise ConfigError("at least one --prefill backend is required")
        if not self.decode:
            raise ConfigError("at least one --decode backend is required")
        prefill = tuple(normalize_url(u) for u in self.prefill)
        decode = tuple(normalize_url(u) for u in self.decode)
        for role, urls in (("prefill", prefill), ("decode", decode)):
            if len(set(urls)) != len(urls):
                raise ConfigError(f"duplicate --{role} backend in {list(urls)}")
        if self.transfer_mode not in TRANSFER_MODES:
            raise ConfigError(f"--transfer-mode must be one of {TRANSFER_MODES}")
        if self.local_prefill_threshold < 0:
            raise ConfigError("--local-prefill-threshold must be >= 0")
        if self.prefix_aware_len < 0:
            raise ConfigError("--prefix-aware-len must be >= 0")
        if not 1 <= self.prefix_chunk_tokens <= 65536 or self.prefix_cache_size < 1:
            raise ConfigError(
                "--prefix-chunk-tokens must be in [1, 65536] and --prefix-cache-size >= 1"
            )
        if self.max_prefill_queue < 0:
            raise ConfigError("--max-prefill-queue must be >= 0")
        if self.max_prefill_queue and not self.local_prefill_threshold:
            raise ConfigError("--max-prefill-queue needs --local-prefill-threshold > 0")
        if self.prefill_retries < 0:
            raise ConfigError("--prefill-retries must be >= 0")
        if self.max_migrations < 0:
            raise ConfigError("--max-migrations must be >= 0")
        if self.request_deadline < 0:
            raise ConfigError("--request-deadline must be >= 0 (0: none)")
        if self.max_inflight_per_prefill < 0 or self.max_queued < 0:
            raise ConfigError("--max-inflight-per-prefill and --max-queued must be >= 0")
        timeouts = {
            "--connect-timeout": self.connect_timeout,
            "--prefill-timeout": self.prefill_timeout,
            "--decode-timeout": self.decode_timeout,
            "--stream-idle-timeout": self.stream_idle_timeout,
            "--health-interval": self.health_interval,
            "--health-timeout": self.health_timeout,
            "--keepalive-timeout": self.keepalive_timeout,
            "--queue-timeout": self.queue_timeout,
        }
        for flag, value in timeouts.items():
            if not value > 0:
                raise ConfigError(f"{flag} must be > 0 (got {value})")
        if self.max_connections < 1 or self.max_connections_per_backend < 0:
            raise ConfigError("--max-connections must be >= 1, --max-connections-per-backend >= 0")
        if self.max_request_bytes < 1024:
            raise ConfigError("--max-request-bytes must be >= 1024")
        if self.max_total_body_bytes < self.max_request_bytes:
            # Otherwise a request the per-request cap allows could never be served.
            raise ConfigError("--max-total-body-bytes must be >= --max-request-bytes")
        if (self.multi_turn_store_size < 1 or self.multi_turn_store_mib < 1
                or not self.multi_turn_ttl > 0):
            raise ConfigError("--multi-turn-store-size and --multi-turn-store-mib must be >= 1, "
                              "--multi-turn-ttl > 0")
        if self.multi_turn_affinity_slack < 0 or not self.session_header.strip():
            raise ConfigError("--multi-turn-affinity-slack must be >= 0, --session-header "
                              "non-empty")
        if self.max_sse_event_bytes < 1024:
            raise ConfigError("--max-sse-event-bytes must be >= 1024")
        if self.max_batch_prompts < 1:
            raise ConfigError("--max-batch-prompts must be >= 1")
        # An empty key (e.g. an empty environment variable) means no key.
        api_key = self.backend_api_key or None
        return dataclasses.replace(self, prefill=prefill, decode=decode, backend_api_key=api_key,
                                   transfer_mode=TransferMode(self.transfer_mode))
