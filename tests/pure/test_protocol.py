"""kv_transfer_params decoding and side-channel wire messages."""

from __future__ import annotations

import msgspec
import pytest

from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.protocol import ParamsError, decode_params


def pull_params(**over):
    raw = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "eng-p",
        "remote_request_id": "req-p",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_block_ids": [[3, 4, 5]],
        "tp_size": 1,
    }
    raw.update(over)
    return raw


def compat(**over):
    base = dict(protocol_version=1, model="m", dtype="bfloat16", block_size=128,
                kv_layout="LBHNC", num_layers=4, num_kv_heads=2, head_size=64, tp_size=1,
                transfer_mode="pull")
    base.update(over)
    return proto.CompatInfo(**base)


# ------------------------------------------------------------------ params
def test_decode_none():
    assert decode_params(None) is None


def test_decode_good_pull():
    p = decode_params(pull_params())
    assert p is not None and p.do_remote_prefill
    assert p.remote_engine_id == "eng-p" and p.remote_port == 5600
    assert p.flat_remote_block_ids() == [3, 4, 5]


def test_decode_flat_block_ids():
    p = decode_params(pull_params(remote_block_ids=[7, 8]))
    assert p.flat_remote_block_ids() == [7, 8]


def test_unknown_keys_ignored():
    p = decode_params(pull_params(_remote_blocks_processed=True, proxy_extra={"x": 1}))
    assert p.remote_request_id == "req-p"


def test_decode_remote_decode_only():
    p = decode_params({"do_remote_decode": True})
    assert p.do_remote_decode and not p.do_remote_prefill


@pytest.mark.parametrize("raw", [[1, 2], "x", 3, b"x"])
def test_non_dict_refused(raw):
    with pytest.raises(ParamsError, match="must be an object"):
        decode_params(raw)


@pytest.mark.parametrize(
    ("field", "value"),
    [("remote_port", "x"), ("tp_size", "two"), ("remote_engine_id", 5),
     ("do_remote_prefill", "maybe"), ("remote_block_ids", "1,2"),
     ("remote_block_ids", [["a"]])],
)
def test_wrong_type_names_field(field, value):
    with pytest.raises(ParamsError, match=field):
        decode_params(pull_params(**{field: value}))


@pytest.mark.parametrize("missing", ["remote_engine_id", "remote_request_id", "remote_host",
                                     "remote_port"])
def test_missing_required_named(missing):
    raw = pull_params()
    del raw[missing]
    with pytest.raises(ParamsError, match=missing):
        decode_params(raw)


def test_empty_string_counts_as_missing():
    with pytest.raises(ParamsError, match="remote_host"):
        decode_params(pull_params(remote_host=""))


def test_missing_not_required_without_prefill():
    p = decode_params({"do_remote_prefill": False, "remote_port": 1})
    assert p is not None and not p.do_remote_prefill


@pytest.mark.parametrize("port", [0, 65536, -1])
def test_port_out_of_range(port):
    with pytest.raises(ParamsError, match="remote_port"):
        decode_params(pull_params(remote_port=port))


def test_block_ids_nested_groups_refused():
    with pytest.raises(ParamsError, match="1 KV-cache group, got 2"):
        decode_params(pull_params(remote_block_ids=[[1], [2]]))


def test_block_ids_mixed_refused():
    with pytest.raises(ParamsError, match="mixes lists and integers"):
        decode_params(pull_params(remote_block_ids=[[1, 2], 3]))


@pytest.mark.parametrize("ids", [[-1, 2], [[0, -3]]])
def test_block_ids_negative_refused(ids):
    with pytest.raises(ParamsError, match=r">= 0 - at `remote_block_ids\["):
        decode_params(pull_params(remote_block_ids=ids))


@pytest.mark.parametrize("ids", [[], [[]], None])
def test_block_ids_empty_refused(ids):
    with pytest.raises(ParamsError, match="remote_block_ids"):
        decode_params(pull_params(remote_block_ids=ids))


def test_unknown_mode_refused():
    with pytest.raises(ParamsError, match=r"transfer_mode='shove'.*pull, push"):
        decode_params(pull_params(transfer_mode="shove"))


def test_push_decode_params_need_no_block_ids_but_pd_request_id():
    base = {"do_remote_prefill": True, "transfer_mode": "push", "remote_engine_id": "p",
            "remote_host": "127.0.0.1", "remote_port": 5600, "pd_request_id": "x1"}
    params = decode_params(base)
    assert params is not None and params.mode == "push" and params.pd_request_id == "x1"
    with pytest.raises(ParamsError, match=r"push mode\) needs pd_request_id"):
        decode_params({k: v for k, v in base.items() if k != "pd_request_id"})
    with pytest.raises(ParamsError, match="needs pd_request_id"):
        decode_params({"do_remote_decode": True, "transfer_mode": "push"})
    probe = decode_params({"do_remote_decode": True, "transfer_mode": "push",
                           "pd_ext_probe": True})
    assert probe is not None and probe.pd_ext_probe


def test_pull_mode_explicit_ok():
    assert decode_params(pull_params(transfer_mode="pull")).transfer_mode == "pull"


def test_tp_size_must_be_positive():
    with pytest.raises(ParamsError, match="tp_size"):
        decode_params(pull_params(tp_size=0))


def test_flat_ids_of_tuple_of_lists_roundtrip():
    # vLLM sends a tuple of per-group lists; after JSON it is a list of lists.
    p = decode_params(pull_params(remote_block_ids=([1, 2, 9],)))
    assert p.flat_remote_block_ids() == [1, 2, 9]


# ------------------------------------------------------------------ messages
AGENT = proto.AgentInfo(tp_rank=0, agent_name="a", agent_metadata=b"\x00\xffmeta",
                        mem_type="DRAM", regions=[proto.Region(4096, 64, 64, 10)])
REQUESTS = [
    proto.HandshakeRequest(engine_id="d", tp_rank=1, compat=compat()),
    proto.LeaseRenew(engine_id="d", request_ids=["a", "b"], acquire=True),
    proto.LeaseRenew(engine_id="d", request_ids=[]),
    proto.LeaseRelease(engine_id="d", request_ids=["a"], tp_rank=1, ok=False, reason="x"),
]
REPLIES = [
    proto.HandshakeReply(engine_id="p", compat=compat(), agent=AGENT),
    proto.LeaseStatus([1.5, proto.LEASE_UNKNOWN, proto.LEASE_EXPIRED]),
    proto.Ack(),
    proto.ErrorReply("malformed", "bad"),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_request_roundtrip(msg):
    assert proto.decode_request(proto.encode(msg)) == msg


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_reply_roundtrip(msg):
    assert proto.decode_reply(proto.encode(msg)) == msg


def test_reply_is_not_a_request():
    with pytest.raises(msgspec.ValidationError):
        proto.decode_request(proto.encode(proto.Ack()))
    with pytest.raises(msgspec.ValidationError):
        proto.decode_reply(proto.encode(REQUESTS[0]))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"garbage bytes", msgspec.msgpack.encode([1, 2]),
                                  msgspec.msgpack.encode({"type": "nope"})])
def test_garbage_raises_msgspec_errors(data):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        proto.decode_request(data)
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        proto.decode_reply(data)


def test_wrong_field_type_in_message():
    data = msgspec.msgpack.encode({"type": "renew", "engine_id": "d", "request_ids": "abc"})
    with pytest.raises(msgspec.ValidationError, match="request_ids"):
        proto.decode_request(data)


# ------------------------------------------------------------------ compat
def test_compat_diff_names_field():
    a, b = compat(), compat(block_size=32)
    assert a.diff(a) == []
    diff = a.diff(b)
    assert len(diff) == 1
    assert diff[0].startswith("block_size:") and "128" in diff[0] and "32" in diff[0]
    many = a.diff(compat(dtype="float16", tp_size=2))
    assert [d.split(":")[0] for d in many] == ["dtype", "tp_size"]


@pytest.mark.parametrize("field", list(proto.CompatInfo.__struct_fields__))
def test_compat_digest_differs_per_field(field):
    a = compat()
    value = getattr(a, field)
    other = value + 1 if isinstance(value, int) else value + "-x"
    b = compat(**{field: other})
    assert a.digest() != b.digest()
    assert a.digest() == compat().digest()
    assert len(a.digest()) == 16


# ------------------------------------------------------------------ bounds
# Everything from a client or a peer is bounded and range-checked at decode
# time, with an error naming the field (issue: hostile input).
@pytest.mark.parametrize("host", ["p 1", "a/b", "h\u00f6st", "tcp://x", "a@b", "", "x" * 300,
                                  "-lead.example", "a..b"])
def test_remote_host_that_is_no_host_is_refused(host):
    with pytest.raises(ParamsError, match="remote_host"):
        decode_params(pull_params(remote_host=host))


@pytest.mark.parametrize("host", ["127.0.0.1", "p-1.pool.svc.cluster.local", "my_host", "::1",
                                  "[fe80::1]", "P1"])
def test_real_hosts_are_accepted(host):
    assert decode_params(pull_params(remote_host=host)).remote_host == host


def test_tcp_address_brackets_ipv6():
    assert proto.tcp_address("::1", 5) == "tcp://[::1]:5"
    assert proto.tcp_address("[::1]", 5) == "tcp://[::1]:5"
    assert proto.tcp_address("p1", 5) == "tcp://p1:5"


@pytest.mark.parametrize("tp", [0, -1, proto.MAX_TP_SIZE + 1, 10**9])
def test_tp_size_is_range_checked(tp):
    with pytest.raises(ParamsError, match="tp_size"):
        decode_params(pull_params(tp_size=tp))


@pytest.mark.parametrize(("field", "n"), [("remote_engine_id", proto.MAX_ENGINE_ID_LEN + 1),
                                          ("remote_request_id", proto.MAX_REQUEST_ID_LEN + 1)])
def test_id_strings_are_bounded(field, n):
    with pytest.raises(ParamsError, match=f"length <= .*{field}"):
        decode_params(pull_params(**{field: "x" * n}))


def test_block_id_list_is_bounded():
    with pytest.raises(ParamsError, match="remote_block_ids"):
        decode_params(pull_params(remote_block_ids=[[0] * (proto.MAX_BLOCKS + 1)]))
    with pytest.raises(ParamsError, match="remote_block_ids"):
        decode_params(pull_params(remote_block_ids=[0] * (proto.MAX_BLOCKS + 1)))


def _register(**over):
    base = dict(engine_id="eng-d", compat=compat(), expect_engine_id="eng-p",
                pd_request_id="pd-1", request_id="d-1", notify_host="127.0.0.1",
                notify_port=5601, agents=[], first_block=0, block_ids=[1, 2], num_tokens=200,
                ttl_s=60.0)
    base.update(over)
    return proto.PushRegister(**base)


@pytest.mark.parametrize("msg", [
    _register(ttl_s=float("inf")), _register(ttl_s=float("nan")), _register(ttl_s=0.0),
    _register(ttl_s=proto.MAX_TTL_S * 2), _register(notify_host="d 1"),
    _register(notify_port=0), _register(first_block=-1), _register(block_ids=[-3]),
    _register(engine_id="e" * (proto.MAX_ENGINE_ID_LEN + 1)),
    _register(pd_request_id=""),
    proto.LeaseRenew(engine_id="d", request_ids=["r"] * (proto.MAX_IDS_PER_MESSAGE + 1)),
    proto.LeaseRelease(engine_id="d", request_ids=["r"], tp_rank=-1),
    proto.LeaseRelease(engine_id="d", request_ids=["r"], tp_rank=proto.MAX_TP_SIZE),
    proto.HandshakeRequest(engine_id="", tp_rank=0, compat=compat()),
    proto.PushResult(engine_id="p", pd_request_id="x", tp_rank=-2, ok=False),
], ids=lambda m: type(m).__name__)
def test_out_of_range_side_channel_fields_are_refused_at_decode(msg):
    with pytest.raises(msgspec.ValidationError):
        proto.decode_request(proto.encode(msg))


def test_in_range_messages_still_decode():
    for msg in (_register(), proto.PushResult(engine_id="p", pd_request_id="x", tp_rank=-1,
                                              ok=False),
                proto.LeaseRelease(engine_id="d", request_ids=["r"] * 100, tp_rank=3)):
        assert proto.decode_request(proto.encode(msg)) == msg


@pytest.mark.parametrize("reply", [
    {"type": "push_accepted", "engine_id": "eng-p", "state": "bogus"},
    {"type": "push_abort_status", "state": "bogus"},
    {"type": "push_abort_status", "state": "IN_FLIGHT"},  # names are not values
    {"type": "push_abort_status", "state": 1},
], ids=["accepted", "abort_status", "abort_status_by_name", "abort_status_int"])
def test_unknown_push_state_is_refused_at_decode_naming_the_field(reply):
    with pytest.raises(msgspec.ValidationError, match=r"\$\.state"):
        proto.decode_reply(msgspec.msgpack.encode(reply))


@pytest.mark.parametrize(("msg", "wire"), [
    *((proto.PushAccepted(engine_id="eng-p", state=s), s.value)
      for s in proto.PushAcceptedState),
    *((proto.PushAbortStatus(s), s.value) for s in proto.PushAbortState),
], ids=str)
def test_push_states_keep_their_wire_strings(msg, wire):
    data = proto.encode(msg)
    assert msgspec.msgpack.decode(data)["state"] == wire
    decoded = proto.decode_reply(data)
    assert decoded == msg and decoded.state is msg.state


def test_push_state_values_are_the_wire_contract():
    assert [s.value for s in proto.PushAcceptedState] == ["waiting", "writing", "queued"]
    assert [s.value for s in proto.PushAbortState] == [
        "aborted", "unknown", "done", "failed", "in_flight"]
    assert {"aborted", "unknown", "done", "failed"} == proto.ABORT_SAFE_STATES


@pytest.mark.parametrize("value", ["localhost\n", "10.0.0.1\n", "[::1]\n"])
def test_a_trailing_newline_is_not_a_host(value):
    assert not proto.valid_host(value)
    with pytest.raises(proto.ParamsError, match="remote_host"):
        proto.decode_params({"do_remote_prefill": True, "remote_engine_id": "p",
                             "remote_request_id": "r", "remote_host": value, "remote_port": 1,
                             "remote_block_ids": [[1]]})


def test_patterns_refuse_a_trailing_newline():
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert("0123456789abcdef\n", proto.BlockHash)
    assert msgspec.convert("0123456789abcdef", proto.BlockHash) == "0123456789abcdef"
