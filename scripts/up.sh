#!/usr/bin/env bash
# Install (once) and start the whole mesh on the embedded default model.
#   bash scripts/up.sh [--port 8000] [--mode agg|disagg] [--workers N] [--prefill N] [--decode N] [--tokenizer N] [--model DIR]
# Ctrl-C stops everything.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/deepinfer" up "$@"
