"""Streaming OpenAI clients (Completions and Chat Completions) that record what the serving metrics need.

Raw SSE over ``httpx`` (not the ``openai`` client: at hundreds of chunks per
second its per-chunk pydantic parsing would cost the benchmark more CPU than
the server under test).

A token time is the arrival of a chunk that carries output text (``choices[].text``
for completions, ``choices[].delta.content`` for chat), or the finish chunk when no
text came at all (the only tokens decoded to a partial character). Counts come
from the final ``usage`` chunk (``stream_options.include_usage``).
"""

from __future__ import annotations

import json
import time

import httpx

from deepinfer.bench.metrics import RequestResult


async def stream_completion(client: httpx.AsyncClient, url: str, model: str, prompt: list[int] | str,
                            max_tokens: int, clock0: float, extra: dict | None = None,
                            headers: dict | None = None) -> RequestResult:
    """POST ``url`` (``.../v1/completions``) with ``stream`` and ``include_usage``; greedy, ``ignore_eos``
    (``extra`` is merged into the body last, so it may override them).

    Times are ``time.perf_counter() - clock0`` seconds. Never raises for a
    failed request: the result carries ``status`` and ``error`` instead.
    """
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **(extra or {})}
    return await stream_sse(client, url, body, clock0, headers)


async def stream_chat(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int,
                      clock0: float, extra: dict | None = None, headers: dict | None = None) -> RequestResult:
    """POST ``url`` (``.../v1/chat/completions``) like ``stream_completion``, with ``messages``."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **(extra or {})}
    return await stream_sse(client, url, body, clock0, headers)


def _chunk_text(choice: dict) -> str:
    delta = choice.get("delta")
    if delta is not None:
        return delta.get("content") or ""
    return choice.get("text") or ""


async def stream_sse(client: httpx.AsyncClient, url: str, body: dict, clock0: float,
                     headers: dict | None = None) -> RequestResult:
    """POST ``body`` (with ``stream: true``) to ``url`` and record the SSE reply as a ``RequestResult``."""
    res = RequestResult(sent=time.perf_counter() - clock0)
    text: list[str] = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                error = (await resp.aread()).decode(errors="replace")
                res.error = error[:2000] or f"HTTP {resp.status_code}"  # the API's error body
                if "retry-after" in resp.headers:
                    res.retry_after_s = float(resp.headers["retry-after"])
                res.end = time.perf_counter() - clock0
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter() - clock0
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", chunk["error"]))[:300]
                    break
                choices = chunk.get("choices") or ()
                pieces = [_chunk_text(c) for c in choices]
                if any(pieces):
                    res.token_times.append(now)
                    text.extend(pieces)
                elif not res.token_times and any(c.get("finish_reason") for c in choices):
                    res.token_times.append(now)  # the only token(s) decoded to no text (a partial character)
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    res.output_tokens = usage.get("completion_tokens", 0)
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
    res.end = time.perf_counter() - clock0
    res.output_text = "".join(text)
    if res.status == 200 and not res.error and not res.token_times:
        res.error = "stream ended without output"
    return res
