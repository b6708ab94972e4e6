# The README's two commands are `make demo` and `make test`; both run `make setup` first.
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
export PATH := $(CURDIR)/.bin:$(CURDIR)/.venv/bin:$(PATH)
PYTEST_ARGS ?=

.PHONY: setup test lint demo bed down bench lock crds

setup:
	@bash scripts/setup.sh

lint: setup
	ruff check .
	ruff format --check .
	lint-imports
	rlfleet crds check

test: lint
	pytest $(PYTEST_ARGS)

demo: setup
	rlfleet run examples/local.yaml

bed: setup
	@bash scripts/bed.sh

down: setup
	rlfleet dev down

bench: setup
	@for b in bench/*.py; do python "$$b"; done

crds: setup
	rlfleet crds generate

# Re-resolve requirements/lock.txt after changing requirements/direct.txt.
lock:
	@source versions.env && "$${XDG_CACHE_HOME:-$$HOME/.cache}/rlfleet/uv-$$UV_VERSION/bin/uv" pip compile \
	  --quiet --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	  requirements/direct.txt --override requirements/overrides.txt -o requirements/lock.txt
