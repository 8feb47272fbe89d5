"""Benchmark clients and metrics: serving metrics (as ``vllm bench serve`` defines them) and Mooncake trace replay."""

import argparse
import sys
from typing import Any, Callable

import httpx


def run_cli(run: Callable[[argparse.Namespace], Any], args: argparse.Namespace,
            empty: Callable[[Any], str | None], errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run a bench command for the command line; returns its exit code.

    ``run(args)`` does the work and returns its document; ``empty(doc)`` names what completed no
    request (None when every part completed one). Exit 2 with one ``error:`` line for bad input or
    an unreachable endpoint (ValueError, OSError, httpx.HTTPError, and ``errors``), 1 when ``empty``
    names something, else 0.
    """
    try:
        doc = run(args)
    except (ValueError, OSError, httpx.HTTPError, *errors) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    what = empty(doc)
    if what:
        print(f"error: {what}", file=sys.stderr)
        return 1
    return 0
