"""Workloads of a serving benchmark: sessions of one or more turns.

A ``Session`` is sent turn after turn: each turn extends the conversation so far
(its ``system`` text, then every earlier user turn followed by the reply the server
actually gave) with a new user turn. Single-turn datasets have sessions of one turn.

Prompt text is made of common English words that are each one token after a space
in the usual byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM2, Qwen), so ``n``
words are ``n`` tokens and a prompt's length does not depend on a local tokenizer;
the report uses the server's own counts (``usage.prompt_tokens``) in any case.
Every text is a pure function of ``(seed, key)``: equal keys give equal text, so
a shared prefix is a shared token prefix.

Datasets (lengths in tokens):

- ``random``: ``n`` prompts of ``input_len`` and outputs of ``output_len`` tokens, each
  drawn uniformly in ``[len * (1 - range_ratio), len * (1 + range_ratio)]`` (vLLM's
  ``random`` dataset); no shared prefix.
- ``shared-prefix``: ``n`` prompts over ``groups`` system prompts of ``prefix_len`` tokens
  (request ``i`` uses group ``i % groups``) followed by a question of ``suffix_len`` tokens
  (SGLang's ``generated-shared-prefix``).
- ``multi-turn``: ``n`` conversations of ``turns`` turns: one short system prompt shared by
  all, then ``turn_len`` new tokens per user turn; turn ``k`` resends turns ``< k`` and
  their replies.
- ``agent``: ``n`` sessions of ``turns`` steps over ``contexts`` long contexts of
  ``context_len`` tokens (repository files, tool schemas...; session ``s`` uses context
  ``s % contexts``), each step adding ``turn_len`` tokens (a tool result): the
  repeated long contexts of agent traffic.
- ``trace``: a Mooncake-format trace (``trace.py``): arrival times from the trace times
  ``time_scale``, a 512-token trace block becomes ``block_tokens`` tokens, outputs times
  ``output_scale``; prompts are token ids (``PromptMaker``) for the completions API, or
  words seeded by each block's hash id for chat, so equal leading hash ids give equal
  leading tokens either way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer.bench.trace import PromptMaker, load_mooncake, scale_trace

DATASETS = ("random", "shared-prefix", "multi-turn", "agent", "trace")

# One token each, after a space, in GPT-2 / Llama 3 / SmolLM2 / Qwen vocabularies (checked for SmolLM2 by
# tests/bench/test_bench_serve.py).
WORDS = tuple("""
the of and to in is that for it as was with be by on not he this are or his from at which but have an they
you were her she there been one all we their has would when if so no will more can out time up about into
some other could than them these two may first then do any like my now over such our man me even most made
after also did many before must through back years where much your way well down should because each just
those people how too little state good very make world still own see men work long get here between both
life being under never day same another know while last might us great old year off come since against go
came right used take three states himself few house use during without again place around however home small
found thought went say part once general high upon school every does got united left number course war until
always away something fact though water less public put think almost hand enough far took head yet government
system better set told nothing night end why called didn find look going asked later point next program city
business give group toward young days let room president side social given present several order national
possible rather second face per among form important often things early white case john become large big need
four within felt along children saw best church light ever least power development thing seemed family
interest want members mind country area others done turned although open god service certain kind problem
began different door thus help sense means whole matter perhaps itself river times law human line above name
example action company hands local show five history whether gave either act feet across taken past quite
anything seen having death experience body word half really week field car words already information tell
together college shall money period held keep sure real probably free seems political cannot behind miss
""".split())


@dataclass
class Turn:
    """One request of a session: ``user`` is what this turn adds (text, or token ids for a
    single-turn completions prompt); ``max_tokens`` the output tokens asked for."""

    user: str | list[int]
    max_tokens: int


@dataclass
class Session:
    """Turns sent one after another, each extending the previous one's conversation.

    system: text every turn starts with (a shared prefix, an agent's long context).
    arrival_s: when the first turn is due, seconds after the start (None: from the arrival
    process). kind: the dataset it came from."""

    turns: list[Turn]
    system: str = ""
    arrival_s: float | None = None
    kind: str = ""
    meta: dict = field(default_factory=dict)


class TextMaker:
    """Words for prompts: ``words(key, n)`` is a pure function of ``(seed, key)``."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def words(self, key: str, n: int) -> list[str]:
        rng = random.Random(f"{self.seed}/{key}")
        return [rng.choice(WORDS) for _ in range(n)]

    def text(self, key: str, n: int) -> str:
        """``n`` words, each after a space: ``n`` tokens, and a clean token boundary at either end."""
        return "".join(" " + w for w in self.words(key, n))


def _around(rng: random.Random, length: int, range_ratio: float) -> int:
    lo, hi = int(length * (1 - range_ratio)), int(length * (1 + range_ratio))
    return max(1, rng.randint(lo, hi))


def random_sessions(n: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0) -> list[Session]:
    """``n`` single-turn prompts of random lengths around ``input_len`` / ``output_len`` tokens."""
    if not 0 <= range_ratio < 1:
        raise ValueError("range_ratio must be in [0, 1)")
    rng, maker = random.Random(seed), TextMaker(seed)
    return [Session([Turn(maker.text(f"random/{i}", _around(rng, input_len, range_ratio)),
                          _around(rng, output_len, range_ratio))], kind="random") for i in range(n)]


def shared_prefix_sessions(n: int, groups: int, prefix_len: int, suffix_len: int, output_len: int,
                           seed: int = 0) -> list[Session]:
    """``n`` single-turn prompts: group ``i % groups``'s ``prefix_len``-token system prompt + a question."""
    maker = TextMaker(seed)
    prefixes = [maker.text(f"prefix/{g}", prefix_len) for g in range(groups)]
    return [Session([Turn(maker.text(f"question/{i}", suffix_len), output_len)], system=prefixes[i % groups],
                    kind="shared-prefix", meta={"group": i % groups}) for i in range(n)]


def conversation_sessions(n: int, turns: int, turn_len: int, output_len: int, system_len: int,
                          contexts: int = 1, seed: int = 0, kind: str = "multi-turn") -> list[Session]:
    """``n`` sessions of ``turns`` turns of ``turn_len`` new tokens; session ``s`` starts with
    context ``s % contexts`` (``system_len`` tokens)."""
    maker = TextMaker(seed)
    systems = [maker.text(f"context/{c}", system_len) for c in range(contexts)]
    return [Session([Turn(maker.text(f"{kind}/{s}/{k}", turn_len), output_len) for k in range(turns)],
                    system=systems[s % contexts], kind=kind, meta={"context": s % contexts}) for s in range(n)]


def multi_turn_sessions(n: int, turns: int, turn_len: int, output_len: int, system_len: int = 32,
                        seed: int = 0) -> list[Session]:
    """Chat: ``n`` conversations sharing one short system prompt."""
    return conversation_sessions(n, turns, turn_len, output_len, system_len, 1, seed, "multi-turn")


def agent_sessions(n: int, contexts: int, context_len: int, turns: int, turn_len: int, output_len: int,
                   seed: int = 0) -> list[Session]:
    """Agents: ``n`` sessions over ``contexts`` long contexts, ``turns`` steps each."""
    return conversation_sessions(n, turns, turn_len, output_len, context_len, contexts, seed, "agent")


def trace_sessions(path: str | Path, n: int | None = None, time_scale: float = 1.0, block_tokens: int = 16,
                   output_scale: float = 1.0, max_input_tokens: int | None = None, token_ids: bool = True,
                   seed: int = 0) -> list[Session]:
    """The first ``n`` requests of a Mooncake-format trace, scaled, with their trace arrival times."""
    rows = load_mooncake(path)[:n]
    if not rows:
        raise ValueError(f"{path}: the trace has no requests")
    reqs = scale_trace(rows, time_scale, block_tokens, output_scale, None, max_input_tokens)
    ids, maker = PromptMaker(block_tokens, seed=seed), TextMaker(seed)
    out = []
    for r in reqs:
        if token_ids:
            prompt: str | list[int] = ids.prompt(r)
        else:
            words = [w for h in r.hash_ids for w in maker.words(f"trace/{h}", block_tokens)]
            prompt = "".join(" " + w for w in words[:r.input_length])
        out.append(Session([Turn(prompt, r.output_length)], arrival_s=r.arrival_s, kind="trace",
                           meta={"input_length": r.input_length}))
    return out
