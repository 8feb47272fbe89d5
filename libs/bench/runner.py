"""Send a workload's sessions to an OpenAI-compatible endpoint and record every request.

Lifecycle of a session (``datasets.Session``):

1. wait for its arrival time (``Session.arrival_s`` from a trace, else the arrival process's);
2. per turn: wait for a free slot when ``max_concurrency`` is set (a semaphore; the request's
   clock starts when it is sent, after the wait, as in vLLM), send it streamed, record it;
3. the next turn resends the conversation so far plus the reply the server actually gave,
   after ``think_time_s``; a failed turn ends its session (its later turns are not sent).

Chat requests send ``messages`` (the system text as a system message, then user and
assistant turns); completions requests send the conversation as one prompt string (or a
single-turn prompt's token ids).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from deepinfer.bench.client import stream_chat, stream_completion
from deepinfer.bench.datasets import Session
from deepinfer.bench.metrics import RequestResult

APIS = ("completions", "chat")


@dataclass
class Target:
    """An OpenAI-compatible endpoint. url: base URL without ``/v1``; api: ``completions`` or
    ``chat``; extra: more request body fields (e.g. ``ignore_eos``, ``temperature``)."""

    url: str
    model: str
    api: str = "completions"
    extra: dict = field(default_factory=dict)
    headers: dict | None = None

    @property
    def endpoint(self) -> str:
        return self.url.rstrip("/") + ("/v1/chat/completions" if self.api == "chat" else "/v1/completions")


@dataclass
class Sent:
    """One request sent: its session and turn (0-based) and what came back."""

    session: int
    turn: int
    result: RequestResult


@dataclass
class Run:
    """A run's requests in completion order and its duration (first send -> last reply, seconds)."""

    sent: list[Sent]
    duration_s: float

    @property
    def results(self) -> list[RequestResult]:
        return [s.result for s in self.sent]


def chat_messages(session: Session, history: list[tuple[str, str]], user: str) -> list[dict]:
    """The messages of a chat turn: system, earlier (user, reply) pairs, the new user text."""
    msgs = [{"role": "system", "content": session.system}] if session.system else []
    for u, reply in history:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": reply}]
    return msgs + [{"role": "user", "content": user}]


def completion_prompt(session: Session, history: list[tuple[str, str]], user: str | list[int]) -> str | list[int]:
    """The prompt of a completions turn: the system text, earlier turns and replies, the new text."""
    if isinstance(user, list):
        if session.system or history:
            raise ValueError("token-id prompts are single-turn without a system text")
        return user
    return session.system + "".join(u + reply for u, reply in history) + user


async def run_sessions(target: Target, sessions: list[Session], arrivals: list[float],
                       max_concurrency: int | None = None, think_time_s: float = 0.0, timeout_s: float = 600,
                       progress: Callable[[int], None] | None = None,
                       transport: httpx.AsyncBaseTransport | None = None) -> Run:
    """Send every session (``arrivals[i]``: session ``i``'s start unless it has its own) and wait
    for all of them. ``progress(n)`` is called with the number of turns just accounted for
    (sent, or skipped after a failure). ``transport``: httpx's (tests pass a mock server)."""
    if target.api not in APIS:
        raise ValueError(f"api must be one of {APIS}")
    if len(arrivals) < len(sessions):
        raise ValueError("one arrival time per session needed")
    chat = target.api == "chat"
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    out: list[Sent] = []
    # NOTE: idle connections expire well before a server's keep-alive timeout (uvicorn's default 5 s):
    # reusing one the server closes that instant fails the request
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0)

    async def send(session: Session, history: list[tuple[str, str]], user, max_tokens: int) -> RequestResult:
        async with sem:
            if chat:
                if not isinstance(user, str):
                    raise ValueError("the chat API needs text prompts")
                return await stream_chat(client, target.endpoint, target.model, chat_messages(session, history, user),
                                         max_tokens, clock0, target.extra, target.headers)
            return await stream_completion(client, target.endpoint, target.model,
                                           completion_prompt(session, history, user), max_tokens, clock0,
                                           target.extra, target.headers)

    async def one(i: int, session: Session) -> None:
        due = session.arrival_s if session.arrival_s is not None else arrivals[i]
        delay = due - (time.perf_counter() - clock0)
        if delay > 0:
            await asyncio.sleep(delay)
        history: list[tuple[str, str]] = []
        for k, turn in enumerate(session.turns):
            if k and think_time_s:
                await asyncio.sleep(think_time_s)
            res = await send(session, history, turn.user, turn.max_tokens)
            out.append(Sent(i, k, res))
            if not res.ok:
                if progress:
                    progress(len(session.turns) - k)
                return
            if progress:
                progress(1)
            history.append((turn.user, res.output_text))

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30), limits=limits,
                                 transport=transport) as client:
        clock0 = time.perf_counter()
        await asyncio.gather(*(one(i, s) for i, s in enumerate(sessions)))
    results = [s.result for s in out]
    duration = max((r.end for r in results), default=0.0) - min((r.sent for r in results), default=0.0)
    return Run(out, max(duration, 1e-9))


async def served_model(url: str, timeout_s: float = 30) -> str:
    """The first model id of ``GET {url}/v1/models``; ValueError when the answer has none."""
    async with httpx.AsyncClient(timeout=timeout_s) as c:
        r = await c.get(url.rstrip("/") + "/v1/models")
        r.raise_for_status()
        try:
            return r.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ValueError(f"{url}/v1/models lists no model: pass --model") from None
