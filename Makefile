# The two commands of the README. Both set up what they need and are idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: demo demo-clean demo-fleet test lint typecheck layering unit kernels setup setup-dev

demo: setup
	bash scripts/demo.sh

# Stop a demo server still running and delete the demo's L3, logs and reports.
demo-clean: setup
	bash scripts/demo.sh clean

# One Redis (the shared L4 tier) and two kvtier serve hosts; each session's turns alternate
# between the hosts (scripts/demo_fleet.sh --help). It stops everything it started.
demo-fleet: setup
	bash scripts/demo_fleet.sh

test: setup-dev lint typecheck layering unit kernels

setup:
	@bash scripts/bootstrap.sh run

setup-dev:
	@bash scripts/bootstrap.sh dev

lint:
	$(VENV)/bin/ruff format --check kvtier ops tests bench
	$(VENV)/bin/ruff check kvtier ops tests bench

# The tests are not type-clean as a whole, but an unknown attribute or name in them is a bug:
# a test that skips here (it needs CUDA or two GPUs) would carry it unseen until a GPU run.
typecheck:
	$(VENV)/bin/mypy
	@out=$$($(VENV)/bin/mypy --no-error-summary tests/kvtier tests/ops tests/bench 2>&1); \
	  [ $$? -le 1 ] || { echo "$$out"; echo "mypy could not check the tests"; exit 1; }; \
	  if echo "$$out" | grep -E "\[(attr-defined|name-defined)\]"; then \
	    echo "tests use attributes or names that do not exist (above)"; exit 1; fi

layering:
	$(VENV)/bin/lint-imports

unit:
	$(PY) -m pytest -q -p no:cacheprovider

# The Triton kernels' tests need CUDA, so `unit` skips them on a machine without a GPU; here a
# subset of them (the `interpret` mark) runs in Triton's CPU interpreter instead, so the kernels'
# logic is checked on every change: about a minute on 2 cores (tests/kvtier/test_paged_triton.py,
# and the fused norm and activation kernels of tests/kvtier/test_fused.py).
kernels:
	CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider -m interpret \
	  tests/kvtier/test_paged_triton.py tests/kvtier/test_fused.py
