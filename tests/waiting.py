"""Polls with a deadline, for tests that wait for a state (a message arrived, a worker registered, a
gauge went back to 0) instead of sleeping a fixed time and hoping it was long enough.

- ``await eventually(predicate, timeout=..., interval=...)``: in a coroutine; ``predicate`` may be a
  plain function or return an awaitable (an ``async def`` or a lambda calling one).
- ``wait_for(predicate, timeout=..., interval=...)``: the same from synchronous code.

Both return the predicate's first truthy value, and raise ``AssertionError`` (naming the predicate
and its last value) if it is still falsy at the deadline. The predicate is called once more at or
after the deadline, so a slow machine fails only when the state really did not come. An exception
raised by the predicate propagates at once.

NOTE: only for waiting until something DOES happen. A test that checks that something does not
happen within a period needs that period's sleep, and keeps it.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable

__all__ = ["eventually", "wait_for"]


def _describe(predicate: Callable) -> str:
    """The predicate's source line for a lambda (what a failure message should show), else its name."""
    name = getattr(predicate, "__qualname__", repr(predicate))
    if name.endswith("<lambda>"):
        try:
            return inspect.getsource(predicate).strip()
        except (OSError, TypeError):
            pass
    return name


def _timed_out(predicate: Callable, timeout: float, value: Any) -> AssertionError:
    return AssertionError(f"condition not met within {timeout:g} s: {_describe(predicate)} (last value: {value!r})")


async def eventually(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.02) -> Any:
    """Await until ``predicate()`` (awaited if it returns an awaitable) is truthy; return that value.
    AssertionError if it is not after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(predicate, timeout, value)
        await asyncio.sleep(interval)


def wait_for(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.05) -> Any:
    """Block until ``predicate()`` is truthy; return that value. AssertionError if it is not after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(predicate, timeout, value)
        time.sleep(interval)
