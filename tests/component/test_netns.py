"""The multi-host topology (vllm_pd_ext/testing/netns.py) on real namespaces.

Hosts reach each other and the root namespace over their veths, reach
nothing else, a partition cuts exactly one host, and everything made is
deleted afterwards, also what a killed run left behind.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_pd_ext.testing import netns

UNAVAILABLE = netns.unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None,
                                reason=f"network namespaces are unavailable: {UNAVAILABLE}")

ECHO = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen()
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.sendall(c.recv(16)); c.close()
"""

CONNECT = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    s.sendall(b"ping"); print(s.recv(16).decode())
except OSError as exc:
    print(type(exc).__name__, exc.errno)
"""


def _ours() -> tuple[str, str]:
    return (subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout,
            subprocess.run(["ip", "link"], capture_output=True, text=True).stdout)


def _echo(host: netns.Host) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(host.wrap([sys.executable, "-c", ECHO, host.addr]),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _connect(cmd_prefix: list[str], addr: str, port: int, timeout: float = 3.0) -> str:
    return subprocess.run([*cmd_prefix, sys.executable, "-c", CONNECT, addr, str(port),
                           str(timeout)], capture_output=True, text=True, timeout=30
                          ).stdout.strip()


def test_hosts_reach_each_other_and_the_root_and_nothing_else() -> None:
    with netns.Topology(2) as topo:
        a, b = topo.hosts
        assert a.addr != b.addr and a.addr.startswith("169.254.")
        routes = subprocess.run(a.wrap(["ip", "route"]), capture_output=True, text=True
                                ).stdout
        assert "default" not in routes
        proc, port = _echo(b)
        try:
            assert _connect(a.wrap([]), b.addr, port) == "ping"  # host to host
        finally:
            proc.wait(timeout=10)
        proc, port = _echo(a)
        try:
            assert _connect([], a.addr, port) == "ping"  # root (the proxy's side) to host
        finally:
            proc.wait(timeout=10)
        # No default route: a public address is unreachable from inside (errno 101).
        assert _connect(a.wrap([]), "192.0.2.1", 80) == "OSError 101"
        before = b.counters()
        assert before["rx_bytes"] > 0 and before["tx_bytes"] > 0  # the echo went through


def test_partition_cuts_one_host_and_heals() -> None:
    with netns.Topology(2) as topo:
        a, b = topo.hosts
        proc, port = _echo(b)
        try:
            b.set_link(False)
            assert not b.link_up()
            assert _connect(a.wrap([]), b.addr, port, timeout=1.0) != "ping"
            # From the root (the proxy's side), a partitioned host's address
            # goes nowhere: the blackhole, not the default route off the machine.
            # (`ip route get` refuses a blackholed address: no device, no gateway.)
            via = subprocess.run(["ip", "route", "get", b.addr], capture_output=True,
                                 text=True)
            assert via.returncode != 0 and " dev " not in via.stdout, via.stdout
            b.set_link(True)
            assert b.link_up()
            assert _connect(a.wrap([]), b.addr, port, timeout=5.0) == "ping"
        finally:
            proc.kill()
            proc.wait(timeout=10)


def test_everything_made_is_deleted_also_after_a_failure() -> None:
    with pytest.raises(RuntimeError, match="boom"), netns.Topology(3) as topo:
        names = [h.netns for h in topo.hosts]
        raise RuntimeError("boom")
    spaces, links = _ours()
    assert not [n for n in names if n in spaces or n in links]


def test_remove_stale_deletes_only_what_a_dead_run_left() -> None:
    # A child process makes a topology and is killed before it can clean up.
    code = ("import os, sys; from vllm_pd_ext.testing import netns; "
            "t = netns.Topology(1).__enter__(); print(t.hosts[0].netns, flush=True); "
            "os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    stale = out[0]
    with netns.Topology(1) as mine:
        assert stale in _ours()[0]
        removed = netns.remove_stale()
        assert stale in removed
        # Its blackhole route too (the one for this run's own /24 stays).
        routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
        assert f"blackhole {mine.blackhole}" in routes
        assert [r for r in removed if r.startswith("169.254.")], removed
        spaces, links = _ours()
        assert stale not in spaces and stale + "r" not in links
        assert mine.hosts[0].netns in spaces  # ours (a live PID) stays


NIXL_PROBE = """
import ctypes, os
from vllm_pd_ext.transport import TransportError
from vllm_pd_ext.transport.nixl import NixlTransport
try:
    NixlTransport(f"probe-{os.getpid()}", ["UCX"], progress_thread=False)
    print("created")
except TransportError as exc:
    print("TransportError:", exc)
"""


def test_nixl_on_a_link_local_only_interface_fails_with_the_reason() -> None:
    """Real NIXL 1.5.1 / UCX: TCP on an interface with only 169.254 and fe80
    addresses cannot work (UCX skips them); the error says so."""
    pytest.importorskip("nixl")
    with netns.Topology(1) as topo:
        h = topo.hosts[0]
        env = {"UCX_NET_DEVICES": h.veth, "UCX_TLS": "tcp"}
        out = subprocess.run(h.wrap(["env", *(f"{k}={v}" for k, v in env.items()),
                                     sys.executable, "-c", NIXL_PROBE]),
                             capture_output=True, text=True, timeout=120).stdout
        assert "TransportError:" in out, out
        assert f"interface {h.veth!r} has only link-local addresses ({h.addr}" in out, out


def test_nixl_on_a_link_local_interface_starts_with_the_test_shim() -> None:
    """The shim (testing/ucx_linklocal.c, preloaded by Host.env) lifts exactly
    that filter: the same probe now creates its UCX backend on the veth."""
    pytest.importorskip("nixl")
    if netns.engines_unavailable() is not None:
        pytest.skip(f"cannot build the shim: {netns.engines_unavailable()}")
    with netns.Topology(1) as topo:
        h = topo.hosts[0]
        env = h.env()
        assert env["UCX_TLS"] == "tcp" and env["UCX_NET_DEVICES"] == h.veth
        out = subprocess.run(h.wrap(["env", *(f"{k}={v}" for k, v in env.items()),
                                     sys.executable, "-c", NIXL_PROBE]),
                             capture_output=True, text=True, timeout=120).stdout
        assert out.strip().endswith("created"), out
