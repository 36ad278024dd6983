"""``vllm serve --api-server-count N``: the parent's SIGTERM drains (issue 27, item 6).

vLLM's parent of several API servers gives its children ``shutdown_timeout``
seconds on SIGTERM and then kills them, API servers and EngineCores alike;
with vLLM's default 0 that was at once. The plugin hook (``register``), which
vLLM calls in that parent while it builds its parser, wraps
``run_multi_api_server`` so that a ``vllm serve`` with our connector and the
drain middleware gets ``drain_timeout`` there. Parsed with vLLM's own parser;
``run_multi_api_server`` itself is replaced by a recorder (it would start
the engines).
"""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any

import pytest
import vllm.entrypoints.cli.serve as serve
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

import vllm_pd_ext
from vllm_pd_ext.compat import patches, serve_parent

DRAIN = "vllm_pd_ext.drain.DrainMiddleware"


def parse(*extra: str, drain_timeout: float | None = 45, connector: str = "PDConnector"
          ) -> argparse.Namespace:
    kv: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_producer"}
    if drain_timeout is not None:
        kv["kv_connector_extra_config"] = {"drain_timeout": drain_timeout}
    parser = make_arg_parser(FlexibleArgumentParser())
    return parser.parse_args(["--model", "m", "--api-server-count", "2",
                              "--kv-transfer-config", json.dumps(kv), *extra])


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``run_multi_api_server`` replaced by a recorder of the shutdown_timeout
    it was called with (the window its SIGTERM handler gives), and the
    process's patches not yet applied."""
    seen: list[int] = []

    # Wrapping vLLM's function, so that the patch's probe reads vLLM's source.
    @functools.wraps(serve.run_multi_api_server)
    def run_multi_api_server(args: argparse.Namespace) -> None:
        seen.append(args.shutdown_timeout)

    # ``wraps`` copies the attributes of what it wraps: if an earlier test in
    # this process registered the plugin, that is our wrapper, marked wrapped.
    vars(run_multi_api_server).pop("_pd_ext_drain", None)

    monkeypatch.setattr(serve, "run_multi_api_server", run_multi_api_server)
    monkeypatch.setattr(patches, "_once", {})
    return seen


def test_register_in_the_serve_parent_gives_its_sigterm_the_drain_window(
        recorded: list[int]) -> None:
    assert serve_parent.is_serve_parent()  # the CLI module is loaded, no mp parent
    vllm_pd_ext.register()  # what vLLM's load_general_plugins calls in `vllm serve`
    # ServeSubcommand.cmd calls the module's run_multi_api_server: now ours.
    serve.run_multi_api_server(parse("--middleware", DRAIN))
    assert recorded == [45]


def test_window_only_for_our_drain_and_never_over_the_users(recorded: list[int]) -> None:
    serve_parent.serve_with_drain_window()
    assert not serve_parent.serve_with_drain_window()  # wrapped once
    serve.run_multi_api_server(parse("--middleware", DRAIN, drain_timeout=None))
    serve.run_multi_api_server(parse("--middleware", DRAIN, "--shutdown-timeout", "7"))
    serve.run_multi_api_server(parse())  # no drain middleware: vLLM's default
    serve.run_multi_api_server(parse("--middleware", DRAIN, drain_timeout=0))
    serve.run_multi_api_server(parse("--middleware", DRAIN, connector="NixlConnector"))
    assert recorded == [120, 7, 0, 0, 0]
