"""``compat`` is the only door to vLLM: no other module of the package imports it.

Every ``import vllm...`` / ``from vllm... import`` anywhere in a module (at
the top, inside a function, under ``TYPE_CHECKING``) counts, so a new
dependency on a vLLM internal cannot slip in beside the patch table
(``compat/patches.py``). Tools and the test harness are held to the same
rule: they drive vLLM over HTTP.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "vllm_pd_ext"
DOOR = SRC / "compat"


def vllm_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "vllm"]
        elif (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
              and node.module.split(".")[0] == "vllm"):
            found.append(node.module)
    return found


MODULES = sorted(p for p in SRC.rglob("*.py") if DOOR not in p.parents)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_only_compat_imports_vllm(path: Path) -> None:
    found = vllm_imports(path)
    assert not found, (f"vllm_pd_ext/{path.relative_to(SRC)} imports {found}: reach vLLM "
                       "through vllm_pd_ext.compat (and a patch of its internals through "
                       "compat/patches.py)")


def test_the_check_sees_imports_anywhere(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from vllm.config import VllmConfig\n"
                      "def f():\n    import vllm.envs as e\n    return e\n")
    assert vllm_imports(sample) == ["vllm.config", "vllm.envs"]


def test_compat_is_where_the_imports_are() -> None:
    assert any(vllm_imports(p) for p in DOOR.rglob("*.py"))
