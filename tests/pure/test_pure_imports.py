"""The pure modules import neither vLLM, torch nor NIXL.

Each module is imported alone in a fresh interpreter (``python -c``), so a
module that is pure only because the test process already loaded vLLM
cannot pass, and the failure names the module that pulled the import in.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PURE = [
    "leases.table",
    "leases.service",
    "leases.lender",
    "scheduler.legs",
    "scheduler.load_state",
    "scheduler.p_pull",
    "worker.peers",
    "wire.specs",
    "scheduler.pushbook",
    "scheduler.bidir",
    "scheduler.heartbeats",
    "transport.coalesce",
    "transport.tp_slices",
    "policy",
    "wire.protocol",
    "wire.auth",
    "wire.side_channel",
    "wire.outbox",
    "wire.wakeup",
    "wire.pump_bell",
    "config",
    "log",
    "tools.sizing.formula",
    "tools.sizing.cli",
    "leg_auth",
    "drain",
    "drain_auth",
    "testing.soak_plan",
    "testing.netns",
    "testing.gpu_check",
    "testing.gpu_report",
    "transport.ucx_env",
    "tools.sse",
    "tools.launch",
    "tools.slo.deploy",
]

CHECK = """
import sys
import vllm_pd_ext.{module}
tops = {{name.split(".")[0] for name in sys.modules}}
print(sorted(t for t in tops if t in ("vllm", "torch") or t.startswith("nixl")))
"""


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_no_vllm_torch_or_nixl(module: str) -> None:
    out = subprocess.run([sys.executable, "-c", CHECK.format(module=module)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"import vllm_pd_ext.{module} failed:\n{out.stderr}"
    assert out.stdout.strip() == "[]", (
        f"vllm_pd_ext.{module} imports {out.stdout.strip()} (keep it pure: import vLLM "
        "types under TYPE_CHECKING, or move the code to a module on the vLLM side)")
