"""Launcher tests that need no model service: nats, redis, process groups, and a
Mesh whose services are small stand-in scripts (so its lifecycle is checked
without the real services)."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

import httpx
import nats
import pytest
import redis

from deepinfer.launcher import (
    LauncherError,
    ManagedProcess,
    Mesh,
    free_port,
    start_nats,
    start_redis,
)
from waiting import wait_for

PY = sys.executable


def group_gone(pgid: int, timeout: float = 3.0) -> bool:
    """True once no process is left in the group (zombies re-parented to init may linger briefly)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


async def test_nats_request_reply_and_jetstream(tmp_path):
    proc = start_nats(tmp_path)
    try:
        assert proc.alive and proc.url == f"nats://127.0.0.1:{proc.port}"
        nc = await nats.connect(proc.url)
        try:
            async def echo(msg):
                await msg.respond(b"pong:" + msg.data)

            await nc.subscribe("deepinfer.test.echo", cb=echo)
            reply = await nc.request("deepinfer.test.echo", b"ping", timeout=2)
            assert reply.data == b"pong:ping"
            js = nc.jetstream()  # started with -js
            await js.add_stream(name="LAUNCHERTEST", subjects=["launcher.test.>"])
            ack = await js.publish("launcher.test.a", b"x")
            assert ack.seq == 1
        finally:
            await nc.close()
    finally:
        proc.stop()
    assert not proc.alive
    assert group_gone(proc.pgid)
    assert (tmp_path / "nats").is_dir()


def test_redis_ping(tmp_path):
    proc = start_redis(tmp_path)
    try:
        r = redis.Redis.from_url(proc.url)
        assert r.ping()
        r.set("k", "v")
        assert r.get("k") == b"v"
        r.close()
    finally:
        proc.stop()
    assert not proc.alive
    assert group_gone(proc.pgid)


def test_stop_kills_stragglers_that_ignore_sigterm(tmp_path):
    # The leader dies on SIGTERM; its child ignores SIGTERM and must still go.
    script = textwrap.dedent(
        """
        import subprocess, time
        subprocess.Popen(["sh", "-c", "trap '' TERM; while :; do sleep 1; done"])
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    p = ManagedProcess("straggler", [PY, "-c", script], tmp_path / "straggler.log")
    wait_for(lambda: "ready" in p.log_tail(), timeout=10, interval=0.02)
    p.stop(timeout=5)
    assert not p.alive
    assert group_gone(p.pgid)
    with pytest.raises(ProcessLookupError):
        os.killpg(p.pgid, 0)
    p.stop()  # idempotent


def test_stop_escalates_to_sigkill(tmp_path):
    script = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    p = ManagedProcess("stubborn", [PY, "-c", script], tmp_path / "stubborn.log")
    wait_for(lambda: "ready" in p.log_tail(), timeout=10, interval=0.02)
    t0 = time.monotonic()
    rc = p.stop(timeout=0.5)
    assert time.monotonic() - t0 < 3
    assert rc == -signal.SIGKILL
    assert group_gone(p.pgid)
    with pytest.raises(ProcessLookupError):
        os.killpg(p.pgid, 0)


def test_kill_and_log_tail(tmp_path):
    p = ManagedProcess("sleeper", ["sh", "-c", "echo hello; echo world; sleep 60"], tmp_path / "s.log")
    wait_for(lambda: "world" in p.log_tail(), timeout=5, interval=0.02)
    assert p.alive and p.returncode is None
    assert p.log_tail(1).strip() == "world"
    p.kill()
    assert not p.alive
    assert p.returncode == -signal.SIGKILL
    assert group_gone(p.pgid)
    with pytest.raises(ProcessLookupError):
        os.killpg(p.pgid, 0)
    p.stop()  # after kill: a no-op


def test_exited_process_reports_code(tmp_path):
    p = ManagedProcess("quick", ["sh", "-c", "exit 3"], tmp_path / "q.log")
    wait_for(lambda: not p.alive, timeout=5, interval=0.02)
    assert p.returncode == 3
    assert p.stop() == 3


# ------------------------------------------------------------ Mesh with stand-ins

STAND_IN = textwrap.dedent(
    """
    # Stand-in for `python -m deepinfer.cli`: `serve <svc> --worker-id ID [--host H --port P]`.
    import json, os, signal, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    args = sys.argv[1:]
    assert args[0] == "serve", args
    svc = args[1]
    opts = dict(zip(args[2::2], args[3::2]))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"{svc} {opts['--worker-id']} started", flush=True)
    if svc == "broken":
        print("broken service: failing on purpose", flush=True)
        sys.exit(3)
    if svc != "gateway":
        while True:
            time.sleep(1)
    time.sleep(0.3)  # a real gateway is healthy only once workers registered: not before a broken one exits

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({k: v for k, v in os.environ.items() if k.startswith(("DEEPINFER_", "HF_", "TOKENIZERS_"))}).encode()
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass

    HTTPServer((opts["--host"], int(opts["--port"])), H).serve_forever()
    """
)


@pytest.fixture
def stand_in(tmp_path):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return [PY, str(script)], model


def test_mesh_lifecycle_with_stand_ins(stand_in, tmp_path):
    command, model = stand_in
    steps = []
    mesh = Mesh(model=str(model), replicas={"decode": 2}, extra_args={"prefill": ["--foo", "bar"]})
    mesh.command = command
    with mesh:
        pass  # started by __enter__
    # __exit__ stopped it; start a fresh one to inspect it while running
    mesh = Mesh(model=str(model), replicas={"decode": 2}, extra_args={"prefill": ["--foo", "bar"]})
    mesh.command = command
    mesh.start(timeout=30, progress=steps.append)
    try:
        assert [len(mesh.processes[s]) for s in ("tokenizer", "kvindex", "prefill", "decode", "gateway")] == [1, 1, 1, 2, 1]
        assert [p.name for p in mesh.processes["decode"]] == ["decode-0", "decode-1"]
        assert "--foo" in mesh.processes["prefill"][0].argv
        assert mesh.gateway_url.startswith("http://127.0.0.1:")
        env = httpx.get(mesh.gateway_url + "/health").json()
        assert env["DEEPINFER_NATS_URL"] == mesh.nats_url
        assert env["DEEPINFER_REDIS_URL"] == mesh.redis_url
        assert env["DEEPINFER_MODEL"] == str(model)
        assert env["DEEPINFER_KV_ROOT"] == str(mesh.workdir / "kvstore")
        assert env["HF_HUB_OFFLINE"] == "1" and env["TOKENIZERS_PARALLELISM"] == "false"
        assert any("waiting for" in s for s in steps)
        victim = mesh.processes["decode"][0]
        victim.kill()
        assert mesh.dead_services() == [victim]
        extra = mesh.start_worker("decode")
        assert extra.name == "decode-2"
        workdir = mesh.workdir
        pgids = [p.pgid for p in mesh.all_services()] + [mesh.nats.pgid, mesh.redis.pgid]
    finally:
        mesh.stop()
    mesh.stop()  # idempotent
    for pgid in pgids:
        assert group_gone(pgid)
    assert not workdir.exists()  # a temporary workdir is removed


def test_several_gateways_share_the_mesh_each_on_its_own_port(stand_in):
    command, model = stand_in
    mesh = Mesh(model=str(model), replicas={"gateway": 3})
    mesh.command = command
    with mesh:
        assert [p.name for p in mesh.processes["gateway"]] == ["gateway-0", "gateway-1", "gateway-2"]
        assert len(set(mesh.gateway_ports)) == 3 and mesh.gateway_urls[0] == mesh.gateway_url
        for url in mesh.gateway_urls:  # every one was waited for, and serves
            assert httpx.get(url + "/health").status_code == 200
        assert {w for w in mesh.metrics_urls if w.startswith("gateway")} == {"gateway", "gateway-1", "gateway-2"}


def test_mesh_start_failure_reports_logs_and_cleans_up(stand_in, tmp_path):
    command, model = stand_in
    mesh = Mesh(model=str(model), workdir=tmp_path / "wd", services=("tokenizer", "broken", "gateway"))
    mesh.command = command
    with pytest.raises(LauncherError, match="failing on purpose"):
        mesh.start(timeout=30)
    procs = mesh.all_services() + [mesh.nats, mesh.redis]
    for p in procs:
        assert not p.alive
        assert group_gone(p.pgid)
    assert (tmp_path / "wd" / "logs" / "broken-0.log").exists()  # a given workdir is kept


def test_mesh_health_timeout(stand_in, tmp_path):
    command, model = stand_in
    mesh = Mesh(model=str(model), workdir=tmp_path / "wd", services=("tokenizer", "gateway"))
    mesh.command = [PY, "-c", "import time; time.sleep(60)"]  # never answers /health
    t0 = time.monotonic()
    with pytest.raises(LauncherError, match="not healthy within"):
        mesh.start(timeout=1.5)
    assert time.monotonic() - t0 < 10
    for p in mesh.all_services():
        assert group_gone(p.pgid)


def test_cli_serve_unknown_service():
    import subprocess

    r = subprocess.run([PY, "-m", "deepinfer.cli", "serve", "nosuch"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "invalid choice: 'nosuch'" in r.stderr and "gateway" in r.stderr  # the services it knows


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_up_stops_everything_on_signal(stand_in, tmp_path, sig):
    import subprocess

    command, model = stand_in
    argv = ["up", "--model", str(model), "--port", str(free_port()), "--workdir", str(tmp_path / "wd")]
    driver = (
        "import sys; from deepinfer import launcher, cli; "
        f"launcher.Mesh.command = {command!r}; sys.exit(cli.main({argv!r}))"
    )
    up = subprocess.Popen([PY, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.monotonic() + 30
    for line in up.stdout:
        lines.append(line)
        if "Press Ctrl-C to stop" in line or time.monotonic() > deadline:
            break
    assert "DeepInfer is up" in "".join(lines), "".join(lines)
    assert "curl" in "".join(lines)
    up.send_signal(sig)
    out, _ = up.communicate(timeout=30)
    assert up.returncode == 0, "".join(lines) + out
    assert "stopped" in out
    # nats (-sd <workdir>/nats), redis (--dir <workdir>) and the stand-ins (tmp_path/stand_in.py) are gone
    ps = subprocess.run(["ps", "-eo", "stat,args"], capture_output=True, text=True).stdout
    assert not [l for l in ps.splitlines() if str(tmp_path) in l and not l.startswith("Z")], ps


@pytest.mark.parametrize("mode", ["disagg", "agg"])
def test_cli_up_passes_batch_invariant_and_gateways_to_the_mesh(monkeypatch, mode):
    """``deepinfer up --batch-invariant --gateways 2``: every engine worker gets the flag (a prefill
    and a decode worker must agree bit for bit), and the mesh runs two gateways."""
    from deepinfer import cli, launcher

    made = {}

    class Stop(Exception):
        pass

    def fake_mesh(**kw):
        made.update(kw)
        raise Stop

    monkeypatch.setattr(launcher, "Mesh", fake_mesh)
    with pytest.raises(Stop):
        cli.main(["up", "--mode", mode, "--batch-invariant", "--gateways", "2", "--port", str(free_port())])
    assert made["extra_args"] == {r: ["--batch-invariant"] for r in ("prefill", "decode")}  # (agg workers: decode)
    assert made["replicas"]["gateway"] == 2 and made["mode"] == mode
