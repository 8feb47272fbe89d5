"""Hostile input: the gateway answers every request 4xx or 2xx, never 5xx, and each refusal in its
API's own error shape. Each test prints its figures (``-s`` shows them).

The gateway runs in-process (``gateway_harness.ConfiguredGateway``, the default 32 MiB body limit)
on a real nats-server, with the real tokenizer service's handler (``TokenizerService``: templates,
the recipe, its refusals) and ``test_gateway``'s scripted fake prefill / decode workers, so every
request a fuzzer makes valid enough goes all the way through and back.

- fuzzing: schemathesis generates requests from the gateway's own OpenAPI spec (GET /openapi.json,
  request bodies included), schema-valid and schema-violating, a bounded number per operation
  (seeded, so a run is repeatable): 0 answers with status 5xx, 0 crashes (the server still serves).
- hand-made hostile bodies on every generation endpoint: a body over the limit (declared and
  chunked) -> 413; JSON nested 100,000 deep (whole body and inside fields that are free-form
  objects: tool schemas, response formats, metadata) -> 400; invalid UTF-8 and raw NUL bytes ->
  400; escaped NULs in text -> not a 5xx; prompts of 2 MiB and 30 MiB (past NATS's 1 MiB message
  limit: were 500s) -> 413 (or 400 context_length_exceeded where the gateway counts the tokens), a
  prompt whose token ids would not fit in one reply -> 400; numbers out of range (beyond 64 bits:
  a top_k of 2**64 was a 500; a temperature past float32; negative) -> 400. OpenAI endpoints
  answer ``{"error": {"message", "type", "param", "code"}}``, Anthropic's ``{"type": "error",
  "error": {"type", "message"}}``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import httpx
import pytest
import pytest_asyncio

from deepinfer.gateway.api.limits import DEFAULT_MAX_BODY_BYTES
from deepinfer.mesh import MeshClient
from deepinfer.tokenizer.service import TokenizerService
from gateway_harness import ConfiguredGateway, nats_url  # noqa: F401 - fixtures
from test_gateway import MODEL_DIR, FakeWorkers

FUZZ_EXAMPLES = 10  # per operation and generation mode (schema-valid, schema-violating)
GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens")
TOKENIZATION = ("/tokenize", "/detokenize")


class RealTokenizerFakes(FakeWorkers):
    """The fake workers, with the real tokenizer service's handler answering encode requests."""

    tokenizer: TokenizerService | None = None

    async def on_encode(self, req):
        return await self.tokenizer.on_encode_chat(req)


@pytest_asyncio.fixture(scope="module")
async def workers(nats_url):  # noqa: F811
    mesh = await MeshClient.connect(nats_url, name="fake-workers")
    fakes = RealTokenizerFakes(mesh)
    fakes.tokenizer = TokenizerService(nats_url, str(MODEL_DIR), worker_id="tokenizer-fake")  # not started: handler only
    await fakes.start()
    yield fakes
    await fakes.stop()
    await mesh.close()


@pytest_asyncio.fixture(scope="module")
async def gateway(nats_url, workers, redis_url):  # noqa: F811
    # a 960 KB prompt takes ~1 s to render and encode alone, here in the test's own process beside the
    # gateway; on a loaded 2-core host that passed 10 s (the tokenizer timeout is not what this tests)
    async with ConfiguredGateway(nats_url, redis_url=redis_url, tokenizer_timeout_s=45.0) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
            deadline = time.monotonic() + 5
            while (await client.get("/health")).status_code != 200:
                assert time.monotonic() < deadline, "gateway never saw the fake workers"
                await asyncio.sleep(0.05)
        yield gw


@pytest_asyncio.fixture
async def client(gateway):
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as c:
        yield c


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def assert_error_shape(path: str, r: httpx.Response, status: int | tuple[int, ...]) -> None:
    """``r`` is a refusal with ``status`` in the error shape of ``path``'s API."""
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, (path, r.status_code, r.text[:300])
    body = r.json()
    if is_anthropic(path):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["message"], body
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["message"] and body["error"]["type"] == "invalid_request_error", body


# --- fuzzing the OpenAPI spec ------------------------------------------------------------------


def fuzz(spec: dict, base_url: str, examples: int, model: str) -> tuple[Counter, list[str]]:
    """schemathesis cases of every operation of ``spec``, positive and negative, sent to ``base_url``
    (blocking: run it off the event loop that serves the gateway). Schema-valid bodies name the served
    ``model`` (a random name stops at the 404). Returns (status counts, 5xx cases)."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_dict(spec)
    statuses: Counter = Counter()
    server_errors: list[str] = []
    session = requests.Session()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

            @settings(max_examples=examples, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def send(case):
                if mode is schemathesis.GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = model
                try:
                    response = case.call(base_url=base_url, session=session, timeout=30)
                except requests.RequestException as e:  # the server dropped the connection: a crash
                    statuses["no answer"] += 1
                    server_errors.append(f"{case.method} {case.path}: {type(e).__name__}: {e}")
                    return
                statuses[response.status_code] += 1
                if response.status_code >= 500:
                    server_errors.append(f"{case.method} {case.formatted_path} {mode.value}: {response.status_code} "
                                         f"{response.text[:300]} <- {str(case.body)[:300]}")

            try:
                send()
            except Unsatisfiable:  # no schema-violating request exists (a GET without parameters)
                statuses["unsatisfiable"] += 1
    return statuses, server_errors


async def test_fuzzing_the_openapi_spec_gets_no_5xx_and_no_crash(client, gateway):
    spec = (await client.get("/openapi.json")).json()
    bodies = [p for p, ops in spec["paths"].items() if "requestBody" in ops.get("post", {})]
    assert sorted(bodies) == sorted(GENERATION + TOKENIZATION)  # the spec describes what the handlers parse
    started = time.monotonic()
    statuses, server_errors = await asyncio.to_thread(fuzz, spec, gateway.url, FUZZ_EXAMPLES, gateway.model)
    took = time.monotonic() - started
    total = sum(n for s, n in statuses.items() if s != "unsatisfiable")
    print(f"\nfuzzing: {total} schemathesis cases over {len(spec['paths'])} paths in {took:.1f} s; statuses "
          f"{dict(sorted(statuses.items(), key=str))}; {len(server_errors)} with status 5xx or no answer")
    assert total >= 100
    assert server_errors == []
    assert not gateway.task.done()  # the server is still up
    health = await client.get("/health")
    assert health.status_code == 200
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello there!"


# --- hand-made hostile bodies -----------------------------------------------------------------


def minimal(path: str, **extra) -> dict:
    """A valid body for ``path`` (a one-message chat), with ``extra`` fields."""
    if path == "/v1/completions":
        return {"prompt": "Say hello", **extra}
    if path == "/v1/responses":
        return {"input": "Say hello", **extra}
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Say hello"}], **extra}
    if path == "/v1/messages":
        body.setdefault("max_tokens", 16)
    elif path == "/v1/chat/completions":
        del body["model"]
    return body


def with_text(path: str, text: str) -> dict:
    """``minimal(path)`` with ``text`` as the prompt."""
    body = minimal(path)
    if path == "/v1/completions":
        body["prompt"] = text
    elif path == "/v1/responses":
        body["input"] = text
    else:
        body["messages"][0]["content"] = text
    return body


def nested(depth: int, leaf="x") -> str:
    return "[" * depth + json.dumps(leaf) + "]" * depth


def nested_object(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def raw(path: str, body: dict, field: str, fragment: str) -> bytes:
    """``body`` as JSON with ``field`` (a top-level key) set to the raw JSON ``fragment``."""
    text = json.dumps({**body, field: "@@HERE@@"})
    return text.replace('"@@HERE@@"', fragment).encode()


DEEP = 100_000


def hostile_cases(path: str) -> list[tuple[str, bytes | dict, int | tuple[int, ...]]]:
    """(name, body: JSON bytes or a dict, expected status or statuses) for ``path``."""
    base = minimal(path)
    cases = [
        ("nested array body", nested(DEEP).encode(), 400),
        ("nested object body", nested_object(DEEP).encode(), 400),
        ("nested in an unknown field", raw(path, base, "extra", nested(DEEP)), 400),
        ("nested metadata", raw(path, base, "metadata", nested_object(DEEP)), 400),
        ("invalid utf-8", json.dumps(base).encode().replace(b"Say hello", b"Say \xff\xfe\xc3( hello"), 400),
        ("lone surrogate escape", json.dumps(base).encode().replace(b"Say hello", b"Say \\ud800 hello"), (200, 400)),
        ("raw NUL in a string", json.dumps(base).encode().replace(b"Say hello", b"Say \x00 hello"), 400),
        ("raw NUL outside strings", json.dumps(base).encode() + b"\x00", 400),
        ("escaped NULs in text", with_text(path, "Say \u0000 hello \u0000" * 100), (200, 400)),
        ("2 MiB prompt", with_text(path, "hello " * ((2 << 20) // 6)), (400, 413)),
        ("30 MiB prompt", with_text(path, "a" * (30 << 20)), (400, 413)),
        ("960 KB of 2-byte one-token characters (ids past the message limit)", with_text(path, "é" * 480_000), 400),
        ("2 MiB model name", {**base, "model": "m" * (2 << 20)}, (400, 404)),
        ("2 MiB cache_salt", {**base, "cache_salt": "s" * (2 << 20)}, 400),
        ("10,000 stop strings", {**base, ("stop_sequences" if path == "/v1/messages" else "stop"): ["x" * 64] * 10_000},
         (200, 400)),
    ]
    if path == "/v1/messages/count_tokens":
        return [c for c in cases if "stop" not in c[0] and "cache_salt" not in c[0]]
    budget = {"/v1/responses": "max_output_tokens"}.get(path, "max_tokens")
    if path != "/v1/messages/count_tokens":
        for value in (2**64, 10**30, -1, 0, -(2**63) - 1):
            cases.append((f"{budget}={value}", {**base, budget: value}, 400))
        cases.append((f"{budget}=1e308", raw(path, base, budget, "1e308"), 400))
        for name, fragment in (("temperature", "1e308"), ("temperature", "-1"), ("top_p", "1e308"),
                               ("top_p", "-0.5"), ("temperature", "NaN"), ("temperature", "Infinity")):
            cases.append((f"{name}={fragment}", raw(path, base, name, fragment), 400))
    if path in ("/v1/chat/completions", "/v1/completions"):
        for name, value in (("seed", 2**64), ("seed", -(2**63) - 1), ("n", 10**9), ("n", 0), ("top_k", 2**64),
                            ("top_k", 10**30), ("min_tokens", 10**20), ("min_tokens", -1), ("stop_token_ids", [2**64]),
                            ("logit_bias", {"1": 1e300}), ("logit_bias", {str(2**64): 1}),
                            ("presence_penalty", 1e308), ("repetition_penalty", -1.0), ("min_p", 2.0)):
            cases.append((f"{name}={json.dumps(value)[:24]}", {**base, name: value}, 400))
    if path == "/v1/chat/completions":
        cases += [("top_logprobs=10**9", {**base, "logprobs": True, "top_logprobs": 10**9}, 400),
                  ("response_format nested", {**base, "response_format": {"type": "json_schema", "json_schema": {
                      "name": "x", "schema": json.loads(nested_object(500))}}}, (200, 400)),
                  ("deep tool schema", raw(path, {**base, "tools": [{"type": "function", "function": {
                      "name": "f", "parameters": "@@P@@"}}]}, "x", "0").replace(b'"@@P@@"', nested_object(5000).encode()),
                   (200, 400)),
                  ("guided_json nested", raw(path, base, "guided_json", nested_object(5000)), (200, 400)),
                  ("2 MiB guided_choice", {**base, "guided_choice": ["x" * 1000 + str(i) for i in range(2000)]},
                   (400, 413))]
    if path == "/v1/completions":
        cases += [("token id 2**64", {**base, "prompt": [1, 2, 2**64]}, 400),
                  ("negative token id", {**base, "prompt": [1, -5]}, 400),
                  ("nested prompt lists", raw(path, base, "prompt", nested(DEEP, 1)), 400),
                  ("logprobs=10**9", {**base, "logprobs": 10**9}, 400)]
    if path == "/v1/messages":
        cases += [("top_k=2**64", {**base, "top_k": 2**64}, 400)]
    return cases


@pytest.mark.parametrize("path", GENERATION)
async def test_hostile_bodies_get_4xx_in_the_apis_own_error_shape(client, gateway, path):
    outcomes, wrong = Counter(), []
    for name, body, expected in hostile_cases(path):
        if isinstance(body, dict):
            r = await client.post(path, json=body)
        else:
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
        outcomes[r.status_code] += 1
        allowed = (expected,) if isinstance(expected, int) else expected
        try:
            assert r.status_code in allowed
            if r.status_code != 200:
                assert_error_shape(path, r, expected)
        except (AssertionError, ValueError):
            wrong.append(f"{name}: {r.status_code} {r.text[:200]}")
    print(f"\n{path}: {sum(outcomes.values())} hostile bodies -> {dict(sorted(outcomes.items()))}")
    for w in wrong:
        print("  unexpected:", w)
    assert wrong == []
    assert not gateway.task.done() and (await client.get("/health")).status_code == 200


async def test_a_huge_completions_prompt_is_refused_at_once_and_never_stalls_the_gateway(client, gateway):
    """/v1/completions tokenizes text prompts in the gateway: a 30 MiB one took minutes on the event
    loop, every other request waiting (regression). Now it is refused without tokenizing, and what
    is tokenized is tokenized off the loop."""
    started = time.monotonic()
    big = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "ab " * (10 << 20)}))
    health = []
    while not big.done():
        t = time.monotonic()
        assert (await client.get("/health")).status_code == 200
        health.append(time.monotonic() - t)
        await asyncio.sleep(0.05)
    r = await big
    took = time.monotonic() - started
    print(f"\n30 MiB completions prompt: {r.status_code} in {took:.2f} s; /health meanwhile answered "
          f"{len(health)} times, slowest {max(health, default=0):.3f} s")
    assert_error_shape("/v1/completions", r, 400)
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert took < 10 and max(health, default=0) < 2


@pytest.mark.parametrize("path", GENERATION)
async def test_bodies_over_the_limit_are_413_declared_or_chunked(client, path):
    big = b"x" * (DEFAULT_MAX_BODY_BYTES + 1)
    r = await client.post(path, content=big, headers={"content-type": "application/json"})
    assert_error_shape(path, r, 413)

    async def chunks():  # no Content-Length: counted as it arrives
        for _ in range((DEFAULT_MAX_BODY_BYTES >> 20) + 1):
            yield b" " * (1 << 20)

    r = await client.post(path, content=chunks(), headers={"content-type": "application/json"})
    assert_error_shape(path, r, 413)
