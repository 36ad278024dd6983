"""auth.py, the pure core: keyrings, signed frames, signed legs (issue 12)."""

from __future__ import annotations

import os

import pytest

from vllm_pd_ext.config import ConfigError, PDConfig
from vllm_pd_ext.wire import auth

SECRET = "s3cret-for-tests-0123456789"
OTHER = "another-secret-9876543210"


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def ring(*secrets: str) -> auth.Keyring:
    return auth.Keyring.parse(",".join(secrets), "test")


# ------------------------------------------------------------------ keyrings
def test_keyring_first_secret_signs_all_verify_ids_are_public_names() -> None:
    kr = auth.Keyring.parse(f"{SECRET}\n{OTHER}\n", "test")
    assert kr.signing_kid == auth.key_id(SECRET.encode())
    assert set(kr.keys) == {auth.key_id(SECRET.encode()), auth.key_id(OTHER.encode())}
    assert SECRET not in kr.describe() and OTHER not in kr.describe()
    assert auth.key_id(OTHER.encode()) in kr.describe()


@pytest.mark.parametrize("text, why", [
    ("", "holds no secret"),
    ("short", "at least 16"),
    (",".join(f"secret-number-{i:04d}" for i in range(9)), "at most 8"),
])
def test_keyring_refuses_unusable_secrets_without_echoing_them(text: str, why: str) -> None:
    with pytest.raises(auth.SecretError, match=why) as exc:
        auth.Keyring.parse(text, "test")
    if text:
        assert text.split(",")[0] not in str(exc.value)


def test_keyring_from_file_wins_over_environment(tmp_path) -> None:
    f = tmp_path / "secret"
    f.write_text(OTHER + "\n")
    env = {auth.DEFAULT_SECRET_ENV: SECRET}
    assert auth.Keyring.load(None, str(f), env).signing_kid == auth.key_id(OTHER.encode())
    assert auth.Keyring.load(None, None, env).signing_kid == auth.key_id(SECRET.encode())
    assert auth.Keyring.load("MY_SECRET", None, {"MY_SECRET": OTHER}).signing_kid == \
        auth.key_id(OTHER.encode())
    assert auth.Keyring.load(None, None, {}) is None
    with pytest.raises(auth.SecretError, match="No such file"):
        auth.Keyring.load(None, str(tmp_path / "missing"), env)


def test_config_keys_name_the_secret_never_hold_it(tmp_path) -> None:
    with pytest.raises(ConfigError, match="NAME of an environment variable"):
        PDConfig.from_extra_config({"auth_secret_env": "not a name=" + SECRET})
    cfg = PDConfig.from_extra_config({"auth_secret_file": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match="auth_secret_file"):
        cfg.load_keyring({})
    assert PDConfig().frame_auth({}) is None
    assert PDConfig().frame_auth({auth.DEFAULT_SECRET_ENV: SECRET}) is not None


def test_advertised_side_channel_address_is_never_unspecified() -> None:
    """Item 5: bind 0.0.0.0 only with an address peers can reach."""
    for host in ("0.0.0.0", "::"):
        with pytest.raises(ConfigError, match="side_channel_advertise_host"):
            PDConfig.from_extra_config({"side_channel_host": host})
        with pytest.raises(ConfigError, match="side_channel_advertise_host"):
            PDConfig.from_extra_config({"side_channel_advertise_host": host})
    cfg = PDConfig.from_extra_config({"side_channel_host": "0.0.0.0",
                                      "side_channel_advertise_host": "10.0.0.7"})
    assert (cfg.side_channel_host, cfg.advertised_host) == ("0.0.0.0", "10.0.0.7")
    assert PDConfig().advertised_host == "127.0.0.1"


# ------------------------------------------------------------------ frames
def test_signed_frame_verifies_once_then_is_a_replay() -> None:
    clock = Clock()
    a = auth.FrameAuth(ring(SECRET), clock=clock)
    header, nonce = a.sign_request(b"body")
    assert a.verify_request(header, b"body") == nonce
    with pytest.raises(auth.AuthError, match="replayed"):
        a.verify_request(header, b"body")


@pytest.mark.parametrize("tamper, why", [
    (lambda h, b: (h, b + b"x"), "bad signature"),
    (lambda h, b: (h[:-1] + bytes([h[-1] ^ 1]), b), "bad signature"),
    (lambda h, b: (b"\x93garbage", b), "malformed auth header"),
    (lambda h, b: (b"x" * 300, b), "auth header of 300 bytes"),
])
def test_altered_frames_are_refused(tamper, why) -> None:
    a = auth.FrameAuth(ring(SECRET), clock=Clock())
    header, _ = a.sign_request(b"body")
    h, b = tamper(header, b"body")
    with pytest.raises(auth.AuthError, match=why):
        a.verify_request(h, b)


def test_wrong_key_stale_and_future_frames_are_refused_and_not_remembered() -> None:
    clock = Clock()
    ours = auth.FrameAuth(ring(SECRET), window_s=30, clock=clock)
    theirs = auth.FrameAuth(ring(OTHER), clock=clock)
    header, _ = theirs.sign_request(b"m")
    with pytest.raises(auth.AuthError, match="unknown key id"):
        ours.verify_request(header, b"m")
    old, _ = auth.FrameAuth(ring(SECRET), clock=Clock(clock.t - 31)).sign_request(b"m")
    new, _ = auth.FrameAuth(ring(SECRET), clock=Clock(clock.t + 31)).sign_request(b"m")
    for h in (old, new):
        with pytest.raises(auth.AuthError, match="clocks out of sync"):
            ours.verify_request(h, b"m")
    assert ours.num_nonces == 0  # only valid frames enter the replay cache


def test_replay_cache_forgets_after_the_window_and_is_bounded() -> None:
    clock = Clock()
    a = auth.FrameAuth(ring(SECRET), window_s=10, clock=clock, max_nonces=2)
    for _ in range(2):
        a.verify_request(a.sign_request(b"m")[0], b"m")
    with pytest.raises(auth.AuthError, match="replay cache full"):
        a.verify_request(a.sign_request(b"m")[0], b"m")
    clock.t += 11  # both remembered nonces can no longer pass the window
    a.verify_request(a.sign_request(b"m")[0], b"m")
    assert a.num_nonces == 1


def test_rotation_two_keys_accepted_by_key_id() -> None:
    clock = Clock()
    old_only = auth.FrameAuth(ring(OTHER), clock=clock)
    mid = auth.FrameAuth(ring(SECRET, OTHER), clock=clock)  # signs new, accepts old
    new_only = auth.FrameAuth(ring(SECRET), clock=clock)
    mid.verify_request(old_only.sign_request(b"m")[0], b"m")
    new_only.verify_request(mid.sign_request(b"m")[0], b"m")
    with pytest.raises(auth.AuthError, match="unknown key id"):
        old_only.verify_request(new_only.sign_request(b"m")[0], b"m")


def test_reply_is_bound_to_its_request_nonce() -> None:
    a = auth.FrameAuth(ring(SECRET), clock=Clock())
    _, nonce = a.sign_request(b"q")
    header = a.sign_reply(b"r", nonce)
    a.verify_reply(header, b"r", nonce)
    with pytest.raises(auth.AuthError, match="bad signature"):
        a.verify_reply(header, b"r", os.urandom(16))
    with pytest.raises(auth.AuthError, match="bad signature"):
        a.verify_reply(header, b"R", nonce)
    with pytest.raises(auth.AuthError, match="unknown key id"):
        auth.FrameAuth(ring(OTHER)).verify_reply(header, b"r", nonce)


# ------------------------------------------------------------------ legs
BODY = {"model": "m", "prompt": "The capital of France is", "max_tokens": 8}
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [[1, 2]],
          "remote_host": "127.0.0.1", "remote_port": 5600, "remote_request_id": "cmpl-1",
          "remote_blocks_expiry_time": 1800000030.25}
NOW = 1_800_000_000.0


def test_signed_leg_verifies_in_the_api_server_and_the_engine_core() -> None:
    kr = ring(SECRET)
    signed = auth.sign_leg(kr, PARAMS, "rid-1", BODY, now=NOW)
    assert set(signed) - set(PARAMS) == {auth.LEG_FIELD}
    auth.verify_leg(kr, signed, request_id="rid-1", body=dict(BODY), now=NOW + 5)
    auth.verify_leg(kr, signed)  # EngineCore: MAC only
    # Key order and a JSON round trip do not matter.
    auth.verify_leg(kr, dict(reversed(list(signed.items()))), body=BODY)


@pytest.mark.parametrize("change, status, why", [
    (lambda p: {k: v for k, v in p.items() if k != "pd_sig"}, 401, "not signed"),
    (lambda p: {**p, "pd_sig": "v1.nope"}, 401, "malformed"),
    (lambda p: {**p, "remote_block_ids": [[1, 3]]}, 401, "does not match"),
    (lambda p: {**p, "remote_host": "10.9.9.9"}, 401, "does not match"),
    (lambda p: {**p, "extra": 1}, 401, "does not match"),
])
def test_unsigned_or_altered_legs_are_refused(change, status, why) -> None:
    kr = ring(SECRET)
    signed = auth.sign_leg(kr, PARAMS, "rid-1", BODY, now=NOW)
    with pytest.raises(auth.AuthError, match=why) as exc:
        auth.verify_leg(kr, change(signed), request_id="rid-1", body=BODY, now=NOW)
    assert exc.value.status == status


def test_leg_signed_for_another_prompt_request_or_time_or_key() -> None:
    kr = ring(SECRET)
    signed = auth.sign_leg(kr, PARAMS, "rid-1", BODY, now=NOW)
    with pytest.raises(auth.AuthError, match="another prompt") as exc:
        auth.verify_leg(kr, signed, body={**BODY, "prompt": "The capital of Spain is"})
    assert exc.value.status == 403
    with pytest.raises(auth.AuthError, match="another request id") as exc:
        auth.verify_leg(kr, signed, request_id="rid-2")
    assert exc.value.status == 403
    with pytest.raises(auth.AuthError, match="clocks out of sync"):
        auth.verify_leg(kr, signed, now=NOW + 31)
    with pytest.raises(auth.AuthError, match="unknown key id"):
        auth.verify_leg(ring(OTHER), signed)


def test_prompt_digest_covers_chat_messages_and_token_prompts() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert auth.body_prompt_digest(chat) != auth.body_prompt_digest(
        {"messages": [{"role": "user", "content": "ho"}]})
    assert auth.body_prompt_digest({"prompt": [1, 2, 3]}) != auth.body_prompt_digest(
        {"prompt": [1, 2, 4]})
    assert auth.token_digest([1, 2, 3]) == auth.token_digest((1, 2, 3))
    assert auth.token_digest([1, 2, 3]) != auth.token_digest([1, 2, 3, 0])


def test_a_secret_file_others_may_write_is_refused_and_a_readable_one_warned(
        tmp_path, caplog) -> None:
    """Issue 27 item 8: the secret file's permissions were never checked."""
    import os

    f = tmp_path / "secret"
    f.write_text("s3cret-for-tests-0123456789")
    os.chmod(f, 0o666)
    with pytest.raises(auth.SecretError, match="writable by others"):
        auth.Keyring.load(None, str(f))
    for mode, who in ((0o644, "readable by others (mode 644)"),
                      (0o660, "writable by its group (mode 660)")):
        os.chmod(f, mode)
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert auth.Keyring.load(None, str(f)) is not None
        assert who in caplog.text
    os.chmod(f, 0o600)
    caplog.clear()
    assert auth.Keyring.load(None, str(f)) is not None and caplog.text == ""
