"""The GPU check's dry run (``python -m vllm_pd_ext.testing.gpu_check --dry-run``):
the plan it would run on GPUs and the judge of its report, with no GPU.

It builds the 2-layer ``gpu-dry`` model once (``.models/gpu-dry``, seconds;
then reused) and starts no engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vllm_pd_ext import STEP_TRACE_ENV
from vllm_pd_ext.testing import gpu_check
from vllm_pd_ext.testing import gpu_report as gr
from vllm_pd_ext.tools.launch import Engine

CPU_ONLY = ("--kv-cache-memory-bytes", "kv_buffer_device", "taskset")


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same plan on any machine: the dry run's two stand-in GPUs."""
    monkeypatch.setattr(gpu_check, "detect_gpus", lambda: [])


def dry(tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any], dict[str, Any]]:
    rc = gpu_check.main(["--dry-run", "--work-dir", str(tmp_path), *extra])
    plan = json.loads((tmp_path / "plan.json").read_text())
    report = json.loads((tmp_path / "report.json").read_text())
    return rc, plan, report


def engines(plan: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {"ref": plan["ref"]}
    for mode, pair in plan["modes"].items():
        out[f"p-{mode}"], out[f"d-{mode}"] = pair["p"], pair["d"]
    return out


def test_two_gpus_plan_and_a_passing_report(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc, plan, report = dry(tmp_path)
    assert rc == 0 and report["verdict"] == "PASS" and report["exit_code"] == 0
    assert plan["prompts"] == [1000, 8000, 32000]
    all_engines = engines(plan)
    assert set(all_engines) == {"ref", "p-pull", "d-pull", "p-push", "d-push"}
    for name, e in all_engines.items():
        cmd, env = e["command"], e["env"]
        assert not [f for f in CPU_ONLY if f in cmd], f"{name}: CPU-only flag in {cmd}"
        assert "VLLM_CPU_OMP_THREADS_BIND" not in env, name
        assert "--gpu-memory-utilization 0.45" in cmd and "--block-size 16" in cmd
        assert "--max-model-len 33024" in cmd
        assert "cuda_ipc" in env["UCX_TLS"] and "cuda_copy" in env["UCX_TLS"]
        assert env["UCX_NET_DEVICES"] and env["UCX_LOG_LEVEL"] == "info"
        # The two GPUs: D alone on the second, P and the reference on the first.
        assert env["CUDA_VISIBLE_DEVICES"] == ("1" if name.startswith("d-") else "0"), name
    assert "--kv-transfer-config" not in all_engines["ref"]["command"]
    for mode in ("pull", "push"):
        assert f'"transfer_mode": "{mode}"' in all_engines[f"p-{mode}"]["command"]
        assert f'"transfer_mode": "{mode}"' in all_engines[f"d-{mode}"]["command"]
        assert '"kv_role": "kv_producer"' in all_engines[f"p-{mode}"]["command"]
        assert '"kv_role": "kv_consumer"' in all_engines[f"d-{mode}"]["command"]
    assert plan["modes"]["push"]["proxy_args"] == ["--transfer-mode", "push"]
    # The model: real head shape, reduced depth.
    assert "'kv_heads': 8, 'head_dim': 128" in report["meta"]["model"]
    assert "'layers': 2" in report["meta"]["model"]
    out = capsys.readouterr().out
    assert "| pull | 32000 |" in out and "# GPU check: PASS" in out
    assert (tmp_path / "report.md").read_text() in out
    # The step-phase trace is opt-in (--step-trace).
    assert all(STEP_TRACE_ENV not in e["env"] for e in all_engines.values())
    assert report["steps"] == {}
    assert "Where a step's time goes" not in out


def test_step_trace_traces_the_reference_and_each_d(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rc, plan, report = dry(tmp_path, "--step-trace")
    assert rc == 0
    for name, e in engines(plan).items():
        want = None if name.startswith("p-") else str(tmp_path / "steps" / name)
        assert e["env"].get(STEP_TRACE_ENV) == want, name
    assert report["steps"] == {n: "not run (dry run)" for n in ("ref", "d-pull", "d-push")}
    out = capsys.readouterr().out
    assert "## Where a step's time goes (medians, ms)" in out
    assert "- d-push: not run (dry run)" in out


def test_the_step_section_puts_each_traced_engine_split_in_the_report() -> None:
    rows = {"first, 1 token": {"steps": 3, "forward": 4.5, "step": 9.25, "admit": None}}
    text = gr.render_steps({"ref": "no trace (no worker events)", "d-push": (rows, "pids")})
    assert "- ref: no trace (no worker events)" in text
    assert "d-push (pids):" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("| first, 1 token"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    header = [c.strip() for c in next(
        ln for ln in text.splitlines() if ln.startswith("| step |")).strip("|").split("|")]
    got = dict(zip(header, cells, strict=True))
    assert (got["steps"], got["forward"], got["step"], got["admit"]) == ("3", "4.50", "9.25", "")
    assert gr.render_steps({}) == ""


def test_one_gpu_plan_shares_it_and_clips_prompts(tmp_path: Path) -> None:
    rc, plan, _ = dry(tmp_path, "--gpus", "0", "--max-model-len", "4096", "--modes", "push")
    assert rc == 0
    assert plan["prompts"] == [1000, 4096 - 16]
    assert set(plan["modes"]) == {"push"}
    for name, e in engines(plan).items():
        assert e["env"]["CUDA_VISIBLE_DEVICES"] == "0", name
        assert "--gpu-memory-utilization 0.28" in e["command"], name
    assert plan["layout"].startswith("one GPU")


def test_a_failing_result_set_exits_non_zero(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, report = dry(tmp_path, "--synthetic", "fail")
    assert rc == 1 and report["verdict"] == "FAIL"
    verdicts = {(c["mode"], c["prompt_tokens"]): c for c in report["cases"]}
    first, last = verdicts[("pull", 1000)], verdicts[("push", 32000)]
    assert {c["name"]: c["verdict"] for c in first["checks"]}["equal"] == "FAIL"
    assert {c["name"]: c["verdict"] for c in last["checks"]}["kv moved"] == "FAIL"
    assert verdicts[("pull", 8000)]["verdict"] == "PASS"
    transport = [c for c in report["run_checks"] if c["name"].startswith("transport")]
    assert transport and all(c["verdict"] == "WARN" and "over tcp" in c["detail"]
                             for c in transport)
    out = capsys.readouterr().out
    assert "# GPU check: FAIL" in out and "!!! VRAM went over tcp" in out


def test_strict_transport_makes_tcp_a_failure(tmp_path: Path) -> None:
    rc, _, report = dry(tmp_path, "--synthetic", "fail", "--strict-transport")
    assert rc == 1
    assert {c["verdict"] for c in report["run_checks"]} == {"FAIL"}


def test_no_gpu_without_dry_run_is_exit_2(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--work-dir", str(tmp_path)]) == 2
    assert "no NVIDIA GPU found" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing built, planned or started


def test_cpu_engine_command_is_unchanged(tmp_path: Path) -> None:
    e = Engine("p", "m", tmp_path, port=1, side_channel_port=2, cpu_bind="0-1")
    assert e.command()[3:22] == [
        "--model", "m", "--host", "127.0.0.1", "--port", "1", "--max-model-len", "2048",
        "--enforce-eager", "--dtype", "bfloat16", "--kv-cache-memory-bytes", str(256 << 20),
        "--max-num-seqs", "32", "--middleware", "vllm_pd_ext.drain.DrainMiddleware",
        "--middleware", "vllm_pd_ext.leg_auth.LegAuthMiddleware"]
    assert e.environment(base={})["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    plain = Engine("x", "m", tmp_path, connector="SomeConnector", port=1)
    assert '"kv_buffer_device": "cpu"' in " ".join(plain.command())
    gpu = Engine("x", "m", tmp_path, connector="SomeConnector", port=1, device="cuda",
                 cpu_bind="0-1", taskset=True, cuda_devices="1")
    assert '"kv_buffer_device": "cuda"' in " ".join(gpu.command())
    assert gpu.command()[0] != "taskset"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in gpu.environment(base={})
    assert gpu.environment(base={})["CUDA_VISIBLE_DEVICES"] == "1"
    with pytest.raises(ValueError):
        Engine("x", "m", tmp_path, device="tpu")


def test_ucx_transports_from_info_lines() -> None:
    log = "\n".join([
        "[1.2] [h:10:0] ucp_worker.c:1890 UCX  INFO  ep_cfg[1]: tag(tcp/lo); "
        "rma(cuda_ipc/cuda tcp/lo) am(cuda_copy/cuda)",
        "(EngineCore pid=3) INFO tcp/lo is not a transport line without UCX",
        "|    rdma_get zcopy | rc_mlx5/mlx5_0:1 |",
    ])
    assert gr.ucx_transports(log) == {"cuda_copy": ["cuda"], "cuda_ipc": ["cuda"],
                                      "rc_mlx5": ["mlx5_0:1"], "tcp": ["lo"]}
    assert gr.judge_transport("pull", {"tcp": ["lo"]}, strict=False).verdict == gr.WARN
    assert gr.judge_transport("pull", {}, strict=True).verdict == gr.FAIL
    assert gr.judge_transport("pull", {"rc_mlx5": ["mlx5_0:1"]}, False).verdict == gr.PASS


def test_handoff_against_the_floor() -> None:
    def case(ms: float) -> gr.Case:
        return gr.Case("pull", 100, status=200, same=True, oracle="same", external_tokens=100,
                       kv_bytes=10, expected_kv_bytes=10, handoff_ms=ms, floor_ms=1.0)
    by = {ms: {c.name: c.verdict for c in gr.judge_case(case(ms)).checks}["handoff"]
          for ms in (0.5, 3.0, 50.0)}
    assert by == {0.5: gr.WARN, 3.0: gr.PASS, 50.0: gr.WARN}
    assert gr.judge([], {}, {}).exit_code == 1  # nothing ran: a failure


def test_handoff_of_a_record_takes_the_pin_beside_the_read_once() -> None:
    from vllm_pd_ext.testing.gpu_check import handoff_ms_of

    rec = {"pin_ms": 1.5, "read_ms": 4.0}
    assert handoff_ms_of(rec, "pull") == 5.5  # in turn (records before issue 29)
    assert handoff_ms_of(dict(rec, pin_with_read=True), "pull") == 4.0
    assert handoff_ms_of({"write_wait_ms": 2.5, "pin_ms": 9.0}, "push") == 2.5
