"""The connector never imports the tools or the test harness; the tools never
import the harness.

Every module of ``vllm_pd_ext`` is parsed with ``ast`` (nothing is imported,
so a lazy import inside a function or under ``TYPE_CHECKING`` counts too) and
its imports are resolved to absolute module names, relative ones included.
The allowed direction is connector <- tools <- testing: the harness may use
the tools (``testing/engines.py`` re-exports ``tools/launch.py``), the
shipped ``vllm-pd-bench`` may not depend on a harness that needs a checkout.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "vllm_pd_ext"
TOOLS, TESTING = "vllm_pd_ext.tools", "vllm_pd_ext.testing"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``: ``import a.b``,
    ``from a import b`` (both ``a`` and ``a.b``, as ``b`` may be a module),
    relative imports, and ``importlib.import_module("a.b")`` with a literal."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name)
                       and node.func.id in ("import_module", "__import__")))):
            yield node.lineno, node.args[0].value


def inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def forbidden_for(module: str) -> tuple[str, ...]:
    """The packages ``module`` must not import."""
    if inside(module, TESTING):
        return ()
    if inside(module, TOOLS):
        return (TESTING,)
    return (TOOLS, TESTING)


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """One line per offending import statement, naming the module and the import."""
    banned = forbidden_for(module)
    first: dict[int, str] = {}
    for line, name in imports(source, module, is_package):
        if any(inside(name, b) for b in banned) and line not in first:
            first[line] = name  # ``from a import b``: ``a`` comes before ``a.b``
    return [f"{module} (line {line}) imports {name}" for line, name in sorted(first.items())]


def all_modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def test_the_scan_sees_the_package() -> None:
    names = {module_name(p) for p in all_modules()}
    # The three layers are all there: an empty scan would pass anything.
    assert {"vllm_pd_ext.connector", "vllm_pd_ext.tools.launch",
            "vllm_pd_ext.testing.engines"} <= names, sorted(names)


def test_connector_imports_neither_tools_nor_harness_and_tools_not_the_harness() -> None:
    found = [v for path in all_modules()
             for v in violations(path.read_text(), module_name(path),
                                 path.name == "__init__.py")]
    assert not found, ("the connector must not import vllm_pd_ext.tools or "
                       "vllm_pd_ext.testing, and the tools must not import the harness:\n"
                       + "\n".join(found))


def test_the_harness_does_use_the_tools() -> None:
    """The allowed direction is real (testing/engines.py re-exports the launcher),
    so the rule above is checked against a graph that has tool edges."""
    src = (PKG / "testing" / "engines.py").read_text()
    assert any(inside(name, "vllm_pd_ext.tools.launch")
               for _, name in imports(src, "vllm_pd_ext.testing.engines"))


@pytest.mark.parametrize(("module", "source", "is_package"), [
    ("vllm_pd_ext.scheduler.dispatcher",
     "from vllm_pd_ext.testing.engines import Engine\n", False),
    ("vllm_pd_ext.scheduler.dispatcher", "from ..testing import netns\n", False),
    ("vllm_pd_ext.wire", "from ..tools import sse\n", True),
    ("vllm_pd_ext.connector", "import vllm_pd_ext.tools.sse as s\n", False),
    ("vllm_pd_ext.connector", "from vllm_pd_ext import testing\n", False),
    ("vllm_pd_ext.stats",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from vllm_pd_ext.tools.launch import Engine\n", False),
    ("vllm_pd_ext.compat",
     "def f():\n    import importlib\n"
     "    return importlib.import_module('vllm_pd_ext.tools.slo')\n", False),
    ("vllm_pd_ext.tools.slo.deploy", "from vllm_pd_ext.testing.engines import Engine\n", False),
    ("vllm_pd_ext.tools.slo.deploy", "from ...testing import engines\n", False),
])
def test_each_form_of_a_forbidden_import_is_caught(module: str, source: str,
                                                    is_package: bool) -> None:
    found = violations(source, module, is_package)
    assert len(found) == 1 and found[0].startswith(f"{module} (line "), found


@pytest.mark.parametrize(("module", "source"), [
    ("vllm_pd_ext.testing.soak", "from vllm_pd_ext.tools.launch import Engine\n"),
    ("vllm_pd_ext.testing.soak", "from vllm_pd_ext.testing import netns\n"),
    ("vllm_pd_ext.tools.slo.deploy", "from vllm_pd_ext.tools.launch import Engine\n"),
    ("vllm_pd_ext.tools.slo.deploy", "from ..launch import Engine\n"),
    ("vllm_pd_ext.tools.sizing.measure", "from vllm_pd_ext.transport.base import XferState\n"),
    ("vllm_pd_ext.connector", "from vllm_pd_ext.toolsmith import x\nimport testing\n"),
])
def test_allowed_imports_pass(module: str, source: str) -> None:
    assert violations(source, module) == []
