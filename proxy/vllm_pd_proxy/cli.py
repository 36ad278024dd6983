"""``vllm-pd-proxy`` command line: parse flags, build the config, run the app.

Lifecycle: :func:`main` parses argv into a :class:`ProxyConfig`, configures
logging, builds the app with ``create_app`` and serves it with
``aiohttp.web.run_app`` until SIGINT/SIGTERM. Handler cancellation is on, so
a client disconnect cancels its request handler and the upstream legs. Every
flag is documented in docs/proxy.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from aiohttp import web

from vllm_pd_ext.wire.auth import DEFAULT_SECRET_ENV, Keyring, SecretError

from . import __version__
from .config import TRANSFER_MODES, ConfigError, ProxyConfig, TransferMode
from .routing import POLICIES

logger = logging.getLogger("vllm_pd_proxy")

_D = ProxyConfig()  # defaults shown in --help come from the dataclass

# Read when --backend-api-key is absent; the environment keeps the key out of
# `ps` output and shell history.
API_KEY_ENV = "VLLM_PD_BACKEND_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-pd-proxy",
        description="Prefill/decode disaggregation proxy for vLLM OpenAI servers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--host", default=_D.host, help="address to listen on")
    p.add_argument("--port", type=int, default=_D.port, help="port to listen on")
    p.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="prefill engine base URL (http://host:port); repeat for several",
    )
    p.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="decode engine base URL (http://host:port); repeat for several",
    )
    p.add_argument(
        "--transfer-mode",
        choices=TRANSFER_MODES,
        default=_D.transfer_mode,
        help="pull: D reads the KV from P after P answers; push: both legs at "
        "once, P writes the KV to D (needs the vllm_pd_ext connector)",
    )
    p.add_argument(
        "--routing",
        choices=sorted(POLICIES),
        default=_D.routing,
        help="how a backend is chosen within each role",
    )
    g = p.add_argument_group("conditional disaggregation")
    g.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=_D.local_prefill_threshold,
        metavar="TOKENS",
        help="requests whose uncached prompt tokens (prompt minus what the chosen "
        "decode engine probably caches) are below this are prefilled by the "
        "decode engine itself (no P leg); 0 disables (docs/slo.md derives it)",
    )
    g.add_argument(
        "--prefix-chunk-tokens",
        type=int,
        default=_D.prefix_chunk_tokens,
        metavar="TOKENS",
        help="granularity of the proxy's memory of each decode engine's prefix "
        "cache (text counts 4 chars per token)",
    )
    g.add_argument(
        "--prefix-cache-size",
        type=int,
        default=_D.prefix_cache_size,
        metavar="CHUNKS",
        help="prompt chunks remembered per decode engine (LRU)",
    )
    g.add_argument(
        "--max-prefill-queue",
        type=int,
        default=_D.max_prefill_queue,
        metavar="N",
        help="when every prefill engine has N P legs in flight, prefill locally "
        "whatever the length; 0 disables (needs --local-prefill-threshold)",
    )
    g.add_argument(
        "--prefix-aware-len",
        type=int,
        default=_D.prefix_aware_len,
        metavar="N",
        help="superseded (uncached tokens are always counted when a threshold is "
        "set); accepted and ignored, with a warning",
    )
    g = p.add_argument_group("multi-turn (bidirectional KV, docs/multi-turn.md)")
    g.add_argument(
        "--multi-turn",
        action="store_true",
        help="ask D to keep each turn's KV and have the next turn's P read it back "
        "(engines need bidirectional_kv_xfer); the next turn goes to the same D",
    )
    g.add_argument(
        "--multi-turn-store-size",
        type=int,
        default=_D.multi_turn_store_size,
        metavar="ENTRIES",
        help="conversations remembered (LRU)",
    )
    g.add_argument(
        "--multi-turn-store-mib",
        type=int,
        default=_D.multi_turn_store_mib,
        metavar="MIB",
        help="memory the remembered conversations may take (LRU beyond it)",
    )
    g.add_argument(
        "--multi-turn-ttl",
        type=float,
        default=_D.multi_turn_ttl,
        metavar="SECONDS",
        help="longest a conversation is remembered between turns (also bounded by "
        "D's lease, decoder_kv_blocks_ttl)",
    )
    g.add_argument(
        "--session-header",
        default=_D.session_header,
        metavar="NAME",
        help="request header naming the conversation (else the body's "
        "conversation_id, else a hash of the conversation's opening)",
    )
    g.add_argument(
        "--multi-turn-affinity-slack",
        type=int,
        default=_D.multi_turn_affinity_slack,
        metavar="N",
        help="a next turn stays on its D while that D has at most N more requests in "
        "flight than the least loaded D",
    )
    g = p.add_argument_group("per-request telemetry (docs/telemetry.md)")
    g.add_argument(
        "--transfer-telemetry",
        action="store_true",
        help="add pd_telemetry to each answer (the non-streamed body, or the stream's "
        "finishing chunk): the legs' timings and D's transfer record (decode engines need "
        "transfer_telemetry_in_response)",
    )
    g.add_argument(
        "--otel",
        action="store_true",
        help="export each request's legs as OpenTelemetry spans (needs opentelemetry-sdk; "
        "the OTEL_* variables configure the exporter)",
    )
    g = p.add_argument_group("back-pressure (prefill admission)")
    g.add_argument(
        "--max-inflight-per-prefill",
        type=int,
        metavar="N",
        default=_D.max_inflight_per_prefill,
        help="prefill legs in flight on one prefill engine; more requests wait in "
        "one FIFO queue; 0: no cap",
    )
    g.add_argument(
        "--queue-timeout",
        type=float,
        metavar="S",
        default=_D.queue_timeout,
        help="longest wait in the queue for a prefill slot; then 503 with Retry-After",
    )
    g.add_argument(
        "--max-queued",
        type=int,
        metavar="N",
        default=_D.max_queued,
        help="requests waiting for a prefill slot at once; above it 503 at once",
    )
    g = p.add_argument_group("timeouts and retries (seconds)")
    g.add_argument(
        "--prefill-retries",
        type=int,
        metavar="N",
        default=_D.prefill_retries,
        help="retries of a prefill leg on another prefill engine after "
        "502/503/504 or a failed connect (never once the request was sent)",
    )
    g.add_argument(
        "--max-migrations",
        type=int,
        metavar="N",
        default=_D.max_migrations,
        help="times one request may go on elsewhere after an engine failed it: the "
        "handoff again on other engines before the client got a byte, or a stream "
        "continued on another decode engine from the tokens already sent (0: never)",
    )
    g.add_argument(
        "--first-token-from-prefill",
        action=argparse.BooleanOptionalAction,
        default=_D.first_token_from_prefill,
        help="stream the first token as soon as the prefill engine sampled it, and let "
        "the decode engine continue from the second (it computes the first token's KV "
        "instead of recomputing the token); requests it cannot serve exactly take the "
        "usual path, counted in pd_proxy_first_token_total",
    )
    g.add_argument(
        "--concurrent-dispatch",
        action=argparse.BooleanOptionalAction,
        default=_D.concurrent_dispatch,
        help="with --first-token-from-prefill, in both transfer modes: send the decode "
        "leg with the prefill leg, before the first token exists; the prefill engine "
        "sends that token to the decode engine with the KV (push) or with its blocks' "
        "names (pull), so the decode engine's request handling overlaps the prefill "
        "(completions with a text prompt, and chat; other requests take the sequential "
        "path). In pull mode it also makes the proxy probe each prefill engine's "
        "identity, as push mode always does",
    )
    g.add_argument(
        "--request-deadline",
        type=float,
        metavar="S",
        default=_D.request_deadline,
        help="no migration starts later than this after the request arrived (0: no "
        "deadline; each leg stays bounded by its own timeout)",
    )
    g.add_argument(
        "--connect-timeout",
        type=float,
        metavar="S",
        default=_D.connect_timeout,
        help="TCP connect to a backend",
    )
    g.add_argument(
        "--prefill-timeout",
        type=float,
        metavar="S",
        default=_D.prefill_timeout,
        help="whole prefill leg",
    )
    g.add_argument(
        "--decode-timeout",
        type=float,
        metavar="S",
        default=_D.decode_timeout,
        help="decode leg until its first bytes (streaming) or whole body",
    )
    g.add_argument(
        "--stream-idle-timeout",
        type=float,
        metavar="S",
        default=_D.stream_idle_timeout,
        help="longest silence between two chunks of a decode stream",
    )
    g.add_argument(
        "--health-interval",
        type=float,
        metavar="S",
        default=_D.health_interval,
        help="period of the background health round",
    )
    g.add_argument(
        "--health-timeout",
        type=float,
        metavar="S",
        default=_D.health_timeout,
        help="each health probe, identity probe and /v1/models call",
    )
    g = p.add_argument_group("connections")
    g.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        default=_D.max_connections,
        help="upstream connection pool size (each request holds up to two)",
    )
    g.add_argument(
        "--max-connections-per-backend",
        type=int,
        metavar="N",
        default=_D.max_connections_per_backend,
        help="per-backend cap; 0: none",
    )
    g.add_argument(
        "--keepalive-timeout",
        type=float,
        metavar="S",
        default=_D.keepalive_timeout,
        help="idle upstream connections are closed after this; keep it below "
        "the engines' keep-alive (uvicorn: 5 s)",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        metavar="N",
        default=_D.max_request_bytes,
        help="largest accepted client request body",
    )
    g.add_argument(
        "--max-total-body-bytes",
        type=int,
        metavar="N",
        default=_D.max_total_body_bytes,
        help="all client request bodies held at once; new requests get 503 above it",
    )
    g.add_argument(
        "--max-sse-event-bytes",
        type=int,
        metavar="N",
        default=_D.max_sse_event_bytes,
        help="longest SSE event relayed from a decode engine; a longer one fails the request",
    )
    g.add_argument(
        "--max-batch-prompts",
        type=int,
        metavar="N",
        default=_D.max_batch_prompts,
        help="prompts of one batched /v1/completions request (each its own P/D "
        "handoff); more get 400; 1 refuses every batch",
    )
    g.add_argument(
        "--backend-api-key",
        metavar="KEY",
        # Not the env value as default: --help prints defaults, never the key.
        default=argparse.SUPPRESS,
        help=f"API key of engines started with --api-key, sent on the proxy's own "
        f"health, /v1/models and identity probe calls (client calls carry the "
        f"client's Authorization); default: ${API_KEY_ENV}",
    )
    g.add_argument(
        "--auth-secret-file",
        metavar="PATH",
        default=None,
        help=f"file holding the shared secret(s) of the engines' kv_connector_extra_config "
        f"(auth_secret_file); the proxy signs every leg's kv_transfer_params with it; "
        f"default: ${DEFAULT_SECRET_ENV}, else legs are unsigned (docs/security.md)",
    )
    g = p.add_argument_group("runtime")
    g.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="'info' writes one access-log line per request",
    )
    g.add_argument(
        "--event-loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="auto: uvloop when it is installed",
    )
    return p


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        host=args.host,
        port=args.port,
        transfer_mode=TransferMode(args.transfer_mode),
        routing=args.routing,
        local_prefill_threshold=args.local_prefill_threshold,
        prefix_aware_len=args.prefix_aware_len,
        prefix_chunk_tokens=args.prefix_chunk_tokens,
        prefix_cache_size=args.prefix_cache_size,
        max_prefill_queue=args.max_prefill_queue,
        prefill_retries=args.prefill_retries,
        max_migrations=args.max_migrations,
        request_deadline=args.request_deadline,
        first_token_from_prefill=args.first_token_from_prefill,
        concurrent_dispatch=args.concurrent_dispatch,
        max_inflight_per_prefill=args.max_inflight_per_prefill,
        queue_timeout=args.queue_timeout,
        max_queued=args.max_queued,
        connect_timeout=args.connect_timeout,
        prefill_timeout=args.prefill_timeout,
        decode_timeout=args.decode_timeout,
        stream_idle_timeout=args.stream_idle_timeout,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        max_connections=args.max_connections,
        max_connections_per_backend=args.max_connections_per_backend,
        keepalive_timeout=args.keepalive_timeout,
        max_request_bytes=args.max_request_bytes,
        max_total_body_bytes=args.max_total_body_bytes,
        max_sse_event_bytes=args.max_sse_event_bytes,
        max_batch_prompts=args.max_batch_prompts,
        backend_api_key=getattr(args, "backend_api_key", None) or os.environ.get(API_KEY_ENV),
        auth=_keyring(args.auth_secret_file),
        multi_turn=args.multi_turn,
        multi_turn_store_size=args.multi_turn_store_size,
        multi_turn_store_mib=args.multi_turn_store_mib,
        multi_turn_ttl=args.multi_turn_ttl,
        session_header=args.session_header,
        multi_turn_affinity_slack=args.multi_turn_affinity_slack,
        transfer_telemetry=args.transfer_telemetry,
        otel=args.otel,
    ).validated()


def _keyring(path: str | None) -> Keyring | None:
    try:
        return Keyring.load(None, path)
    except SecretError as exc:
        raise ConfigError(str(exc).replace("auth_secret_file", "--auth-secret-file")) from None


def _event_loop(choice: str) -> asyncio.AbstractEventLoop | None:
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise SystemExit("--event-loop uvloop: uvloop is not installed") from None
        return None
    return uvloop.new_event_loop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from .app import create_app  # after logging is set up

    app = create_app(config)
    if config.auth is None:
        logger.warning(
            "no shared secret (--auth-secret-file or $%s): legs are sent unsigned and engines "
            "with a secret refuse them; without one, run only on an isolated network "
            "(docs/security.md)", DEFAULT_SECRET_ENV)
    else:
        logger.info("legs signed (%s)", config.auth.describe())
    if config.prefix_aware_len:
        logger.warning(
            "--prefix-aware-len is superseded and ignored: with --local-prefill-threshold "
            "the proxy counts each request's uncached prompt tokens in chunks of "
            "--prefix-chunk-tokens (docs/proxy.md)")
    logger.info(
        "vllm-pd-proxy %s on http://%s:%d mode=%s routing=%s "
        "max_inflight_per_prefill=%d prefill=%s decode=%s",
        __version__,
        config.host,
        config.port,
        config.transfer_mode,
        config.routing,
        config.max_inflight_per_prefill,
        list(config.prefill),
        list(config.decode),
    )
    web.run_app(
        app,
        host=config.host,
        port=config.port,
        handler_cancellation=True,  # client disconnect -> cancel legs upstream
        access_log=None,  # our own access log line is richer
        print=None,
        loop=_event_loop(args.event_loop),
    )


if __name__ == "__main__":
    main()
