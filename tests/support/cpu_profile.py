"""Profiling only (never in CI): whose CPU the suite spends.

A pytest plugin that puts every engine and proxy the harness starts, and
each pytest process, in a ``cpuacct`` cgroup of its own under
``/sys/fs/cgroup/cpuacct/pdprof`` (cgroup v1, root). A cgroup keeps the
CPU time of processes that already exited, which ``ps`` and ``time`` lose
for engines killed by signal. How docs/testing.md's "Where the CPU goes"
was measured:

    sudo mkdir -p /sys/fs/cgroup/cpuacct/pdprof
    PYTHONPATH=tests/support PYTEST_ADDOPTS="-p cpu_profile" .ci/run
    python tests/support/cpu_profile.py        # CPU seconds per cgroup

Names are ``<worker>-eng-<log folder>-<engine>``; remove the cgroups
(``rmdir``) before the next run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path("/sys/fs/cgroup/cpuacct/pdprof")
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")


def _put(name: str, pid: int) -> None:
    group = ROOT / name.replace("/", "_")
    try:
        group.mkdir(parents=True, exist_ok=True)
        (group / "cgroup.procs").write_text(str(pid))
    except OSError as exc:  # not root, or no cgroup v1 cpuacct: say so once
        print(f"cpu_profile: cannot use {group}: {exc}", file=sys.stderr)


def pytest_configure(config: Any) -> None:
    from vllm_pd_ext.tools import launch

    _put(f"pytest-{WORKER}", os.getpid())
    for cls, kind in ((launch.Engine, "eng"), (launch.Proxy, "proxy")):
        start = cls.start

        def wrapped(self: Any, *args: Any, _start: Any = start, _kind: str = kind,
                    **kwargs: Any) -> Any:
            out = _start(self, *args, **kwargs)
            if self.proc is not None:
                name = getattr(self, "name", "proxy")
                _put(f"{WORKER}-{_kind}-{Path(self.log_dir).name}-{name}", self.proc.pid)
            return out

        cls.start = wrapped  # type: ignore[method-assign]


def report() -> list[tuple[float, str]]:
    rows = [(int((g / "cpuacct.usage").read_text()) / 1e9, g.name)
            for g in ROOT.iterdir() if g.is_dir()]
    return sorted(rows, reverse=True)


if __name__ == "__main__":
    rows = report()
    for seconds, name in rows:
        print(f"{seconds:8.1f}  {name}")
    print(f"{sum(s for s, _ in rows):8.1f}  total")
