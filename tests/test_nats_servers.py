"""A NATS URL setting may be a comma-separated seed list of a cluster's servers: services, the
gateway, ``deepinfer status`` and ``bench replay`` connect through any server of it that answers,
also when the first one is down (nats-py itself takes a list, and fails on a comma-separated string)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from deepinfer.launcher import free_port, start_nats
from deepinfer.mesh import MeshClient, nats_servers
from deepinfer.protocol import LoadReport, subjects
from deepinfer.status import collect


def test_a_setting_is_split_into_its_servers():
    assert nats_servers("nats://a:4222") == ["nats://a:4222"]
    assert nats_servers(" nats://a:4222, nats://b:4222 ,") == ["nats://a:4222", "nats://b:4222"]
    with pytest.raises(ValueError):
        nats_servers(" , ")


def test_clients_connect_through_a_seed_list_whose_first_server_is_down():
    live = start_nats(Path(tempfile.mkdtemp(prefix="nats-seeds-")))
    seeds = f"nats://127.0.0.1:{free_port()},{live.url}"  # nothing listens on the first

    async def run():
        worker = await asyncio.wait_for(MeshClient.connect(seeds, name="worker"), 10)
        try:
            async def beat():
                while True:
                    await worker.publish(subjects.load("prefill", "p-1"), LoadReport(role="prefill", worker_id="p-1"))
                    await asyncio.sleep(0.1)

            task = asyncio.create_task(beat())
            reports = await collect(seeds, seconds=0.5)  # ``deepinfer status``
            task.cancel()
            return reports
        finally:
            await worker.nc.close()

    try:
        assert list(asyncio.run(run())) == ["p-1"]
    finally:
        live.stop()
