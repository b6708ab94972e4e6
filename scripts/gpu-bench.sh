#!/usr/bin/env bash
# `bench/gpu.py` on a GPU machine that has no registry (the device machine): installs what
# `scripts/gpu-wheels.sh` put in ./.whl beside its own torch, then runs the benchmark with
# the repository's source roots on the path. Arguments go to bench/gpu.py.
set -euo pipefail
cd "$(dirname "$0")/.."
site=${RLFLEET_GPU_SITE:-/tmp/site}
pip=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site")
"${pip[@]}" --upgrade .whl/*.whl
DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation .whl/deepspeed-*.tar.gz
export PYTHONPATH="$site:core:trainer:weightsync:rollout" PYTHONUNBUFFERED=1
exec python3 bench/gpu.py "$@"
