"""A mesh spread over several "hosts": Linux network namespaces joined by one bridge.

Every other mesh test runs all its services in one network namespace, where they all reach
each other over 127.0.0.1: a service that ignored its configured address, or bound where
no other host can reach it, would go unnoticed. Here each "host" is a network namespace
of its own, with only ``lo`` and one veth on a shared bridge, so the services reach each
other through their configured addresses on the bridge or not at all:

- ``infra``    10.X.Y.1: nats-server (JetStream) and redis-server, bound to that address only;
- ``workers``  10.X.Y.2: the tokenizer, the kvindex, a prefill and a decode worker;
- ``workers2`` 10.X.Y.4: a second decode worker (the survivor when the first one dies);
- ``front``    10.X.Y.3: the gateway, HTTP on its own address, and the test's client.

The engine workers run the mock engine (real scheduler, block manager and storage tier; no
weights), so the mesh starts in seconds. They share one storage-tier directory
(``DEEPINFER_KV_ROOT``): the file system is not namespaced, as NFS would be shared by real
hosts. The processes are started with ``ip netns exec <host> ...``; the test itself enters a
namespace from a thread of its own (``setns`` moves only the calling thread), so its HTTP
client talks to the gateway from ``front`` as a client on another host would.

Checks: the isolation itself (loopback in ``workers`` does not reach nats, the bridge
address does), a chat completion through the official ``openai`` client, plain and
streamed, a stored response (gateway -> Redis across hosts), and a decode worker SIGKILLed
mid-stream: the stream resumes on the other host's decode worker with the same text.

Needs root and iproute2 (``ip``); skipped otherwise, or when namespaces cannot be created.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import httpx
import openai
import pytest

from deepinfer.launcher import ManagedProcess, nats_server_binary, redis_server_binary, wait_for_port
from deepinfer.models.convert import DEFAULT_MODEL_NAME, resolve_model

MODEL = DEFAULT_MODEL_NAME
# Every host has its own port space, so the well-known ports are free in each.
NATS_PORT, REDIS_PORT, GATEWAY_PORT = 4222, 6379, 8000
# Mock timing models (a s/step, b s/token, d, e): prefill fast; decode 30 ms a step, so a
# 120-token stream lasts ~4 s and a kill lands in its middle.
MOCK = ["--engine", "mock", "--heartbeat-s", "0.5", "--kv-cache-gb", "0.25"]
PREFILL_ARGS = [*MOCK, "--mock-cost", "0.004,2e-5,1e-9,1e-7"]
DECODE_ARGS = [*MOCK, "--mock-cost", "0.03,2e-5,1e-9,1e-7"]
START_TIMEOUT = 60  # seconds for the whole mesh to become healthy

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def ip(*args: str) -> str:
    """Run ``ip ARGS``; raises ``CalledProcessError`` (with ip's message) when it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, ["ip", *args], done.stdout, done.stderr)
    return done.stdout


class Hosts:
    """Network namespaces ("hosts") on one bridge, named after this process so parallel
    runs never clash; ``teardown`` removes all of them, whatever was built."""

    def __init__(self, names: list[str]):
        pid = os.getpid()
        self.tag = f"di{pid}"  # interface names: at most 15 characters
        self.bridge = f"{self.tag}br"
        self.subnet = f"10.{200 + (pid >> 8) % 50}.{pid & 255}"
        self.names = names
        self.ns = {name: f"deepinfer-{pid}-{name}" for name in names}
        self.addr = {name: f"{self.subnet}.{i + 1}" for i, name in enumerate(names)}
        self.procs: list[ManagedProcess] = []
        self._threads: dict[str, ThreadPoolExecutor] = {}
        self._made_ns: list[str] = []
        self._made_links: list[str] = []

    # --- the network -------------------------------------------------------------------
    def build(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        self._made_links.append(self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            ns, outer, inner = self.ns[name], f"{self.tag}h{i}", f"{self.tag}n{i}"
            ip("netns", "add", ns)
            self._made_ns.append(ns)
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self._made_links.append(outer)
            ip("link", "set", outer, "master", self.bridge, "up")
            ip("link", "set", inner, "netns", ns)
            ip("-n", ns, "link", "set", inner, "name", "eth0")
            ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def bridge_passes_traffic(self, a: str, b: str, timeout: float = 5) -> bool:
        """Whether a TCP connection from host ``a`` reaches a listener on host ``b`` (a host
        firewall filtering bridged traffic, br_netfilter, could drop it)."""
        listener = self.call(b, socket.create_server, (self.addr[b], 0))
        try:
            port = listener.getsockname()[1]

            def connect() -> bool:
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    try:
                        socket.create_connection((self.addr[b], port), timeout=1).close()
                        return True
                    except OSError:
                        time.sleep(0.1)  # the veths may still be coming up
                return False

            return self.call(a, connect)
        finally:
            listener.close()

    # --- running things on a host --------------------------------------------------------
    def _thread(self, name: str) -> ThreadPoolExecutor:
        """A thread that lives in host ``name``'s network namespace (sockets it opens are there)."""
        if name not in self._threads:
            path = f"/var/run/netns/{self.ns[name]}"

            def enter() -> None:
                fd = os.open(path, os.O_RDONLY)
                try:
                    if _libc.setns(fd, CLONE_NEWNET) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, f"setns({path}): {os.strerror(err)}")
                finally:
                    os.close(fd)

            self._threads[name] = ThreadPoolExecutor(1, thread_name_prefix=f"netns-{name}", initializer=enter)
        return self._threads[name]

    def submit(self, name: str, fn: Callable, *args, **kwargs) -> Future:
        """Run ``fn`` on host ``name`` (its thread runs one call at a time)."""
        return self._thread(name).submit(fn, *args, **kwargs)

    def call(self, name: str, fn: Callable, *args, **kwargs):
        return self.submit(name, fn, *args, **kwargs).result()

    def start(self, name: str, proc_name: str, argv: list[str], log: Path, env: dict[str, str]) -> ManagedProcess:
        """Start a process on host ``name``. ``ip netns exec`` execs the command in place, so
        the pid (and process group) is the service's own, which ``stop``/``kill`` signal."""
        proc = ManagedProcess(proc_name, ["ip", "netns", "exec", self.ns[name], *argv], log, env=env)
        self.procs.append(proc)
        return proc

    def teardown(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL), then remove namespaces, veths and bridge."""
        # the services all at once, then nats and redis (as launcher.Mesh.stop), so that no
        # service drains against a NATS that is already gone
        services = [p for p in self.procs if p.name not in ("nats", "redis")]
        for group in (services, [p for p in self.procs if p not in services]):
            for p in group:
                p.terminate()
            for p in group:
                try:
                    p.stop(timeout=5)
                except Exception:
                    pass
        for pool in self._threads.values():
            pool.shutdown(wait=False, cancel_futures=True)
        for ns in self._made_ns:  # a namespace's veth end (and so its pair) goes with it
            try:
                ip("netns", "delete", ns)
            except subprocess.CalledProcessError:
                pass
        for link in reversed(self._made_links):
            if Path(f"/sys/class/net/{link}").exists():
                try:
                    ip("link", "delete", link)
                except subprocess.CalledProcessError:
                    pass


def can_connect(host: str, port: int, timeout: float = 1) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def hosts():
    if not sys.platform.startswith("linux") or _libc is None:
        pytest.skip("network namespaces are Linux-only")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    h = Hosts(["infra", "workers", "front", "workers2"])
    try:
        try:
            h.build()
        except (subprocess.CalledProcessError, OSError) as e:
            pytest.skip(f"cannot build network namespaces here: {getattr(e, 'stderr', '') or e}")
        if not h.bridge_passes_traffic("front", "infra"):
            pytest.skip("the bridge passes no traffic between namespaces (a firewall on bridged traffic?)")
        yield h
    finally:
        h.teardown()


class SpreadMesh:
    """The mesh's processes on their hosts, and where to reach its gateway."""

    def __init__(self, hosts: Hosts, workdir: Path):
        self.hosts = hosts
        self.workdir = workdir
        self.nats_url = f"nats://{hosts.addr['infra']}:{NATS_PORT}"
        self.redis_url = f"redis://{hosts.addr['infra']}:{REDIS_PORT}"
        self.gateway_url = f"http://{hosts.addr['front']}:{GATEWAY_PORT}"
        self.procs: dict[str, ManagedProcess] = {}
        self.host_of: dict[str, str] = {}  # worker id -> the host it runs on
        self._model_dir = str(resolve_model(None))

    def env(self) -> dict[str, str]:
        """What every service gets, as a deployment would set it (README, "Running services
        yourself"): the infrastructure's bridge addresses, the model, the shared tier."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_") or k == "DEEPINFER_CACHE"}
        env.update(
            DEEPINFER_NATS_URL=self.nats_url,
            DEEPINFER_REDIS_URL=self.redis_url,
            DEEPINFER_MODEL=self._model_dir,
            DEEPINFER_KV_ROOT=str(self.workdir / "kvstore"),
            OMP_WAIT_POLICY="PASSIVE",  # several processes share two cores (see launcher.Mesh)
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
        )
        return env

    def start_infra(self) -> None:
        addr, logs = self.hosts.addr["infra"], self.workdir / "logs"
        (self.workdir / "nats").mkdir(parents=True)
        # as launcher.start_nats / start_redis, but bound to the bridge address, not 127.0.0.1
        self.procs["nats"] = self.hosts.start(
            "infra", "nats",
            [nats_server_binary(), "-a", addr, "-p", str(NATS_PORT), "-js", "-sd", str(self.workdir / "nats")],
            logs / "nats.log", env=dict(os.environ))
        # Redis 7 without a password answers clients on other hosts only "DENIED ... protected
        # mode", bound address or not: a deployment sets a password or turns protected mode off.
        self.procs["redis"] = self.hosts.start(
            "infra", "redis",
            [redis_server_binary(), "--bind", addr, "--port", str(REDIS_PORT), "--protected-mode", "no",
             "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", str(self.workdir)],
            logs / "redis.log", env=dict(os.environ))
        # waited for from another host: what the services will see
        for name, port in (("nats", NATS_PORT), ("redis", REDIS_PORT)):
            self.hosts.call("workers", wait_for_port, port, self.procs[name], 20, host=addr)

    def start_service(self, host: str, service: str, worker_id: str, args: list[str] = ()) -> ManagedProcess:
        argv = [sys.executable, "-m", "deepinfer.cli", "serve", service, "--worker-id", worker_id, *args]
        proc = self.hosts.start(host, worker_id, argv, self.workdir / "logs" / f"{worker_id}.log", self.env())
        self.procs[worker_id] = proc
        self.host_of[worker_id] = host
        return proc

    def describe(self, n: int = 25) -> str:
        return "\n".join(f"--- {p.name} ({p!r}, log {p.log_path}) ---\n{p.log_tail(n)}" for p in self.procs.values())

    def health(self) -> dict:
        """The gateway's /health body, asked from the front host."""
        def get() -> dict:
            try:
                return httpx.get(self.gateway_url + "/health", timeout=2).json()
            except (httpx.HTTPError, ValueError) as e:
                return {"error": f"{type(e).__name__}: {e}"}
        return self.hosts.call("front", get)

    def wait_healthy(self, want: dict[str, int], timeout: float) -> dict:
        """Until the gateway sees ``want`` live workers by role and the kvindex with its Redis."""
        deadline = time.monotonic() + timeout
        body: dict = {}
        while True:
            dead = [p.name for p in self.procs.values() if not p.alive]
            assert not dead, f"{dead} exited during start-up:\n{self.describe()}"
            body = self.health()
            workers = body.get("workers") or {}
            kv = body.get("kv_index") or {}
            if all(workers.get(role) == n for role, n in want.items()) and kv.get("redis_ok"):
                return body
            assert time.monotonic() < deadline, f"not healthy within {timeout}s (last: {body}):\n{self.describe()}"
            time.sleep(0.25)

    def log_events(self, worker_id: str, event: str) -> list[dict]:
        out = []
        for line in self.procs[worker_id].log_path.read_text().splitlines():
            if f'"{event}"' in line:
                try:
                    out.append(json.loads(line))
                except ValueError:  # a line being written as we read
                    pass
        return out

    def decoding(self, worker_id: str) -> set[str]:
        """Request ids a decode worker's log shows started and not yet finished."""
        started = {r["request_id"] for r in self.log_events(worker_id, "decode_started")}
        return started - {r["request_id"] for r in self.log_events(worker_id, "decode_finished")}


@pytest.fixture(scope="module")
def spread(hosts, tmp_path_factory) -> SpreadMesh:
    """The mesh, spread over the hosts, healthy (module-scoped: it starts once)."""
    m = SpreadMesh(hosts, tmp_path_factory.mktemp("multihost"))
    (m.workdir / "kvstore").mkdir()
    t0 = time.monotonic()
    m.start_infra()
    # the services all at once, each on its host (nats and redis answer already)
    m.start_service("workers", "tokenizer", "tokenizer-0")
    m.start_service("workers", "kvindex", "kvindex-0")
    m.start_service("workers", "prefill", "prefill-0", PREFILL_ARGS)
    m.start_service("workers", "decode", "decode-0", DECODE_ARGS)
    m.start_service("workers2", "decode", "decode-1", DECODE_ARGS)
    m.start_service("front", "gateway", "gateway-0",
                    ["--host", hosts.addr["front"], "--port", str(GATEWAY_PORT), "--mode", "disagg"])
    body = m.wait_healthy({"tokenizer": 1, "prefill": 1, "decode": 2}, START_TIMEOUT)
    print(f"\nmesh on {len(hosts.names)} hosts ({hosts.subnet}.0/24) healthy in {time.monotonic() - t0:.1f}s: {body}")
    yield m
    # hosts' teardown stops the processes (it outlives this fixture)


def client(m: SpreadMesh) -> openai.OpenAI:
    """The official client, pointed at the gateway's bridge address (use it from the front host)."""
    return openai.OpenAI(base_url=m.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(m: SpreadMesh, **kwargs):
    """One chat completion sent from the front host."""
    def send():
        with client(m) as c:
            return c.chat.completions.create(**kwargs)
    return m.hosts.call("front", send)


def chat_kwargs(content: str, max_tokens: int, salt: str) -> dict:
    return dict(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
                temperature=0, extra_body={"cache_salt": salt})


# --- isolation ------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_hosts_reach_nats_only_over_the_bridge(spread):
    """No service can have used loopback: nothing answers on 127.0.0.1 of the workers' host,
    nats and redis answer on the infrastructure host's bridge address, and that address is
    not a local one there."""
    h, infra = spread.hosts, spread.hosts.addr["infra"]
    for port in (NATS_PORT, REDIS_PORT):
        assert not h.call("workers", can_connect, "127.0.0.1", port)
        assert h.call("workers", can_connect, infra, port)
        assert h.call("front", can_connect, infra, port)
    assert not h.call("infra", can_connect, "127.0.0.1", NATS_PORT)  # bound to the bridge address only
    assert not h.call("front", can_connect, "127.0.0.1", GATEWAY_PORT)  # the gateway, likewise
    addrs = h.call("workers", lambda: subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout)
    assert infra not in addrs and h.addr["workers"] in addrs
    # each service runs in its host's namespace, under the pid the test signals (ip netns exec execs in place)
    for worker_id, host in spread.host_of.items():
        pid = spread.procs[worker_id].pid
        assert os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/var/run/netns/{h.ns[host]}").st_ino, worker_id
        assert b"serve" in Path(f"/proc/{pid}/cmdline").read_bytes(), worker_id


# --- a request end to end -------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_chat_completion_crosses_the_hosts(spread):
    def scenario():
        with client(spread) as c:
            models = [m.id for m in c.models.list().data]
            plain = c.chat.completions.create(**chat_kwargs("Tell me about bridges.", 16, "plain"))
            stream = c.chat.completions.create(**chat_kwargs("Tell me about bridges.", 16, "stream"), stream=True)
            streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        return models, plain, streamed

    models, plain, streamed = spread.hosts.call("front", scenario)
    assert models == [MODEL]
    assert plain.usage.completion_tokens == 16 and plain.choices[0].finish_reason == "length"
    assert plain.choices[0].message.content
    assert streamed == plain.choices[0].message.content  # the mock is deterministic, whatever the path
    served = sum(len(spread.log_events(w, "decode_finished")) for w in ("decode-0", "decode-1"))
    assert served >= 2, served
    # the prefill worker's KV events went through JetStream (infra) to the kvindex (workers), which
    # indexed the stored blocks in Redis (infra): the gateway (front) sees them counted
    deadline = time.monotonic() + 15
    while (spread.health().get("kv_index") or {}).get("num_blocks", 0) <= 0:
        assert time.monotonic() < deadline, f"the kvindex indexed no block: {spread.health()}"
        time.sleep(0.25)


@pytest.mark.timeout(180)
def test_a_stored_response_is_read_back_through_redis_on_another_host(spread):
    def scenario():
        with httpx.Client(base_url=spread.gateway_url, timeout=30) as c:
            created = c.post("/v1/responses", json={"model": MODEL, "input": "Say hi.", "max_output_tokens": 8,
                                                    "store": True})
            assert created.status_code == 200, created.text
            rid = created.json()["id"]
            return created.json(), c.get(f"/v1/responses/{rid}")

    created, fetched = spread.hosts.call("front", scenario)
    assert fetched.status_code == 200, fetched.text
    assert fetched.json()["id"] == created["id"] and fetched.json()["output"] == created["output"]


# --- failover across hosts (last: it kills a worker) -----------------------------------------


@pytest.mark.timeout(180)
def test_a_decode_host_killed_mid_stream_resumes_on_the_other_host(spread):
    """SIGKILL the decode worker a stream is on: the gateway (another host) notices its
    heartbeats stop and resumes the stream on the decode worker of a third host, which reads
    the prompt's blocks from the shared tier; the client sees one stream with the same text."""
    request = chat_kwargs("Write a long story about a lighthouse keeper and the sea. " * 4, 120, "failover")
    reference = chat(spread, **{**request, "extra_body": {"cache_salt": "reference"}})
    assert reference.usage.completion_tokens == 120

    chunks: list[str] = []

    def stream() -> str:
        with client(spread) as c:
            for ch in c.chat.completions.create(**request, stream=True):
                if ch.choices and ch.choices[0].delta.content:
                    chunks.append(ch.choices[0].delta.content)
        return "".join(chunks)

    run = spread.hosts.submit("front", stream)
    deadline = time.monotonic() + 30
    while len(chunks) < 10 and not run.done():
        assert time.monotonic() < deadline, "the stream did not get under way"
        time.sleep(0.02)
    assert not run.done(), "the stream finished before the kill: lengthen it"
    on = [w for w in ("decode-0", "decode-1") if spread.decoding(w)]
    assert len(on) == 1, f"decoding: {on}"
    victim, survivor = on[0], ({"decode-0", "decode-1"} - {on[0]}).pop()
    at_kill = len(chunks)
    spread.procs[victim].kill()
    killed_at = time.monotonic()

    text = run.result(timeout=60)
    took = time.monotonic() - killed_at
    resumed = spread.log_events("gateway-0", "failover_done")
    loaded = spread.log_events(survivor, "kv_prefix_loaded")
    print(f"\nkilled {victim} (host {spread.host_of[victim]}) after "
          f"{at_kill} chunks; stream done {took:.1f}s later on {survivor}; failovers {len(resumed)}, "
          f"prefix loads on the survivor {len(loaded)}")
    assert text == reference.choices[0].message.content
    assert resumed, "the gateway logged no failover"
    assert loaded, f"{survivor} resumed without the prompt's blocks from the shared tier"

    # the mesh goes on serving, from the surviving host
    finished = len(spread.log_events(survivor, "decode_finished"))
    again = chat(spread, **chat_kwargs("Still there?", 8, "after"))
    assert again.usage.completion_tokens == 8
    assert len(spread.log_events(survivor, "decode_finished")) > finished
