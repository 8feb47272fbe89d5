"""Operations: a prefill worker started against a running mesh joins and takes work; SIGTERM drains
it without failing a request; ``deepinfer status`` lists the live workers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from test_failover import Reports, Streams, mock_args, until

SLOW_PREFILL = "0.03,1.5e-3,0,0"  # ~30 ms a step + 1.5 ms a prompt token: a queue builds under load
FAST_DECODE = "0.01,1e-5,0,0"


def requests(salt: str, items: range) -> list[dict]:
    return [dict(messages=[{"role": "user", "content": f"Request {i}: " + "scale me out, please. " * 25}],
                 max_tokens=12, temperature=0, extra_body={"ignore_eos": True, "cache_salt": salt})
            for i in items]


def status(mesh, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer.cli", "status", "--nats", mesh.nats_url, *args],
                          capture_output=True, text=True, timeout=60)


def test_extra_prefill_worker_joins_takes_work_and_drains_on_sigterm(make_mesh):
    m = make_mesh(extra_args={"prefill": mock_args(SLOW_PREFILL), "decode": mock_args(FAST_DECODE)})

    async def scenario():
        reference = await Streams(m, requests("reference", range(24))).run()
        reports = await Reports().start(m)
        # load on the one prefill worker; meanwhile a second one is started against the same NATS
        first = Streams(m, requests("first", range(12)))
        run_first = asyncio.ensure_future(first.run())
        extra = m.start_worker("prefill")
        await until(lambda: extra.name in reports.latest, 60, "the new prefill worker's first load report")
        # it joined: the gateway routes new requests to it (its queue is the shortest)
        second = Streams(m, requests("second", range(12, 24)))
        got = await asyncio.gather(run_first, second.run())
        await until(lambda: reports.latest[extra.name].finished_requests > 0, 10, "the new worker's load report")
        took = reports.latest[extra.name].finished_requests
        listed = await asyncio.to_thread(status, m, "--json", "--wait", "1.5")
        # SIGTERM while it has work: it drains, nothing fails
        third = Streams(m, requests("third", range(24)))
        run_third = asyncio.ensure_future(third.run())
        await until(lambda: reports.latest[extra.name].active_requests + reports.latest[extra.name].waiting_requests
                    > 0 or run_third.done(), 30, "the new worker to have queued requests")
        busy = reports.latest[extra.name]
        assert busy.active_requests + busy.waiting_requests > 0, "the requests ended before the SIGTERM"
        extra.terminate()
        sent_at = time.monotonic()
        last = await run_third
        exit_code = await asyncio.to_thread(extra.popen.wait, 40)
        print(f"\nthe extra prefill worker took {took} of 24 requests; SIGTERM with {busy.active_requests} running, "
              f"{busy.waiting_requests} waiting: exited {time.monotonic() - sent_at:.1f}s later")
        await reports.close()
        return reference, got[0] + got[1], last, took, listed, exit_code, extra.name

    reference, got, last, took, listed, exit_code, extra = asyncio.run(scenario())
    assert got == reference and last == reference  # every request answered, none failed (salts differ, texts not)
    assert took > 0
    assert exit_code == 0
    assert listed.returncode == 0, listed.stderr
    workers = {r["worker_id"]: r for r in json.loads(listed.stdout)}
    assert workers[extra]["role"] == "prefill" and workers[extra]["finished_requests"] > 0
    assert {"prefill-0", "decode-0", "tokenizer-0", "kvindex-0", extra} <= set(workers)  # (the gateway sends none)


def test_status_table_and_no_mesh():
    from deepinfer.protocol import LoadReport
    from deepinfer.status import format_table

    table = format_table({
        "decode-0": LoadReport(role="decode", worker_id="decode-0", active_requests=3, kv_tokens_used=512,
                               kv_tokens_capacity=2048, finished_requests=7, engine="native",
                               tier_id="0123456789abcdef"),
        "prefill-1": LoadReport(role="prefill", worker_id="prefill-1", draining=True, queued_prefill_tokens=900,
                                queued_prefill_s=1.25),
    }).splitlines()
    assert table[0].split()[:3] == ["ROLE", "WORKER", "STATE"]
    assert table[1].split()[:4] == ["prefill", "prefill-1", "draining", "0"] and "900 tok / 1.25 s" in table[1]
    assert table[2].split()[:4] == ["decode", "decode-0", "live", "3"] and "512/2048 (25%)" in table[2]
    assert table[0].split()[-1] == "TIER" and table[2].split()[-1] == "01234567" and table[1].split()[-1] == "-"
    out = subprocess.run([sys.executable, "-m", "deepinfer.cli", "status", "--nats", "nats://127.0.0.1:1",
                          "--wait", "0.2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot read the mesh" in out.stderr
