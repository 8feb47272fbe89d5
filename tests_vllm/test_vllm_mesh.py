"""The mesh with ``--engine vllm`` prefill and decode workers: the skeleton's end-to-end checks
(official openai client, a real SmolLM2 answer, streaming = non-streaming), KV handed off through
the storage tier by the connector; a fresh prefill worker reusing the prefix another one stored;
and the start-up refusal of a mesh feature vLLM lacks."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import openai
import pytest
from texts import TEXT_A

from deepinfer.kvstore import KVIndexClient
from deepinfer.launcher import Mesh
from deepinfer.mesh import MeshClient
from deepinfer.models.convert import DEFAULT_MODEL_NAME

VLLM_ARGS = ["--engine", "vllm", "--block-size", "128"]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, model_dir):
    m = Mesh(workdir=tmp_path_factory.mktemp("vllm-mesh"), extra_args={"prefill": VLLM_ARGS, "decode": VLLM_ARGS},
             env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    m.start(timeout=600)
    yield m
    m.stop()


@pytest.fixture
def client(mesh):
    c = openai.OpenAI(base_url=mesh.gateway_url + "/v1", api_key="test", max_retries=0, timeout=300)
    yield c
    c.close()


def chat(client, content, **kw):
    kw.setdefault("max_tokens", 32)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": content}],
                                          **kw)


def test_capital_of_france_through_vllm_workers(client):
    resp = chat(client, "What is the capital of France?")
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens > 10 and resp.usage.completion_tokens > 1  # decode ran after the handoff


def test_streamed_deltas_concatenate_to_the_non_streamed_text(client):
    content = "Write two sentences about the moon."
    full = chat(client, content, max_tokens=40).choices[0].message.content
    stream = chat(client, content, max_tokens=40, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == full
    assert len(full) > 20


def test_a_feature_vllm_workers_lack_is_a_400_naming_it(client):
    """Refused per request by the prefill worker's engine: the client's error, not a 503."""
    with pytest.raises(openai.BadRequestError, match="not available on --engine vllm"):
        chat(client, "Hello", logprobs=True)
    with pytest.raises(openai.BadRequestError, match="not available on --engine vllm"):
        chat(client, "Hello", response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="logprobs, prompt logprobs are not available on --engine vllm"):
        client.completions.create(model=DEFAULT_MODEL_NAME, prompt="Hello", echo=True, logprobs=1, max_tokens=0)


def hit_tokens(mesh, worker: str) -> float:
    """The worker's ``deepinfer_engine_prefix_hit_tokens_total`` (vLLM: tokens its connector loaded)."""
    text = httpx.get(mesh.metrics_urls[worker], timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("deepinfer_engine_prefix_hit_tokens_total"))


def test_long_prompt_handoff_loads_the_stored_prefix(mesh, client):
    """A prompt over three blocks: prefill's connector stores its full blocks, decode's loads them
    (decode's prompt is the prompt + the first token, so every full prompt block)."""
    before = hit_tokens(mesh, "decode-0")
    text = "Here is a list of fruits: " + ", ".join(f"fruit number {i}" for i in range(60)) + ". How many are there?"
    resp = chat(client, text, max_tokens=8)
    n = resp.usage.prompt_tokens
    assert n > 3 * 128 and resp.choices[0].message.content
    assert len(list(mesh.kv_root.rglob("*.kvb"))) >= n // 128
    assert hit_tokens(mesh, "decode-0") - before == n // 128 * 128
    keys = [f.stem for f in mesh.kv_root.rglob("*.kvb")]
    assert asyncio.run(indexed(mesh, keys)) == len(keys)  # prefill announced what its connector stored


async def indexed(mesh, keys: list[str], wait_s: float = 10.0) -> int:
    """How many of ``keys`` the kvindex knows (each looked up alone), once all are or ``wait_s`` passed."""
    mc = await MeshClient.connect(mesh.nats_url, "vllm-test")
    try:
        index = KVIndexClient(mc, "vllm-test", "", lookup_timeout_s=2.0)
        for _ in range(int(wait_s * 10)):
            found = sum([await index.lookup([k]) for k in keys])
            if found == len(keys):
                break
            await asyncio.sleep(0.1)
        return found
    finally:
        await mc.close()


def test_speculative_decoding_is_refused_at_start_up(model_dir):
    p = subprocess.run([sys.executable, "-m", "deepinfer.cli", "serve", "decode", *VLLM_ARGS, "--speculative", "ngram",
                        "--nats", "nats://127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "not available on --engine vllm: speculative decoding (ngram, adaptive verification)" in p.stderr


def test_a_fresh_prefill_worker_loads_the_prefix_another_one_stored(mesh, client):
    """Cross-worker reuse through the connector: prefill-0 computes a prompt cold and its connector
    stores the blocks; prefill-0 is stopped and prefill-1 (a fresh vLLM engine, nothing cached) gets
    the same prompt: it reports the stored full blocks as cached and answers as the cold run did.
    (Last in this module: it replaces the mesh's prefill worker.)"""
    content = TEXT_A + "\nSummarise this story in one sentence."
    cold = chat(client, content, max_tokens=16)
    n = cold.usage.prompt_tokens
    assert n > 2 * 128 and not cold.usage.prompt_tokens_details.cached_tokens
    mesh.processes["prefill"][0].stop()
    mesh.start_worker("prefill")  # prefill-1
    deadline, warm = time.monotonic() + 300, None
    while warm is None:
        try:
            warm = chat(client, content, max_tokens=16)
        except openai.APIError:  # prefill-0 gone, prefill-1 still starting: the gateway has no worker yet
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
    assert warm.usage.prompt_tokens_details.cached_tokens == (n - 1) // 128 * 128
    assert warm.choices[0].message.content == cold.choices[0].message.content
    # cached_tokens counts the blocks granted, also when their load failed and vLLM recomputed them:
    # prefill-1's connector really loaded them (its load reports count loaded blocks only)
    assert hit_tokens(mesh, "prefill-1") == (n - 1) // 128 * 128
