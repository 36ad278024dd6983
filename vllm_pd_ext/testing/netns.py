"""Several "hosts" on one machine: one network namespace per engine (tests, soak, benchmarks).

Role: give each engine its own network stack, so that P and D talk over a
real (virtual) network instead of loopback, where UCX would copy memory
between processes with CMA. Each host is a namespace joined to the root
namespace by a veth pair carrying one link-local /30 (169.254.S.4i+1 on the
root side, .4i+2 inside). Inside there is no default route, only a route to
the topology's own /24 through the root side, which forwards between the
topology's veths (per-interface ``forwarding``, not the global
``ip_forward``: nothing arriving on any other interface is forwarded). So an
engine can reach the other hosts and the root namespace (where the proxy
runs), and nothing else.

Lifecycle: ``Topology(n)`` is a context manager; ``__enter__`` creates every
namespace and link, ``__exit__`` deletes exactly what this object created,
also after a failure halfway through creating them. Names carry this
process's PID, so ``remove_stale`` can delete what a killed run of ours left
behind without touching anything else.

Needs root and ``ip netns``; ``unavailable()`` says why not, for a skip.
Real engines with PDConnector also need UCX to accept the veths' link-local
addresses, which it does not by itself: ``Host.env`` preloads a test-only
shim for that (``ucx_linklocal.c``, built here with the system C compiler;
``engines_unavailable()`` says why it cannot be). The shim's source is in
the source tree only, beside this module: it is not package data, so a
wheel install of the package has no multi-host engines, and says so.
A partition is ``Host.set_link(False)``: the root side of the veth goes down
(the kernel has no netem here, so no delay or loss). The root namespace
holds a blackhole route for the topology's /24 (less specific than each
host's /30), so traffic for a partitioned host is dropped here; without it
the root namespace's default route would carry it off the machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "pdx"
SHIM_SOURCE = Path(__file__).with_name("ucx_linklocal.c")
_NAME = re.compile(rf"^{PREFIX}(\d+)h(\d+)$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (this process is not uid 0)"
    probe = f"{PREFIX}{os.getpid()}probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"'ip netns add' failed: {r.stderr.strip()[:200]}"
    _ip("netns", "del", probe, check=False)
    return None


def engines_unavailable() -> str | None:
    """Why real engines cannot run in namespaces here, or None when they can."""
    reason = unavailable()
    if reason is None and not SHIM_SOURCE.is_file():
        reason = _missing_shim()
    if reason is None and shutil.which("cc") is None:
        reason = "no C compiler ('cc') to build the UCX link-local shim (ucx_linklocal.c)"
    return reason


def _missing_shim() -> str:
    return (f"the UCX link-local shim's source {SHIM_SOURCE} is missing: it is test-only "
            "and not shipped in the wheel; run multi-host engines from a source checkout")


def linklocal_shim() -> Path:
    """The UCX link-local shim, built once per version of its source.

    Kept in this user's private directory under the temp directory
    (``shim_dir``), under a name carrying the source's hash, so concurrent
    test runs share one build and an edit rebuilds it. Engines preload it,
    so nobody else may be able to put a library there.
    """
    if not SHIM_SOURCE.is_file():
        raise FileNotFoundError(_missing_shim())
    digest = hashlib.sha256(SHIM_SOURCE.read_bytes()).hexdigest()[:12]
    out = shim_dir() / f"ucx-linklocal-{digest}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        r = subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-Wall", "-o", str(tmp),
                            str(SHIM_SOURCE)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"building {SHIM_SOURCE.name} failed: {r.stderr.strip()[:500]}")
        os.replace(tmp, out)
    return out


def shim_dir() -> Path:
    """``<tmp>/vllm-pd-ext-<uid>``, created 0700; refused unless it is a
    directory (not a link) owned by this user that nobody else may write."""
    path = Path(tempfile.gettempdir()) / f"vllm-pd-ext-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(
            f"{path} is not a private directory of this user (owner {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}{', a link' if stat.S_ISLNK(st.st_mode) else ''}): "
            "the UCX shim engines preload is built there; remove it")
    return path


@dataclass
class Host:
    """One namespace ("host") and the veth pair that joins it to the root namespace."""

    index: int
    netns: str
    addr: str  # inside the namespace: bind and advertise this
    gateway: str  # root side of the pair
    veth: str  # inside: UCX_NET_DEVICES
    veth_root: str

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside this host (``ip netns exec`` execs in place: same PID)."""
        return ["ip", "netns", "exec", self.netns, *cmd]

    def set_link(self, up: bool, timeout: float = 5.0) -> None:
        """Partition the host (down) or heal it (up), and wait until the
        kernel reports the new state (the carrier comes back asynchronously,
        later on a loaded machine); sockets inside survive."""
        _ip("link", "set", self.veth_root, "up" if up else "down")
        deadline = time.monotonic() + timeout
        while self.link_up() != up:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.veth_root}: link still {'down' if up else 'up'} "
                                   f"{timeout} s after setting it {'up' if up else 'down'}")
            time.sleep(0.01)

    def link_up(self) -> bool:
        return Path(f"/sys/class/net/{self.veth_root}/operstate").read_text().strip() != "down"

    def counters(self) -> dict[str, int]:
        """Bytes the host received and sent over its veth (root side's view reversed)."""
        stats = Path(f"/sys/class/net/{self.veth_root}/statistics")
        return {"rx_bytes": int((stats / "tx_bytes").read_text()),
                "tx_bytes": int((stats / "rx_bytes").read_text())}

    def env(self) -> dict[str, str]:
        """The settings an engine in this host needs (docs/deployment.md).

        UCX over TCP on the veth, so no shared-memory transport can
        short-cut the network. UCX's TCP transport skips 169.254.0.0/16 and
        fe80::/10 when it looks up the device's address, and link-local
        addresses are all this topology has, so the test-only shim
        (``ucx_linklocal.c``) is preloaded to lift that one filter. Without
        it NIXL refuses to start, and the engine says why
        (``transport/ucx_env.py``).
        """
        preload = " ".join(x for x in (str(linklocal_shim()), os.environ.get("LD_PRELOAD"))
                           if x)
        return {"UCX_NET_DEVICES": self.veth, "UCX_TLS": "tcp", "LD_PRELOAD": preload,
                "VLLM_HOST_IP": self.addr, "VLLM_NIXL_SIDE_CHANNEL_HOST": self.addr}

    def listeners(self) -> list[tuple[str, int]]:
        """Every listening TCP socket inside the namespace, as (address, port)."""
        return [local for local, _ in self._ss("-Hltn")]

    def connections(self) -> list[tuple[tuple[str, int], tuple[str, int]]]:
        """Established TCP connections inside the namespace: (local, peer)."""
        return self._ss("-Htn", "state", "established")

    def _ss(self, *args: str) -> list[tuple[tuple[str, int], tuple[str, int]]]:
        out = subprocess.run(self.wrap(["ss", *args]), capture_output=True, text=True,
                             check=True).stdout
        found = []
        for line in out.splitlines():
            cols = line.split()
            # "-Hltn": State Recv-Q Send-Q Local Peer; "state established" drops State.
            local, peer = cols[-2], cols[-1]
            found.append((_endpoint(local), _endpoint(peer)))
        return found


class Topology:
    """``n`` hosts on one /24 of 169.254.0.0/16, created on enter, deleted on exit."""

    def __init__(self, n: int, subnet: int | None = None) -> None:
        if not 1 <= n <= 60:
            raise ValueError("1..60 hosts (one /30 each in a /24)")
        self.n = n
        self.subnet = subnet if subnet is not None else _free_subnet()
        self.hosts: list[Host] = []
        self._forwarding: dict[str, str] = {}
        self.blackhole = f"169.254.{self.subnet}.0/24"
        self._blackholed = False

    def __enter__(self) -> Topology:
        try:
            for i in range(self.n):
                self._add(i)
            # A partition removes a host's /30 route: its packets then end in
            # this blackhole, never on the default route (the machine's
            # external interface).
            _ip("route", "add", "blackhole", self.blackhole)
            self._blackholed = True
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add(self, i: int) -> None:
        base = f"{PREFIX}{os.getpid()}h{i}"
        s = self.subnet
        host = Host(index=i, netns=base, addr=f"169.254.{s}.{4 * i + 2}",
                    gateway=f"169.254.{s}.{4 * i + 1}", veth=f"{base}n", veth_root=f"{base}r")
        _ip("netns", "add", host.netns)
        # Listed before its link exists, so close() removes a half-made host too.
        self.hosts.append(host)
        _ip("link", "add", host.veth_root, "type", "veth", "peer", "name", host.veth)
        _ip("link", "set", host.veth, "netns", host.netns)
        _ip("addr", "add", f"{host.gateway}/30", "dev", host.veth_root)
        _ip("link", "set", host.veth_root, "up")
        _sysctl(f"net.ipv4.conf.{host.veth_root}.forwarding", "1")
        ns = ("-n", host.netns)
        _ip(*ns, "link", "set", "lo", "up")
        _ip(*ns, "addr", "add", f"{host.addr}/30", "dev", host.veth)
        _ip(*ns, "link", "set", host.veth, "up")
        _ip(*ns, "route", "add", f"169.254.{s}.0/24", "via", host.gateway)

    def close(self) -> None:
        """Delete every link and namespace this topology made (idempotent)."""
        if self._blackholed:
            _ip("route", "del", "blackhole", self.blackhole, check=False)
            self._blackholed = False
        for host in self.hosts:
            _ip("link", "del", host.veth_root, check=False)
            _ip("netns", "del", host.netns, check=False)
        self.hosts = []


def _endpoint(text: str) -> tuple[str, int]:
    addr, _, port = text.rpartition(":")
    return addr.strip("[]"), int(port) if port.isdigit() else 0


def _sysctl(key: str, value: str) -> None:
    Path("/proc/sys/" + key.replace(".", "/")).write_text(value)


def _free_subnet() -> int:
    """A third octet no address or route on this machine uses yet."""
    used = _ip("-4", "addr").stdout + _ip("-4", "route").stdout
    for s in [100 + (os.getpid() + k) % 150 for k in range(150)]:
        if f"169.254.{s}." not in used:
            return s
    raise RuntimeError("no free 169.254.S.0/24 for the topology")


def remove_stale() -> list[str]:
    """Delete namespaces and links left by a run of ours whose process is gone."""
    removed: list[str] = []
    names = _ip("netns", "list", check=False).stdout.split()
    links = re.findall(rf"\d+: ({PREFIX}\d+h\d+r)[@:]", _ip("link", check=False).stdout)
    for name in set(names) | {link[:-1] for link in links}:
        m = _NAME.match(name)
        if not m or pid_alive(int(m.group(1))):
            continue
        _ip("link", "del", name + "r", check=False)
        _ip("netns", "del", name, check=False)
        removed.append(name)
    # A dead run's blackhole: a topology /24 no address uses any more.
    addrs = _ip("-4", "addr", check=False).stdout
    for net in re.findall(r"blackhole (169\.254\.\d+\.0/24)",
                          _ip("-4", "route", check=False).stdout):
        if net.rsplit(".", 1)[0] + "." not in addrs:
            _ip("route", "del", "blackhole", net, check=False)
            removed.append(net)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (ours or not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
