#!/usr/bin/env bash
# The main job with embedded defaults (see README). Replaced step by step as parts land.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/kvtier --help
