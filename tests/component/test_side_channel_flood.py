"""No peer without the secret gets a message assembled (issue 27 item 1).

zmq's ``MAXMSGSIZE`` bounds frames, not how many a message has, and libzmq
assembles a whole multipart message before the server sees it: a peer
without the secret could make the engine allocate whatever it sent. Here a
real side-channel server with a secret runs in a process of its own, and
this test floods it with many-part messages (each 256 MiB in 8 MiB frames,
under the per-frame limit) from three kinds of peers without the secret:
a plain zmq socket, a CURVE socket with a random key (the server's key is
public by design), and one with another secret's key. The server's peak
memory stays flat, it counts the refused handshakes, and a holder of the
secret is served right after.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from pdunit_utils import free_port

from vllm_pd_ext.testing.flood import many_part_flood
from vllm_pd_ext.wire import curve
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.auth import FrameAuth, Keyring
from vllm_pd_ext.wire.side_channel import SideChannelClient

HOST = "127.0.0.1"
SECRET = "flood-test-secret-0123456789"
WRONG = "another-secret-0123456789abc"
FRAME = 8 << 20
FRAMES = 32  # 256 MiB a message
MESSAGES = 4

SERVER = """
import sys, time
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.auth import FrameAuth, Keyring
from vllm_pd_ext.wire.side_channel import SideChannelServer
compat = proto.CompatInfo(protocol_version=6, model="m", dtype="bfloat16", block_size=16,
                          kv_layout="LBHNC", num_layers=2, num_kv_heads=2, head_size=64,
                          tp_size=1, transfer_mode="pull")
agent = proto.AgentInfo(tp_rank=0, agent_name="p", agent_metadata=b"md", mem_type="DRAM",
                        regions=[proto.Region(4096, 64, 64, 8)])
srv = SideChannelServer("127.0.0.1", int(sys.argv[1]), "eng-p", compat, {0: agent}, None,
                        auth=FrameAuth(Keyring.parse(sys.argv[2], "t")))
print("ready", flush=True)
for line in sys.stdin:
    print(srv.num_unauthenticated, flush=True)
"""


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize("peer", ["plain", "random_curve_key", "other_secret"])
def test_many_part_flood_from_a_peer_without_the_secret_allocates_nothing(peer: str) -> None:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), SECRET],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    client = SideChannelClient(5.0, auth=FrameAuth(Keyring.parse(SECRET, "test")))
    try:
        assert server.stdout is not None and server.stdin is not None
        assert server.stdout.readline().strip() == "ready"
        hello = proto.HandshakeRequest(engine_id="eng-d", tp_rank=0, compat=proto.CompatInfo(
            protocol_version=6, model="m", dtype="bfloat16", block_size=16, kv_layout="LBHNC",
            num_layers=2, num_kv_heads=2, head_size=64, tp_size=1, transfer_mode="pull"))
        assert isinstance(client.request(HOST, port, hello), proto.HandshakeReply)
        before = peak_rss_mib(server.pid)
        keys = {"plain": None, "random_curve_key": zmq.curve_keypair(),
                "other_secret": curve.client_keypair(WRONG.encode())}[peer]
        # Queued: up to all 4. None when the refusal came first; a server
        # that admitted the peer would have taken all 4 (and grown by 1 GiB).
        res = many_part_flood(HOST, port, keys, frame_bytes=FRAME, frames=FRAMES,
                              messages=MESSAGES)
        assert not res.replied
        # Still serving a holder of the secret, and the flood cost nothing.
        assert isinstance(client.request(HOST, port, hello), proto.HandshakeReply)
        grown = peak_rss_mib(server.pid) - before
        print(f"{peer}: {res.queued} x {FRAMES * FRAME >> 20} MiB queued; the server's peak "
              f"memory {before:.0f} -> {before + grown:.0f} MiB")  # shown with -rP
        assert grown < 32, f"the server's peak memory grew by {grown:.0f} MiB"
        server.stdin.write("count\n")
        server.stdin.flush()
        assert int(server.stdout.readline()) >= 1  # the refused handshake(s), counted
    finally:
        client.close()
        server.kill()
        server.wait(timeout=10)
