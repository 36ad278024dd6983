"""Explain a UCX backend that NIXL could not create (pure; no NIXL import).

NIXL reports a UCX context without usable devices as ``NIXL_ERR_BACKEND``
("No such device"), and UCX's own log line only lists what it would accept.
The common causes are in ``UCX_NET_DEVICES``: a name that does not exist in
this network namespace, an interface that is down, or one whose only
addresses are link-local. UCX's TCP transport ignores an interface whose
IPv4 addresses are all in 169.254.0.0/16 and IPv6 ones in fe80::/10
(``ucs_netif_get_addr``), so a P/D network addressed that way never works.
``diagnose`` names the first such problem; ``NixlTransport`` adds it to the
error it raises. Called only after NIXL failed, so a wrong guess costs a
misleading hint, never a working engine.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

SIOCGIFADDR = 0x8915
SIOCGIFFLAGS = 0x8913
IFF_UP = 0x1
IFF_RUNNING = 0x40


def diagnose(env: Mapping[str, str],
             interface: Callable[[str], tuple[bool, list[str]] | None]) -> str | None:
    """The reason ``UCX_NET_DEVICES`` leaves UCX nothing to use, or None.

    ``interface(name)`` is None when the device does not exist here, else
    (is up and running, its IP addresses).
    """
    raw = env.get("UCX_NET_DEVICES", "")
    if not raw or raw == "all":
        return None
    for name in (d.strip() for d in raw.split(",")):
        if not name or ":" in name:  # "mlx5_0:1": an RDMA port, not a netdev
            continue
        info = interface(name)
        if info is None:
            return (f"UCX_NET_DEVICES={raw}: there is no network interface {name!r} in this "
                    "network namespace")
        running, addrs = info
        if not running:
            return f"UCX_NET_DEVICES={raw}: interface {name!r} is down"
        usable = [a for a in addrs if not ipaddress.ip_address(a).is_link_local]
        if not addrs:
            return f"UCX_NET_DEVICES={raw}: interface {name!r} has no IP address"
        shimmed = "ucx-linklocal" in env.get("LD_PRELOAD", "")  # testing/ucx_linklocal.c
        if name != "lo" and not usable and not shimmed:
            return (f"UCX_NET_DEVICES={raw}: interface {name!r} has only link-local addresses "
                    f"({', '.join(addrs)}); UCX's TCP transport ignores 169.254.0.0/16 and "
                    "fe80::/10, so give it a routable or unique-local address")
    return None


def local_interface(name: str) -> tuple[bool, list[str]] | None:
    """This namespace's view of one interface (see ``diagnose``)."""
    if not Path(f"/sys/class/net/{name}").exists():
        return None
    addrs: list[str] = []
    running = False
    packed = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            flags = struct.unpack("H", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, packed)[16:18])[0]
            running = bool(flags & IFF_UP and flags & IFF_RUNNING)
            addrs.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, packed)[20:24]))
        except OSError:
            pass
    try:
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            cols = line.split()
            if len(cols) >= 6 and cols[5] == name:
                addrs.append(str(ipaddress.IPv6Address(bytes.fromhex(cols[0]))))
    except OSError:
        pass
    return running, addrs


def explain_backend_failure() -> str | None:
    try:
        return diagnose(os.environ, local_interface)
    except Exception:  # a hint must never replace the real error
        return None
