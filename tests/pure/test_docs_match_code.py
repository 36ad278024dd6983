"""The docs state facts the code decides: check that they still agree.

Cheap (reads the Markdown files under docs/, imports only pure modules and
the proxy's metrics module; no vLLM, torch or NIXL: what needs vLLM, such as
stats.py, is read as source). Each check names what drifted and where.
The proxy's CLI flags are checked against docs/proxy.md by
tests/proxy/test_cli.py::test_every_flag_is_documented.
"""

from __future__ import annotations

import ast
import enum
import json
import re
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from vllm_pd_ext.config import MIN_LEASE_S, NIXL_BACKENDS, TRANSFER_MODES, ConfigError, PDConfig
from vllm_pd_ext.transport import base as transport_base
from vllm_pd_ext.wire import protocol

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
SRC = REPO / "vllm_pd_ext"
PROXY = REPO / "proxy" / "vllm_pd_proxy"
KEY_TABLE_HEADER = "| Key | Type | Default | Accepted values | Meaning |"


def _read(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _cells(row: str) -> list[str]:
    """Cells of one Markdown table row (no escaped pipes in these tables)."""
    return [c.strip() for c in row.strip().strip("|").split("|")]


def _key_table() -> dict[str, list[str]]:
    """docs/configuration.md's ``kv_connector_extra_config`` table: key -> cells."""
    lines = _read("configuration.md").splitlines()
    assert KEY_TABLE_HEADER in lines, f"configuration.md lost its key table ({KEY_TABLE_HEADER})"
    start = lines.index(KEY_TABLE_HEADER) + 2  # skip the | --- | row
    rows: dict[str, list[str]] = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        m = re.fullmatch(r"`([a-z_]+)`", cells[0])
        assert m, f"configuration.md key table: first cell {cells[0]!r} is not a `key`"
        assert m.group(1) not in rows, f"configuration.md documents {m.group(1)} twice"
        rows[m.group(1)] = cells
    return rows


def _code_defaults() -> dict[str, object]:
    return {
        f.name: f.default
        for f in fields(PDConfig)
        if not f.name.startswith("_") and f.default is not MISSING
    }


def _doc_type(hint: object) -> str:
    """The word the Type column uses for a PDConfig field's annotation."""
    if isinstance(hint, types.UnionType):  # float | None: documented as its value type
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        return "list"
    if isinstance(hint, type) and issubclass(hint, enum.StrEnum):
        return "string"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}[hint]


# ----------------------------------------------------------- configuration.md
def test_every_config_key_is_documented_and_every_documented_key_exists():
    code = PDConfig.keys()
    documented = list(_key_table())
    assert sorted(code) == sorted(set(code)), "PDConfig.keys() has duplicates"
    missing = [k for k in code if k not in documented]
    unknown = [k for k in documented if k not in code]
    assert not missing, (
        f"keys accepted by vllm_pd_ext/config.py but not in docs/configuration.md: {missing}")
    assert not unknown, f"keys in docs/configuration.md that config.py rejects: {unknown}"
    # Each documented key is really accepted (the validators, not only the fields).
    for key, value in _code_defaults().items():
        if value is not None:
            PDConfig.from_extra_config({key: list(value) if isinstance(value, tuple) else value})


def test_documented_defaults_and_types_match_the_code():
    table = _key_table()
    hints = typing.get_type_hints(PDConfig)
    for key, default in _code_defaults().items():
        _, typ, doc_default, _, _ = table[key]
        assert typ.startswith(_doc_type(hints[key])), (
            f"docs/configuration.md: {key} has type {typ!r}, code: {hints[key]}")
        if default is None:
            assert "omitted" in doc_default, (
                f"docs/configuration.md: {key} defaults to None in the code (key omitted), "
                f"docs say {doc_default!r}")
            continue
        m = re.search(r"`([^`]+)`", doc_default)
        assert m, f"docs/configuration.md: no `value` in the Default cell of {key}"
        documented = json.loads(m.group(1))
        expected = list(default) if isinstance(default, tuple) else default
        if isinstance(expected, enum.StrEnum):
            expected = expected.value  # JSON has its value
        assert documented == expected and type(documented) is type(expected), (
            f"docs/configuration.md: {key} defaults to {m.group(1)}, code: {expected!r}")


def test_documented_accepted_values_match_the_code():
    table = _key_table()
    modes = set(re.findall(r'`"([a-z]+)"`', table["transfer_mode"][3]))
    assert modes == set(TRANSFER_MODES), (
        f"docs/configuration.md: transfer_mode accepts {sorted(modes)}, code: {TRANSFER_MODES}")
    backends = set(re.findall(r"`([A-Z_]+)`", table["nixl_backends"][3]))
    assert backends == set(NIXL_BACKENDS), (
        f"docs/configuration.md: nixl_backends {sorted(backends)}, code: {NIXL_BACKENDS}")
    assert f">= {MIN_LEASE_S:g}" in table["lease_duration"][3], (
        f"docs/configuration.md: lease_duration's minimum is {MIN_LEASE_S:g} in the code")


@pytest.mark.parametrize("extra", [
    {"lease": 1},
    {"transfer_mode": "shove"},
    {"lease_duration": -1},
    {"lease_duration": 1.0},
    {"heartbeat_interval": 40.0},
], ids=lambda e: next(iter(e)))
def test_documented_config_errors_are_the_real_messages(extra):
    with pytest.raises(ConfigError) as exc:
        PDConfig.from_extra_config(extra)
    line = f"ConfigError: {exc.value}"
    assert line in _read("configuration.md"), f"docs/configuration.md does not show: {line}"


# ------------------------------------------------------------ architecture.md
def test_protocol_version_in_architecture_md():
    stated = re.findall(r"PROTOCOL_VERSION = (\d+)", _read("architecture.md"))
    assert stated, "docs/architecture.md no longer states `PROTOCOL_VERSION = N`"
    assert set(stated) == {str(protocol.PROTOCOL_VERSION)}, (
        f"docs/architecture.md says PROTOCOL_VERSION = {stated}, "
        f"vllm_pd_ext.wire.protocol has {protocol.PROTOCOL_VERSION}")


def test_every_transfer_mode_is_documented():
    from vllm_pd_proxy.config import TRANSFER_MODES as PROXY_MODES  # light: no aiohttp

    assert tuple(protocol.TRANSFER_MODES) == TRANSFER_MODES == tuple(PROXY_MODES)
    for doc in ("architecture.md", "configuration.md"):
        text = _read(doc)
        missing = [m for m in TRANSFER_MODES if f'`"{m}"`' not in text and f"`{m}`" not in text]
        assert not missing, f"docs/{doc} does not mention transfer mode(s) {missing}"


def _thread_names_in_code() -> set[str]:
    """Literal names of every thread, pool and outbox the connector starts."""
    pattern = re.compile(
        r'(?:threading\.Thread|Outbox)\([^)]*?name="([^"]+)"|thread_name_prefix="([^"]+)"',
        re.S)
    names = set()
    for path in SRC.rglob("*.py"):
        if "testing" in path.parts:
            continue
        for m in pattern.finditer(path.read_text(encoding="utf-8")):
            names.add(m.group(1) or m.group(2))
    return names


def test_every_thread_is_in_architecture_md():
    names = _thread_names_in_code()
    assert {"pd-side-channel", "pd-heartbeats", "pd-nixl-progress", "pd-push"} <= names, names
    text = _read("architecture.md")
    start = text.index("### Threads")
    threads = text[start:text.index("\n## ", start)]
    # A pool's threads are documented as `name_0`, an outbox's lanes as `name-<port>`.
    missing = sorted(
        n for n in names if not re.search(rf"`{re.escape(n)}(?:_0|-<port>)?`", threads))
    assert not missing, f"threads missing from docs/architecture.md#threads: {missing}"


# ------------------------------------------------------------ transport/base.py
def test_transport_contract_names_every_method():
    doc = transport_base.__doc__ or ""
    methods = set(transport_base.Transport.__abstractmethods__) | {"start_progress_pump"}
    missing = sorted(m for m in methods if f"``{m}(" not in doc)
    assert not missing, f"vllm_pd_ext/transport/base.py's Contract does not cover {missing}"


# ------------------------------------------------------- architecture.md: the map
def _map_paths() -> list[str]:
    """The paths drawn in docs/architecture.md#the-map, rebuilt from the tree."""
    text = _read("architecture.md")
    start = text.index("## The map")
    block = text[text.index("```\n", start) + 4:]
    block = block[:block.index("```")]
    lines = block.splitlines()
    assert lines[0].strip() == "vllm_pd_ext/", f"the map starts with {lines[0]!r}"
    paths, stack = [], ["vllm_pd_ext"]
    for line in lines[1:]:
        m = re.match(r"([│├└─ ]*)([\w.]+/?)", line)
        assert m and m.group(2), f"docs/architecture.md map: cannot read {line!r}"
        depth = len(m.group(1)) // 3  # each level is 3 characters of tree
        name = m.group(2).rstrip("/")
        del stack[depth:]
        paths.append("/".join([*stack, name]))
        if m.group(2).endswith("/"):
            stack.append(name)
    return paths


def test_the_map_lists_every_module_and_nothing_else():
    drawn = _map_paths()
    assert len(drawn) == len(set(drawn)), "docs/architecture.md map lists a path twice"
    files = {p for p in SRC.rglob("*") if p.suffix in (".py", ".c")
             and "__pycache__" not in p.parts}
    real = {str(p.relative_to(REPO)) for p in files}
    real |= {str(p.parent.relative_to(REPO)) for p in files if p.parent != SRC}
    missing = sorted(real - set(drawn))
    unknown = sorted(set(drawn) - real)
    assert not missing, f"modules missing from docs/architecture.md#the-map: {missing}"
    assert not unknown, f"docs/architecture.md#the-map names what does not exist: {unknown}"


# Paths the docs quote from other projects (vLLM, UCX), not from this repository.
UPSTREAM_PATHS = {
    "shm_broadcast.py",
    "src/ucs/sys/sock.c",
    "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py",
    "examples/disaggregated/disaggregated_serving/disagg_proxy_multiturn.py",
    "vllm/v1/worker/gpu/kv_connector.py",
    "kv_connector_model_runner_mixin.py",
    "vllm/v1/attention/backends/cpu_attn.py",
}


def test_every_file_path_in_the_docs_exists():
    """A `path.py` (or `.c`) in any doc but the changelog, which records history."""
    ours = (SRC, PROXY.parent, REPO / "tests", REPO / "benchmarks", REPO / "examples")
    names = {p.name for d in ours for p in d.rglob("*") if p.suffix in (".py", ".c")}
    missing = []
    for doc in [*sorted(DOCS.glob("*.md")), REPO / "README.md"]:
        if doc.name == "changelog.md":
            continue
        for code in re.findall(r"`([^`\n]+)`", doc.read_text(encoding="utf-8")):
            for path in re.findall(r"([\w./-]+\.(?:py|c))\b", code):
                path = path.removeprefix("./")
                if path in UPSTREAM_PATHS:
                    continue
                bases = (REPO, SRC, PROXY)
                if any((base / path).is_file() for base in bases):
                    continue
                if "/" not in path and path in names:
                    continue
                missing.append(f"{doc.name}: {path}")
    assert not missing, f"the docs name files that do not exist: {sorted(set(missing))}"


# ------------------------------------------------------------------ metrics.md
def _section(doc: str, heading: str) -> str:
    text = _read(doc)
    start = text.index(heading)
    level = heading.split(" ")[0]
    ends = [i for i in (text.find(f"\n{h} ", start + len(heading))
                        for h in ("#" * n for n in range(1, len(level) + 1))) if i >= 0]
    return text[start:min(ends, default=len(text))]


def _table(text: str) -> dict[str, list[str]]:
    """A section's Markdown table rows: the first cell's `name` -> cells."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = _cells(line)
            m = re.fullmatch(r"`([^`]+)`", cells[0])
            assert m, f"first cell {cells[0]!r} is not one `name`"
            rows[m.group(1)] = cells
    return rows


def _connector_series() -> dict[str, tuple[str, str]]:
    """Every series PDPromMetrics registers: exposed name -> (type, PDStats key).

    Read from stats.py's source: importing it needs vLLM. Counters are
    exposed with ``_total``.
    """
    tree = ast.parse((SRC / "stats.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PDPromMetrics")
    def kind(node: ast.AST) -> str | None:
        """"counter" or "histogram" for a call of PDPromMetrics' local helpers."""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            return node.func.id if node.func.id in ("counter", "histogram") else None
        return None

    keyed = {}  # the helper call -> the PDStats key its dict entry names
    for node in ast.walk(cls):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if kind(value):
                    assert isinstance(key, ast.Constant), ast.dump(node)
                    keyed[value] = key.value
    series = {}
    for node in ast.walk(cls):
        if (what := kind(node)) is None:
            continue
        arg = node.args[0]  # type: ignore[attr-defined]
        assert isinstance(arg, ast.Constant), ast.dump(node)
        assert node in keyed, f"stats.py: series {arg.value} is not keyed by a PDStats key"
        name = f"vllm:pd_ext_{arg.value}" + ("_total" if what == "counter" else "")
        series[name] = (what, keyed[node])
    # Labelled series are registered directly (one child per label value).
    for node in ast.walk(cls):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("_counter_cls", "_histogram_cls")):
            name_kw = next(k.value for k in node.keywords if k.arg == "name")
            if isinstance(name_kw, ast.Constant):
                assert node.func.attr == "_counter_cls", "a labelled histogram: teach this test"
                base = name_kw.value.removeprefix("vllm:pd_ext_").removesuffix("s")
                series[f"{name_kw.value}_total"] = ("counter", f"{base}_<reason>")
    return series


def _stats_keys() -> set[str]:
    """stats.py's COUNTERS and SERIES (the literal keys; the per-reason
    fallback keys are one ``readback_fallback_<reason>``)."""
    tree = ast.parse((SRC / "stats.py").read_text(encoding="utf-8"))
    keys = {"readback_fallback_<reason>"}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id in ("COUNTERS", "SERIES"):
            assert isinstance(node.value, ast.Tuple)
            keys |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    return keys


def test_every_connector_series_is_in_metrics_md_and_back():
    code = _connector_series()
    assert {"vllm:pd_ext_kv_transfers_total", "vllm:pd_ext_kv_transfer_seconds",
            "vllm:pd_ext_readback_fallbacks_total"} <= set(code), sorted(code)
    documented = set(re.findall(r"vllm:pd_ext_[a-z0-9_]+", _read("metrics.md")))
    missing = sorted(set(code) - documented)
    unknown = sorted(documented - set(code))
    assert not missing, (
        f"series registered in vllm_pd_ext/stats.py, not in docs/metrics.md: {missing}")
    assert not unknown, (
        f"series in docs/metrics.md that vllm_pd_ext/stats.py never registers: {unknown}")


def test_connector_series_tables_match_the_code():
    code = _connector_series()
    section = _section("metrics.md", "## The connector's series")
    tables = {"counter": _table(_section("metrics.md", "### Counters")),
              "histogram": _table(_section("metrics.md", "### Histograms"))}
    assert section.index("### Counters") < section.index("### Histograms")
    for name, (kind, key) in code.items():
        row = tables[kind].get(name)
        assert row, f"docs/metrics.md: {name} (a {kind}) is not in the {kind} table"
        assert row[1] == f"`{key}`", (
            f"docs/metrics.md: {name}'s PDStats key is {row[1]}, stats.py: {key}")
    documented_keys = {row[1].strip("`") for table in tables.values() for row in table.values()}
    assert documented_keys == _stats_keys(), (
        f"docs/metrics.md's PDStats keys differ from stats.py's COUNTERS and SERIES: "
        f"{sorted(documented_keys ^ _stats_keys())}")


def test_fallback_reasons_in_metrics_md_match_the_code():
    from vllm_pd_ext.scheduler.bidir import FALLBACK_LABELS  # pure

    row = _table(_section("metrics.md", "### Counters"))["vllm:pd_ext_readback_fallbacks_total"]
    reasons = re.findall(r"`([a-z_]+)`", row[3].split("label `reason`:", 1)[1].split("(")[0])
    assert sorted(reasons) == sorted(FALLBACK_LABELS), (
        f"docs/metrics.md: fallback reasons {reasons}, code: {FALLBACK_LABELS}")


def _proxy_series() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every series of the proxy's registry: exposed name -> (type, label names)."""
    from types import SimpleNamespace

    from vllm_pd_proxy.metrics import Metrics  # prometheus_client only

    # One backend, so the scrape-time collector yields its samples (and labels).
    backend = SimpleNamespace(url="http://127.0.0.1:1", in_flight=0, outstanding_tokens=0,
                              state="healthy", requests_total=0)
    metrics = Metrics([SimpleNamespace(role="prefill", backends=[backend])])  # type: ignore[list-item]
    declared = {obj._name: tuple(obj._labelnames) for obj in vars(metrics).values()
                if hasattr(obj, "_labelnames")}
    series = {}
    for family in metrics.registry.collect():
        labels = declared.get(family.name)
        if labels is None:
            labels = tuple(family.samples[0].labels) if family.samples else ()
        name = family.name + ("_total" if family.type == "counter" else "")
        series[name] = (family.type, labels)
    return series


def test_every_proxy_series_is_in_metrics_md_and_back():
    code = _proxy_series()
    assert {"pd_proxy_requests_total", "pd_proxy_backend_healthy"} <= set(code), sorted(code)
    # A name anywhere in the proxy's source is registered in its one registry.
    for path in PROXY.rglob("*.py"):
        for name in re.findall(r'"(pd_proxy_[a-z0-9_]+)"', path.read_text(encoding="utf-8")):
            assert name in code or f"{name}_total" in code, (
                f"{path.relative_to(REPO)} names {name}, which the proxy's registry lacks")
    documented = set(re.findall(r"pd_proxy_[a-z0-9_]+", _read("metrics.md")))
    missing = sorted(set(code) - documented)
    unknown = sorted(documented - set(code))
    assert not missing, f"proxy series not in docs/metrics.md: {missing}"
    assert not unknown, f"series in docs/metrics.md that the proxy never registers: {unknown}"


def test_proxy_series_types_and_labels_match_the_code():
    table = _table(_section("metrics.md", "## The proxy's series"))
    for name, (kind, labels) in _proxy_series().items():
        row = table.get(name)
        assert row, f"docs/metrics.md: {name} has no row in the proxy's table"
        assert row[1] == kind, f"docs/metrics.md: {name} is a {row[1]}, the code: a {kind}"
        # The label names, without the values in parentheses after each.
        documented = tuple(re.findall(r"`([a-z_]+)`", re.sub(r"\([^()]*\)", "", row[2])))
        assert documented == labels, (
            f"docs/metrics.md: {name} has labels {documented}, the code: {labels}")
