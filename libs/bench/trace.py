"""Mooncake-format traces (FAST'25 trace release): load, scale, turn into prompts, ideal hit rate.

A trace is JSON lines: ``timestamp`` (ms since the trace's start),
``input_length`` / ``output_length`` (tokens) and ``hash_ids``: one id per
512-token block of the input, equal ids meaning an equal prefix up to and
including that block (the ids are remapped prefix hashes), so two requests
share exactly the leading blocks whose ids agree.

Scaling (so a trace fits a small machine): arrival times multiply by
``time_scale``; a trace block becomes ``block_tokens`` tokens (default 16,
i.e. length scale 1/32) and the input length scales the same way; output
lengths multiply by ``output_scale``. Prompt tokens are a pure function of
the hash ids (``prompt_tokens``): the tokens of trace block ``i`` are drawn
from a generator seeded by ``hash_ids[i]``, so requests with equal leading
ids get equal leading tokens, and so equal KV-block hashes in the engine.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake release


@dataclass(frozen=True)
class TraceRequest:
    """One request of a (scaled) trace. arrival_s: seconds after the first
    request. input_length / output_length: tokens. hash_ids: one per trace
    block (``block_tokens`` tokens each, the last one possibly partial)."""

    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_mooncake(path: str | Path) -> list[dict]:
    """The raw rows of a Mooncake-format JSON-lines trace, in file order.

    Raises ValueError (with the file and line) on a line that is not a JSON object with
    numeric ``timestamp``, ``input_length``, ``output_length`` >= 0 and a non-empty list of
    integer ``hash_ids``; OSError when the file cannot be read."""
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object")
        missing = {"timestamp", "input_length", "output_length", "hash_ids"} - row.keys()
        if missing:
            raise ValueError(f"{path}:{n}: missing {sorted(missing)}")
        ok = (all(isinstance(row[k], (int, float)) and row[k] >= 0 for k in ("timestamp", "input_length",
                                                                              "output_length"))
              and isinstance(row["hash_ids"], list) and row["hash_ids"]
              and all(isinstance(h, int) for h in row["hash_ids"]))
        if not ok:
            raise ValueError(f"{path}:{n}: timestamp / input_length / output_length must be numbers >= 0 "
                             "and hash_ids a non-empty list of integers")
        rows.append(row)
    return rows


def repeat_trace(rows: list[dict], times: int) -> list[dict]:
    """The trace played ``times`` times back to back, for a replay longer than the trace.

    Pass ``k`` (0-based) starts one mean inter-arrival gap after pass ``k - 1``'s last
    arrival, and its hash ids are shifted past every id of the trace, so it shares no
    prefix with the passes before it: each pass offers the load and cache reuse the trace
    itself does. Raises ValueError when ``times < 1``."""
    if times < 1:
        raise ValueError("times must be >= 1")
    if times == 1 or not rows:
        return list(rows)
    t0, t1 = rows[0]["timestamp"], rows[-1]["timestamp"]
    period = (t1 - t0) + (t1 - t0) / max(1, len(rows) - 1)
    shift = max(h for r in rows for h in r["hash_ids"]) + 1
    return [{**r, "timestamp": r["timestamp"] + k * period, "hash_ids": [h + k * shift for h in r["hash_ids"]]}
            for k in range(times) for r in rows]


def scale_trace(rows: list[dict], time_scale: float = 1.0, block_tokens: int = 16, output_scale: float = 1.0,
                max_requests: int | None = None, max_input_tokens: int | None = None) -> list[TraceRequest]:
    """Scaled requests: arrival ``timestamp * time_scale / 1000`` s (relative to the first row),
    input ``ceil(input_length * block_tokens / 512)`` tokens (at most ``len(hash_ids) * block_tokens``,
    then at most ``max_input_tokens``, whole blocks dropped with it), output
    ``max(1, round(output_length * output_scale))`` tokens; the first ``max_requests`` rows."""
    if time_scale <= 0 or block_tokens <= 0 or output_scale <= 0:
        raise ValueError("time_scale, block_tokens and output_scale must be > 0")
    rows = rows[:max_requests] if max_requests else rows
    t0 = rows[0]["timestamp"] if rows else 0
    out = []
    for r in rows:
        ids = tuple(r["hash_ids"])
        n = min(-(-r["input_length"] * block_tokens // TRACE_BLOCK_TOKENS), len(ids) * block_tokens)
        if max_input_tokens:
            n = min(n, max_input_tokens)
        n = max(n, 1)
        out.append(TraceRequest((r["timestamp"] - t0) * time_scale / 1000, n,
                                max(1, round(r["output_length"] * output_scale)), ids[:-(-n // block_tokens)]))
    return out


class PromptMaker:
    """Token ids for scaled trace requests: trace block ``i`` -> ``block_tokens`` ids in
    ``[low, high)`` from ``random.Random(seed, hash_ids[i])``; cached per hash id."""

    def __init__(self, block_tokens: int = 16, low: int = 1000, high: int = 20000, seed: int = 0):
        self.block_tokens, self.low, self.high, self.seed = block_tokens, low, high, seed
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        toks = self._blocks.get(hash_id)
        if toks is None:
            rng = random.Random(f"{self.seed}/{hash_id}")
            toks = self._blocks[hash_id] = [rng.randrange(self.low, self.high) for _ in range(self.block_tokens)]
        return toks

    def prompt(self, req: TraceRequest) -> list[int]:
        """The request's ``input_length`` prompt token ids."""
        out: list[int] = []
        for h in req.hash_ids:
            out += self.block(h)
        return out[:req.input_length]


def ideal_hit_rate(rows: list[dict]) -> float:
    """The trace's own ideal (infinite cache) hit rate in tokens: each request hits its leading
    hash ids seen in any earlier request, ``min(hits * 512, input_length)`` tokens; over all
    input tokens."""
    seen: set[int] = set()
    hit = total = 0
    for r in rows:
        m = 0
        for h in r["hash_ids"]:
            if h not in seen:
                break
            m += 1
        hit += min(m * TRACE_BLOCK_TOKENS, r["input_length"])
        total += r["input_length"]
        seen.update(r["hash_ids"])
    return hit / total if total else 0.0


def ideal_engine_hits(reqs: list[TraceRequest], block_tokens: int, kv_block_size: int = 16) -> list[int]:
    """Per scaled request, the prompt tokens an infinite prefix cache with ``kv_block_size``-token
    KV blocks would serve: the leading full KV blocks stored by any earlier request, at most
    ``input_length - 1`` tokens (the engine computes at least the last prompt token)."""
    seen: set[tuple[int, int]] = set()
    out = []
    for r in reqs:
        keys = []
        for j in range(r.input_length // kv_block_size):  # full KV blocks only
            last = (j + 1) * kv_block_size - 1  # its last token, in trace block t
            t = last // block_tokens
            keys.append((r.hash_ids[t], last - t * block_tokens))  # ids encode the prefix up to t
        m = 0
        for k in keys:
            if k not in seen:
                break
            m += 1
        out.append(min(m * kv_block_size, (r.input_length - 1) // kv_block_size * kv_block_size))
        seen.update(keys)
    return out
