"""The soak's command line refuses what cannot run before any engine starts."""

from __future__ import annotations

import pytest

from vllm_pd_ext.testing import soak


@pytest.mark.parametrize(("argv", "named"), [
    (["--faults", "2"], "--faults 2: the chaos scenario fires each of its 6 fault classes"),
    (["--tp", "1,3"], "--tp 1,3: each size must be 1..2"),
    (["--tp", "2"], "--tp takes P,D"),
])
def test_bad_arguments_fail_before_any_engine_starts(monkeypatch, capsys, argv, named):
    def no_run(*_a, **_kw):  # pragma: no cover - reaching it is the failure
        raise AssertionError("the soak started")

    monkeypatch.setattr(soak, "run", no_run)
    with pytest.raises(SystemExit) as exit_:
        soak.main(argv)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err
