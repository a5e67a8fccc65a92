#!/usr/bin/env bash
# Set up everything `make demo` / `make test` need on a fresh Debian machine. Idempotent: a second
# run only checks stamps and returns in about a second.
#   scripts/bootstrap.sh          runtime (+ server extra) for the demo
#   scripts/bootstrap.sh dev      also dev tools and the Debian packages the tests need
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-run}"
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi

# torch: users bring their own (often a CUDA build). Only where none is importable do we install
# the CPU build, so that a plain dependency resolution never pulls a multi-GB CUDA wheel.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "bootstrap: no torch in $VENV; installing the CPU build"
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" \
    || "$VENV/bin/python" -m pip install -q torch --index-url "https://download.pytorch.org/whl/cpu"
fi

extra="server"
[ "$mode" = "dev" ] && extra="dev"
stamp="$VENV/.stamp-$extra-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "bootstrap: installing kvtier[$extra] (editable)"
  "$VENV/bin/python" -m pip install -q -e ".[$extra]"
  touch "$stamp"
fi

if [ "$mode" = "dev" ]; then
  # Debian packages the tests use: promtool + prometheus server (rules tests, real scrape),
  # tmux (kvtop end-to-end), redis-server (the L4 tests start one, and a 3+3 cluster), haproxy
  # (the fleet test, tests/kvtier/test_fleet.py). Installed only when missing.
  need=()
  command -v promtool >/dev/null || need+=(prometheus)
  command -v tmux >/dev/null || need+=(tmux)
  command -v redis-server >/dev/null || need+=(redis-server)
  command -v haproxy >/dev/null || need+=(haproxy)
  if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then
      echo "bootstrap: apt-get install ${need[*]}"
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    else
      echo "bootstrap: missing Debian packages ${need[*]} (run as root or sudo apt-get install them)" >&2
    fi
  fi
fi
