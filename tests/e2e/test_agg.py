"""Aggregated serving (``deepinfer up --mode agg``): workers that prefill and decode their own
requests, through real meshes started by the launcher.

- the official ``openai`` client: greedy text equals ``transformers`` (fp32), streamed or not;
  the worker writes the prompt's blocks to the storage tier (the kvindex knows them) and a
  second request with the same prompt reports them cached; it scores a prompt (echo, logprobs,
  max_tokens 0) as transformers does, computing it whole;
- a worker killed (-9) mid-stream: its requests resume on the other worker with the same text;
- SIGTERM: a worker drains (in-flight requests finish, exit 0) while the other keeps serving.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import torch

from deepinfer.models.convert import DEFAULT_MODEL_NAME, ensure_default_model
from test_failover import FAST_START, Reports, Streams, busiest_decoding, log_count, mock_args, process, \
    story_requests, until

MODEL = DEFAULT_MODEL_NAME
SYSTEM = "You answer in one short sentence. " + "Keep to the facts you are given and nothing else. " * 12


def test_agg_mesh_answers_the_official_client_as_transformers_and_stores_prompts(make_mesh):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = make_mesh(mode="agg", extra_args={"decode": FAST_START})
    assert "prefill" not in m.processes and len(m.processes["decode"]) == 1
    client = openai.OpenAI(base_url=m.gateway_url + "/v1", api_key="t", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = next(c.usage for c in chunks if c.usage)

    model_dir = ensure_default_model(progress=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):]
    expected = tok.decode(ref, skip_special_tokens=True)
    assert first.choices[0].message.content == expected == text
    assert first.usage.prompt_tokens == len(ids)
    # the second request hit the first one's prompt blocks (all full blocks but the last token's)
    assert usage.prompt_tokens_details.cached_tokens >= (len(ids) - 1) // 16 * 16 - 16
    health = httpx.get(m.gateway_url + "/health", timeout=10).json()
    assert health["workers"].get("prefill") is None and health["workers"]["decode"] == 1
    assert health["kv_index"]["num_blocks"] >= len(ids) // 16  # the worker stored the prompt's blocks

    # the worker scores the (now cached) prompt too: its prompt logprobs, computed whole
    scored = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=0)
    with torch.inference_mode():
        ref = torch.log_softmax(hf.float()(torch.tensor([ids])).logits[0], dim=-1)
    got = scored.choices[0].logprobs.token_logprobs
    assert scored.usage.prompt_tokens_details.cached_tokens == 0 and scored.usage.completion_tokens == 0
    assert got[0] is None and got[1:] == pytest.approx([ref[p - 1, ids[p]].item() for p in range(1, len(ids))],
                                                       abs=1e-3)


def test_agg_worker_killed_mid_stream_resumes_on_the_other_one_with_the_same_text(make_mesh):
    m = make_mesh(mode="agg", replicas={"decode": 2}, extra_args={"decode": FAST_START})
    max_tokens = 40

    async def scenario():
        reference = await Streams(m, story_requests("reference", max_tokens)).run()
        assert all(isinstance(t, str) and t for t in reference), reference
        streams = Streams(m, story_requests("failover", max_tokens))
        run = asyncio.ensure_future(streams.run())
        await until(lambda: streams.min_chunks() >= 6 or run.done(), 120, "every stream to be under way")
        assert not run.done(), "the streams finished before the kill: lengthen them"
        victim, on_victim = busiest_decoding(m)
        assert on_victim, "no worker is decoding"
        await asyncio.to_thread(process(m, victim).kill)
        killed_at = time.monotonic()
        got = await run
        return reference, got, streams.resume_gaps(killed_at), victim, on_victim

    reference, got, gaps, victim, on_victim = asyncio.run(scenario())
    errors = [g for g in got if isinstance(g, BaseException)]
    assert not errors, errors
    assert got == reference  # greedy and seeded, resumed or not: the no-failure text
    resumed = log_count(m, "gateway-0", "failover_done")
    survivor = next(p.name for p in m.processes["decode"] if p.name != victim)
    loaded = log_count(m, survivor, "kv_prefix_loaded")  # the victim's stored prompt blocks, read back
    print(f"\nagg: killed {victim} ({len(on_victim)} decoding); {resumed} streams resumed, {loaded} from "
          f"stored blocks; kill -> next token per stream (s): {[round(g, 2) for g in gaps]}")
    assert resumed >= 1 and loaded >= 1
    assert gaps and max(gaps) < 15, gaps


def test_sigterm_drains_an_agg_worker_without_failing_a_request(make_mesh):
    m = make_mesh(mode="agg", replicas={"decode": 2}, extra_args={"decode": mock_args("0.03,2e-5,1e-9,1e-7")})

    def requests(salt: str, items: range) -> list[dict]:
        return [dict(messages=[{"role": "user", "content": f"Item {i}: " + "drain me slowly. " * 30}],
                     max_tokens=60, temperature=0, extra_body={"ignore_eos": True, "cache_salt": salt})
                for i in items]

    async def scenario():
        reference = await Streams(m, requests("reference", range(8))).run()
        reports = await Reports().start(m)
        first = Streams(m, requests("first", range(4)))
        run_first = asyncio.ensure_future(first.run())
        await until(lambda: first.min_chunks() >= 3 or run_first.done(), 60, "the first requests to stream")
        assert not run_first.done()
        busy = await reports.busiest("decode", busy=True)
        assert busy.active_requests > 0
        process(m, busy.worker_id).terminate()  # SIGTERM: drain
        await until(lambda: reports.latest[busy.worker_id].draining, 5, "the draining worker to say so")
        second = Streams(m, requests("second", range(4, 8)))  # arrive while it drains: go to the other
        got = await asyncio.gather(run_first, second.run())
        code = await asyncio.to_thread(process(m, busy.worker_id).popen.wait, 40)
        await reports.close()
        return reference, got[0] + got[1], code, busy.worker_id

    reference, got, code, drained = asyncio.run(scenario())
    assert got == reference  # salts differ, texts do not
    assert code == 0
    assert log_count(m, "gateway-0", "worker_failed") == 0  # drained, not failed over
    assert log_count(m, drained, "service_draining") == 1
