"""``deepinfer status``: the live workers of a running mesh and their load.

Every service publishes a ``LoadReport`` on ``deepinfer.load.<role>.<worker_id>``
every ``--heartbeat-s`` (default 1 s). ``collect`` listens on ``deepinfer.load.>``
for a few seconds and keeps each worker's latest report; a worker heard in that
window is live (a draining one says so). Nothing else is asked of the mesh, so
it works against any NATS server the services use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import asdict

from deepinfer.protocol import LoadReport, ProtocolError, subjects, unpack

ROLE_ORDER = ("gateway", "tokenizer", "vision", "kvindex", "balancer", "prefill", "decode")


async def collect(nats_url: str, seconds: float = 2.5) -> dict[str, LoadReport]:
    """worker id -> its latest ``LoadReport`` heard within ``seconds``.

    Raises TimeoutError / OSError / nats errors when NATS cannot be reached within 5 s."""
    import nats

    from deepinfer.mesh.client import nats_servers

    reports: dict[str, LoadReport] = {}

    async def on_msg(msg):
        try:
            report = unpack(msg.data, expect=LoadReport)
        except ProtocolError:
            return
        reports[report.worker_id] = report

    async def quiet(_e):  # the failure is raised below; nats-py would also print it
        pass

    # NOTE: nats-py keeps retrying an unreachable server on its own; the timeout bounds it. Each
    # server of a seed list is tried once (a dead first one does not hide a live second).
    nc = await asyncio.wait_for(nats.connect(servers=nats_servers(nats_url), allow_reconnect=True,
                                             connect_timeout=2, max_reconnect_attempts=1,
                                             reconnect_time_wait=0, dont_randomize=True, error_cb=quiet),
                                timeout=5)
    try:
        await nc.subscribe(subjects.LOAD_ALL, cb=on_msg)
        await asyncio.sleep(seconds)
    finally:
        await nc.close()
    return reports


def format_table(reports: dict[str, LoadReport]) -> str:
    """One line per worker, by role: state, running / waiting requests, KV tokens used /
    capacity, queued prefill (tokens, predicted seconds), finished requests, engine, storage tier
    (the first 8 characters of its id: a worker whose differs is on another tier)."""
    rows = [("ROLE", "WORKER", "STATE", "RUNNING", "WAITING", "KV USED", "QUEUED PREFILL", "FINISHED", "ENGINE",
             "TIER")]
    order = {r: i for i, r in enumerate(ROLE_ORDER)}
    for r in sorted(reports.values(), key=lambda r: (order.get(r.role, len(order)), r.worker_id)):
        kv = (f"{r.kv_tokens_used}/{r.kv_tokens_capacity} ({r.kv_tokens_used / r.kv_tokens_capacity:.0%})"
              if r.kv_tokens_capacity else "-")
        queued = f"{r.queued_prefill_tokens} tok / {r.queued_prefill_s:.2f} s" if r.role == "prefill" else "-"
        rows.append((r.role, r.worker_id, "draining" if r.draining else "live", str(r.active_requests),
                     str(r.waiting_requests), kv, queued, str(r.finished_requests), r.engine or "-",
                     r.tier_id[:8] or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", "--nats-url", dest="nats", default=os.environ.get("DEEPINFER_NATS_URL",
                                                                              "nats://127.0.0.1:4222"),
                   help="NATS URL of the mesh (env DEEPINFER_NATS_URL)")
    p.add_argument("--wait", type=float, default=2.5, help="seconds to listen for load reports (default 2.5)")
    p.add_argument("--json", action="store_true", help="print the reports as JSON (one object per worker)")


def cli(args) -> int:
    """Print the live workers; exit status 1 when none was heard (or NATS is unreachable)."""
    try:
        reports = asyncio.run(collect(args.nats, args.wait))
    except Exception as e:  # unreachable NATS: say so, not a traceback
        why = str(e) or "no connection within 5 s"
        print(f"deepinfer status: cannot read the mesh at {args.nats}: {type(e).__name__}: {why}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([asdict(r) for r in reports.values()], indent=1))
    else:
        print(format_table(reports) if reports else f"no worker reported on {args.nats} within {args.wait:g} s")
    return 0 if reports else 1
