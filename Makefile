# The README's two commands are `make demo` and `make test`; both run `make setup` first.
# `setup` is the Python environment, all a local run (`make demo`) needs; `binaries` the test
# bed's Kubernetes, etcd, kwok and helm, and the tests' S3 server (versitygw), built from Go
# modules for what starts the bed.
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
export PATH := $(CURDIR)/.bin:$(CURDIR)/.venv/bin:$(PATH)
PYTEST_ARGS ?=

.PHONY: setup binaries test unit lint demo bed down bench bench-quick lock crds docs

setup:
	@bash scripts/setup.sh

binaries: setup
	@bash scripts/build-binaries.sh

lint: setup
	ruff check .
	ruff format --check .
	lint-imports
	rlfleet crds check
	rlfleet docs check

# The whole suite on two workers, as this 2-core machine has cores: one process left one
# core idle about half the time. Each worker takes whole modules, the bed tier as one
# (`tests/tiers.py`); `pytest` alone runs the same suite in one process.
TEST_WORKERS ?= 2
test: lint binaries
	pytest -n $(TEST_WORKERS) --no-loadscope-reorder $(PYTEST_ARGS)

# The inner loop: every test that starts no server, engine or cluster (tests/unit/), in
# under two minutes; `docs/guides/development.md` says which tier to run for a change.
# Some render the chart with helm, so the bed's binaries (cached after the first build).
unit: binaries
	pytest -q tests/unit $(PYTEST_ARGS)

demo: setup
	rlfleet run examples/local.yaml

bed: binaries
	@bash scripts/bed.sh

down: binaries
	rlfleet dev down

bench: binaries
	@for b in bench/*.py; do python "$$b"; done

# Every benchmark's quick mode (small sizes, the keys it prints checked), the long ones too:
# about 25 minutes on 2 cores. `make test` runs the short ones.
bench-quick: binaries
	RLFLEET_BENCH_QUICK_ALL=1 pytest -q tests/engines/test_bench_quick.py $(PYTEST_ARGS)

crds: setup
	rlfleet crds generate

# The site (mkdocs.yml) into .rlfleet/site: its reference pages must match the code
# (`rlfleet docs generate` rewrites them), and a warning or a broken link fails the build.
docs: setup
	rlfleet docs check
	NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet

# Re-resolve the lock after changing a dependency set in pyproject.toml: requirements/lock.txt
# holds the whole environment (`dev`); requirements/<set>.txt each image's set, at the
# lock's versions (`engine-cpu` stands in for the rollout image's vLLM in its environment
# test). Pins already in the lock stay unless pyproject.toml moves them.
IMAGE_SETS := operator trainer rollout engine-cpu
lock:
	@source versions.env && uv="$${XDG_CACHE_HOME:-$$HOME/.cache}/rlfleet/uv-$$UV_VERSION/bin/uv" && \
	  compile() { "$$uv" pip compile --quiet --python-version 3.11 \
	    --python-platform x86_64-manylinux_2_28 --override requirements/overrides.txt pyproject.toml "$$@"; } && \
	  compile --extra dev -o requirements/lock.txt && \
	  for set in $(IMAGE_SETS); do \
	    compile --extra $$set -c requirements/lock.txt --no-header --no-annotate -o requirements/$$set.txt; \
	  done
