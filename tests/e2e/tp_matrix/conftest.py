"""The TP matrix runs only when asked (``PD_EXT_TP_MATRIX=1``): its cells
start ten engines, TP=2 ones among them, which the CI's time budget does
not hold (docs/testing.md, "The TP matrix")."""

from __future__ import annotations

import os

TP_MATRIX_ENV = "PD_EXT_TP_MATRIX"

collect_ignore_glob = [] if os.environ.get(TP_MATRIX_ENV) == "1" else ["test_*.py"]
