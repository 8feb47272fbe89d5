"""Shared fixtures: real nats-server / redis-server and whole meshes, started by
the same launcher code that ``deepinfer up`` uses.

- ``nats_url`` / ``redis_url``: one nats-server (JetStream on) and one
  redis-server for the whole session, on free ports.
- ``mesh``: one mesh (default model, tokenizer + prefill + decode + gateway)
  for the whole session; tests must not break it (no kills, no restarts).
- ``openai_client``: the official ``openai`` client pointed at ``mesh``.
- ``make_mesh``: start a private mesh for destructive tests (kill a worker,
  restart one...); each one is stopped when the test ends.

Logs of every process are kept under pytest's temporary directory
(``<basetemp>/mesh*/logs``) for debugging a failed run.
"""

from __future__ import annotations

import os
from typing import Callable

import pytest

from deepinfer.launcher import Mesh, start_nats, start_redis

# Meshes started by the tests run fp32 unless a test asks otherwise (``env={"DEEPINFER_DTYPE": ...}``):
# their outputs are pinned token for token against ``transformers`` in fp32, and ``--dtype auto``
# would pick bf16 on a CPU with fast bf16 GEMMs (tests/test_dtype.py covers that choice).
os.environ.setdefault("DEEPINFER_DTYPE", "float32")

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
