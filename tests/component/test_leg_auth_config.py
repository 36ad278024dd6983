"""Where the API server's leg check finds the secret, with vLLM's own parser (issue 27 item 4).

``LegAuthMiddleware`` used to read only ``--kv-transfer-config JSON`` from
argv: ``--kv_transfer_config``, the dotted keys or ``--config file.yaml``
turned it off without a word while the EngineCore had the secret. Here each
form is parsed by vLLM's ``vllm serve`` parser, and the middleware's
``resolve`` finds the secret in what vLLM parsed (the app state carries the
parsed args and config).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_pd_ext.config import extra_config_from_argv
from vllm_pd_ext.leg_auth import resolve
from vllm_pd_ext.wire import auth

SECRET = "s3cret-for-tests-0123456789"
KV = {"kv_connector": "PDConnector", "kv_role": "kv_producer",
      "kv_connector_extra_config": {"auth_secret_env": "PD_CFG_TEST_SECRET",
                                    "auth_window_s": 12}}


def forms(tmp_path: Any) -> dict[str, list[str]]:
    yaml = tmp_path / "serve.yaml"
    yaml.write_text(f"kv-transfer-config: '{json.dumps(KV)}'\n")
    return {
        "underscores": ["--kv_transfer_config", json.dumps(KV)],
        "dotted": ["--kv-transfer-config.kv_connector=PDConnector",
                   "--kv-transfer-config.kv_role=kv_producer",
                   "--kv-transfer-config.kv_connector_extra_config.auth_secret_env="
                   "PD_CFG_TEST_SECRET",
                   "--kv-transfer-config.kv_connector_extra_config.auth_window_s=12"],
        "config_file": ["--config", str(yaml)],
    }


@pytest.mark.parametrize("form", ["underscores", "dotted", "config_file"])
def test_every_command_line_form_gives_the_middleware_its_secret(
        form: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = forms(tmp_path)[form]
    assert extra_config_from_argv(["vllm", "serve", *argv]) is None  # what it used to read
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m", *argv])
    monkeypatch.setenv("PD_CFG_TEST_SECRET", SECRET)
    monkeypatch.setattr("sys.argv", ["vllm", "serve", *argv])
    for state in (SimpleNamespace(args=args),  # the parsed args
                  SimpleNamespace(vllm_config=SimpleNamespace(  # the engine's config
                      kv_transfer_config=args.kv_transfer_config))):
        keyring, window = resolve(SimpleNamespace(state=state), environ={})
        assert keyring is not None and window == 12
        assert keyring.signing_kid == auth.Keyring.parse(SECRET, "t").signing_kid
