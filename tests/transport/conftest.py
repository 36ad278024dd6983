"""Transport tests: UCX must only use loopback; set before NIXL loads."""

from __future__ import annotations

import os

os.environ["UCX_NET_DEVICES"] = "lo"
