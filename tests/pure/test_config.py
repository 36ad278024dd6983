"""PDConfig.from_extra_config: defaults, per-key validation, cross-key checks."""

from __future__ import annotations

import pytest

from vllm_pd_ext.config import MIN_LEASE_S, NIXL_BACKENDS, ConfigError, PDConfig


def test_defaults():
    for cfg in (PDConfig.from_extra_config(None), PDConfig.from_extra_config({})):
        assert cfg == PDConfig()
        assert cfg.transfer_mode == "pull"
        assert cfg.side_channel_host == "127.0.0.1"
        assert cfg.side_channel_port == 5600
        assert cfg.lease_duration == 30.0
        assert cfg.heartbeat_interval is None
        assert cfg.effective_heartbeat_interval == pytest.approx(5.0)
        assert cfg.nixl_backends == ("UCX",)
        assert cfg.nixl_progress_thread is False


def test_keys_excludes_private():
    keys = PDConfig.keys()
    assert "_extra" not in keys
    assert {"transfer_mode", "lease_duration", "nixl_backends"} <= set(keys)


def test_good_values_converted():
    cfg = PDConfig.from_extra_config({
        "side_channel_host": "localhost", "side_channel_port": 6000, "lease_duration": 4,
        "heartbeat_interval": 0.5, "transfer_timeout": 3, "handshake_timeout": 1.5,
        "nixl_backends": "UCX", "nixl_progress_thread": True,
        "nixl_progress_interval_ms": 0,
    })
    assert cfg.lease_duration == 4.0 and isinstance(cfg.lease_duration, float)
    assert cfg.nixl_backends == ("UCX",)
    assert cfg.effective_heartbeat_interval == 0.5
    assert cfg.nixl_progress_interval_ms == 0.0
    assert PDConfig.from_extra_config({"side_channel_host": "::1"}).side_channel_host == "::1"
    assert PDConfig.from_extra_config(
        {"nixl_backends": ["UCX", "POSIX"]}).nixl_backends == ("UCX", "POSIX")


BAD = [
    ("transfer_mode", "carrier-pigeon", "pull"),
    ("side_channel_host", "not-an-ip", "IP address"),
    ("side_channel_host", "", "IP address"),
    ("side_channel_host", 127, "IP address"),
    ("side_channel_port", 0, "1..65535"),
    ("side_channel_port", 70000, "1..65535"),
    ("side_channel_port", "5600", "1..65535"),
    ("side_channel_port", True, "1..65535"),
    ("lease_duration", 0, "> 0"),
    ("lease_duration", -1.0, "> 0"),
    ("lease_duration", "30", "> 0"),
    ("lease_duration", True, "> 0"),
    ("heartbeat_interval", 0, "> 0"),
    ("transfer_timeout", -5, "> 0"),
    ("handshake_timeout", None, "> 0"),
    ("nixl_backends", [], "NIXL backend names"),
    ("nixl_backends", [1], "NIXL backend names"),
    ("nixl_backends", ["UCX", "WARP"], "WARP"),
    ("nixl_progress_thread", 1, "true or false"),
    ("nixl_progress_thread", "yes", "true or false"),
    ("nixl_progress_interval_ms", -1, ">= 0"),
    ("nixl_progress_interval_ms", "1", ">= 0"),
    ("kv_huge_pages", "yes", "true or false"),
]


@pytest.mark.parametrize(("key", "value", "accepted"), BAD)
def test_bad_value_names_key_and_accepted(key, value, accepted):
    with pytest.raises(ConfigError) as err:
        PDConfig.from_extra_config({key: value})
    msg = str(err.value)
    assert f"kv_connector_extra_config.{key}" in msg
    assert accepted in msg


def test_bad_backend_lists_accepted_values():
    with pytest.raises(ConfigError) as err:
        PDConfig.from_extra_config({"nixl_backends": ["NOPE"]})
    for b in NIXL_BACKENDS:
        assert b in str(err.value)


def test_unknown_key_lists_accepted_keys():
    with pytest.raises(ConfigError) as err:
        PDConfig.from_extra_config({"lease_durtion": 5, "zzz": 1})
    msg = str(err.value)
    assert "'lease_durtion'" in msg and "'zzz'" in msg
    accepted = msg.split("accepted keys:")[1]
    known = PDConfig.keys()
    assert all(key in accepted for key in known)


def test_private_key_is_unknown():
    with pytest.raises(ConfigError, match="unknown key"):
        PDConfig.from_extra_config({"_extra": {}})


@pytest.mark.parametrize(("lease", "hb"), [(4.0, 4.0), (4.0, 5.0)])
def test_heartbeat_not_shorter_than_lease_refused(lease, hb):
    with pytest.raises(ConfigError, match="heartbeat_interval"):
        PDConfig.from_extra_config({"lease_duration": lease, "heartbeat_interval": hb})


def test_heartbeat_shorter_ok():
    cfg = PDConfig.from_extra_config({"lease_duration": 4.0, "heartbeat_interval": 3.99})
    assert cfg.effective_heartbeat_interval == 3.99


def test_lease_below_minimum_refused():
    with pytest.raises(ConfigError, match="lease_duration") as err:
        PDConfig.from_extra_config({"lease_duration": MIN_LEASE_S / 2})
    assert str(MIN_LEASE_S) in str(err.value)
    assert PDConfig.from_extra_config({"lease_duration": MIN_LEASE_S}).lease_duration == MIN_LEASE_S


def test_push_mode_accepted_and_unknown_mode_refused():
    cfg = PDConfig.from_extra_config({"transfer_mode": "push", "push_timeout": 12})
    assert cfg.transfer_mode == "push" and cfg.push_timeout == 12.0
    with pytest.raises(ConfigError) as err:
        PDConfig.from_extra_config({"transfer_mode": "shove"})
    msg = str(err.value)
    assert "transfer_mode='shove'" in msg and "pull, push" in msg
    with pytest.raises(ConfigError, match="push_timeout"):
        PDConfig.from_extra_config({"push_timeout": 0})
