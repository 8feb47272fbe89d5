"""POST /v1/completions (OpenAI legacy completions): raw prompts, no chat template.

``prompt`` is a string, a list of token ids, or a list of either (OpenAI's batch: one
request per prompt). A string is encoded here with the model's tokenizer, as
``tokenizer(prompt)`` would (its special tokens are parsed, since a raw prompt is the
caller's own template). Each prompt gets ``n`` choices, in OpenAI's order: choice
``index = prompt_i * n + j`` (at most ``MAX_CHOICES`` in all); usage sums the prompts' tokens
once each and every choice's completion tokens. ``echo`` prepends the prompt (its text as
sent, or its token ids decoded with their special tokens); ``logprobs`` (0-5) fills the
legacy ``logprobs`` object (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``). ``echo`` with ``logprobs`` puts the prompt's tokens first, with their
logprobs under the model's raw distribution (the first token's logprob and top_logprobs
null, as OpenAI and vLLM give them): the engine computes them during prefill
(``SamplingParams.prompt_logprobs``), reading nothing from the prefix cache. ``max_tokens: 0``
(with ``echo`` only) scores a text without generating, as lm-evaluation-harness does: the
worker samples one token, which is dropped (text and usage count none; finish reason
"length"). Refused: ``suffix`` (no fill-in-the-middle) and ``best_of`` other than ``n``. A
vision-language model's image placeholder token in a prompt (as an id, or as
its text, which a raw prompt parses as the special token) is refused too: only
an image may put it there, and this endpoint takes none.
Generation, n > 1, stop strings and errors are the chat endpoint's
(``pipeline/generation.py``); responses have OpenAI's ``text_completion`` shape.
vLLM's structured-output fields (``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``, ``structured_outputs``) constrain the
text (``gateway.api.structured``).
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import Response

from deepinfer.gateway.api import logprobs as lp
from deepinfer.gateway.api import openai_schema as oai
from deepinfer.gateway.api.chat import sampling_params, validate_sampling
from deepinfer.gateway.api.common import parse_body
from deepinfer.gateway.api.errors import OpenAIError, bad_request, context_length_exceeded, error_body, internal
from deepinfer.gateway.pipeline.generation import (Choice, Gateway, abort_all, chunks, failure, http_error, new_choices,
                                        open_prompts, raise_if_failed, respond, start_request, usage_counts)
from deepinfer.gateway.stream.request_stream import ClientGone, StreamError, spawn
from deepinfer.gateway.api.structured import openai_spec
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

MAX_LOGPROBS = 5
MAX_CHOICES = 128  # prompts x n per request (each is a request through the mesh)
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint
_FIELD_NAMES = oai.field_names()


async def create_completion(request: Request, gw: Gateway) -> Response:
    req = parse_body(oai.CompletionRequest, await request.body(), _FIELD_NAMES)
    validate(req, gw)
    gen_req = generation_request(req)
    structured = openai_spec(req)
    request_id, traffic_class = start_request(request, gw, req)
    prompts = [await prompt_token_ids(p, req, gw) for p in prompt_list(req)]
    want_logprobs = req.logprobs is not None and not scores_only(req)  # (the scored token is dropped)
    samplings = []
    for ids in prompts:
        sampling = sampling_params(gen_req, len(ids), gw.max_model_len, logprobs=want_logprobs,
                                   top_logprobs=req.logprobs or 0, prompt_field="prompt",
                                   default_max_tokens=DEFAULT_MAX_TOKENS)
        sampling.structured = structured
        sampling.prompt_logprobs = req.logprobs if req.echo else None
        samplings.append(sampling)
    n = req.n or 1
    choices = new_choices(gw, request_id, len(prompts) * n, req.stop_strings, traffic_class, req.cache_salt)
    groups = [(choices[i * n:(i + 1) * n], ids, sampling) for i, (ids, sampling) in enumerate(zip(prompts, samplings))]
    try:
        await open_prompts(groups, request.is_disconnected)
    except ClientGone:
        return Response(status_code=499)
    echoes = [echo_text(p, ids, gw) if req.echo else "" for p, ids in zip(prompt_list(req), prompts)]
    try:
        reply = _Completion(f"cmpl-{request_id}", int(time.time()), gw.model.served_name, req, prompts, choices, gw,
                            echoes)
    except OpenAIError:
        await abort_all(choices)
        raise
    return await respond(request, bool(req.stream), reply.sse() if req.stream else None, reply.collect,
                         {"X-Request-Id": request_id})


def prompt_list(req: oai.CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one string or token-id list, or each of a list of them."""
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)) or not p:
        return [p]
    return list(p)


def scores_only(req: oai.CompletionRequest) -> bool:
    """``echo`` with ``max_tokens: 0``: the prompt is scored (its logprobs), nothing generated."""
    return req.echo and req.max_tokens == 0


def generation_request(req: oai.CompletionRequest) -> oai.CompletionRequest:
    """The request the workers run: a scoring request samples one token (dropped), the prompt's
    logprobs coming with it."""
    return req.model_copy(update={"max_tokens": 1}) if scores_only(req) else req


def validate(req: oai.CompletionRequest, gw: Gateway) -> None:
    """400 for what this endpoint does not do or takes out of range (404 for an unknown model)."""
    if req.suffix is not None:
        raise bad_request("suffix (fill-in-the-middle) is not supported", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request("best_of is not supported (only best_of == n)", param="best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {req.logprobs}", param="logprobs")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be at least 1 (0 only with echo: the prompt is scored, nothing "
                          "generated), got 0", param="max_tokens")
    validate_sampling(generation_request(req), gw.model)
    prompts = prompt_list(req)
    if len(prompts) * (req.n or 1) > MAX_CHOICES:
        raise bad_request(f"at most {MAX_CHOICES} choices per request (prompts times n), got "
                          f"{len(prompts)} x {req.n or 1}", param="prompt")
    vocab = gw.model.vocab_size or 2**31
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not p:
            raise bad_request(f"{where} is empty", param="prompt")
        if isinstance(p, list) and any(not 0 <= t < vocab for t in p):
            raise bad_request(f"{where}: token ids must be in [0, {vocab})", param="prompt")


async def prompt_token_ids(prompt: str | list[int], req: oai.CompletionRequest, gw: Gateway) -> list[int]:
    """One prompt's ids: given, or a text prompt tokenized here, off the event loop (a long prompt
    there stalled every other request for as long as it took: minutes for 30 MiB). A text longer
    than any prompt that fits can be (``max_model_len`` tokens of the vocabulary's longest token,
    with room for normalisation) is refused without tokenizing it. Raises 400."""
    if isinstance(prompt, list):
        ids = list(prompt)
    else:  # a ``tokenizers.Tokenizer`` returns an Encoding; a transformers tokenizer, a list of ids
        limit = gw.max_model_len * longest_token_chars(gw.model.tokenizer) * 4
        if len(prompt) > limit:
            raise context_length_exceeded(gw.max_model_len, gw.max_model_len, max(req.max_tokens or 0, 1), "prompt",
                                          exact=False)
        enc = await asyncio.to_thread(gw.model.tokenizer.encode, prompt)
        ids = list(enc.ids) if hasattr(enc, "ids") else list(enc)
    if not ids:
        raise bad_request("the prompt is empty", param="prompt")
    image_token = gw.model.image_token_id
    if image_token is not None and image_token in ids:
        # NOTE: its rows would be fed the token's own embedding instead of an image's: garbage, silently
        raise bad_request(f"the prompt holds the image placeholder token (id {image_token}) but this endpoint "
                          "takes no images: send images as image_url parts to /v1/chat/completions",
                          param="prompt", code="image_token_without_image")
    return ids


def echo_text(prompt: str | list[int], ids: list[int], gw: Gateway) -> str:
    """What ``echo`` prepends: a text prompt as sent; token ids decoded, special tokens included."""
    return prompt if isinstance(prompt, str) else gw.model.tokenizer.decode(ids, skip_special_tokens=False)


_LONGEST: dict[int, int] = {}  # id(tokenizer) -> its longest token, in characters of its vocabulary


def longest_token_chars(tokenizer) -> int:
    """The most characters one token stands for (byte-level vocabularies: bytes, so at least as many)."""
    key = id(tokenizer)
    if key not in _LONGEST:
        _LONGEST[key] = max(map(len, tokenizer.get_vocab()), default=1) or 1
    return _LONGEST[key]


class _Completion:
    """One completions response under construction (JSON or SSE): ``choices[k]`` answers
    ``prompts[k // n]`` and starts with ``echoes[k // n]``. Raises a 500 ``OpenAIError`` when prompt
    logprobs were asked and a choice's first chunk came without them."""

    def __init__(self, cid: str, created: int, model: str, req: oai.CompletionRequest, prompts: list[list[int]],
                 choices: list[Choice], gw: Gateway, echoes: list[str]):
        self.id, self.created, self.model, self.req = cid, created, model, req
        self.prompts, self.choices, self.gw, self.echoes = prompts, choices, gw, echoes
        self.n = req.n or 1
        self.scoring = scores_only(req)
        self.offsets = {c.index: 0 for c in choices}  # text_offset of the next token
        # each choice's legacy logprobs so far: the prompt's first with echo
        self.echo_logprobs = {c.index: self._legacy(c, self._prompt_entries(c)) for c in choices}

    def echo(self, c: Choice) -> str:
        return self.echoes[c.index // self.n]

    def finish_reason(self, c: Choice) -> str | None:
        return "length" if self.scoring and c.proc.finish_reason else c.proc.finish_reason

    def usage(self) -> dict:
        """Each prompt's tokens once, every choice's completion tokens (none when scoring); cached:
        per prompt, what all of its choices found cached."""
        counts = [usage_counts(self.choices[i * self.n:(i + 1) * self.n], len(ids))
                  for i, ids in enumerate(self.prompts)]
        prompt, completion, cached = (sum(col) for col in zip(*counts))
        return oai.usage(prompt, 0 if self.scoring else completion, cached)

    def _prompt_entries(self, c: Choice) -> list[dict]:
        """``logprobs.content``-style entries of the choice's prompt tokens (echo with logprobs), else []."""
        if not self.req.echo or self.req.logprobs is None:
            return []
        wire = c.first.prompt_logprobs if c.first is not None else None
        ids = self.prompts[c.index // self.n]
        if wire is None or len(wire) != len(ids):
            raise internal(f"worker {c.stream.worker_id} sent no prompt logprobs for the echoed prompt",
                           code="worker_error")
        return lp.prompt_content(self.gw.token_bytes, ids, wire)

    def logprobs(self, c: Choice, chunk) -> dict | None:
        """Legacy logprobs of the chunk's tokens (None when not asked, or when scoring)."""
        if self.req.logprobs is None or self.scoring:
            return None
        return self._legacy(c, lp.content(self.gw.token_bytes, chunk.token_ids, chunk.logprobs) or [])

    def _legacy(self, c: Choice, entries: list[dict]) -> dict:
        """The legacy ``logprobs`` object of ``entries`` (the choice's next tokens), offsets advanced."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(e["token"])
            out["token_logprobs"].append(e["logprob"])
            top = e["top_logprobs"]
            out["top_logprobs"].append(None if top is None else {t["token"]: t["logprob"] for t in top})
            out["text_offset"].append(self.offsets[c.index])
            self.offsets[c.index] += len(e["token"])
        return out

    async def collect(self, request: Request) -> dict:
        merged = self.echo_logprobs
        try:
            async with aclosing(chunks(self.choices, request.is_disconnected)) as arriving:
                async for c, chunk in arriving:
                    raise_if_failed(chunk)
                    delta = c.proc.process(chunk)
                    if not self.scoring:
                        c.parts.append(delta.text)
                    for k, v in (self.logprobs(c, chunk) or {}).items():
                        merged[c.index][k] += v
                    if delta.finish_reason:
                        await c.stream.abort()  # a stop string ended it: the worker still runs
        except StreamError as e:
            raise http_error(e) from None
        finally:
            await abort_all(self.choices)
        out = [oai.completion_choice(c.index, self.echo(c) + "".join(c.parts), self.finish_reason(c),
                                     merged[c.index] if self.req.logprobs is not None else None)
               for c in self.choices]
        return oai.completion(self.id, self.created, self.model, out, self.usage())

    async def sse(self):
        try:
            for c in self.choices:
                if self.echo(c):
                    logprobs = self.echo_logprobs[c.index] if self.req.logprobs is not None else None
                    yield _event(self._chunk(c.index, self.echo(c), None, logprobs))
            try:
                async with aclosing(chunks(self.choices)) as arriving:
                    async for c, chunk in arriving:
                        failed = failure(chunk)
                        if failed is not None:
                            yield _event(error_body(failed.message, failed.type, None, failed.code))
                            return
                        delta = c.proc.process(chunk)
                        logprobs = self.logprobs(c, chunk)
                        text = "" if self.scoring else delta.text
                        if text or delta.finish_reason or logprobs:
                            yield _event(self._chunk(c.index, text, self.finish_reason(c) if delta.finish_reason
                                                     else None, logprobs))
                        if delta.finish_reason:
                            await c.stream.abort()
            except StreamError as e:
                yield _event(error_body(str(e), "server_error", None, e.code))
                return
            if self.req.include_usage:
                yield _event({**oai.completion(self.id, self.created, self.model, [], self.usage())})
            yield "data: [DONE]\n\n"
        finally:
            for c in self.choices:
                spawn(c.stream.abort())

    def _chunk(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        body = oai.completion(self.id, self.created, self.model,
                              [oai.completion_choice(index, text, finish_reason, logprobs)], None)
        if not self.req.include_usage:
            del body["usage"]
        return body


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


__all__ = ["create_completion", "OpenAIError"]
