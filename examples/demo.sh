#!/usr/bin/env bash
# The 1P1D demo on CPU: sets up .venv and the tiny model (first run: a few
# minutes), then runs examples/demo_1p1d.py.
set -euo pipefail
cd "$(dirname "$0")/.."
.ci/setup-env
# shellcheck disable=SC1091
. .venv/bin/activate
export UCX_NET_DEVICES=lo VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1
exec python examples/demo_1p1d.py "$@"
