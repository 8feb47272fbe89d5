#!/usr/bin/env bash
# Install (once) and run the tests; arguments go to pytest. The 25 slowest tests are listed at the end.
#   bash scripts/test.sh [-k name] [tests/test_x.py] ...
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
set +e
"$ROOT/.venv/bin/python" -m pytest -q --durations=25 "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    echo "test.sh: pytest collected no tests: treating as a failure" >&2
    exit 1
fi
exit $rc
