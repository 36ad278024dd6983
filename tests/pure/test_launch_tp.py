"""The launcher's tensor-parallel engines (tools/launch.py, issue 26 item 5):
``--tensor-parallel-size``, one core set per rank in
``VLLM_CPU_OMP_THREADS_BIND``, and taskset given the ranks' cores together."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_pd_ext.tools.launch import Engine


def test_tp2_engine_command_and_environment(tmp_path: Path) -> None:
    e = Engine("p", "m", tmp_path, port=1, side_channel_port=2, cpu_bind="0|1", tp_size=2,
               taskset=True)
    cmd = e.command()
    assert cmd[:3] == ["taskset", "-c", "0,1"]
    i = cmd.index("--tensor-parallel-size")
    assert cmd[i + 1] == "2"
    assert e.environment({})["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"


def test_tp1_engine_has_no_tp_flag(tmp_path: Path) -> None:
    e = Engine("p", "m", tmp_path, port=1, side_channel_port=2, cpu_bind="0")
    assert "--tensor-parallel-size" not in e.command()


@pytest.mark.parametrize("bind", [None, "0-1", "0|1|2"])
def test_tp2_on_cpu_needs_one_core_set_per_rank(tmp_path: Path, bind: str | None) -> None:
    with pytest.raises(ValueError, match="one core set per rank"):
        Engine("p", "m", tmp_path, port=1, side_channel_port=2, cpu_bind=bind, tp_size=2)


def test_tp_size_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        Engine("p", "m", tmp_path, port=1, side_channel_port=2, tp_size=0)


def test_a_new_process_keeps_the_previous_log_of_its_name(tmp_path) -> None:
    """An engine or proxy started again under one name keeps the earlier
    run's log (a failure's evidence) as ``<name>.<n>.log``."""
    from vllm_pd_ext.tools.launch import keep_previous_log

    log = tmp_path / "d-push.log"
    assert keep_previous_log(log) is None
    log.write_text("first run")
    assert keep_previous_log(log) == tmp_path / "d-push.1.log"
    log.write_text("second run")
    assert keep_previous_log(log) == tmp_path / "d-push.2.log"
    assert not log.exists()
    assert (tmp_path / "d-push.1.log").read_text() == "first run"
    assert (tmp_path / "d-push.2.log").read_text() == "second run"
