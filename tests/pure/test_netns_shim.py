"""testing/netns.py without the UCX shim's source (a wheel install: the
shim is test-only and not package data) says which file is missing, both
where a test asks whether it can run engines and where an engine needs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_pd_ext.testing import netns


def test_the_shim_source_is_beside_netns_in_the_source_tree() -> None:
    assert Path(netns.__file__).with_name("ucx_linklocal.c") == netns.SHIM_SOURCE
    assert netns.SHIM_SOURCE.is_file()


def test_a_missing_shim_source_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = tmp_path / "ucx_linklocal.c"
    monkeypatch.setattr(netns, "SHIM_SOURCE", missing)
    with pytest.raises(FileNotFoundError, match="source checkout") as info:
        netns.linklocal_shim()
    assert str(missing) in str(info.value)
    # Namespaces usable, the shim not: the reason is the missing file, not a crash.
    monkeypatch.setattr(netns, "unavailable", lambda: None)
    reason = netns.engines_unavailable()
    assert reason is not None and str(missing) in reason and "not shipped" in reason


def test_the_shim_is_built_only_in_a_private_directory(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 27 item 8: the shim engines preload was built at a predictable
    temp path and reused whoever had put a file there."""
    import os

    monkeypatch.setattr(netns.tempfile, "gettempdir", lambda: str(tmp_path))
    mine = tmp_path / f"vllm-pd-ext-{os.getuid()}"
    assert netns.shim_dir() == mine and (mine.stat().st_mode & 0o777) == 0o700
    os.chmod(mine, 0o777)  # someone else may plant a library
    with pytest.raises(RuntimeError, match="not a private directory"):
        netns.shim_dir()
    os.rmdir(mine)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    mine.symlink_to(elsewhere)
    with pytest.raises(RuntimeError, match="a link"):
        netns.shim_dir()
