"""Runs an ``LLMEngine`` on its own thread next to a service's asyncio loop.

Commands (add, abort) go in through a thread-safe queue and are applied at a
step boundary; each step's outputs come back to the loop with
``call_soon_threadsafe``. torch releases the GIL inside its kernels, so the
loop keeps serving NATS while a forward pass runs.

After ``abort(request_id)`` no output of the aborted sequence reaches ``on_outputs``:
a step that ran before the engine thread applied the abort may have posted some,
and a new request under the same id (a resume of the request on this worker) must
not be credited with them. Outputs and the abort's application reach the loop in
the order the engine thread posts them, so the ones in between are dropped.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Callable

from deepinfer.engine.interface import StepOutput
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.telemetry import get_logger

log = get_logger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_outputs: Callable[[list[StepOutput]], None]):
        self.engine = engine
        self.on_outputs = on_outputs
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        # request id -> prompt tokens, for every request added and not finished (engine thread only):
        # what a failed step must end, even a request the failing step had already taken out of the queues
        self._live: dict[str, int] = {}
        # request id -> aborts the engine thread has not applied yet (loop only): its outputs are dropped
        self._aborting: dict[str, int] = {}

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    async def add_request(self, **kwargs) -> None:
        """Queue ``engine.add_request(**kwargs)``; raises what it raises (e.g. RequestError)."""
        fut = self._loop.create_future()
        self._commands.put(("add", kwargs, fut))
        await fut

    async def call(self, fn: Callable, *args):
        """Run ``fn(*args)`` on the engine thread at a step boundary; its result or exception."""
        fut = self._loop.create_future()
        self._commands.put(("call", (fn, args), fut))
        return await fut

    def abort(self, request_id: str) -> None:
        """Remove the request at the next step boundary; from now on none of its outputs are delivered."""
        self._aborting[request_id] = self._aborting.get(request_id, 0) + 1
        self._commands.put(("abort", request_id, None))

    def _aborted(self, request_id: str) -> None:
        """(loop) The engine thread applied an abort of ``request_id``: later outputs are a new request's."""
        left = self._aborting.pop(request_id, 0) - 1
        if left > 0:
            self._aborting[request_id] = left

    def _deliver(self, outputs: list[StepOutput]) -> None:
        """(loop) Hand ``outputs`` on, less those of requests aborted meanwhile."""
        if self._aborting:
            outputs = [o for o in outputs if o.request_id not in self._aborting]
        if outputs:
            self.on_outputs(outputs)

    def _resolve(self, fut, exc=None, result=None):
        if fut.done():
            return
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)

    def _apply(self, cmd) -> None:
        kind, arg, fut = cmd
        if kind == "abort":
            self.engine.abort(arg)
            self._live.pop(arg, None)
            self._loop.call_soon_threadsafe(self._aborted, arg)
            return
        try:
            if kind == "call":
                fn, args = arg
                result = fn(*args)
            else:
                result = self.engine.add_request(**arg)
                self._live[arg["request_id"]] = len(arg["prompt_token_ids"])
            self._loop.call_soon_threadsafe(self._resolve, fut, None, result)
        except Exception as e:
            self._loop.call_soon_threadsafe(self._resolve, fut, e)

    def _run(self) -> None:
        while not self._stop.is_set():
            idle = not self.engine.has_unfinished()
            try:
                self._apply(self._commands.get(timeout=0.05) if idle else self._commands.get_nowait())
                while True:
                    self._apply(self._commands.get_nowait())
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step_async() if self.engine.config.async_scheduling else self.engine.step()
            except Exception:  # never kill the thread silently: fail the batch's requests
                log.exception("engine_step_failed")
                outputs = self._fail_all()
            for out in outputs:
                if out.finish_reason is not None:
                    self._live.pop(out.request_id, None)
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _fail_all(self) -> list[StepOutput]:
        """End every live request with finish reason "error" (after a step raised): those in the
        scheduler's queues and those the failed step had already finished but not yet reported."""
        live = dict(self._live)
        for seq in self.engine.fail_all():
            live.setdefault(seq.request_id, seq.num_prompt_tokens)
        return [StepOutput(request_id, [], "error", n) for request_id, n in live.items()]
