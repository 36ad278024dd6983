"""The console command, its documentation and the import boundary."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from pdproxy_helpers import parse_sse
from vllm_pd_proxy.cli import build_parser, config_from_args, main

from vllm_pd_ext.tools.ports import free_port

DOCS = Path(__file__).resolve().parents[2] / "docs" / "proxy.md"


def test_import_boundary():
    code = (
        "import sys, vllm_pd_proxy.app, vllm_pd_proxy.cli\n"
        "assert 'vllm_pd_proxy.forward' in sys.modules\n"
        "heavy = [m for m in ('vllm', 'torch', 'nixl', 'zmq') if m in sys.modules]\n"
        "print('heavy:', heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "heavy: []" in proc.stdout


def test_every_flag_is_documented():
    docs = DOCS.read_text()
    flags = [
        opt
        for action in build_parser()._actions
        for opt in action.option_strings
        if opt.startswith("--")
    ]
    assert len(flags) > 15
    missing = [f for f in flags if f"`{f}" not in docs]
    assert not missing, f"flags missing from docs/proxy.md: {missing}"


def test_parse_repeated_backends():
    args = build_parser().parse_args(
        [
            "--prefill",
            "http://127.0.0.1:8100",
            "--prefill",
            "127.0.0.1:8101",
            "--decode",
            "http://127.0.0.1:8200",
            "--transfer-mode",
            "push",
            "--routing",
            "round-robin",
            "--local-prefill-threshold",
            "256",
        ]
    )
    config = config_from_args(args)
    assert config.prefill == ("http://127.0.0.1:8100", "http://127.0.0.1:8101")
    assert config.transfer_mode == "push" and config.routing == "round-robin"
    assert config.local_prefill_threshold == 256


def test_bad_flags_exit_with_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "--prefill",
                "http://127.0.0.1:1",
                "--decode",
                "http://127.0.0.1:2",
                "--prefill-timeout",
                "0",
            ]
        )
    assert exc.value.code == 2
    assert "--prefill-timeout must be > 0" in capsys.readouterr().err


async def test_console_command_end_to_end(engines):
    p, d = await engines("prefill"), await engines("decode", chunks=["a", "b"])
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm_pd_proxy.cli",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefill",
        p.url,
        "--decode",
        d.url,
    ]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            async with asyncio.timeout(20):
                while True:  # bounded by the timeout above
                    try:
                        async with session.get(base + "/health") as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientConnectionError:
                        pass
                    await asyncio.sleep(0.1)
            body = {"prompt": "hi", "stream": True}
            async with session.post(base + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                events = parse_sse(await resp.read())
        assert [e["choices"][0]["text"] for e in events[:-1]] == ["a", "b"]
        # The default --local-prefill-threshold (docs/slo.md): a 2-char prompt is
        # prefilled on D; nothing goes to P.
        assert p.legs() == [] and len(d.legs()) == 1
    finally:
        proc.terminate()  # only the process this test started
        _, err = await asyncio.wait_for(proc.communicate(), 15)
    log = err.decode()
    assert "request_id=" in log and "mode=pull" in log and f"decode={d.url}" in log
    assert "ttft_ms=" in log and "status=200" in log
