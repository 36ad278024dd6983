"""The docs state facts the code decides: check that they still agree.

Cheap (reads three Markdown files, imports only the pure config and protocol
modules; no vLLM, torch or NIXL). Each check names what drifted and where.
The proxy's CLI flags are checked against docs/proxy.md by
tests/proxy/test_cli.py::test_every_flag_is_documented.
"""

from __future__ import annotations

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

DOCS = Path(__file__).resolve().parents[2] / "docs"
SRC = Path(__file__).resolve().parents[2] / "vllm_pd_ext"
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
