#!/usr/bin/env bash
# The test suite: unit, scheduler-level, real-NIXL transport, proxy and
# end-to-end tests with real vLLM engines on CPU. Sets up .venv first.
# Extra arguments go to pytest (e.g. tests/run.sh tests/pure -k lease).
set -euo pipefail
cd "$(dirname "$0")/.."
.ci/setup-env
# shellcheck disable=SC1091
. .venv/bin/activate
export UCX_NET_DEVICES=lo VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1
if [ $# -eq 0 ]; then set -- tests; fi
exec python -m pytest -q -p no:cacheprovider "$@"
