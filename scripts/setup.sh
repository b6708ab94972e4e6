#!/usr/bin/env bash
# One idempotent setup: a fresh Debian machine with Python 3.11 to the Python environment a
# local run needs (the bed's binaries are `make binaries`, scripts/build-binaries.sh).
# Installs into ./.venv (git-ignored); everything downloaded or built is
# cached per version under the user's cache directory, so a fresh clone sets up in seconds.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source versions.env
cache=${RLFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rlfleet}
start=$(date +%s)

uv_home="$cache/uv-$UV_VERSION"
if [ ! -x "$uv_home/bin/uv" ]; then
  echo "installing uv $UV_VERSION"
  python3 -m pip install --quiet --disable-pip-version-check --target "$uv_home" "uv==$UV_VERSION"
fi
uv="$uv_home/bin/uv"

if [ ! -x .venv/bin/python ]; then
  "$uv" venv --quiet --python "python$PYTHON_VERSION" .venv
fi
stamp=.venv/.rlfleet-lock
# The editable install maps each top-level subpackage, so a new one means reinstalling.
want=$( (cat requirements/lock.txt requirements/overrides.txt pyproject.toml setup.py scripts/setup.sh \
  examples/environments/*/pyproject.toml; ls -d ./*/rlfleet/*/) |
  sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "syncing the Python environment with requirements/lock.txt"
  # Bytecode compiled once here: this machine and CI set PYTHONDONTWRITEBYTECODE, so without
  # it every process compiles torch, transformers and vLLM from source again (an import of
  # vLLM 28 s instead of 14, a CPU engine's start 2.5 min instead of under 1).
  VIRTUAL_ENV="$root/.venv" "$uv" pip sync --quiet --compile-bytecode requirements/lock.txt
  VIRTUAL_ENV="$root/.venv" "$uv" pip install --quiet --no-deps -e .
  # The examples' environments, so that `rlfleet run examples/lookup.yaml` finds its own.
  for example in examples/environments/*/; do
    VIRTUAL_ENV="$root/.venv" "$uv" pip install --quiet --no-deps -e "$example"
  done
  echo "$want" > "$stamp"
fi

echo "setup done in $(( $(date +%s) - start ))s"
