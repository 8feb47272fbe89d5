"""Fixtures for gateway API tests on the fake mesh of ``test_gateway`` (real nats-server, scripted
fake tokenizer / prefill / decode workers, in-process gateway), with settings a test module picks.

Import the fixtures into a test module (``from gateway_harness import *``-style, by name); they are
module-scoped, so each module gets its own nats-server, workers and gateway. The gateway is built
with ``GATEWAY_OVERRIDES`` (``GatewayConfig`` fields) plus the session's ``redis_url``.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import pytest_asyncio
import uvicorn

from deepinfer.gateway.app import create_app
from deepinfer.gateway.config import GatewayConfig, load_model
from deepinfer.gateway.stream.request_stream import StreamTimeouts
from deepinfer.launcher import free_port
from deepinfer.mesh import MeshClient
from test_gateway import MAX_MODEL_LEN, MODEL_DIR, FakeWorkers, InProcessGateway, Script, start_nats_server

SMALL_BODY_LIMIT = 64 * 1024  # bytes: max_body_bytes of the test gateway, so 413 is cheap to provoke


class ConfiguredGateway(InProcessGateway):
    """``InProcessGateway`` with extra ``GatewayConfig`` fields (``redis_url``, ``max_body_bytes``...)."""

    def __init__(self, nats_url: str, **overrides):  # noqa: super().__init__ would build a second app
        self.config = GatewayConfig(
            nats_url=nats_url,
            model=str(MODEL_DIR),
            max_model_len=MAX_MODEL_LEN,
            port=free_port(),
            worker_id="gateway-test",
            timeouts=StreamTimeouts(inactivity_s=4.0, handoff_s=1.0, tick_s=0.1),
            **overrides,
        )
        self.app = create_app(self.config, load_model(self.config))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.config.port,
                                                    log_level="warning", lifespan="on"))
        self.url = f"http://127.0.0.1:{self.config.port}"
        self.model = self.app.state.gateway.model.served_name
        self.task: asyncio.Task | None = None


@pytest.fixture(scope="module")
def nats_url():
    proc, url = start_nats_server()
    yield url
    proc.stop()


@pytest_asyncio.fixture(scope="module")
async def workers(nats_url):
    mesh = await MeshClient.connect(nats_url, name="fake-workers")
    fakes = FakeWorkers(mesh)
    await fakes.start()
    yield fakes
    await fakes.stop()
    await mesh.close()


@pytest_asyncio.fixture(scope="module")
async def gateway(nats_url, workers, redis_url):
    async with ConfiguredGateway(nats_url, redis_url=redis_url, max_body_bytes=SMALL_BODY_LIMIT) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
            deadline = time.monotonic() + 5
            while (await client.get("/health")).status_code != 200:  # first heartbeats
                assert time.monotonic() < deadline, "gateway never saw the fake workers"
                await asyncio.sleep(0.05)
        yield gw


@pytest_asyncio.fixture
async def client(gateway):
    async with httpx.AsyncClient(base_url=gateway.url, timeout=15) as c:
        yield c


@pytest.fixture
def script(workers):
    """Set what the fakes do for this test; reset afterwards."""

    def set_script(**kw) -> Script:
        workers.script = Script(**kw)
        return workers.script

    yield set_script
    workers.script = Script()


async def sse_events(client: httpx.AsyncClient, path: str, body: dict, headers: dict | None = None) -> list:
    """POST a streaming request; return ``(event name, decoded data)`` for every SSE event."""
    events = []
    async with client.stream("POST", path, json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
                name = None
    return events
