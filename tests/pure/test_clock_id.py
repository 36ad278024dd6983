"""``specs.monotonic_clock_id``: which ``time.monotonic`` clock a process
reads, so that a time crosses from D's scheduler to a worker only where both
read the same one (a concurrent pull's ``RecvSpec.valid_until``)."""

from __future__ import annotations

import subprocess
import sys

from vllm_pd_ext.wire import specs


def test_processes_of_one_host_name_the_same_clock() -> None:
    here = specs.monotonic_clock_id()
    other = subprocess.run(
        [sys.executable, "-c", "from vllm_pd_ext.wire.specs import monotonic_clock_id as c; "
                               "print(c())"], capture_output=True, text=True, check=True)
    assert here and other.stdout.strip() == here
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        assert f.read().strip() == here


def test_no_boot_id_names_no_clock(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(specs, "_BOOT_ID", str(tmp_path / "missing"))
    specs.monotonic_clock_id.cache_clear()
    try:
        assert specs.monotonic_clock_id() == ""
    finally:
        specs.monotonic_clock_id.cache_clear()
