#!/usr/bin/env bash
# The wheels `bench/gpu.py` needs on a GPU machine that has Python 3.12, torch,
# transformers and numpy but no registry: the rest of the trainer's and weightsync's
# dependency sets at the lock's versions, into ./.whl (git-ignored), and DeepSpeed's
# source archive, which installs there without compiling ops (the trainer uses torch's
# AdamW). `scripts/gpu-bench.sh` installs them there and runs the benchmark.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# transformers at the lock's version: the trainer's kernels register into its internals;
# regex and typing-extensions at the lock's too, as transformers and pydantic check theirs.
wheels=(msgspec nats-py zstandard xxhash pydantic pydantic-core annotated-types
  typing-inspection typing-extensions regex hjson transformers)
pins=()
for name in "${wheels[@]}"; do
  pins+=("$(grep -i "^${name}==" requirements/lock.txt)")
done
rm -rf .whl && mkdir .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
python3 -m pip download --quiet --no-deps --no-binary=:all: -d .whl \
  "$(grep -i '^deepspeed==' requirements/lock.txt)"
du -sh .whl
