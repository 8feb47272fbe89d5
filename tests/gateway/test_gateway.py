"""Gateway against a real nats-server and fake workers scripted by each test.

The fakes speak the real protocol: a tokenizer that renders a ChatML prompt
and encodes it with the default model's real tokenizer, a prefill worker that
answers SubmitReply and publishes the first token, a decode worker that
publishes the rest, LoadReport heartbeats every 0.2 s, and a recorder of every
AbortRequest. The fake prefill also answers a re-dispatch (the same request id
submitted again after its worker died) and the fake decode worker ``DECODE_ID``
takes resumes (a ``DecodeRequest`` from the gateway) and continues the script's
tokens from the ones already given. ``Script`` says what the workers do for
the next request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import tempfile
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio
import uvicorn
from opentelemetry import trace
from tokenizers import Tokenizer

from deepinfer.gateway.app import create_app
from deepinfer.gateway.config import GatewayConfig, load_model
from deepinfer.gateway.stream.request_stream import StreamTimeouts
from deepinfer.kvstore import block_hashes
from deepinfer.mesh import MeshClient
from deepinfer.models.convert import ensure_default_model
from deepinfer.protocol import (
    AbortRequest,
    EncodeChatReply,
    EncodeChatRequest,
    ErrorReply,
    DecodeRequest,
    LoadReport,
    PrefillRequest,
    SubmitReply,
    TokenChunk,
    subjects,
)
from deepinfer.launcher import free_port, start_nats
from deepinfer.telemetry import configure_tracing
from waiting import eventually


MODEL_DIR = ensure_default_model(progress=False)  # converts once on a fresh machine
MAX_MODEL_LEN = 256
EOS = 2  # <|im_end|>
TOKENIZER = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
PREFILL_ID, DECODE_ID, TOKENIZER_ID = "prefill-fake", "decode-fake", "tokenizer-fake"
FINGERPRINT, BLOCK_SIZE = "fakefingerprint0", 16  # in the fakes' LoadReports: resumes name stored blocks
HEARTBEAT_S = 0.2



def render(messages: list[dict]) -> str:
    out = "".join(f"<|im_start|>{m['role']}\n{m['content'] or ''}<|im_end|>\n" for m in messages)
    return out + "<|im_start|>assistant\n"


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False).ids


# --- fake workers ----------------------------------------------------------------


@dataclass
class Script:
    """What the fake workers do with the next request."""

    text: str = "Hello there!"
    eos: bool = True  # end with the EOS token (finish "stop"); else finish "length"
    tokens_per_chunk: int = 1
    delay_s: float = 0.0
    cached_tokens: int = 0
    prefill_worker: str = PREFILL_ID
    decode_worker: str = DECODE_ID
    prefill_silent: bool = False  # accept, then never publish
    no_handoff: bool = False  # publish the first token, then nothing
    die_after: int | None = None  # decode: after N chunks stop publishing AND heartbeating
    stall_after: int | None = None  # decode: after N chunks stop publishing, keep heartbeating
    error_after: int | None = None  # decode: chunk N is finish_reason "error"
    first_error: str | None = None  # prefill: the first chunk is finish_reason "error"
    redispatch_ok: bool = False  # prefill: a second submit of a request is served normally (else refused)
    zombie_s: float | None = None  # decode with die_after: stops beating, yet publishes the rest after this
    decode_refuses: bool = False  # decode: refuse resumes from the gateway
    submit_hang_s: float = 0.0  # prefill: answer a submit only after this long (a busy worker), then refuse

    @property
    def token_ids(self) -> list[int]:
        return encode(self.text) + ([EOS] if self.eos else [])


@dataclass
class FakeWorkers:
    mesh: MeshClient
    script: Script = field(default_factory=Script)
    prefill_requests: list[PrefillRequest] = field(default_factory=list)
    decode_requests: list[DecodeRequest] = field(default_factory=list)  # resumes from the gateway
    tokenizer_requests: list[EncodeChatRequest] = field(default_factory=list)
    aborts: list[tuple[str, str]] = field(default_factory=list)  # (subject, request_id)
    trace_ids: list[tuple[str, int]] = field(default_factory=list)  # (handler, trace_id)
    beating: dict[str, str] = field(default_factory=dict)  # worker_id -> role
    report_fields: dict[str, dict] = field(default_factory=dict)  # worker_id -> more LoadReport fields
    zombies: list[asyncio.Task] = field(default_factory=list)
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    resumed: set[str] = field(default_factory=set)  # request ids whose task is a resume on DECODE_ID

    async def start(self) -> None:
        await self.mesh.subscribe(subjects.TOKENIZER_ENCODE_CHAT, self.on_encode, queue=subjects.TOKENIZER_GROUP)
        await self.mesh.subscribe(subjects.PREFILL_SUBMIT, self.on_submit, queue=subjects.PREFILL_GROUP)
        await self.mesh.subscribe(subjects.prefill_submit(PREFILL_ID), self.on_submit)
        await self.mesh.subscribe(subjects.DECODE_SUBMIT, self.on_decode_submit, queue=subjects.DECODE_GROUP)
        await self.mesh.subscribe(subjects.decode_submit(DECODE_ID), self.on_decode_submit)
        await self.mesh.nc.subscribe(f"{subjects.PREFIX}.*.*.abort", cb=self.on_abort)
        await self.mesh.nc.subscribe(f"{subjects.PREFIX}.*.abort", cb=self.on_abort)  # final aborts, to every worker
        self.beating.update({TOKENIZER_ID: "tokenizer", PREFILL_ID: "prefill", DECODE_ID: "decode"})
        self.tasks["heartbeat"] = asyncio.create_task(self.heartbeat())
        await self.mesh.nc.flush()

    async def stop(self) -> None:
        for t in self.tasks.values():
            t.cancel()

    async def heartbeat(self) -> None:
        while True:
            for worker_id, role in list(self.beating.items()):
                report = LoadReport(role=role, worker_id=worker_id, interval_s=HEARTBEAT_S,
                                    fingerprint=FINGERPRINT, block_size=BLOCK_SIZE,
                                    **self.report_fields.get(worker_id, {}))
                await self.mesh.publish(subjects.load(role, worker_id), report)
            await asyncio.sleep(HEARTBEAT_S)

    def _record_trace(self, handler: str) -> None:
        self.trace_ids.append((handler, trace.get_current_span().get_span_context().trace_id))

    async def on_encode(self, req: EncodeChatRequest):
        self._record_trace("tokenizer")
        self.tokenizer_requests.append(req)
        if any("TRIGGER_BAD_REQUEST" in m["content"] for m in req.messages):
            return ErrorReply(error="message content is not allowed", kind="bad_request")
        return EncodeChatReply(req.request_id, encode(render(req.messages)))

    async def on_submit(self, req: PrefillRequest):
        self._record_trace("prefill")
        again = any(r.request_id == req.request_id for r in self.prefill_requests)
        self.prefill_requests.append(req)
        s = self.script
        if s.submit_hang_s:
            await asyncio.sleep(s.submit_hang_s)
            return SubmitReply(accepted=False, worker_id=PREFILL_ID, error="too late")
        if again:  # a re-dispatch after the first prefill worker died
            if not s.redispatch_ok:
                return SubmitReply(accepted=False, worker_id=PREFILL_ID, error="busy")
            s = dataclasses.replace(s, prefill_worker=PREFILL_ID, prefill_silent=False)
        self.tasks[req.request_id] = asyncio.create_task(self.generate(req, s))
        return SubmitReply(accepted=True, worker_id=s.prefill_worker)

    async def on_decode_submit(self, req: DecodeRequest):
        self.decode_requests.append(req)
        if self.script.decode_refuses:
            return SubmitReply(accepted=False, worker_id=DECODE_ID, error="no room")
        self.tasks[req.request_id] = asyncio.create_task(self.resume(req, self.script))
        self.resumed.add(req.request_id)
        return SubmitReply(accepted=True, worker_id=DECODE_ID)

    async def resume(self, req: DecodeRequest, s: Script) -> None:
        """Continue the script's tokens after the ones the gateway already has, as ``DECODE_ID``."""
        ids, done = s.token_ids, len(req.output_token_ids)
        assert req.output_token_ids == ids[:done]
        await self.mesh.publish(req.stream_subject, TokenChunk(req.request_id, [], "decode", DECODE_ID))
        for i in range(done, len(ids)):
            await asyncio.sleep(s.delay_s)
            finish = ("stop" if s.eos else "length") if i == len(ids) - 1 else None
            await self.mesh.publish(req.stream_subject, TokenChunk(req.request_id, ids[i : i + 1], "decode",
                                                                   DECODE_ID, finish))

    async def on_abort(self, raw) -> None:
        from deepinfer.protocol import unpack

        msg = unpack(raw.data, expect=AbortRequest)
        self.aborts.append((raw.subject, msg.request_id))
        if msg.request_id in self.resumed and raw.subject not in (
                subjects.abort("decode", DECODE_ID), subjects.PREFILL_ABORT_ANY, subjects.DECODE_ABORT_ANY):
            return  # addressed to the worker the request was moved away from, not to the resume's
        task = self.tasks.pop(msg.request_id, None)
        if task:
            task.cancel()

    async def publish_late(self, req: PrefillRequest, s: Script, late: list, chunk) -> None:
        await asyncio.sleep(s.zombie_s)
        for part, finish in late:
            await self.mesh.publish(req.stream_subject, chunk(part, "decode", s.decode_worker, finish))

    async def generate(self, req: PrefillRequest, s: Script) -> None:
        ids = s.token_ids
        final_reason = "stop" if s.eos else "length"

        def chunk(token_ids, role, worker, finish=None, error=None):
            return TokenChunk(req.request_id, token_ids, role, worker, finish, error,
                              num_prompt_tokens=len(req.prompt_token_ids), num_cached_tokens=s.cached_tokens)

        if s.prefill_silent:
            return
        if s.first_error:
            await self.mesh.publish(req.stream_subject, chunk([], "prefill", s.prefill_worker, "error", s.first_error))
            return
        first_final = final_reason if len(ids) == 1 else None
        await self.mesh.publish(req.stream_subject, chunk(ids[:1], "prefill", s.prefill_worker, first_final))
        if first_final or s.no_handoff:
            return
        self.beating.setdefault(s.decode_worker, "decode")
        rest = [ids[i : i + s.tokens_per_chunk] for i in range(1, len(ids), s.tokens_per_chunk)]
        for n, part in enumerate(rest):
            if s.die_after is not None and n >= s.die_after:
                self.beating.pop(s.decode_worker, None)
                if s.zombie_s is not None:  # only slow: the rest comes late (not cancellable by an abort)
                    late = [(p, final_reason if k == len(rest) - 1 else None) for k, p in enumerate(rest)][n:]
                    self.zombies.append(asyncio.create_task(self.publish_late(req, s, late, chunk)))
                return
            if s.stall_after is not None and n >= s.stall_after:
                return
            await asyncio.sleep(s.delay_s)
            if s.error_after is not None and n >= s.error_after:
                failed = chunk([], "decode", s.decode_worker, "error", "CUDA on fire")
                await self.mesh.publish(req.stream_subject, failed)
                return
            finish = final_reason if n == len(rest) - 1 else None
            await self.mesh.publish(req.stream_subject, chunk(part, "decode", s.decode_worker, finish))


# --- fixtures ----------------------------------------------------------------------


def start_nats_server():
    """A private nats-server (the launcher's code) so these fake workers see no others."""
    proc = start_nats(Path(tempfile.mkdtemp(prefix="gateway-test-nats-")))
    return proc, proc.url


class InProcessGateway:
    def __init__(self, nats_url: str):
        self.config = GatewayConfig(
            nats_url=nats_url,
            model=str(MODEL_DIR),
            max_model_len=MAX_MODEL_LEN,
            port=free_port(),
            worker_id="gateway-test",
            timeouts=StreamTimeouts(inactivity_s=4.0, handoff_s=1.0, tick_s=0.1),
        )
        self.app = create_app(self.config, load_model(self.config))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.config.port,
                                                    log_level="warning", lifespan="on"))
        self.url = f"http://127.0.0.1:{self.config.port}"
        self.model = self.app.state.gateway.model.served_name
        self.task: asyncio.Task | None = None

    async def __aenter__(self):
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.task.done():
                raise RuntimeError("gateway did not start") from self.task.exception()
            await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *exc):
        self.server.should_exit = True
        await self.task


@pytest.fixture(scope="session")
def nats_url():
    proc, url = start_nats_server()
    yield url
    proc.stop()


@pytest_asyncio.fixture(scope="session")
async def workers(nats_url):
    mesh = await MeshClient.connect(nats_url, name="fake-workers")
    fakes = FakeWorkers(mesh)
    await fakes.start()
    yield fakes
    await fakes.stop()
    await mesh.close()


@pytest_asyncio.fixture(scope="session")
async def gateway(nats_url, workers):
    configure_tracing("gateway-test")
    async with InProcessGateway(nats_url) as gw:
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


def chat_body(model: str, content: str = "Say hello", **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **kw}


async def stream_events(client: httpx.AsyncClient, body: dict) -> list:
    """POST a streaming request; return the decoded ``data:`` payloads ("[DONE]" kept as is)."""
    events = []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def streamed_text(events: list) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices"))


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


# --- models and health -------------------------------------------------------


async def test_models_lists_the_served_model_named_after_the_model_directory(client, gateway):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL_DIR.name] == [gateway.model]
    assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == MAX_MODEL_LEN


async def test_health_counts_live_workers_by_role(client):
    r = await client.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok"
    assert all(body["workers"].get(role, 0) >= 1 for role in ("tokenizer", "prefill", "decode"))


async def test_without_workers_health_and_chat_answer_503():
    proc, url = start_nats_server()
    try:
        async with InProcessGateway(url) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
            r = await c.get("/health")
            assert r.status_code == 503
            assert r.json() == {"status": "unavailable", "workers": {},
                                "kv_index": {"reachable": False, "redis_ok": None}}
            r = await c.post("/v1/chat/completions", json=chat_body(gw.model))
            assert_openai_error(r, 503)
            r = await c.post("/v1/chat/completions", json=chat_body(gw.model, stream=True))
            assert_openai_error(r, 503)
    finally:
        proc.stop()


# --- error shapes ------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": None}, "messages"),  # missing messages
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "10"}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": -0.5}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, "top_p"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "seed": 2**70}, "seed"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs"),
    ],
)
async def test_invalid_fields_are_400_naming_the_param(client, workers, body, param):
    before = len(workers.prefill_requests)
    for stream in (False, True):
        r = await client.post("/v1/chat/completions", json={**body, "stream": body.get("stream", stream)})
        err = assert_openai_error(r, 400, param=param)
        assert err["type"] == "invalid_request_error"
    assert len(workers.prefill_requests) == before  # nothing reached a worker
    assert (await client.get("/health")).status_code == 200


async def test_invalid_json_and_non_object_bodies_are_400(client):
    r = await client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(r, 400)
    r = await client.post("/v1/chat/completions", json=[1, 2])
    assert_openai_error(r, 400)
    r = await client.post("/v1/chat/completions", content=b"")
    assert_openai_error(r, 400)


async def test_unknown_model_is_404_model_not_found(client):
    r = await client.post("/v1/chat/completions", json=chat_body("gpt-17"))
    err = assert_openai_error(r, 404, param="model", code="model_not_found")
    assert "gpt-17" in err["message"]


async def test_unknown_route_and_wrong_method_use_the_openai_shape(client):
    assert_openai_error(await client.get("/v1/nothing"), 404)
    assert_openai_error(await client.get("/v1/chat/completions"), 405)


async def test_tokenizer_bad_request_is_400(client, gateway):
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model, "TRIGGER_BAD_REQUEST"))
    err = assert_openai_error(r, 400, param="messages")
    assert "not allowed" in err["message"]


async def test_prompt_longer_than_the_model_is_400(client, gateway):
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model, "word " * MAX_MODEL_LEN))
    assert_openai_error(r, 400, param="messages", code="context_length_exceeded")
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model, max_tokens=MAX_MODEL_LEN))
    assert_openai_error(r, 400, param="messages", code="context_length_exceeded")


# --- sampling handed to prefill ---------------------------------------------------


async def test_sampling_defaults_and_extensions_reach_prefill(client, gateway, workers, script):
    script(text="ok")
    body = chat_body(gateway.model, "Hi", seed=7, ignore_eos=True, stop_token_ids=[5])
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    req = workers.prefill_requests[-1]
    prompt_len = len(encode(render([{"role": "user", "content": "Hi"}])))
    assert req.prompt_token_ids == encode(render([{"role": "user", "content": "Hi"}]))
    assert req.stream_subject == subjects.stream(req.request_id)
    s = req.sampling
    assert (s.temperature, s.top_p, s.max_tokens) == (1.0, 1.0, MAX_MODEL_LEN - prompt_len)
    assert (s.seed, s.ignore_eos, s.stop_token_ids) == (7, True, [5])

    body = chat_body(gateway.model, "Hi", temperature=0, top_p=0.5, max_completion_tokens=9, max_tokens=3)
    r = await client.post("/v1/chat/completions", json=body)
    s = workers.prefill_requests[-1].sampling
    assert (s.temperature, s.top_p, s.max_tokens) == (0.0, 0.5, 9)


async def test_text_content_parts_are_joined(client, gateway, workers, script):
    script(text="ok")
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    body = {"model": gateway.model, "messages": [{"role": "developer", "content": "Be brief"},
                                                 {"role": "user", "content": parts}]}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    expected = render([{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hello\nworld"}])
    assert workers.prefill_requests[-1].prompt_token_ids == encode(expected)


# --- text: detokenization, stop strings, usage ------------------------------------------


UNICODE_TEXT = "Grüße 🦙 from 東京! ✨ done"


async def test_streamed_text_equals_non_streamed_text_across_split_utf8(client, gateway, script):
    ids = encode(UNICODE_TEXT)
    assert any("\ufffd" in TOKENIZER.decode([i]) for i in ids), "test text must split a character over tokens"
    for per_chunk in (1, 2, 3):
        script(text=UNICODE_TEXT, tokens_per_chunk=per_chunk)
        r = await client.post("/v1/chat/completions", json=chat_body(gateway.model))
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": UNICODE_TEXT}
        assert choice["finish_reason"] == "stop"

        events = await stream_events(client, chat_body(gateway.model))
        assert events[-1] == "[DONE]"
        deltas = [e["choices"][0]["delta"].get("content") for e in events[:-1]]
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all("\ufffd" not in (d or "") for d in deltas)
        assert streamed_text(events) == UNICODE_TEXT
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])


async def test_length_finish_is_reported(client, gateway, script):
    script(text="cut short", eos=False)
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model, max_tokens=3))
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["choices"][0]["message"]["content"] == "cut short"


@pytest.mark.parametrize(
    "stop, expected",
    [
        (["swer is 4"], "The an"),  # spans several tokens and starts mid-token
        ("42.", "The answer is "),
        (["final", "\n\n", "is"], "The answer "),  # the earliest occurrence of any stop string wins
        (["zzz"], "The answer is 42. It is final."),  # no match: held-back text is flushed
    ],
)
async def test_stop_strings_cut_text_identically_when_streaming(client, gateway, workers, script, stop, expected):
    script(text="The answer is 42. It is final.", delay_s=0.005)
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model, stop=stop))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == expected
    assert choice["finish_reason"] == "stop"
    events = await stream_events(client, chat_body(gateway.model, stop=stop))
    assert streamed_text(events) == expected
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    if stop != ["zzz"]:  # generation was cut by the gateway: every decode worker is told it is over
        rid = workers.prefill_requests[-1].request_id
        await eventually(lambda: (subjects.DECODE_ABORT_ANY, rid) in workers.aborts)


async def test_usage_block_counts_prompt_completion_and_cached_tokens(client, gateway, script):
    script(text="Four tokens here", cached_tokens=7)
    prompt_len = len(encode(render([{"role": "user", "content": "Say hello"}])))
    completion_len = len(encode("Four tokens here")) + 1  # + EOS
    expected = {"prompt_tokens": prompt_len, "completion_tokens": completion_len,
                "total_tokens": prompt_len + completion_len, "prompt_tokens_details": {"cached_tokens": 7}}
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model))
    body = r.json()
    assert body["usage"] == expected
    assert body["object"] == "chat.completion" and body["model"] == gateway.model
    assert body["id"].startswith("chatcmpl-")

    events = await stream_events(client, chat_body(gateway.model, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"] == expected
    assert all(e["usage"] is None for e in events[:-2])
    events = await stream_events(client, chat_body(gateway.model))
    assert all("usage" not in e for e in events[:-1])


async def test_return_token_ids_like_vllm(client, gateway, script):
    s = script(text="Token ids please", tokens_per_chunk=2)
    prompt_ids = encode(render([{"role": "user", "content": "Say hello"}]))
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model, return_token_ids=True))
    body = r.json()
    assert body["prompt_token_ids"] == prompt_ids
    assert body["choices"][0]["token_ids"] == s.token_ids

    events = await stream_events(client, chat_body(gateway.model, return_token_ids=True))
    assert events[0]["prompt_token_ids"] == prompt_ids
    streamed_ids = [t for e in events[1:-1] for t in e["choices"][0]["token_ids"]]
    assert streamed_ids == s.token_ids
    plain = await client.post("/v1/chat/completions", json=chat_body(gateway.model))
    assert "prompt_token_ids" not in plain.json() and "token_ids" not in plain.json()["choices"][0]


# --- failures: dead workers, timeouts, worker errors -------------------------------------


TEXT8 = "one two three four five six seven eight"


async def test_decode_worker_dying_mid_stream_is_resumed_on_another_decode_worker(client, gateway, workers, script):
    s = script(text=TEXT8, decode_worker="decode-doomed-0", die_after=3, delay_s=0.02)
    workers.decode_requests.clear()
    t0 = time.monotonic()
    events = await stream_events(client, chat_body(gateway.model, "Say hello, please. " * 8))  # 3 full blocks
    assert events[-1] == "[DONE]" and streamed_text(events) == TEXT8  # every token once, in order
    assert time.monotonic() - t0 < 6
    (resume,) = workers.decode_requests
    prefill = workers.prefill_requests[-1]
    assert resume.request_id == prefill.request_id and resume.stream_subject == prefill.stream_subject
    assert resume.prompt_token_ids == prefill.prompt_token_ids and resume.sampling == prefill.sampling
    assert resume.output_token_ids == s.token_ids[:4]  # the first token + 3 decode chunks
    # the prompt's full blocks, named as the workers' LoadReports say (fingerprint, block size)
    assert resume.kv_block_keys == block_hashes(prefill.prompt_token_ids, BLOCK_SIZE, FINGERPRINT)
    assert resume.num_kv_tokens == len(resume.kv_block_keys) * BLOCK_SIZE > 0
    await eventually(lambda: (subjects.abort("decode", "decode-doomed-0"), prefill.request_id) in workers.aborts)


async def test_a_decode_worker_that_was_only_slow_never_streams_duplicates(client, gateway, workers, script):
    # silent (no heartbeat, no chunk) for 4 s: declared dead after 3; its late chunks come while the
    # resumed worker (2 s for the rest) is still streaming
    text = " ".join(f"w{i}" for i in range(40))
    script(text=text, decode_worker="decode-slow-0", die_after=2, zombie_s=4.0, delay_s=0.05)
    workers.decode_requests.clear()
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == text
    assert len(workers.decode_requests) == 1
    zombie = workers.zombies[-1]
    assert zombie.done()  # it did publish the rest, late, before the end: the gateway dropped it
    rid = workers.prefill_requests[-1].request_id
    # aborted when it was abandoned, and once more (not once per chunk) when its late chunks showed that
    # the first abort had not reached it
    assert workers.aborts.count((subjects.abort("decode", "decode-slow-0"), rid)) == 2


async def test_decode_worker_dying_with_no_decode_worker_to_take_over_ends_with_an_error_event(client, gateway,
                                                                                                script):
    script(text=TEXT8, decode_worker="decode-doomed-1", die_after=3, delay_s=0.02, decode_refuses=True)
    t0 = time.monotonic()
    events = await stream_events(client, chat_body(gateway.model))
    elapsed = time.monotonic() - t0
    assert "error" in events[-1] and "[DONE]" not in events
    message = events[-1]["error"]["message"]
    assert "decode-doomed-1" in message and "resuming on another decode worker failed" in message
    assert "no room" in message  # the fake decode worker's refusal
    assert set(events[-1]["error"]) == {"message", "type", "param", "code"}
    assert streamed_text(events)  # some text came before the failure
    assert elapsed < 6, elapsed


async def test_prefill_worker_dead_before_first_token_is_redispatched(client, gateway, workers, script):
    script(text=TEXT8, prefill_worker="prefill-doomed-0", prefill_silent=True, redispatch_ok=True)
    t0 = time.monotonic()
    events = await stream_events(client, chat_body(gateway.model))
    assert events[-1] == "[DONE]" and streamed_text(events) == TEXT8
    assert time.monotonic() - t0 < 6
    first, again = workers.prefill_requests[-2:]
    assert again.request_id == first.request_id and again.stream_subject == first.stream_subject
    assert again.prompt_token_ids == first.prompt_token_ids and again.sampling == first.sampling
    await eventually(lambda: (subjects.abort("prefill", "prefill-doomed-0"), first.request_id) in workers.aborts)


async def test_prefill_worker_dead_before_first_token_and_no_other_takes_it_is_503(client, gateway, script):
    script(prefill_worker="prefill-doomed-1", prefill_silent=True)
    t0 = time.monotonic()
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model, stream=True))
    err = assert_openai_error(r, 503)
    assert "prefill-doomed-1" in err["message"] and "re-dispatching" in err["message"]
    assert time.monotonic() - t0 < 6


async def test_handoff_that_produces_nothing_aborts_prefill_and_resumes_on_decode(client, gateway, workers, script):
    script(text="first then nothing", no_handoff=True)
    workers.decode_requests.clear()
    events = await stream_events(client, chat_body(gateway.model))
    assert events[-1] == "[DONE]" and streamed_text(events) == "first then nothing"
    rid = workers.prefill_requests[-1].request_id
    assert [d.request_id for d in workers.decode_requests] == [rid]
    await eventually(lambda: (subjects.abort("prefill", PREFILL_ID), rid) in workers.aborts)

    script(text="first then nothing", no_handoff=True, decode_refuses=True)
    events = await stream_events(client, chat_body(gateway.model))
    assert "handoff" in events[-1]["error"]["message"]


async def test_live_prefill_workers_too_busy_to_answer_the_submit_is_429_and_the_request_is_dropped(
        client, gateway, workers, script, monkeypatch):
    monkeypatch.setattr(gateway.config.timeouts, "submit_s", 1.0)
    script(submit_hang_s=1.5)
    for stream in (False, True):
        r = await client.post("/v1/chat/completions", json=chat_body(gateway.model, stream=stream))
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("rate_limit_exceeded", "worker_busy") and "too busy" in err["message"]
        rid = workers.prefill_requests[-1].request_id
        await eventually(lambda: (subjects.PREFILL_ABORT_ANY, rid) in workers.aborts)
    assert gateway.app.state.gateway.admission.rejected["worker_busy"] == 2


async def test_live_but_silent_decode_worker_hits_the_inactivity_timeout(client, gateway, workers, script):
    script(text="a b c d e f", stall_after=2)
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model))
    assert_openai_error(r, 503, code="timeout")
    rid = workers.prefill_requests[-1].request_id
    await eventually(lambda: (subjects.abort("decode", DECODE_ID), rid) in workers.aborts)


async def test_worker_error_is_500_before_output_and_an_sse_error_after(client, gateway, script):
    script(first_error="out of KV blocks")
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model))
    err = assert_openai_error(r, 500)
    assert "out of KV blocks" in err["message"]
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model, stream=True))
    assert_openai_error(r, 500)

    script(text="a b c d e f", error_after=2)
    events = await stream_events(client, chat_body(gateway.model))
    assert "CUDA on fire" in events[-1]["error"]["message"]
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model))
    assert_openai_error(r, 500)


async def test_client_disconnect_mid_stream_aborts_it_on_every_worker(client, gateway, workers, script):
    script(text="word " * 150, delay_s=0.02)
    async with client.stream("POST", "/v1/chat/completions", json=chat_body(gateway.model, stream=True)) as r:
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 4:
                break
    rid = workers.prefill_requests[-1].request_id
    await eventually(lambda: {(subjects.PREFILL_ABORT_ANY, rid), (subjects.DECODE_ABORT_ANY, rid)} <= set(workers.aborts),
                     timeout=2)


async def test_a_full_decode_worker_gets_requests_refused_up_front_with_429(client, gateway, workers, script):
    def kv_used() -> int | None:  # the decode worker's KV in use, as its last report in the gateway says
        return next((w.report.kv_tokens_used for w in gateway.app.state.gateway.registry.alive("decode")
                     if w.report.worker_id == DECODE_ID), None)

    script(text="fine")
    workers.report_fields[DECODE_ID] = {"kv_tokens_used": 1000, "kv_tokens_capacity": 1000}
    try:
        await eventually(lambda: kv_used() == 1000)  # a full report reached the gateway
        submitted = len(workers.prefill_requests)
        r = await client.post("/v1/chat/completions", json=chat_body(gateway.model))
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "decode_full" and len(workers.prefill_requests) == submitted
    finally:
        workers.report_fields.pop(DECODE_ID)
    await eventually(lambda: kv_used() == 0)  # ... and then one with room again
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "fine"


async def test_client_leaving_a_non_streaming_request_aborts_the_worker(gateway, workers, script):
    script(text="word " * 150, delay_s=0.02)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=0.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/chat/completions", json=chat_body(gateway.model))
    rid = workers.prefill_requests[-1].request_id
    await eventually(lambda: (subjects.DECODE_ABORT_ANY, rid) in workers.aborts, timeout=2)


# --- tracing -------------------------------------------------------------------------


async def test_one_request_is_one_trace_through_tokenizer_and_prefill(client, gateway, workers, script):
    script(text="traced")
    workers.trace_ids.clear()
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model))
    assert r.status_code == 200
    handlers = dict(workers.trace_ids)
    assert set(handlers) == {"tokenizer", "prefill"}
    assert handlers["tokenizer"] == handlers["prefill"] != 0


# --- the official openai client ------------------------------------------------------


async def test_openai_client_parses_streaming_and_non_streaming(gateway, script):
    script(text=UNICODE_TEXT, cached_tokens=3)

    def sync_calls():
        c = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        models = c.models.list()
        done = c.chat.completions.create(model=gateway.model, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=50, temperature=0)
        chunks = list(c.chat.completions.create(model=gateway.model, messages=[{"role": "user", "content": "hi"}],
                                                stream=True, stream_options={"include_usage": True}))
        return models, done, chunks

    models, done, chunks = await asyncio.to_thread(sync_calls)
    assert [m.id for m in models.data] == [gateway.model]
    assert done.choices[0].message.content == UNICODE_TEXT
    assert done.choices[0].finish_reason == "stop"
    assert done.usage.prompt_tokens_details.cached_tokens == 3
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == UNICODE_TEXT
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens

    ac = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    stream = await ac.chat.completions.create(model=gateway.model, messages=[{"role": "user", "content": "hi"}],
                                              stream=True, extra_body={"return_token_ids": True})
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == UNICODE_TEXT

    with pytest.raises(openai.NotFoundError):
        await ac.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as e:
        await ac.chat.completions.create(model=gateway.model, messages=[{"role": "user", "content": "hi"}], top_p=2)
    assert e.value.body["param"] == "top_p"
    await ac.close()


async def test_openai_client_raises_api_error_on_a_mid_stream_failure(gateway, script):
    script(text="a b c d e f", error_after=2)
    ac = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    stream = await ac.chat.completions.create(model=gateway.model, messages=[{"role": "user", "content": "hi"}],
                                              stream=True)
    with pytest.raises(openai.APIError, match="CUDA on fire"):
        async for _ in stream:
            pass
    await ac.close()


# --- the entry point ------------------------------------------------------------------


async def test_main_serves_and_stops_cleanly_on_sigterm(nats_url, workers):
    port = free_port()
    env = {**os.environ, "DEEPINFER_NATS_URL": nats_url, "DEEPINFER_MODEL": str(MODEL_DIR)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.gateway", "--port", str(port), "--served-model-name", "smol",
         "--log-level", "WARNING"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as c:
            deadline = time.monotonic() + 20
            while True:
                try:
                    r = await c.get("/health")
                    if r.status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read().decode()
                await asyncio.sleep(0.1)
            assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["smol"]
            r = await c.post("/v1/chat/completions", json=chat_body("smol"))
            assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- tools ---------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL_TEXT = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


async def test_tool_calls_are_parsed_streaming_and_not_with_the_official_client(gateway, workers, script):
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    script(text=CALL_TEXT)
    r = await client.chat.completions.create(model=gateway.model, messages=msgs, tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Checking."
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert workers.tokenizer_requests[-1].tools == TOOLS  # offered to the template

    script(text=CALL_TEXT)
    stream = await client.chat.completions.create(model=gateway.model, messages=msgs, tools=TOOLS, stream=True)
    text, calls, reasons = "", [], []
    async for chunk in stream:
        for ch in chunk.choices:
            text += ch.delta.content or ""
            calls += ch.delta.tool_calls or []
            reasons.append(ch.finish_reason)
    assert text == "Checking." and "<" not in text
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert reasons[-1] == "tool_calls"

    # the call and its result go back into the conversation
    script(text="It is sunny.")
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r = await client.chat.completions.create(model=gateway.model, messages=follow, tools=TOOLS)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "It is sunny."
    sent = workers.tokenizer_requests[-1].messages
    assert sent[1]["tool_calls"][0]["function"]["name"] == "get_weather" and sent[2]["tool_call_id"] == call.id

    # tool_choice "none": no parsing, the text is the text
    script(text=CALL_TEXT)
    r = await client.chat.completions.create(model=gateway.model, messages=msgs, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == CALL_TEXT and not r.choices[0].message.tool_calls
    await client.close()


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format"),  # a keyword llguidance does not implement
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),  # two kinds at once
    ({"tool_choice": "auto"}, "tool_choice"),  # without tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS * 2}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}], "user": 5}, "user"),
])
async def test_unsupported_or_malformed_tool_and_format_requests_are_400(client, gateway, workers, extra, param):
    before = len(workers.prefill_requests)
    body = {**chat_body(gateway.model), **extra}
    r = await client.post("/v1/chat/completions", json=body)
    err = assert_openai_error(r, 400)
    assert err["param"] == param, err
    assert len(workers.prefill_requests) == before


# --- /v1/completions ----------------------------------------------------------------------


async def test_completions_with_the_official_client_streaming_and_not(gateway, workers, script):
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    script(text="Paris is lovely. STOP here")
    r = await client.completions.create(model=gateway.model, prompt="The capital of France is", max_tokens=20,
                                        stop=[" STOP"], logprobs=2)
    (ch,) = r.choices
    assert r.object == "text_completion" and ch.text == "Paris is lovely." and ch.finish_reason == "stop"
    assert workers.prefill_requests[-1].prompt_token_ids == TOKENIZER.encode("The capital of France is").ids
    assert r.usage.prompt_tokens == len(TOKENIZER.encode("The capital of France is").ids)
    sp = workers.prefill_requests[-1].sampling
    assert sp.logprobs and sp.top_logprobs == 2  # (the logprobs' shape: test_gateway_sampling)

    script(text="Paris is lovely.", eos=False)
    stream = await client.completions.create(model=gateway.model, prompt=[1, 2, 3], max_tokens=4, stream=True,
                                             echo=True, stream_options={"include_usage": True})
    text, usage, reasons = "", None, []
    async for chunk in stream:
        for c in chunk.choices:
            text += c.text
            reasons.append(c.finish_reason)
        usage = chunk.usage or usage
    assert workers.prefill_requests[-1].prompt_token_ids == [1, 2, 3]
    assert workers.prefill_requests[-1].sampling.max_tokens == 4
    assert text == TOKENIZER.decode([1, 2, 3], skip_special_tokens=False) + "Paris is lovely."
    assert reasons[-1] == "length"
    assert usage.prompt_tokens == 3 and usage.completion_tokens == len(encode("Paris is lovely."))

    script(text="x")
    await client.completions.create(model=gateway.model, prompt="hi")
    assert workers.prefill_requests[-1].sampling.max_tokens == 16  # the endpoint's default
    await client.close()


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "suffix": "end"}, "suffix"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [[1, 2], [-1]]}, "prompt"),
    ({"prompt": ["a"] * 65, "n": 2}, "prompt"),  # more than 128 choices
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "logprobs": 9}, "logprobs"),
    ({"prompt": "hi", "echo": True, "max_tokens": -1}, "max_tokens"),
    ({"prompt": [-1, 5]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "word " * 300}, "prompt"),  # longer than the context
])
async def test_completions_bad_input_is_400_naming_the_param(client, gateway, workers, body, param):
    before = len(workers.prefill_requests)
    r = await client.post("/v1/completions", json={"model": gateway.model, **body})
    err = assert_openai_error(r, 400)
    assert err["param"] == param, err
    assert len(workers.prefill_requests) == before


async def test_completions_stream_equals_non_stream_with_unicode_and_a_stop_string(gateway, script):
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    for per_chunk in (1, 3):
        script(text=UNICODE_TEXT + " tail", tokens_per_chunk=per_chunk)
        done = await client.completions.create(model=gateway.model, prompt="x", max_tokens=50, stop=["! ✨"])
        script(text=UNICODE_TEXT + " tail", tokens_per_chunk=per_chunk)
        stream = await client.completions.create(model=gateway.model, prompt="x", max_tokens=50, stop=["! ✨"],
                                                 stream=True, stream_options={"include_usage": True})
        parts, usage = [], None
        async for chunk in stream:
            parts += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
        assert done.choices[0].text == "".join(parts) == "Grüße 🦙 from 東京"
        assert "\ufffd" not in "".join(parts) and usage.total_tokens == done.usage.total_tokens
    await client.close()


async def test_request_body_over_the_limit_is_413_in_each_apis_shape(client, gateway):
    big = b"x" * ((32 << 20) + 1)
    r = await client.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert_openai_error(r, 413, code="request_too_large")

    async def chunks():  # no Content-Length: counted as it arrives
        for _ in range(33):
            yield b" " * (1 << 20)

    r = await client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(r, 413, code="request_too_large")
    r = await client.post("/v1/messages", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "request_too_large"
    assert (await client.get("/health")).status_code == 200  # still healthy
