"""Structured output: grammars from request specs, and the per-request matchers that enforce them.

A request asks for structured output with ``SamplingParams.structured``, one of::

    {"type": "json_object"}                          any JSON object
    {"type": "json_schema", "schema": {...}}         an instance of the JSON schema
    {"type": "regex", "pattern": "..."}              a full match of the regex (Rust ``regex`` syntax)
    {"type": "choice", "choices": ["a", "b", ...]}   exactly one of the strings
    {"type": "grammar", "lark": "..."}               llguidance's Lark dialect (``%json {...}`` inside it)

Where each piece runs::

    gateway   compile_grammar(spec) -> grammar text (LRU by the spec's canonical JSON); a spec
              llguidance refuses raises StructuredOutputError naming the feature -> HTTP 400
    engine    add_request: StructuredOutputManager.add(request_id, spec, output_token_ids) ->
              a StructuredMatcher, keyed by request id; its llguidance matcher is built on the
              compiler's thread pool (the model's tokenizer, then a copy of the cached compiled
              grammar, then the tokens already generated)
    sampler   stage 0: matcher.fill_bitmask(bitmask, row) waits for that build only if it is not
              done yet; apply_bitmask sets disallowed logits to -inf (greedy, sampling, logprobs)
    engine    the sampled token -> StructuredOutputManager.advance; finished / aborted -> free

JSON is generated in one fixed layout, ``json.dumps``' default (``", "`` and ``": "``, no other
whitespace): a small model given free whitespace may spend its whole budget on it. JSON-schema
keywords llguidance knows but does not implement (``uniqueItems``, ``not``, ...) are errors
(its strict default, never ``lenient``); keywords unknown to JSON Schema are ignored, as the
specification says.
When the grammar is complete the mask allows only the model's EOS tokens, so the request ends
with "stop".

Bitmask layout (llguidance's and xgrammar's): int32 ``[rows, ceil(V / 32)]``, token ``t`` allowed
iff bit ``t % 32`` of word ``t // 32`` is set.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from llguidance import LLMatcher, LLTokenizer

from deepinfer.engine.sequence import RequestStatus, Sequence
from deepinfer.telemetry import get_logger

# NOTE: torch is imported inside the bitmask functions: the gateway validates specs with this
# module and never loads torch.

log = get_logger(__name__)

SPEC_TYPES = ("json_object", "json_schema", "regex", "choice", "grammar")
# JSON layout enforced everywhere (also inside ``%json`` of Lark grammars): json.dumps' default.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "lenient": False, "coerce_one_of": False}
GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept per engine (and validated ones in the gateway)


class StructuredOutputError(ValueError):
    """A structured-output spec that is malformed or uses a feature llguidance does not support;
    the message names it."""


# --- specs -> grammars (no tokenizer needed) ---------------------------------------------------


def spec_key(spec: dict) -> str:
    """The canonical JSON of a spec (sorted keys, no spaces): the cache key."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def json_lark(schema: dict | bool) -> str:
    """``%json {...}`` for a Lark grammar: ``schema`` with this module's JSON layout."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise StructuredOutputError(f"a JSON schema must be an object, got {type(schema).__name__}")
    body = {k: v for k, v in schema.items() if k != "x-guidance"}
    return "%json " + json.dumps({**body, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def lark_string(text: str) -> str:
    """A Lark string literal matching exactly ``text``."""
    return json.dumps(text, ensure_ascii=False)


def grammar_from_spec(spec: dict) -> str:
    """The llguidance grammar (its JSON form) for a spec, not validated yet.

    Raises StructuredOutputError for a malformed spec (unknown type, missing or mistyped field).
    """
    if not isinstance(spec, dict):
        raise StructuredOutputError(f"structured output spec must be an object, got {type(spec).__name__}")
    kind = spec.get("type")
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "json_schema":
        schema = spec.get("schema")
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise StructuredOutputError("json_schema needs 'schema': a JSON schema object")
        schema = {k: v for k, v in schema.items() if k != "x-guidance"}  # options are ours to set
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as e:
            raise StructuredOutputError(f"invalid JSON schema: {e}") from None
    if kind == "regex":
        pattern = spec.get("pattern")
        if not isinstance(pattern, str):
            raise StructuredOutputError("regex needs 'pattern': a string")
        return LLMatcher.grammar_from_regex(pattern)
    if kind == "choice":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise StructuredOutputError("choice needs 'choices': a non-empty list of strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(lark_string(c) for c in choices))
    if kind == "grammar":
        lark = spec.get("lark")
        if not isinstance(lark, str) or not lark.strip():
            raise StructuredOutputError("grammar needs 'lark': a non-empty Lark grammar")
        return LLMatcher.grammar_from_lark(lark)
    raise StructuredOutputError(f"unknown structured output type {kind!r}; expected one of {', '.join(SPEC_TYPES)}")


_WHAT = {"json_object": "unsupported JSON schema", "json_schema": "unsupported JSON schema",
         "regex": "invalid or unsupported regex", "choice": "invalid choices", "grammar": "invalid or unsupported grammar"}


def compile_grammar(spec: dict) -> str:
    """``grammar_from_spec`` validated by llguidance without a tokenizer (cached, LRU by
    ``spec_key``). Raises StructuredOutputError naming what is unsupported or wrong, e.g.
    ``unsupported JSON schema: Unimplemented keys: ["uniqueItems"]``."""
    return _compile(spec_key(spec))


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _compile(key: str) -> str:
    spec = json.loads(key)
    grammar = grammar_from_spec(spec)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise StructuredOutputError(f"{_WHAT[spec['type']]}: {_first_line(error)}")
    return grammar


def _first_line(message: str) -> str:
    """llguidance's message without the source excerpts and carets it appends, on one line."""
    kept = []
    for line in message.strip().splitlines():
        if re.match(r"\s*\d+ \|", line):  # "   1 | start: ..." and what follows it
            break
        if line.strip() and set(line.strip()) != {"^"}:
            kept.append(line.strip())
    return " ".join(kept)[:1000]


# --- bitmasks ------------------------------------------------------------------------------------


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> "torch.Tensor":
    """An all-allowed bitmask: int32 [rows, ceil(vocab_size / 32)] of -1 (every bit set)."""
    import torch

    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def apply_bitmask(logits: "torch.Tensor", bitmask: "torch.Tensor") -> None:
    """In place: ``logits`` [R, V] float32 gets -inf wherever ``bitmask`` [R, >= ceil(V / 32)]
    int32 has a 0 bit (plain torch ops; bits past V are ignored)."""
    import torch

    rows, vocab = logits.shape
    words = bitmask_words(vocab)
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :words].unsqueeze(-1) >> bits) & 1).view(rows, words * 32)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


# --- per-request matchers ----------------------------------------------------------------------


class StructuredMatcher:
    """One request's grammar state (an llguidance ``LLMatcher``), possibly still being built.

    Every method waits for the build if it is not done. A build that failed, or a token the
    grammar refuses, puts the matcher in an error state for good (``error`` says why): its mask
    then allows only EOS, and ``accept`` returns False. Not thread-safe: use it from one thread
    at a time (the engine: the forward thread samples, the engine thread accepts, never at once).

    Speculative decoding (draft tokens ``d_1..d_k`` after the last accepted token)::

        n = m.fill_bitmask_with_draft(bitmask, row, drafts)  # rows row..row+k: masks before d_1,
                                                             # after d_1, ... after d_n (n = valid
                                                             # drafts); later rows all-allowed;
                                                             # the matcher is left unchanged
        ... verify: the target's token at position j is sampled under row + j ...
        m.accept(accepted + [bonus])                         # advance by what was kept

    or, advancing first: ``n = m.try_accept(drafts)`` (consumes the valid prefix) and, after
    verification kept ``a <= n`` of them, ``m.rollback(n - a)``. ``validate(tokens)`` counts the
    valid prefix without consuming it.
    """

    def __init__(self, future: "Future[tuple[LLMatcher, int]]", eos_token_ids: list[int], num_tokens: int = 0):
        self._future = future  # -> (the matcher, its tokenizer's vocabulary size)
        self.num_tokens = num_tokens  # tokens consumed (the build's prefix included), net of rollbacks
        self.vocab_size = 0  # the tokenizer side's vocabulary (may exceed the logits' width), once built
        self.eos_token_ids = list(eos_token_ids)
        self._matcher: LLMatcher | None = None
        self._error = ""

    # --- state ---
    @property
    def ready(self) -> bool:
        """The build is done (no method will wait)."""
        return self._future.done()

    def _get(self) -> LLMatcher | None:
        if self._matcher is None and not self._error:
            try:
                self._matcher, self.vocab_size = self._future.result()
            except Exception as e:  # noqa: BLE001 - reported through ``error``
                self._error = f"grammar build failed: {e}"
            else:
                self._error = self._matcher.get_error()
        return self._matcher if not self._error else None

    @property
    def error(self) -> str:
        """Why the matcher is in an error state ("" when it is not)."""
        m = self._get()
        if m is not None and m.is_error():
            self._error = _first_line(m.get_error())
        return self._error

    @property
    def is_error(self) -> bool:
        return bool(self.error)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and nothing but EOS may follow (or EOS was accepted)."""
        m = self._get()
        return m is not None and m.is_stopped() and not m.is_error()

    @property
    def is_accepting(self) -> bool:
        """What was accepted so far is a complete match (EOS allowed now)."""
        m = self._get()
        return m is not None and m.is_accepting()

    # --- masks ---
    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 [rows, ceil(V / 32)],
        contiguous, on CPU; V = the logits' width). Tokens past the tokenizer's vocabulary are
        disallowed; in the error state only EOS is allowed."""
        target = bitmask[row]
        m = self._get()
        if m is None:
            self._eos_only(target)
            return
        words = bitmask_words(self.vocab_size)
        if target.numel() == words and target.is_contiguous():
            m.unsafe_compute_mask_ptr(target.data_ptr(), words * 4)
        else:  # the logits and the tokenizer differ in width: fill a scratch row, copy, pad with 0
            import torch

            scratch = torch.empty(words, dtype=torch.int32)
            m.unsafe_compute_mask_ptr(scratch.data_ptr(), words * 4)
            n = min(words, target.numel())
            target[:n] = scratch[:n]
            target[n:] = 0
        if m.is_error():  # llguidance computes an EOS-only mask then; keep ``error`` in sync
            self._error = _first_line(m.get_error())

    def fill_bitmask_with_draft(self, bitmask: "torch.Tensor", row: int, draft_token_ids: list[int]) -> int:
        """Masks for verifying ``draft_token_ids`` (k of them): ``bitmask[row + j]`` is the mask
        after the first j drafts, for j = 0..n where n is how many drafts are valid; rows
        ``row + n + 1 .. row + k`` are set all-allowed (never used: the draft before them is
        rejected). The matcher's state is unchanged. Returns n."""
        self.fill_bitmask(bitmask, row)
        m = self._get()
        n = 0 if m is None else m.validate_tokens(list(draft_token_ids))
        for j in range(1, len(draft_token_ids) + 1):
            if j <= n:
                m.consume_token(draft_token_ids[j - 1])
                self.fill_bitmask(bitmask, row + j)
            else:
                bitmask[row + j] = -1
        if n:
            m.rollback(n)
        return n

    def _eos_only(self, target: "torch.Tensor") -> None:
        target.zero_()
        for t in self.eos_token_ids:
            if 0 <= t < target.numel() * 32:
                word, bit = divmod(t, 32)
                target[word] |= _bit(bit)

    # --- tokens ---
    def accept(self, token_ids: list[int]) -> bool:
        """Consume ``token_ids`` in order. False if the matcher is (or now is) in the error state:
        a refused token leaves it there for good."""
        m = self._get()
        if m is None:
            return False
        if not token_ids:
            return True
        ok = m.consume_tokens(list(token_ids))
        if ok:
            self.num_tokens += len(token_ids)
        else:
            self._error = _first_line(m.get_error()) or "token refused by the grammar"
        return ok

    def validate(self, token_ids: list[int]) -> int:
        """How many leading ``token_ids`` the grammar would accept now (EOS counts); consumes none."""
        m = self._get()
        return 0 if m is None else m.validate_tokens(list(token_ids))

    def try_accept(self, token_ids: list[int]) -> int:
        """Consume the longest valid prefix of ``token_ids`` (e.g. draft tokens) and return its
        length; never enters the error state. Undo with ``rollback``."""
        n = self.validate(token_ids)
        if n:
            self._matcher.consume_tokens(list(token_ids[:n]))
            self.num_tokens += n
        return n

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` consumed tokens (draft tokens verification rejected).
        Raises ValueError if the matcher cannot (more than it consumed, or in the error state)."""
        m = self._get()
        if n <= 0:
            return
        if m is None or n > self.num_tokens or not m.rollback(n):
            raise ValueError(f"cannot roll the grammar back by {n} of {self.num_tokens} tokens: {self.error}")
        self.num_tokens -= n


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 word as a Python int in int32 range (bit 31 is negative)."""
    return -(1 << 31) if i == 31 else 1 << i


class GrammarCompiler:
    """An engine's grammar side: the model's llguidance tokenizer, compiled grammars (LRU by
    ``spec_key``, ``cache_size`` kept) and a small thread pool that builds matchers off the
    engine's critical path.

    ``vocab_size``: the logits' width; ``eos_token_ids``: the model's EOS ids (what a complete
    grammar allows). The tokenizer (``tokenizer.json`` of ``model_dir``, via transformers) is
    loaded on the pool the first time a matcher is asked for (~1 s once).
    """

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: list[int], threads: int = 1,
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._tokenizer: LLTokenizer | None = None
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self.num_compiled = 0  # grammars compiled (cache misses)

    def matcher(self, spec: dict, prefix_token_ids: list[int] = ()) -> StructuredMatcher:
        """A new matcher for ``spec`` that has consumed ``prefix_token_ids`` (tokens generated
        before, e.g. by the prefill worker); built on the pool, so this returns at once. Raises
        StructuredOutputError for a spec ``compile_grammar`` refuses (checked here, cached)."""
        grammar = compile_grammar(spec)
        future = self._pool.submit(self._build, spec_key(spec), grammar, list(prefix_token_ids))
        return StructuredMatcher(future, self.eos_token_ids, len(prefix_token_ids))

    def tokenizer(self) -> LLTokenizer:
        """The model's llguidance tokenizer, loaded once (n_vocab = max(logits width, tokenizer size):
        ids the tokenizer does not have are never allowed)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf
                from transformers import AutoTokenizer

                hf = AutoTokenizer.from_pretrained(self.model_dir)
                n_vocab = max(self.vocab_size, _tokenizer_size(self.model_dir))
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=self.eos_token_ids)
            return self._tokenizer

    def _build(self, key: str, grammar: str, prefix: list[int]) -> tuple[LLMatcher, int]:
        tok = self.tokenizer()
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
        if template is None:
            template = LLMatcher(tok, grammar, log_level=0)  # compiles (drops the GIL)
            if template.is_error():
                raise StructuredOutputError(_first_line(template.get_error()))
            with self._lock:
                self.num_compiled += 1
                self._compiled[key] = template
                while len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
        m = template.deep_copy()
        if prefix and not m.consume_tokens(prefix):
            log.warning("structured_prefix_refused", error=_first_line(m.get_error()))
        return m, tok.vocab_size

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _tokenizer_size(model_dir: Path) -> int:
    """Token ids in ``tokenizer.json`` (the model vocabulary plus added tokens); 0 if unreadable."""
    try:
        data = json.loads((model_dir / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return 0
    vocab = data.get("model", {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t.get("id", -1) for t in data.get("added_tokens", [])]
    return max(ids, default=-1) + 1


class StructuredOutputManager:
    """One engine's structured-output requests: request id -> its ``StructuredMatcher`` (vLLM v1's
    ``StructuredOutputManager``). The grammar side (``GrammarCompiler``: the model's llguidance
    tokenizer, ~1 s to load) is made by the first request that asks.

    The engine adds a request's matcher (``add``), the step reads the batch's matchers
    (``for_batch``, from the forward thread too: one dict read per request), ``advance`` feeds them
    the step's tokens, and a request that ends or is aborted is dropped (``free``).
    """

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: list[int]):
        self._compiler_args = (model_dir, vocab_size, list(eos_token_ids))
        self.compiler: GrammarCompiler | None = None
        self.matchers: dict[str, StructuredMatcher] = {}

    def add(self, request_id: str, spec: dict, output_token_ids: list[int] = ()) -> None:
        """A matcher for ``spec`` that has consumed ``output_token_ids`` (tokens generated before,
        e.g. by the prefill worker); it builds on the compiler's pool meanwhile. Raises
        StructuredOutputError for a spec ``compile_grammar`` refuses."""
        if self.compiler is None:
            self.compiler = GrammarCompiler(*self._compiler_args)
        self.matchers[request_id] = self.compiler.matcher(spec, list(output_token_ids))

    def get(self, request_id: str) -> StructuredMatcher | None:
        return self.matchers.get(request_id)

    def for_batch(self, seqs: list[Sequence]) -> list[StructuredMatcher | None] | None:
        """Row i: ``seqs[i]``'s matcher or None; None when no request of the batch has one."""
        if not self.matchers:
            return None
        rows = [self.matchers.get(s.request_id) for s in seqs]
        return rows if any(m is not None for m in rows) else None

    def free(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def advance(self, seqs: list[Sequence]) -> list[tuple[Sequence, RequestStatus]]:
        """After a step's tokens were applied: each running sequence's matcher consumes the output
        tokens appended since it last did (``matcher.num_tokens`` counts them); a finished
        sequence's matcher is dropped. Returns the sequences to end and why: FINISHED_ERROR for a
        token the grammar refuses or a grammar that failed to build (a bug, never a silent bad
        output), FINISHED_STOPPED for an ``ignore_eos`` request whose grammar is complete (nothing
        else may follow)."""
        ended = []
        for seq in seqs:
            m = self.matchers.get(seq.request_id)
            if m is None:
                continue
            if seq.status.is_finished:
                self.free(seq.request_id)
                continue
            new = seq.output_token_ids[m.num_tokens:]
            if new and not m.accept(new):
                log.error("structured_output_failed", request_id=seq.request_id, error=m.error)
                ended.append((seq, RequestStatus.FINISHED_ERROR))
            elif seq.sampling.ignore_eos and m.is_terminated:  # complete: EOS would not stop it, so stop here
                ended.append((seq, RequestStatus.FINISHED_STOPPED))
        return ended

    def shutdown(self) -> None:
        if self.compiler is not None:
            self.compiler.shutdown()
