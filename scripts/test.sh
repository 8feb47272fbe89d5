#!/usr/bin/env bash
# Install (once) and run the tests; arguments go to pytest. The 25 slowest tests are listed at the end.
#   bash scripts/test.sh [-k name] [tests/test_x.py] ...
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
# the tests run engines in pytest and in several mesh processes at once: OpenMP threads must not
# spin while they wait, or each process's threads take the cores from the others' (libs/launcher.py)
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
set +e
"$ROOT/.venv/bin/python" -m pytest -q --durations=25 "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    echo "test.sh: pytest collected no tests: treating as a failure" >&2
    exit 1
fi
exit $rc
