#!/usr/bin/env bash
# The test suite: unit, scheduler-level, real-NIXL transport, proxy and
# end-to-end tests with real vLLM engines on CPU. Sets up .venv first.
#
#   tests/run.sh [OPTIONS]     every tier: each lane of the e2e tier (real
#                              engines, tests/e2e/lanes.py) in a pytest-xdist
#                              worker, the engine-free tiers in two more
#                              beside them (tests/conftest.py); pytest
#                              OPTIONS (e.g. --durations=20) apply to the run
#   tests/run.sh --fast [ARGS] every tier but real engines (pure, component,
#                              scheduler, transport, proxy; nothing marked
#                              `engine`) on 4 workers: the everyday check,
#                              narrowed by ARGS (e.g. -k lease)
#   tests/run.sh PATHS [ARGS]  plain pytest in one process (e.g. tests/pure -k lease)
#
# Skips are listed with their reasons at the end (-rs); .ci/run sets
# PD_EXT_NO_SKIP=1, which makes every skip a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PD_EXT_SETUP_DONE:-}" ]; then  # .ci/run set it up already
  .ci/setup-env
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export UCX_NET_DEVICES=lo VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1
FAST_TIERS=(tests/pure tests/component tests/scheduler tests/transport tests/proxy)
names_a_test() {  # does any argument name a test file, folder or node id?
  local a
  for a in "$@"; do
    if [[ -e "${a%%::*}" && "$a" != -* ]]; then return 0; fi
  done
  return 1
}
if [ "${1:-}" = "--fast" ]; then
  shift
  set -- -n 4 -m "not engine" "${FAST_TIERS[@]}" "$@"
elif ! names_a_test "$@"; then
  set -- -n 4 --dist loadgroup "$@" tests
fi
exec python -m pytest -q -p no:cacheprovider -rs "$@"
