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


def test_stream_replicas_come_from_the_flag_or_the_environment(monkeypatch):
    from deepinfer.mesh import stream_replicas
    from deepinfer.mesh.args import service_parser

    monkeypatch.delenv("DEEPINFER_STREAM_REPLICAS", raising=False)
    assert stream_replicas() == 1
    monkeypatch.setenv("DEEPINFER_STREAM_REPLICAS", "3")
    assert stream_replicas() == 3
    monkeypatch.setenv("DEEPINFER_STREAM_REPLICAS", "two")
    with pytest.raises(ValueError, match="DEEPINFER_STREAM_REPLICAS"):
        stream_replicas()
    service_parser("kvindex", "").parse_args(["--stream-replicas", "5"])
    assert stream_replicas() == 5
    with pytest.raises(SystemExit):
        service_parser("kvindex", "").parse_args(["--stream-replicas", "0"])


def test_the_events_stream_gets_the_replicas_asked_and_an_existing_one_is_kept_with_a_warning(monkeypatch):
    """Created with ``stream_replicas()`` replicas; one that exists with another count is kept (an
    operator's decision) and named in a warning. More replicas than servers cannot be created."""
    from structlog.testing import capture_logs

    from deepinfer.kvstore import index_client

    server = start_nats(Path(tempfile.mkdtemp(prefix="nats-replicas-")))

    async def run():
        mesh = await MeshClient.connect(server.url, name="t")
        js = mesh.nc.jetstream()
        try:
            monkeypatch.setenv("DEEPINFER_STREAM_REPLICAS", "3")
            with pytest.raises(Exception):  # one server: no room for 3 replicas
                await index_client.ensure_kv_events_stream(js)
            monkeypatch.setenv("DEEPINFER_STREAM_REPLICAS", "1")
            await index_client.ensure_kv_events_stream(js)
            info = await js.stream_info(subjects.KV_EVENTS_STREAM)
            assert info.config.num_replicas == 1
            monkeypatch.setenv("DEEPINFER_STREAM_REPLICAS", "3")
            monkeypatch.setattr(index_client, "_warned_replicas", set())
            with capture_logs() as logs:
                await index_client.ensure_kv_events_stream(js)
            assert [e for e in logs if e["event"] == "jetstream_replicas_differ"] == [
                {"event": "jetstream_replicas_differ", "log_level": "warning", "stream": subjects.KV_EVENTS_STREAM,
                 "replicas": 1, "wanted": 3}]
        finally:
            await mesh.nc.close()

    try:
        asyncio.run(run())
    finally:
        server.stop()
