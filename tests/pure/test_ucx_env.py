"""Why NIXL's UCX backend could not be created: ``transport/ucx_env.diagnose``."""

from __future__ import annotations

import pytest

from vllm_pd_ext.transport.ucx_env import diagnose

IFACES = {
    "eth1": (True, ["10.0.1.7", "fe80::1"]),
    "veth0": (True, ["169.254.7.2", "fe80::d06c:e5ff:fe92:372f"]),
    "down0": (False, ["10.0.2.7"]),
    "bare0": (True, []),
    "lo": (True, ["127.0.0.1", "::1"]),
}


@pytest.mark.parametrize(("devices", "want"), [
    ("eth1", None),
    ("lo", None),
    ("all", None),
    ("", None),
    ("mlx5_0:1", None),  # RDMA ports are not netdevs; nothing to say
    ("veth0", "has only link-local addresses (169.254.7.2, fe80::d06c:e5ff:fe92:372f)"),
    ("eth1,veth0", "interface 'veth0' has only link-local"),
    ("nope0", "there is no network interface 'nope0' in this network namespace"),
    ("down0", "interface 'down0' is down"),
    ("bare0", "interface 'bare0' has no IP address"),
])
def test_diagnose(devices: str, want: str | None) -> None:
    got = diagnose({"UCX_NET_DEVICES": devices}, IFACES.get)
    if want is None:
        assert got is None
    else:
        assert got is not None and want in got, got
        assert got.startswith(f"UCX_NET_DEVICES={devices}:")


def test_link_local_is_no_reason_once_the_test_shim_is_preloaded() -> None:
    # testing/ucx_linklocal.c lifts UCX's link-local filter (multi-host tests).
    env = {"UCX_NET_DEVICES": "veth0", "LD_PRELOAD": "/tmp/vllm-pd-ext-ucx-linklocal-ab12.so"}
    assert diagnose(env, IFACES.get) is None
    assert "is down" in (diagnose(dict(env, UCX_NET_DEVICES="down0"), IFACES.get) or "")
