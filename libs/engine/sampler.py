"""Token sampling: one token per row of logits, each row by its own request's ``SamplingParams``.

The stages, in vLLM v1's order (a stage no row of the batch uses is skipped)::

    logits [B, V] float32, from the model
      0. grammar             l[t] = -inf unless the request's grammar allows t next (structured
                             output: the row's ``StructuredMatcher``, ``engine.structured``)
      1. logit_bias          l[t] += bias[t]                                     (OpenAI)
      2. min_tokens          l[EOS], l[stop_token_ids] = -inf while num_output_tokens < min_tokens
      3. repetition_penalty  t in prompt + output:  l > 0 ? l / r : l * r         (HF / CTRL)
      4. frequency/presence  l[t] -= frequency * count_out(t) + presence * (count_out(t) > 0)  (OpenAI)
         |--> logprobs: log_softmax of these logits (see NOTE below)
         '--> temperature 0 (greedy): argmax of these logits; done
      5. temperature         l / T
      6. min_p               drop tokens with p < min_p * p_max                  (p = softmax after 5)
      7. top_k               keep the k largest (exactly k)
      8. top_p               keep the shortest most-likely-first prefix whose mass reaches top_p,
                             the mass renormalised over what 6-7 kept
      9. draw                inverse CDF with one uniform number from the row's generator

NOTE (logprobs convention): logprobs are the log-softmax of the logits after
0-4 (grammar mask, bias, min_tokens mask, penalties) and before 5-8 (temperature and the
truncations). That is the distribution greedy decoding takes the argmax of,
so a greedy token is always the top-1 logprob; it does not change with
temperature / top-k / top-p / min-p, so logprobs of the same text are
comparable across sampling settings and never ``-inf`` merely because a
truncation dropped a token; and what the request itself asked to change
(logit_bias, penalties, min_tokens) shows. Without those knobs it is exactly
vLLM's default (``logprobs_mode="raw_logprobs"``, the model's distribution).
A token masked by min_tokens or by the grammar has logprob ``-inf`` (the gateway
clamps it to -9999.0 for JSON, as vLLM does). When min_tokens would mask the
only tokens a grammar allows (its EOS once it is complete), the grammar wins.

NOTE (reproducibility): a request with a seed gets its own ``torch.Generator``
from the engine; its rows draw exactly one number from it per step, and
every stage is row-wise, so its tokens do not depend on which other requests
share the batch (up to the order of exactly tied logits at a top-k / top-p
edge). Rows without a generator share one draw from torch's global RNG. The
draw is an inverse-CDF lookup rather than ``torch.multinomial`` (one call per
row, ~30x slower on CPU) or vLLM's exponential race (V random numbers per row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.engine.sequence import Sequence
from deepinfer.engine.structured import allocate_bitmask, apply_bitmask

# Temperatures below this are greedy (dividing by them overflows float32), as in vLLM.
MIN_TEMPERATURE = 1e-5
# top-p looks for the nucleus among the top _NUCLEUS_START tokens, then 4x more, ... instead of sorting V.
_NUCLEUS_START = 64


@dataclass
class TokenLogprobs:
    """The sampled token's logprob and the ``top_logprobs`` most likely (token_id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]

    def to_wire(self) -> list:
        """The ``TokenChunk.logprobs`` entry: ``[logprob, [[token_id, logprob], ...]]``."""
        return [self.logprob, [[t, lp] for t, lp in self.top]]


@dataclass
class SampleResult:
    """One token per row; ``logprobs[i]`` is None unless row i's request set ``logprobs``.
    ``prompt_logprobs``: ``(sequence, first position, [TokenLogprobs, ...])`` per sequence whose
    prompt logprobs the step computed (entry i is prompt token ``first + 1 + i``'s)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[tuple[Sequence, int, list[TokenLogprobs]]] = field(default_factory=list)


def sample(
    logits: torch.Tensor,
    seqs: list[Sequence],
    generators: list[torch.Generator | None],
    eos_token_ids: list[int] | tuple[int, ...] = (),
    matchers: list | None = None,
) -> SampleResult:
    """Pick the next token of each sequence from ``logits`` [B, V] (row i is ``seqs[i]``'s).

    ``generators[i]``: the request's seeded generator, or None (global RNG).
    ``eos_token_ids``: the model's EOS ids, masked for ``min_tokens``.
    ``matchers[i]``: the request's ``StructuredMatcher`` or None (None for all: no grammar).
    ``logits`` is not modified.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(seqs) == len(generators)
    params = [s.sampling for s in seqs]
    logits = apply_logits_processors(logits, seqs, eos_token_ids, matchers=matchers)
    token_ids = logits.argmax(dim=-1)
    rows = [i for i, sp in enumerate(params) if sp.temperature >= MIN_TEMPERATURE]
    if len(rows) == len(seqs):
        token_ids = _sample_rows(logits, params, generators)
    elif rows:
        token_ids[rows] = _sample_rows(logits[rows], [params[i] for i in rows], [generators[i] for i in rows])
    tokens = token_ids.tolist()
    return SampleResult(tokens, _logprobs(logits, tokens, params))


# --- 0-4: logits processors (also what logprobs and greedy see) --------------------------


def apply_logits_processors(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids=(),
                            grammar_bitmask: torch.Tensor | None = None,
                            matchers: list | None = None) -> torch.Tensor:
    """The grammar mask, logit bias, the min_tokens mask and the penalties, on a copy (``logits``
    itself if none apply). Waits for a request's grammar if it is still being compiled.

    Row i's grammar mask is ``matchers[i]``'s next-token mask (a ``StructuredMatcher``, or None:
    no grammar; ``matchers`` None: none in the batch), unless ``grammar_bitmask`` (int32
    [R, ceil(V / 32)], a row per logits row, all bits set where no grammar applies) is given:
    speculative verification, whose rows after draft tokens need the mask after those drafts
    (``StructuredMatcher.fill_bitmask_with_draft``), passes its own.
    """
    params = [s.sampling for s in seqs]
    needs = [bool(sp.logit_bias) or sp.min_tokens > 0 or _has_penalty(sp) for sp in params]
    if not any(needs) and matchers is None and grammar_bitmask is None:
        return logits.float()
    logits = logits.to(torch.float32, copy=True)
    vocab = logits.shape[1]
    if grammar_bitmask is not None:
        apply_bitmask(logits, grammar_bitmask)
    elif matchers is not None and any(m is not None for m in matchers):
        _apply_grammar(logits, matchers)
    for i, seq in enumerate(seqs):
        sp = seq.sampling
        ids = [t for t in sp.logit_bias if 0 <= t < vocab]
        if ids:
            logits[i, ids] += torch.tensor([sp.logit_bias[t] for t in ids], dtype=torch.float32)
        if seq.num_output_tokens < sp.min_tokens:
            banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos_token_ids))
            banned = [t for t in banned if 0 <= t < vocab]
            if banned:
                kept = logits[i, banned].clone() if matchers is not None and matchers[i] is not None else None
                logits[i, banned] = float("-inf")
                if kept is not None and not torch.isfinite(logits[i]).any():  # the grammar allows only these
                    logits[i, banned] = kept
    _apply_penalties(logits, seqs)
    return logits


def _apply_grammar(logits: torch.Tensor, matchers: list) -> None:
    """Stage 0, in place: each row with a matcher keeps only the tokens its grammar allows next."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    bitmask = allocate_bitmask(len(rows), logits.shape[1])
    for r, i in enumerate(rows):
        matchers[i].fill_bitmask(bitmask, r)
    if len(rows) == len(matchers):
        apply_bitmask(logits, bitmask)
    else:
        masked = logits[rows]
        apply_bitmask(masked, bitmask)
        logits[rows] = masked


def _has_penalty(sp) -> bool:
    return sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Repetition, then frequency and presence penalties, in place, touching only tokens that occurred.

    NOTE: each row's token ids are gathered, changed and scattered back,
    instead of building [B, V] count tensors (O(tokens), not O(V)). A token
    listed twice is written twice with the same value; frequency is a
    ``scatter_add`` of ``-frequency`` per occurrence. Rows without the knob
    run with a neutral value (1 or 0), which leaves their logits bit-identical.
    """
    params = [s.sampling for s in seqs]
    vocab = logits.shape[1]
    rep = torch.tensor([sp.repetition_penalty for sp in params], dtype=torch.float32).unsqueeze(1)
    if (rep != 1.0).any():
        ids, real = _token_index([s.token_ids if s.sampling.repetition_penalty != 1.0 else [] for s in seqs], vocab)
        vals = logits.gather(1, ids)
        penalised = torch.where(vals > 0, vals / rep, vals * rep)
        logits.scatter_(1, ids, torch.where(real.any(1, keepdim=True), penalised, vals))
    freq = torch.tensor([sp.frequency_penalty for sp in params], dtype=torch.float32).unsqueeze(1)
    pres = torch.tensor([sp.presence_penalty for sp in params], dtype=torch.float32).unsqueeze(1)
    if (freq != 0).any() or (pres != 0).any():
        wanted = [sp.frequency_penalty != 0 or sp.presence_penalty != 0 for sp in params]
        ids, real = _token_index([s.output_token_ids if w else [] for s, w in zip(seqs, wanted)], vocab)
        logits.scatter_add_(1, ids, torch.where(real, -freq, 0.0))
        vals = logits.gather(1, ids)
        logits.scatter_(1, ids, torch.where(real.any(1, keepdim=True), vals - pres, vals))


def _token_index(token_lists: list[list[int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids as a [rows, longest] long tensor and a mask of the real entries.

    Padding (and any id outside the vocabulary) points at the row's first real
    id, so writing that token's new value there is harmless; a row with no
    real id points at token 0, and callers write back its unchanged value.
    """
    width = max(1, max(len(t) for t in token_lists))
    ids = np.zeros((len(token_lists), width), dtype=np.int64)
    real = np.zeros((len(token_lists), width), dtype=bool)
    for r, toks in enumerate(token_lists):
        ids[r, : len(toks)] = toks
        real[r, : len(toks)] = True
    real &= (ids >= 0) & (ids < vocab)
    rows = np.arange(len(token_lists))
    first = np.where(real.any(axis=1), ids[rows, real.argmax(axis=1)], 0)
    ids = np.where(real, ids, first[:, None])
    return torch.from_numpy(ids), torch.from_numpy(real)


# --- 5-9: random sampling ---------------------------------------------------------------


def _sample_rows(logits: torch.Tensor, params: list, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Steps 5-9 for rows that sample (temperature > 0): one token id per row."""
    return _draw(sampling_weights(logits, params), generators)


def sampling_weights(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Steps 5-8 for rows that sample: unnormalised probabilities [B, V] float32 (0 where a
    truncation dropped a token; row i divided by its sum is the distribution step 9 draws from).
    ``logits`` [B, V] are after stages 1-4; row i follows ``params[i]``."""
    temperature = torch.tensor([sp.temperature for sp in params], dtype=torch.float32).unsqueeze(1)
    x = logits / temperature
    min_p = torch.tensor([sp.min_p for sp in params], dtype=torch.float32).unsqueeze(1)
    if (min_p > 0).any():
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    vocab = x.shape[1]
    top_k = torch.tensor([sp.top_k if 0 < sp.top_k < vocab else vocab for sp in params]).unsqueeze(1)
    top_p = torch.tensor([sp.top_p for sp in params], dtype=torch.float32).unsqueeze(1)
    truncated = ((top_k < vocab) | (top_p < 1.0)).squeeze(1)
    if truncated.any():
        x[truncated] = _top_k_top_p(x[truncated], top_k[truncated], top_p[truncated])
    return (x - x.amax(dim=-1, keepdim=True)).exp_()


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """-inf outside each row's top-k tokens and, among those, its top-p nucleus.

    NOTE: a full sort of [B, V] costs ~30 softmaxes on CPU. The kept set is a
    most-likely-first prefix, so it is found in ``topk(K)`` once K covers it:
    K starts at the largest top_k (or 64) and grows 4x until every row's
    nucleus closes inside the window (almost always at once: the nucleus of
    a real model's distribution is small).
    """
    vocab = x.shape[1]
    limited = top_k < vocab
    window = min(vocab, max(_NUCLEUS_START, int(top_k[limited].max()) if limited.any() else 0))
    full_lse = torch.logsumexp(x, dim=-1, keepdim=True)
    while True:
        vals, idx = x.topk(window, dim=-1)  # sorted, most likely first
        keep = torch.arange(window).unsqueeze(0) < top_k
        # Probabilities renormalised over the top-k kept (or the whole row without top-k).
        kept_lse = torch.logsumexp(vals.masked_fill(~keep, float("-inf")), dim=-1, keepdim=True)
        probs = (vals - torch.where(limited, kept_lse, full_lse)).exp().masked_fill(~keep, 0.0)
        mass_before = probs.cumsum(dim=-1) - probs
        keep &= mass_before < top_p  # the first token always stays (mass before it is 0)
        closed = (top_k <= window) | (mass_before[:, -1:] + probs[:, -1:] >= top_p)
        if window == vocab or bool(closed.all()):
            break
        window = min(vocab, window * 4)
    out = torch.full_like(x, float("-inf"))
    return out.scatter_(1, idx, vals.masked_fill(~keep, float("-inf")))


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row: the first whose cumulative weight exceeds u * total, u ~ U[0, 1).

    ``probs`` need not be normalised (non-negative, some positive in each row).
    Row i's u comes from ``generators[i]`` alone when it has one.
    """
    u = torch.empty(probs.shape[0], dtype=torch.float32)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded))
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g)[0]
    cdf = probs.cumsum(dim=-1)
    target = (u.unsqueeze(1) * cdf[:, -1:]).contiguous()
    # right=True: the first index whose cdf is > target, so a zero-probability token
    # (cdf equal to its predecessor's) can never be picked.
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    over = picked >= probs.shape[1]  # u * total rounded up to total: take the last possible token
    if over.any():
        last_nonzero = probs.shape[1] - 1 - (probs[over].flip(-1) > 0).int().argmax(dim=-1)
        picked[over] = last_nonzero
    return picked


# --- logprobs ------------------------------------------------------------------------------


def _logprobs(logits: torch.Tensor, tokens: list[int], params: list) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    rows = [i for i, sp in enumerate(params) if sp.logprobs]
    if not rows:
        return out
    logp = torch.log_softmax(logits[rows], dim=-1)
    chosen = logp.gather(1, torch.tensor([[tokens[i]] for i in rows])).squeeze(1).tolist()
    k = max(params[i].top_logprobs for i in rows)
    top_vals, top_ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for r, i in enumerate(rows):
        n = params[i].top_logprobs
        out[i] = TokenLogprobs(tokens[i], chosen[r], list(zip(top_ids[r][:n], top_vals[r][:n])))
    return out


def prompt_token_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Prompt logprobs of one slice of positions: ``logits`` [N, V] (any float dtype) at the
    positions before ``targets`` [N] (the prompt tokens they predict); each target's logprob under
    the raw distribution (no logits processor: what the model gives the prompt) and the ``k``
    most likely tokens there, best first."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(targets, dtype=torch.long).unsqueeze(1)).squeeze(1).tolist()
    if k > 0:
        top_vals, top_ids = logp.topk(k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_vals.tolist())]
    else:
        tops = [[] for _ in targets]
    return [TokenLogprobs(t, c, top) for t, c, top in zip(targets, chosen, tops)]
