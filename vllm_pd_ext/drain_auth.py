"""Who may ``POST /pd/drain``: the drain token (pure: hmac, hashlib).

With a shared secret configured (``auth_secret_file`` / ``auth_secret_env``,
the keyring ``leg_auth`` loads), the drain middleware (``drain.py``) accepts
``POST /pd/drain`` only with ``Authorization: Bearer <drain token>``. The
token is HMAC-SHA256 of a fixed label under one secret of the keyring, in
hex: never the secret itself, which signs the side channel and the legs and
must not cross the engine's plain-HTTP port. Every secret of a keyring being
rotated (``OLD,NEW``) has its token accepted. Without a secret nothing is
checked (the engine already logs that it runs unauthenticated).

The operator computes the token with ``python -m vllm_pd_ext.drain_auth``
(the secret from ``VLLM_PD_AUTH_SECRET``, ``--auth-secret-env`` or
``--auth-secret-file``, as the engine reads it) or with openssl:
``printf %s 'vllm-pd-ext drain v1' | openssl dgst -sha256 -hmac "$SECRET"``.
The token does not expire (draining is idempotent and the engine goes away);
whoever can read it off the wire can drain the engines of that secret.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import sys
from collections.abc import Iterable

from vllm_pd_ext.wire import auth

#: What the token signs; a new version of the scheme changes it.
DRAIN_LABEL = b"vllm-pd-ext drain v1"
SCHEME = "Bearer"


def drain_token(secret: bytes) -> str:
    """The drain token of one secret (64 hex digits)."""
    return hmac.new(secret, DRAIN_LABEL, hashlib.sha256).hexdigest()


def drain_auth_problem(keyring: auth.Keyring | None,
                       headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """Why a ``POST /pd/drain`` with these (ASGI) headers must be refused;
    None if it may drain."""
    if keyring is None:
        return None
    value = next((bytes(v).decode("latin-1") for k, v in headers
                  if bytes(k).lower() == b"authorization"), None)
    if value is None:
        return ("missing Authorization header: with a shared secret configured, "
                "POST /pd/drain needs 'Authorization: Bearer <drain token>' "
                "(python -m vllm_pd_ext.drain_auth prints it; docs/security.md)")
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != SCHEME.lower() or not token:
        return "Authorization must be 'Bearer <drain token>'"
    given = token.encode("latin-1", "replace")
    # Every key is compared, so the time taken says nothing about which matched.
    matches = [hmac.compare_digest(given, drain_token(key).encode())
               for key in keyring.keys.values()]
    if not any(matches):
        return "the drain token matches none of this engine's secrets"
    return None


def main(argv: list[str] | None = None) -> int:
    """Print the drain token of the secret the engines are configured with."""
    parser = argparse.ArgumentParser(
        prog="python -m vllm_pd_ext.drain_auth",
        description="Print the token for 'Authorization: Bearer <token>' on POST /pd/drain.")
    parser.add_argument("--auth-secret-file", help="the file named by auth_secret_file")
    parser.add_argument("--auth-secret-env", default=None,
                        help=f"the variable holding the secret (default {auth.DEFAULT_SECRET_ENV})")
    args = parser.parse_args(argv)
    try:
        keyring = auth.Keyring.load(args.auth_secret_env, args.auth_secret_file)
    except auth.SecretError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if keyring is None:
        print(f"error: no secret: set {args.auth_secret_env or auth.DEFAULT_SECRET_ENV} or "
              "pass --auth-secret-file", file=sys.stderr)
        return 2
    print(drain_token(keyring.signing_key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
