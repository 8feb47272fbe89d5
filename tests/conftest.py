"""Shared fixtures: real nats-server / redis-server and whole meshes, started by
the same launcher code that ``deepinfer up`` uses.

- ``nats_url`` / ``redis_url``: one nats-server (JetStream on) and one
  redis-server for the whole session, on free ports.
- ``mesh``: one mesh (default model, tokenizer + prefill + decode + gateway)
  for the whole session; tests must not break it (no kills, no restarts).
- ``openai_client``: the official ``openai`` client pointed at ``mesh``.
- ``make_mesh``: start a private mesh for destructive tests (kill a worker,
  restart one...); each one is stopped when the test ends.
- ``@pytest.mark.quiet``: a test that measures latency against a bound runs
  alone: under ``-n N`` the other test workers finish their current test and
  wait (``cpu_turn``), so another test's load is not measured as its own.
- ``@pytest.mark.timing``: a test that asserts a wall-clock or memory bound (a benchmark in
  disguise: it can fail because the machine is slow or busy, not because the behaviour broke). It
  is deselected unless the ``-m`` expression mentions ``timing`` (``pytest -m timing``, or
  ``-m "timing or not timing"`` for everything); its behaviour is checked untimed by a sibling test
  in the default run.

Logs of every process are kept under pytest's temporary directory
(``<basetemp>/mesh*/logs``) for debugging a failed run.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import functools
import gc
import os
import re
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Callable

import pytest

from deepinfer.launcher import Mesh, start_nats, start_redis

# tests/ mirrors the source folders (engine/, gateway/, kvstore/, mesh/, ...); a test module imports the
# shared helpers here (model_helpers, gateway_harness, cli_args, waiting: polls with a deadline) and other
# modules' helpers by file name
TESTS = Path(__file__).resolve().parent
TEST_FOLDERS = sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name[0] not in "._")
for _folder in (TESTS, *TEST_FOLDERS):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

# Meshes started by the tests run fp32 unless a test asks otherwise (``env={"DEEPINFER_DTYPE": ...}``):
# their outputs are pinned token for token against ``transformers`` in fp32, and ``--dtype auto``
# would pick bf16 on a CPU with fast bf16 GEMMs (tests/engine/test_dtype.py covers that choice).
os.environ.setdefault("DEEPINFER_DTYPE", "float32")
# ... on a 0.5 GB KV cache (the default 1 GB): room for the whole 8,192-token context in fp32, and the
# memory of the meshes that run at once (two test workers: the groups below) stays well inside the host
os.environ.setdefault("DEEPINFER_KV_CACHE_GB", "0.5")
# Start-up timings (``deepinfer.probe_cache``) are shared by this run's processes (the test workers
# and every mesh they start: a mesh then starts in ~10 s instead of ~20), in a directory of the
# run's own: a test that fakes a timing never leaves it for a later run or for the user's meshes.
os.environ.setdefault("DEEPINFER_PROBE_CACHE", os.path.join(
    tempfile.gettempdir(), f"deepinfer-probes-{os.environ.get('PYTEST_XDIST_TESTRUNUID') or os.getpid()}"))

_libc_name = ctypes.util.find_library("c")
_libc = ctypes.CDLL(_libc_name) if _libc_name else None
if _libc is not None and not hasattr(_libc, "malloc_trim"):  # not glibc
    _libc = None

MESH_START_TIMEOUT = 300  # seconds for services to become healthy (the model is converted before)


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory) -> str:
    proc = start_nats(tmp_path_factory.mktemp("nats"))
    yield proc.url
    proc.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    proc = start_redis(tmp_path_factory.mktemp("redis"))
    yield proc.url
    proc.stop()


@pytest.fixture(scope="session")
def mesh(tmp_path_factory) -> Mesh:
    m = Mesh(workdir=tmp_path_factory.mktemp("mesh"))
    m.start(timeout=MESH_START_TIMEOUT)  # stops what it started if it fails
    yield m
    m.stop()


@pytest.fixture
def openai_client(mesh):
    import openai

    client = openai.OpenAI(base_url=mesh.gateway_url + "/v1", api_key="test", max_retries=0, timeout=120)
    yield client
    client.close()


@pytest.fixture
def make_mesh(tmp_path_factory) -> Callable[..., Mesh]:
    """Factory: ``make_mesh(replicas={"decode": 2}, ...)`` -> a started private Mesh.

    Takes ``Mesh``'s keyword arguments, plus ``timeout``. Every mesh it made is
    stopped at the end of the test, whatever happened.
    """
    started: list[Mesh] = []

    def _make(timeout: float = MESH_START_TIMEOUT, **kwargs) -> Mesh:
        kwargs.setdefault("workdir", tmp_path_factory.mktemp("mesh-private"))
        m = Mesh(**kwargs)
        started.append(m)
        m.start(timeout=timeout)
        return m

    yield _make
    for m in reversed(started):
        m.stop()


def pytest_runtest_teardown(item):
    """Free a test's engines before the next test: an engine sits in reference cycles, so the ones a
    module's tests create stay until Python's cyclic collector happens to run (test_engine.py with
    test_spec_decode.py in one process: peak RSS 8.9 GB without this, 7.6 GB with it). Only modules
    that build engines in-process pay for the collection."""
    module = getattr(item, "module", None)
    if module is not None and "LLMEngine" in vars(module):
        gc.collect()
        if _libc is not None:
            _libc.malloc_trim(0)  # hand the freed heap back to the OS, so the next test starts lean


@contextlib.contextmanager
def cpu_turn(rootdir: Path, exclusive: bool):
    """A readers-writer lock over the test workers of one run (files keyed by the root dir):
    every test holds it shared; a ``quiet`` test holds it exclusively. A ``gate`` lock gives the
    exclusive side priority: while a quiet test waits, other workers start no new test."""
    base = Path(tempfile.gettempdir()) / f"deepinfer-tests-{zlib.crc32(str(rootdir).encode()):08x}"
    with open(f"{base}.gate", "a+") as gate, open(f"{base}.lock", "a+") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, each test (with the module fixtures its setup and teardown start or stop)
    runs inside ``cpu_turn``: a ``quiet`` one alone."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    with cpu_turn(item.config.rootpath, item.get_closest_marker("quiet") is not None):
        yield


# Modules that start meshes but do not use the session ``mesh``, run in the session mesh's lane to
# balance the two lanes (by their measured time; a module not named here runs in the other lane)
SESSION_MESH_LANE = {"test_failover.py", "test_reliability_mesh.py"}


@functools.cache
def _test_kind(path: str) -> str:
    """Which worker a test module runs on under ``-n N`` (scripts/test.sh): a module that starts
    meshes of engine processes (~1 GB per engine process: the session ``mesh``, ``make_mesh``, or a
    ``Mesh`` of its own that is not only mock workers) in one of two lanes, "meshes" (the session
    ``mesh``'s users, which then start it once, and ``SESSION_MESH_LANE``) or "meshes-2"; "engines"
    for one that builds engines in-process (a few GB at its peak); else the module itself."""
    text = (Path(__file__).parent.parent / path).read_text(encoding="utf-8")
    session_mesh = (re.search(r"\bopenai_client\b|def test_\w+\([^)]*\bmesh\b", text)
                    and not re.search(r"^(async )?def mesh\(", text, re.M))
    if session_mesh or Path(path).name in SESSION_MESH_LANE:
        return "meshes"
    if re.search(r"\bmake_mesh\b|def test_\w+\([^)]*\bmesh\b", text) or (
            re.search(r"\bMesh\(", text) and "MOCK_ARGS" not in text):
        return "meshes-2"
    return "engines" if "LLMEngine" in text else path


def pytest_xdist_make_scheduler(config, log):
    """``-n N --dist loadscope``: scopes by ``_test_kind``, so the tests that start meshes run one
    after another in two lanes and the in-process engine tests in a third, side by side: at most
    three meshes at once (the session mesh stays up beside a private one in its lane; ~1 GB per
    engine process; ~11 GB of a 24 GB host in use at the peak under ``-n 3``), and a module's
    module-scoped mesh is built once. The other modules spread over the workers."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByKind(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _test_kind(nodeid.split("::")[0])

    return ByKind(config, log)


# What makes a test module an integration test: it starts servers or processes (a mesh, nats-server,
# redis-server, the CLI, a subprocess) or builds an engine on model weights in-process.
INTEGRATION = re.compile(r"\bMesh\(|\bmake_mesh\b|\bopenai_client\b|def test_\w+\([^)]*\bmesh\b|\bnats_url\b|"
                         r"\bredis_url\b|\bstart_nats(_server)?\b|\bstart_redis\b|\bsubprocess\b|\bLLMEngine\b|"
                         r"\bengine_greedy\b|\bMockEngine\b")


@functools.cache
def _test_level(path: Path) -> str:
    """"integration" or "unit" for a test module (``INTEGRATION``)."""
    return "integration" if INTEGRATION.search(path.read_text(encoding="utf-8")) else "unit"


def pytest_collection_modifyitems(config, items):
    """Every test is marked ``unit`` (in-process, no servers: ``pytest -m unit``) or ``integration``
    (``_test_level`` of its module), unless it carries one of the two itself. ``timing`` tests are
    deselected unless the ``-m`` expression mentions ``timing``."""
    for item in items:
        if item.get_closest_marker("unit") is None and item.get_closest_marker("integration") is None:
            item.add_marker(_test_level(Path(item.fspath)))
    if "timing" not in (config.option.markexpr or ""):
        timed = [item for item in items if item.get_closest_marker("timing") is not None]
        if timed:
            config.hook.pytest_deselected(items=timed)
            items[:] = [item for item in items if item.get_closest_marker("timing") is None]
