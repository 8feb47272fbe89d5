#!/usr/bin/env bash
# Install (once) and run the tests; arguments go to pytest. The 25 slowest tests are listed at the end.
#   bash scripts/test.sh                        # the main suite (tests/, in .venv), then the vLLM backend's
#                                               # (tests_vllm/, in .venv-vllm: scripts/setup_vllm.sh)
#   bash scripts/test.sh [-k name] [tests/engine/test_x.py] ...   # only the main suite, with these arguments
#   bash scripts/test.sh --vllm [pytest args]   # only the vLLM backend's tests
# DEEPINFER_SKIP_VLLM=1 leaves the vLLM tests out of a full run (the second environment is ~4
# minutes to build and ~900 MB). DEEPINFER_TEST_WORKERS=N (default 3) runs the main suite on N pytest
# workers (pytest-xdist; 1: in one process): much of the suite waits on mesh processes, so three
# workers keep 2 cores busy (2 cores: 662 s on 2 workers, 572 s on 3, 2026-12-07). Tests that start
# meshes run in two lanes, tests that build engines in-process in a third (tests/conftest.py), so
# the peak memory stays well inside a 24 GB host (~11 GB used at the peak on 3 workers).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# the tests run engines in pytest and in several mesh processes at once: OpenMP threads must not
# spin while they wait, or each process's threads take the cores from the others' (libs/launcher.py)
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"

# pytest in one environment; pytest's "no tests collected" (5) counts as a failure
suite() {
    local python="$1"
    shift
    set +e
    "$python" -m pytest -q "$@"
    local rc=$?
    set -e
    if [[ $rc -eq 5 ]]; then
        echo "test.sh: pytest collected no tests: treating as a failure" >&2
        rc=1
    fi
    return $rc
}

vllm_suite() {
    bash "$ROOT/scripts/setup_vllm.sh" || return $?
    local where=tests_vllm arg  # pyproject's testpaths is tests/: name tests_vllm unless a path in it is given
    for arg in "$@"; do [[ "$arg" == tests_vllm* ]] && where=""; done
    suite "$ROOT/.venv-vllm/bin/python" --durations=10 ${where:+"$where"} "$@"
}

if [[ "${1:-}" == "--vllm" ]]; then
    shift
    vllm_suite "$@"
    exit $?
fi

bash "$ROOT/scripts/setup.sh"
# the embedded models' one-time conversions (the default model; Gemma-3-270M for the model-family
# tests): set-up, done before the suite so no test's time includes them (a no-op once converted)
"$ROOT/.venv/bin/python" -c 'from deepinfer.models.convert import ensure_default_model, ensure_gemma3_270m
ensure_default_model(progress=False); ensure_gemma3_270m(progress=False)'
rc=0
workers="${DEEPINFER_TEST_WORKERS:-3}"
parallel=()
[[ "$workers" -gt 1 ]] && parallel=(-n "$workers" --dist loadscope)
suite "$ROOT/.venv/bin/python" "${parallel[@]}" --durations=25 "$@" || rc=$?
if [[ $# -eq 0 && "${DEEPINFER_SKIP_VLLM:-}" != 1 ]]; then
    echo "test.sh: the vLLM backend's tests (tests_vllm/, .venv-vllm)" >&2
    vllm_suite || { r=$?; [[ $rc -ne 0 ]] || rc=$r; }
fi
exit $rc
