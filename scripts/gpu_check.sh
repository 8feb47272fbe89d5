#!/usr/bin/env bash
# The GPU check of the Triton kernels (docs/kernels.md), for a machine with a CUDA GPU:
#
#   bash scripts/gpu_check.sh            # ~2-4 minutes; every step has its own time limit, 280 s in all
#
#   1. the kernel tests natively on the GPU (tests/kernel/test_triton_kernels.py: each kernel
#      vs its torch reference, bf16 as half precision);
#   2. the engine test (greedy output identical on the torch and Triton paths) under
#      TRITON_INTERPRET=1: the engine itself runs on the CPU, so its Triton path runs
#      in the interpreter there;
#   3. benchmarks/bench_kernels.py: each Triton kernel vs the torch reference, ms per
#      call side by side with the ratio.
#
# Python: $PYTHON if set, else .venv/bin/python when its torch sees CUDA, else python3
# (a CUDA build of torch, triton, pytest, and deepinfer's own dependencies for step 2). Where `deepinfer`
# is not installed, the repository is put on PYTHONPATH in its installed layout.
#
# Without a CUDA device it says so and exits 1: on a CPU the same tests run under the
# interpreter with `pytest tests/kernel/test_triton_interpreter.py`. Exit status: 0 when
# every step passed, 1 otherwise (all steps still run).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
say() { echo "gpu_check.sh: $*" >&2; }

has_cuda() { "$1" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' >/dev/null 2>&1; }
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]] && has_cuda "$ROOT/.venv/bin/python"; then
    PY="$ROOT/.venv/bin/python"
else
    PY="$(command -v python3 || true)"
fi
if [[ -z "$PY" ]] || ! has_cuda "$PY"; then
    say "no CUDA device visible to torch (python: ${PY:-none}; torch: $("${PY:-python3}" -c 'import torch; print(torch.__version__)' 2>&1 | tail -1)): nothing checked."
    say "On a CPU the kernels are tested under the Triton interpreter: .venv/bin/python -m pytest tests/kernel/test_triton_interpreter.py"
    exit 1
fi
if ! "$PY" -c 'import triton, pytest' >/dev/null 2>&1; then
    say "$PY lacks triton or pytest (pip install 'triton>=3.4,<4' pytest)"
    exit 1
fi

# deepinfer's engine and kernels live in libs/ (pyproject's package-dir: deepinfer <- libs/); without an install, a shim
if ! "$PY" -c 'import deepinfer.kernels.attention' >/dev/null 2>&1; then
    SHIM="$(mktemp -d)"
    trap 'rm -rf "$SHIM"' EXIT
    mkdir "$SHIM/deepinfer"
    for f in "$ROOT"/libs/*; do ln -s "$f" "$SHIM/deepinfer/"; done
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
    say "deepinfer not installed for $PY: using $SHIM"
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
"$PY" -c 'import sys, torch, triton; print(f"python {sys.version.split()[0]}  torch {torch.__version__} (CUDA {torch.version.cuda})  triton {triton.__version__}  GPU {torch.cuda.get_device_name()}")'

failed=()
step() {  # step NAME SECONDS command...
    local name="$1" limit="$2"
    shift 2
    echo
    echo "== $name (limit ${limit}s)"
    local start=$SECONDS
    timeout -k 10 "$limit" "$@"
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - start))s"
    [[ $rc -eq 0 ]] || failed+=("$name (rc=$rc)")
}

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs --noconftest)  # conftest starts NATS/redis: not needed
step "kernel tests, native" 100 env -u TRITON_INTERPRET "${PYTEST[@]}" tests/kernel/test_triton_kernels.py -k "not engine"
step "engine test, interpreter" 90 env TRITON_INTERPRET=1 "${PYTEST[@]}" tests/kernel/test_triton_kernels.py -k engine
step "benchmark" 90 env -u TRITON_INTERPRET "$PY" benchmarks/bench_kernels.py

echo
if [[ ${#failed[@]} -gt 0 ]]; then
    say "FAILED: ${failed[*]}"
    exit 1
fi
say "all steps passed"
