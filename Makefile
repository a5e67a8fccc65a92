# The two commands of the README. Both set up what they need and are idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: demo demo-clean test lint typecheck layering unit setup setup-dev

demo: setup
	bash scripts/demo.sh

# Stop a demo server still running and delete the demo's L3, logs and reports.
demo-clean: setup
	bash scripts/demo.sh clean

test: setup-dev lint typecheck layering unit

setup:
	@bash scripts/bootstrap.sh run

setup-dev:
	@bash scripts/bootstrap.sh dev

lint:
	$(VENV)/bin/ruff format --check kvtier ops tests bench
	$(VENV)/bin/ruff check kvtier ops tests bench

typecheck:
	$(VENV)/bin/mypy

layering:
	$(VENV)/bin/lint-imports

unit:
	$(PY) -m pytest -q -p no:cacheprovider
