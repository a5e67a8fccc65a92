# The two commands of the README. Both set up what they need and are idempotent.
VENV ?= .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: demo demo-clean demo-fleet test lint typecheck layering unit setup setup-dev

demo: setup
	bash scripts/demo.sh

# Stop a demo server still running and delete the demo's L3, logs and reports.
demo-clean: setup
	bash scripts/demo.sh clean

# One Redis (the shared L4 tier) and two kvtier serve hosts; each session's turns alternate
# between the hosts (scripts/demo_fleet.sh --help). It stops everything it started.
demo-fleet: setup
	bash scripts/demo_fleet.sh

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
