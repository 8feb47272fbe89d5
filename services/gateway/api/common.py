"""What the Responses and Anthropic Messages endpoints share beyond ``pipeline.generation``.

* ``parse_body``: strict pydantic parsing into an ``OpenAIError`` (400) naming the field.
* ``encode_messages_images``: template messages (OpenAI chat shape, images too) -> prompt ids and
  images via the vision and tokenizer services.
* ``output_budget``: the prompt plus the requested output must fit the context (every API's check).
* ``Assembler``: text deltas -> ordered content blocks (text, tool call), as events, so a stream
  and a collected response are built by the same code and are equal by construction.
* ``run``: one choice's chunks -> assembler events, with the chat endpoint's abort rules.

Errors are ``OpenAIError`` (status, message, type, code); each API renders them in its own shape.
"""

from __future__ import annotations

import json
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

from pydantic import BaseModel, ValidationError

from deepinfer.gateway.api.errors import (OpenAIError, bad_request, context_length_exceeded, mesh_errors,
                                     validation_error)
from deepinfer.gateway.pipeline.generation import Choice, Gateway, abort_all, chunks, http_error, raise_if_failed
from deepinfer.gateway.stream.output import OutputProcessor
from deepinfer.gateway.stream.request_stream import ClientGone, StreamError, spawn
from deepinfer.gateway.api.tools import ToolCall, ToolCallParser
from deepinfer.mesh import RequestTimeout
from deepinfer.protocol import EncodeChatReply, EncodeChatRequest, subjects
from deepinfer.telemetry import get_logger, tracer

log = get_logger(__name__)


# --- the request ------------------------------------------------------------------


def parse_body(model: type[BaseModel], body: bytes, field_names: set[str], dotted: bool = False):
    """``model`` parsed strictly from JSON bytes. Raises a 400 naming the deepest failing field as
    the body has it (``dotted``: ``messages.0.content``, Anthropic's form of ``messages[0].content``)."""
    try:
        return model.model_validate_json(body or b"")
    except ValidationError as e:
        errors = [_friendlier(err) for err in e.errors(include_url=False)]
        try:
            sent = json.loads(body)
        except (ValueError, RecursionError):  # (nested deeper than Python's json takes: pydantic said so)
            raise validation_error(errors, field_names, dotted=dotted) from None
        raise validation_error(errors, field_names, sent, dotted) from None


def _friendlier(err: dict) -> dict:
    # NOTE: a tagged union's mismatch message names our discriminator function; say what the client sent.
    if err.get("type") == "union_tag_invalid":
        ctx = err.get("ctx") or {}
        return {**err, "msg": f"unsupported type {ctx.get('tag')!r}; expected one of {ctx.get('expected_tags')}"}
    if err.get("type") == "union_tag_not_found":
        return {**err, "msg": "must be an object with a 'type' field"}
    return err


def field_names(*models: type[BaseModel]) -> set[str]:
    """Every field name of ``models`` (to name ``param`` in validation errors)."""
    names: set[str] = set()
    for m in models:
        names |= set(m.model_fields)
    return names


# --- the prompt -------------------------------------------------------------------


async def encode_messages_images(gw: Gateway, request_id: str, messages: list[dict], tools: list[dict] | None,
                                 param: str = "messages", terms=None, add_generation_prompt: bool = True
                                 ) -> tuple[list[int], list[list], str]:
    """Render ``messages`` (OpenAI chat shape: role, content text or parts, tool_calls, tool_call_id)
    and ``tools`` (``{"type": "function", "function": {...}}``, or None) with the model's chat
    template on the tokenizer service. Image parts (``{"type": "image_url", "url"}``) are fetched,
    checked and encoded by the vision service first (``images.resolve_images``; ``terms``: the API's
    words for images in errors, ``images.OPENAI`` by default). ``add_generation_prompt``: end with
    the template's opening of the assistant's turn. Returns (prompt ids,
    ``[offset, length, content hash]`` per image, embeddings fingerprint).

    Raises 400 (a bad image, the template refused the messages, or the prompt is empty; ``param``
    names the field), 503 (no tokenizer / vision worker, or no answer in time), 500 (their failure,
    a bad reply).
    """
    from deepinfer.gateway.api.images import OPENAI, resolve_images

    messages, fingerprint = await resolve_images(gw, request_id, messages, param, terms or OPENAI)
    reply = await _encode(gw, request_id, messages, tools, param, add_generation_prompt)
    return list(reply.token_ids), [list(i) for i in reply.images], fingerprint


TOKENIZER_RETRY_AFTER_S = 3.0  # a tokenizer request unanswered this long is sent again (once)


async def _encode(gw: Gateway, request_id: str, messages: list[dict], tools: list[dict] | None,
                  param: str, add_generation_prompt: bool = True) -> EncodeChatReply:
    """The tokenizer service's rendering of ``messages``. A request unanswered after
    ``TOKENIZER_RETRY_AFTER_S`` (at most half the timeout) is sent once more with what is left of
    ``tokenizer_timeout_s``: the queue group may have given it to a replica that died with it
    (without the retry it would fail only after the whole timeout), and a dead replica's
    subscription is gone, so the retry reaches a live one. Encoding has no side effects: a slow
    first replica's late answer is simply dropped."""
    msg = EncodeChatRequest(request_id, messages, add_generation_prompt, tools=tools or None)
    timeout = gw.config.tokenizer_timeout_s
    first = min(TOKENIZER_RETRY_AFTER_S, timeout / 2)
    with mesh_errors("tokenizer", "tokenizer", timeout, param), \
            tracer().start_as_current_span("gateway.tokenize") as span:
        try:
            reply = await gw.mesh.request(subjects.TOKENIZER_ENCODE_CHAT, msg, timeout=first, expect=EncodeChatReply)
        except RequestTimeout:
            log.warning("tokenizer_retry", request_id=request_id, after_s=first)
            span.set_attribute("deepinfer.tokenizer.retried", True)
            reply = await gw.mesh.request(subjects.TOKENIZER_ENCODE_CHAT, msg, timeout=timeout - first,
                                          expect=EncodeChatReply)
        span.set_attribute("gen_ai.usage.input_tokens", len(reply.token_ids))
    if not reply.token_ids:
        raise bad_request("the rendered prompt is empty", param=param)
    return reply


def output_budget(max_model_len: int, num_prompt_tokens: int, requested: int | None, prompt_field: str,
                  default: int | None = None) -> int:
    """Output tokens the request may generate: ``requested``; when None, ``default`` or else all the
    room the prompt leaves, capped at that room.

    Raises 400 ``context_length_exceeded`` (``errors.context_length_exceeded``, ``param`` the prompt's
    field ``prompt_field``) when the prompt plus ``requested`` tokens (at least one) exceeds
    ``max_model_len``.
    """
    room = max_model_len - num_prompt_tokens
    wanted = max(requested or 0, 1)
    if wanted > room:
        raise context_length_exceeded(max_model_len, num_prompt_tokens, wanted, prompt_field)
    if requested is not None:
        return requested
    return room if default is None else min(default, room)


def matched_stop(proc: OutputProcessor) -> str | None:
    """The stop string that ended generation, or None."""
    # NOTE: OutputProcessor exposes only ``stopped_by_string``; the string itself is its matcher's.
    matcher = getattr(proc, "_stop", None)
    return getattr(matcher, "matched", None)


# --- output blocks ------------------------------------------------------------------


@dataclass
class Block:
    """One content block of the output, in order: text, or one tool call."""

    index: int
    kind: str  # "text" | "tool"
    text: str = ""
    call: ToolCall | None = None


@dataclass
class Event:
    """``start`` / ``stop`` of a block, or a ``delta`` of text appended to a text block."""

    kind: str
    block: Block
    text: str = ""


class Assembler:
    """Text deltas -> ordered blocks (text blocks and tool-call blocks) as start/delta/stop events.

    Tool calls are parsed by ``ToolCallParser`` (when ``parse_tools``); a call closes the open text
    block and is a block of its own. Whitespace-only text around tool calls (the newlines a model
    writes between ``</tool_call>`` and ``<tool_call>``) is dropped instead of becoming a block;
    any other text is kept exactly (trailing whitespace is emitted once more text follows).
    ``keep_empty``: an output with no block at all still gets one
    empty text block (OpenAI Responses always has a message item; Anthropic allows no content).
    ``max_calls``: at most that many tool calls (``ToolCallParser``); ``run`` ends the generation
    at the last one.
    """

    def __init__(self, parse_tools: bool, keep_empty: bool = False, max_calls: int | None = None):
        self.parser = ToolCallParser(enabled=parse_tools, max_calls=max_calls)
        self.keep_empty = keep_empty
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._held = ""  # whitespace not placed yet: it may precede a tool call
        self.finished = False

    @property
    def calls(self) -> list[ToolCall]:
        return [b.call for b in self.blocks if b.kind == "tool"]

    def add(self, text: str, final: bool = False, truncated: bool = False) -> list[Event]:
        """Take generated text (``final``: the last of it; ``truncated``: the output was cut at
        max_tokens, so a call still open is dropped); returns the events it completes."""
        events: list[Event] = []
        for piece in _pieces(text) if self.parser.enabled else [text]:
            out, calls = self.parser.feed(piece)
            self._text(out, events)
            for call in calls:
                self._call(call, events)
        if final and not self.finished:
            self._text(self.parser.flush(truncated), events)
            self._finish(events)
        return events

    def _text(self, text: str, events: list[Event]) -> None:
        # Trailing whitespace waits for what follows: more text (kept), a tool call (dropped) or the end.
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        if not body:
            return
        if self._open is None:
            if self.blocks and self.blocks[-1].kind == "tool":
                body = body.lstrip()
            self._open = self._new("text")
            events.append(Event("start", self._open))
        events.append(Event("delta", self._open, self._append(self._open, body)))

    def _call(self, call: ToolCall, events: list[Event]) -> None:
        self._held = ""
        if self._open is not None:
            events.append(Event("stop", self._open))
            self._open = None
        block = self._new("tool", call)
        events += [Event("start", block), Event("stop", block)]

    def _finish(self, events: list[Event]) -> None:
        self.finished = True
        if self._open is not None:
            if self._held:
                events.append(Event("delta", self._open, self._append(self._open, self._held)))
            events.append(Event("stop", self._open))
            self._open = None
        elif not self.blocks and (self._held or self.keep_empty):
            block = self._new("text")
            events.append(Event("start", block))
            if self._held:
                events.append(Event("delta", block, self._append(block, self._held)))
            events.append(Event("stop", block))
        self._held = ""

    def _new(self, kind: str, call: ToolCall | None = None) -> Block:
        block = Block(len(self.blocks), kind, call=call)
        self.blocks.append(block)
        return block

    @staticmethod
    def _append(block: Block, text: str) -> str:
        block.text += text
        return text


def _pieces(text: str) -> list[str]:
    """``text`` cut after every ``>``: a tool call can only complete at the end of a piece, so feeding
    the parser piece by piece keeps text before a call apart from text after it."""
    out, start = [], 0
    while True:
        i = text.find(">", start)
        if i < 0:
            break
        out.append(text[start: i + 1])
        start = i + 1
    if start < len(text):
        out.append(text[start:])
    return out


# --- generation -------------------------------------------------------------------------


@dataclass
class Run:
    """One n=1 request in flight: its choice, its blocks, and timing for the log."""

    request_id: str
    choice: Choice
    assembler: Assembler
    num_prompt_tokens: int
    started: float = field(default_factory=time.monotonic)

    @property
    def proc(self) -> OutputProcessor:
        return self.choice.proc

    @property
    def output_tokens(self) -> int:
        return len(self.proc.token_ids)

    @property
    def cached_tokens(self) -> int:
        return self.proc.num_cached_tokens or (self.choice.first.num_cached_tokens if self.choice.first else 0)


async def run(r: Run, is_disconnected=None) -> AsyncIterator[list[Event]]:
    """Each chunk of the request as the assembler events it completes, until the choice is done.

    A worker still running after a stop string ended the text, or after the last tool call the
    assembler takes (``max_calls``; the finish reason is then "stop"), is aborted. Raises
    ``OpenAIError`` for a failed chunk (500 worker error, 503 abort) or a lost stream (503 /
    timeout), and ``ClientGone`` when ``is_disconnected`` says the client left.
    """
    try:
        async with aclosing(chunks([r.choice], is_disconnected)) as arriving:
            async for c, chunk in arriving:
                raise_if_failed(chunk)
                delta = c.proc.process(chunk)
                events = r.assembler.add(delta.text, final=delta.finish_reason is not None,
                                         truncated=delta.finish_reason == "length")
                if r.assembler.parser.done and not delta.finish_reason:
                    c.proc.finish_reason = delta.finish_reason = "stop"  # its one call is made: the turn ends
                    events += r.assembler.add("", final=True)
                yield events
                if delta.finish_reason:
                    await c.stream.abort()  # ended by a stop string, the worker still runs; else a no-op
    except StreamError as e:
        raise http_error(e) from None


def log_finished(r: Run, disconnected: bool = False) -> None:
    log.info("request_finished", request_id=r.request_id, prompt_tokens=r.num_prompt_tokens,
             completion_tokens=r.output_tokens, cached_tokens=r.cached_tokens,
             finish_reason=str(r.proc.finish_reason), tool_calls=len(r.assembler.calls),
             client_disconnected=disconnected, seconds=round(time.monotonic() - r.started, 3))


async def run_to_end(r: Run, is_disconnected=None) -> None:
    """Drive ``run`` to the end for a non-streamed reply (its events fill ``r.assembler``);
    abort the worker whatever happens and log the request. Raises what ``run`` raises."""
    clean = False
    try:
        async with aclosing(run(r, is_disconnected)) as events:
            async for _ in events:
                pass
        clean = True
    except (OpenAIError, ClientGone):
        clean = True
        raise
    finally:
        if clean:
            await abort_all([r.choice])
        else:  # cancelled: an await here could be cancelled too
            spawn(r.choice.stream.abort())
        log_finished(r)
