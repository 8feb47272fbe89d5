"""Start-up timings kept on disk, so that the next process on the same machine reads them instead of
timing again.

An engine times its CPU at start-up before it serves: which rows packed GEMM wins
(``models.layers.tune_packed_rows``), whether bf16 beats fp32 (``engine.dtype_choice``), threads per
step (``engine.step_threads``), the step cost model (``LLMEngine.calibrate``). On a 2-core host that
is ~8 s of a worker's ~10 s start (SmolLM2-135M, fp32), and a mesh starts two engines side by side.
The figures are properties of the machine, the software and the settings, so each one is stored
under a key naming what it timed, in a file per machine identity (CPU model and flags, torch and
deepinfer versions, intra-op threads, the OpenMP wait policy): a process with other settings, or on
another CPU, times afresh. Entries older than ``MAX_AGE_S`` are timed again, so one noisy start-up
does not decide for ever.

``$DEEPINFER_PROBE_CACHE``: unset: ``$DEEPINFER_CACHE/probes`` (default ``~/.cache/deepinfer/probes``);
a directory: that one; ``0``: off (every process times everything; tests that fake a probe use it).
Only plain measurements are cached (numbers, never a choice): the choices are made again from them
and logged each start-up, after one line saying that (and which file) the timings came from. Processes
take turns on a file (a lock held while timing), so workers that start together time each thing once,
one at a time; writes are atomic (a temp file renamed over the old one).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import math
import os
import platform
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

from deepinfer.telemetry import get_logger

T = TypeVar("T")
log = get_logger(__name__)

MAX_AGE_S = 24 * 3600.0
VERSION = 1  # bump when what a key means changes

_logged: set[Path] = set()  # cache files this process said it read from
_inside = threading.local()  # .measuring: this thread runs a ``measure`` under the lock


def _directory() -> Path | None:
    where = os.environ.get("DEEPINFER_PROBE_CACHE", "")
    if where == "0":
        return None
    if where and where != "1":
        return Path(where)
    root = os.environ.get("DEEPINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")
    return Path(root) / "probes"


@functools.cache
def _host_and_code() -> dict:
    """The CPU (model name, a hash of its flags, cores), torch's version, and a hash of this
    package's source files (their names, sizes and modification times: changed code is timed again)."""
    import torch

    cpu = flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = (part.strip() for part in line.partition(":"))
            if name == "model name" and not cpu:
                cpu = value
            elif name == "flags" and not flags:
                flags = hashlib.sha256(value.encode()).hexdigest()[:16]
    except OSError:
        pass
    package = Path(__file__).parent
    code = hashlib.sha256()
    for f in sorted(p for suffix in ("*.py", "*.c") for p in package.rglob(suffix)):
        st = f.stat()
        code.update(f"{f.relative_to(package)} {st.st_size} {st.st_mtime_ns}\n".encode())
    return {"version": VERSION, "cpu": cpu or platform.processor(), "cpu_flags": flags, "cores": os.cpu_count(),
            "torch": torch.__version__, "code": code.hexdigest()[:16]}


def machine() -> dict:
    """What every cached timing depends on besides its own key: ``_host_and_code`` and the
    settings of this moment (intra-op threads, the OpenMP wait policy)."""
    import torch

    return {**_host_and_code(), "threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", "")}


def _path(directory: Path) -> Path:
    ident = json.dumps(machine(), sort_keys=True)
    return directory / f"{hashlib.sha256(ident.encode()).hexdigest()[:24]}.json"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data.get("entries", {}) if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _valid(value: object) -> bool:
    """A result worth keeping: None or a non-finite float says a timing could not run (a dummy
    step that did not fit this engine's KV cache), which is no property of the machine."""
    return value is not None and not (isinstance(value, float) and not math.isfinite(value))


def measured(kind: str, key: object, measure: Callable[[], T]) -> T:
    """``measure()``'s result for ``(kind, key)``: read from this machine's cache file when a
    process timed it there within ``MAX_AGE_S``, else timed now and stored (unless None or not
    finite: ``_valid``). ``key`` and the result must survive JSON (numbers, strings, None, lists;
    tuples come back as lists). Processes that start together take turns (a lock file beside the
    cache file, held while timing): the second reads what the first timed instead of timing on
    the same cores at the same moment. Never raises for the cache itself: an unreadable or
    unwritable cache means timing every time."""
    directory = _directory()
    if directory is None or getattr(_inside, "measuring", False):  # (a timing inside a timing: no lock twice)
        return measure()
    name = f"{kind}:{json.dumps(key, sort_keys=True, default=str)}"
    path = _path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")
    except OSError as e:
        log.warning("probe cache not usable", path=str(path), error=str(e))
        return measure()
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes, or the process dies)
        entries = _read(path)
        entry = entries.get(name)
        if isinstance(entry, dict) and "value" in entry and time.time() - entry.get("at", 0) < MAX_AGE_S:
            if path not in _logged:
                _logged.add(path)
                log.info("start-up timings read from the probe cache", path=str(path),
                         how_to_time_again="DEEPINFER_PROBE_CACHE=0")
            return entry["value"]
        _inside.measuring = True
        try:
            value = measure()
        finally:
            _inside.measuring = False
        if _valid(value):
            _write(path, {**_read(path), name: {"value": value, "at": time.time()}})
        return value


def _write(path: Path, entries: dict) -> None:
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump({"machine": machine(), "entries": entries}, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as e:
        log.warning("probe cache not written", path=str(path), error=str(e))
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
