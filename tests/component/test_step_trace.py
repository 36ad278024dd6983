"""``compat/step_trace.py`` against the installed vLLM, in a child process
(the wrapping is process-wide; this test's own vLLM classes stay as they
are). A real engine's trace: ``tests/e2e/test_push.py::
test_step_trace_splits_d_first_step_after_the_load``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from vllm_pd_ext import QUIET_SPIN_ENV, STEP_TRACE_ENV

CHILD = r"""
import json, os, sys
from vllm_pd_ext.compat import patches
outcomes = patches.apply_once(patches.Process.PLUGIN)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

class Out:
    num_scheduled_tokens = {"r1": 1}
    scheduled_new_reqs = []

try:  # a bogus self: vLLM's code raises, the trace still has both edges
    GPUModelRunner.execute_model(object(), Out())
except Exception as exc:
    raised = type(exc).__name__
else:
    raised = None
print(json.dumps({
    "outcomes": {o.name: o.status for o in outcomes},
    "wrapped": hasattr(Scheduler.schedule, "__wrapped__")
               and hasattr(GPUModelRunner._model_forward, "__wrapped__"),
    # Every probe still reads vLLM's code through the wrappers.
    "moved": {k: v for k, v in patches.probe_all().items() if v},
    "raised": raised,
    "again": patches.step_trace.install(os.environ["VLLM_PD_EXT_STEP_TRACE"]),
}))
"""


def run_child(env_extra: dict[str, str], script: str = CHILD) -> dict[str, object]:
    import os

    env = {k: v for k, v in os.environ.items() if k not in (STEP_TRACE_ENV, QUIET_SPIN_ENV)}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_install_wraps_vllm_step_methods_and_writes_both_edges(tmp_path: Path) -> None:
    got = run_child({STEP_TRACE_ENV: str(tmp_path)})
    assert got["outcomes"] == {"quiet_shm_spin_everywhere": "skipped", "step_trace": "applied"}
    assert got["wrapped"] is True
    assert got["moved"] == {}
    assert got["raised"] is not None
    assert got["again"] == ["schedule", "update", "execute", "admit", "prepare", "forward",
                            "sample"]
    (log,) = tmp_path.glob("steps-*.log")
    lines = log.read_text().splitlines()
    assert [ln.split(" ", 4)[2:4] for ln in lines] == [["execute", "B"], ["execute", "E"]]
    assert json.loads(lines[0].split(" ", 4)[4]) == {"new": [], "tokens": {"r1": 1}}


def test_without_the_variable_nothing_is_wrapped_or_written(tmp_path: Path) -> None:
    # The child's last call installs by hand; everything before it ran unwrapped.
    script = CHILD.replace('os.environ["VLLM_PD_EXT_STEP_TRACE"]', repr(str(tmp_path)))
    got = run_child({}, script)
    assert got["outcomes"] == {"quiet_shm_spin_everywhere": "skipped", "step_trace": "skipped"}
    assert got["wrapped"] is False
    assert list(tmp_path.glob("steps-*.log")) == []
