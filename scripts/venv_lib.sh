# Shared by scripts/setup.sh and scripts/setup_vllm.sh (sourced, after `set -euo pipefail`):
# quiet command runs, the python check and venv creation. Expects PYTHON to be set.

say() { echo "$(basename "$0"): $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT

# Run quietly; on failure show what it printed and stop.
run() {
    if ! "$@" >"$LOG" 2>&1; then
        say "FAILED: $*"
        tail -n 60 "$LOG" >&2
        exit 1
    fi
}

check_python() {
    command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found (install python3 >= 3.10)"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || die "python >= 3.10 required, found $("$PYTHON" --version 2>&1)"
}

# make_venv DIR: (re)create DIR unless it holds a working python
make_venv() {
    if [[ ! -x "$1/bin/python" ]] || ! "$1/bin/python" -c 'import sys' >/dev/null 2>&1; then
        say "creating $1"
        rm -rf "$1"
        if ! "$PYTHON" -m venv "$1" >"$LOG" 2>&1; then
            tail -n 20 "$LOG" >&2
            die "could not create a venv (on Debian: apt-get install python3-venv)"
        fi
    fi
}
