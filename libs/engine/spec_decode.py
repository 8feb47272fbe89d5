"""Speculative decoding: drafters, an adaptive verification length, lossless verification.

One decode step with speculation (the engine runs it synchronously)::

    scheduled decode seqs ──propose──> up to γ draft tokens each, with confidences c_{r,j}
        ──choose ℓ_r (DSpark Algorithm 1, or a fixed k)──> the step feeds anchor + ℓ_r drafts
        ──forward──> logits at the anchor and after each draft: [1 + ℓ_r, V] per sequence
        ──verify──> accepted drafts + one more token; the rejected drafts' KV is rolled back

Drafters (``SpecConfig.method``):

* ``ngram``: prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` proposer): the
  longest suffix of the context (``ngram_max`` down to ``ngram_min`` tokens) that
  occurred before; the tokens that followed its latest earlier occurrence are the
  drafts. An incremental n-gram -> position index per request keeps it O(new tokens).
  Confidence: the acceptance rate learned online per bucket (how often the draft
  token followed its n-gram among the n-gram's earlier occurrences: always / at
  least half / less, the suffix decoding signal of arXiv 2411.04975; whether the
  target rejected that token when this request drafted it before, since an edit
  (a rename, say) recurs wherever the text it copies has the old token; how the
  request's previous drafts fared: all accepted / some / none / no history, since
  a request copying a passage keeps copying; draft position; match length).
* ``draft``: self-draft by early exit (LayerSkip, arXiv 2404.16710; Draft & Verify,
  arXiv 2309.08168): the target's first ``draft_layers`` layers, its final norm and
  head, run autoregressively γ times. Those layers' KV of accepted tokens is the
  target's own, so the drafter needs no cache of its own. Drafts are greedy;
  confidence: the early-exit probability of the drafted token, calibrated online
  per probability decile.

Verification length (``SpecConfig.verify``): ``fixed`` verifies min(γ, drafts)
per request. ``adaptive`` is DSpark's Algorithm 1 (deepseek-ai/DeepSpec;
docs/speculative_decoding.md): a_{r,j} = Π_{i≤j} c_{r,i} is the chance draft j is accepted;
starting from ℓ_r = 0, the (r, j) are visited by decreasing a_{r,j}, each adding
one token to the step and a_{r,j} expected tokens, and the prefix of that order
with the highest expected throughput τ · SPS is verified (Algorithm 1 stops
at the first token that does not raise it; see ``_choose`` for why all are
scanned). SPS, the steps per second of the step being planned, is 1 / T with T
a step cost model (``cost_model.StepCostModel``: a + b·Σn + d·Σn(c + n/2) +
e·Σ(c + n) over the step's pieces) plus the step's measured overhead besides the
forward pass. Its a and b are fitted online on decode steps only (every piece
one token plus its drafts; the engine's calibrated model until 16 were seen),
since a verified token goes through the LM head and a prefill token does not;
d and e are the engine's at the first decode step once that model has been fitted
(by its start-up calibration, in a worker), kept from then on. So a draft costs b + d·(its position) + e, and the
price of the step without any draft, the baseline every draft must beat,
includes the KV gather of the batch's contexts. Prefill chunks sharing the step
are left out of T and τ: their compute is owed whatever is verified. Light
load: the fixed per-step cost dominates, so long drafts pay; heavy load: each
verified token's share grows, so only likely ones do.
(DSpark's SPS(B) is a curve over B alone; on the CPU a step's time depends on
the contexts as much as on B, and a curve profiled at one context priced the
no-draft baseline at half its real cost at 32 requests: see
docs/speculative_decoding.md.)

Verification is lossless (Leviathan et al., arXiv 2211.17192). Greedy: accept
while the draft equals the target's argmax; the first mismatch is replaced by
the argmax, and when every draft is accepted the last row's argmax is a bonus
token. Sampling: drafts are deterministic proposals (q is a point mass), so a
draft d is accepted with probability min(1, p(d) / q(d)) = p(d), and on
rejection the token is drawn from the residual max(0, p - q), i.e. p without d,
renormalised; p is the request's sampling distribution (temperature, min-p,
top-k, top-p, logit bias). The output distribution is exactly non-speculative
sampling's.

Not speculated (decoded one token per step as usual): prefill-only engines,
requests with repetition / frequency / presence penalties or an unmet
``min_tokens`` (position-dependent logits), seeded sampling (its one random
number per token is what makes a seed reproduce across workers), and hybrid
sliding-window models (rejected: ``EngineConfig`` check). Structured output
speculates: drafts are cut at the first token the request's grammar refuses, and
each verification row gets the grammar mask after the drafts before it
(``StructuredMatcher.fill_bitmask_with_draft``); the engine's matcher then
consumes the emitted tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from deepinfer.engine.cost_model import StepCostModel
from deepinfer.engine.sampler import (MIN_TEMPERATURE, SampleResult, _draw, _has_penalty, _logprobs,
                                      apply_logits_processors, sample, sampling_weights)
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.structured import allocate_bitmask

METHODS = ("ngram", "draft")
MIN_DECODE_STEPS = 16  # decode steps observed before adaptive verification prices by their own model
VERIFY_MODES = ("adaptive", "fixed")


@dataclass
class SpecConfig:
    """method: "ngram" or "draft" (self-draft, see the module docstring).
    num_speculative_tokens: γ, the most drafts a request proposes per step.
    verify: "adaptive" (DSpark Algorithm 1) or "fixed" (every draft, up to γ).
    ngram_min / ngram_max: suffix lengths (tokens) prompt lookup tries, longest first.
    draft_layers: layers of the self-draft (None = a quarter of the model's).
    prior: confidence of a bucket nothing has been observed in yet; prior_weight:
    how many observations that prior counts as. draft_stop: the self-draft stops
    drafting for a request once the chance all its drafts so far are accepted falls
    below this (each draft token costs a forward pass of ``draft_layers`` layers)."""

    method: str = "ngram"
    num_speculative_tokens: int = 5
    verify: str = "adaptive"
    ngram_min: int = 2
    ngram_max: int = 4
    draft_layers: int | None = None
    prior: float = 0.5
    prior_weight: float = 4.0
    draft_stop: float = 0.1

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, not {self.method!r}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"speculative verify must be one of {VERIFY_MODES}, not {self.verify!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")


@dataclass
class Draft:
    """Draft tokens for one request, each with its confidence (P(accepted | earlier drafts
    accepted)) and its calibration bucket."""

    tokens: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    buckets: list[tuple] = field(default_factory=list)


class AcceptanceCalibrator:
    """Online P(a draft is accepted | the drafts before it were), per bucket.

    A bucket is a tuple of keys from coarse to fine, e.g. ("ngram", last, j, n); every
    prefix of it is counted too, and a bucket's estimate shrinks toward its parent's
    (the empty bucket's parent is ``prior``): (accepted + parent * w) / (reached + w).
    A fine bucket seen rarely thus answers with what its coarser buckets learned.
    Counts are halved past ``horizon`` observations so estimates follow the workload.
    """

    def __init__(self, prior: float = 0.5, prior_weight: float = 4.0, horizon: int = 2000):
        self.prior, self.prior_weight, self.horizon = prior, prior_weight, horizon
        self.counts: dict[tuple, list[float]] = {}

    def confidence(self, bucket: tuple) -> float:
        p = self.prior
        for k in range(len(bucket) + 1):
            acc, n = self.counts.get(bucket[:k], (0.0, 0.0))
            p = (acc + p * self.prior_weight) / (n + self.prior_weight)
        return p

    def observe(self, buckets: list[tuple], num_accepted: int) -> None:
        """Drafts ``buckets[:num_accepted]`` were accepted and the next one (if any) rejected;
        later ones were never reached and say nothing."""
        for j, bucket in enumerate(buckets[: num_accepted + 1]):
            for k in range(len(bucket) + 1):
                c = self.counts.setdefault(bucket[:k], [0.0, 0.0])
                c[0] += j < num_accepted
                c[1] += 1
                if c[1] > self.horizon:
                    c[0] /= 2
                    c[1] /= 2


class NgramIndex:
    """Per-request prompt-lookup index: for each n, n-gram -> end (exclusive) of its latest
    occurrence that is not the context's own suffix, and how often each token followed it."""

    def __init__(self, ngram_min: int, ngram_max: int):
        self.sizes = range(ngram_max, ngram_min - 1, -1)
        self.maps: dict[int, dict[tuple, int]] = {n: {} for n in self.sizes}
        self.nexts: dict[int, dict[tuple, dict[int, int]]] = {n: {} for n in self.sizes}
        self.indexed = 0  # n-grams ending at positions < indexed+1 are in the maps
        self.last = "new"  # how the request's last verified drafts fared: "all", "some", "none"
        self.replaced: set[int] = set()  # draft tokens of this request the target rejected (replaced)

    def lookup(self, tokens: list[int], k: int) -> tuple[int, list[int], list[float]]:
        """(n, up to k tokens that followed the latest earlier occurrence of the longest
        suffix of ``tokens`` found, per draft token the share of its n-gram's earlier
        occurrences that it followed), or (0, [], []) without a match."""
        for end in range(self.indexed + 1, len(tokens)):
            nxt = tokens[end]
            for n in self.sizes:
                if end >= n:
                    gram = tuple(tokens[end - n:end])
                    self.maps[n][gram] = end
                    counts = self.nexts[n].setdefault(gram, {})
                    counts[nxt] = counts.get(nxt, 0) + 1
        self.indexed = max(self.indexed, len(tokens) - 1)
        for n in self.sizes:
            if len(tokens) > n:
                e = self.maps[n].get(tuple(tokens[-n:]))
                if e is not None:
                    drafts = tokens[e:e + k]
                    shares = []
                    for j, t in enumerate(drafts):  # draft j follows the n-gram ending at e + j
                        counts = self.nexts[n][tuple(tokens[e + j - n:e + j])]
                        shares.append(counts[t] / sum(counts.values()))
                    return n, drafts, shares
        return 0, [], []


class SpecDecoder:
    """Speculative decoding for one engine (``LLMEngine``): ``plan`` before the step's
    inputs are built, ``verify`` on its logits. Counters: ``num_verify_steps`` (steps
    with drafts), ``num_draft_tokens`` (verified), ``num_accepted_tokens``,
    ``num_spec_seqs`` (request-steps with drafts; emitted tokens = accepted + this)."""

    def __init__(self, config: SpecConfig, engine):
        self.config = config
        self.engine = engine
        self.calibrator = AcceptanceCalibrator(config.prior, config.prior_weight)
        num_layers = engine.model_config.num_hidden_layers
        self.draft_layers = config.draft_layers or max(1, num_layers // 4)
        if config.draft_layers is not None and config.draft_layers < 1:
            raise ValueError("draft_layers must be >= 1")
        if config.method == "draft" and not 1 <= self.draft_layers < num_layers:
            raise ValueError(f"draft_layers must be in [1, {num_layers - 1}]")
        self.num_verify_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_spec_seqs = 0
        self.overhead_s = 0.0  # a step's seconds besides the forward pass (``observe_overhead``)
        # seconds of a decode step (no prefill chunk): its a and b fitted on those steps only, since
        # a verified token goes through the LM head and a prefill token does not (e.g. SmolLM2-135M:
        # ~1.1 of ~4.6 ms a token on one thread); d and e the engine model's at the first decode
        # step after its first fit (``observe_step``)
        self.decode_cost = StepCostModel(fitted=(1,))
        self._kept_de = False  # decode_cost's d, e taken from a fitted engine model, kept since
        # per request, by request id: the n-gram drafter's index of its tokens, and the calibration
        # buckets of the drafts planned for the step in flight (``free`` drops both)
        self.states: dict[str, NgramIndex] = {}
        self._buckets: dict[str, list[tuple]] = {}

    def free(self, request_id: str) -> None:
        """Forget a request that ended or was aborted."""
        self.states.pop(request_id, None)
        self._buckets.pop(request_id, None)

    # --- which requests -------------------------------------------------------------
    def _budget(self, seq: Sequence) -> int:
        """Drafts ``seq`` may verify this step (0 = not speculated)."""
        sp = seq.sampling
        if (seq.prefill_only or seq.num_scheduled_tokens != 1 or seq.num_computed_tokens != len(seq.token_ids) - 1
                or _has_penalty(sp) or seq.num_output_tokens < sp.min_tokens
                or (sp.seed is not None and sp.temperature >= MIN_TEMPERATURE)):
            return 0
        left = min(sp.max_tokens - seq.num_output_tokens, self.engine.max_model_len - len(seq.token_ids)) - 1
        return max(0, min(self.config.num_speculative_tokens, left))

    # --- plan -----------------------------------------------------------------------
    def plan(self, seqs: list[Sequence], tokens_left: int) -> None:
        """Propose drafts for the step's decoding sequences and choose how many each verifies:
        sets ``seq.draft_token_ids`` and grows ``seq.num_scheduled_tokens`` and the block table
        (never beyond free blocks; at most ``tokens_left`` draft tokens in all)."""
        bm = self.engine.block_manager
        budgets = {id(s): self._budget(s) for s in seqs}
        cands = [s for s in seqs if budgets[id(s)] > 0]
        if not cands or tokens_left <= 0:
            return
        if self.config.method == "draft":
            # the drafter writes KV at the anchor's position and γ - 1 after it: room for γ + 1
            fits = []
            for s in cands:
                g = budgets[id(s)]
                while g and not bm.can_allocate(s, s.num_computed_tokens + 1 + g):
                    g -= 1
                if g:
                    bm.allocate(s, s.num_computed_tokens + 1 + g)
                    budgets[id(s)] = g
                    fits.append(s)
            drafts = self._self_draft(fits, [budgets[id(s)] for s in fits])
        else:
            drafts = [self._ngram_draft(s, budgets[id(s)]) for s in cands]
            fits = cands
        eos = set(self.engine.model_config.eos_token_ids)
        structured = self.engine.structured
        for s, d in zip(fits, drafts):  # structured output: drafts stop at the first the grammar refuses
            m = structured.get(s.request_id) if structured is not None else None
            if m is not None and d.tokens:
                # and before EOS: the matcher does not count a consumed EOS as a token it can roll
                # back, so verifying one would corrupt its state (EOS is still sampled after them)
                n = m.validate(d.tokens)
                n = next((j for j, t in enumerate(d.tokens[:n]) if t in eos), n)
                del d.tokens[n:], d.confidences[n:], d.buckets[n:]
        lengths = self._choose(seqs, fits, drafts, tokens_left)
        for s, d, n in zip(fits, drafts, lengths):
            while n and not bm.can_allocate(s, s.num_computed_tokens + 1 + n):
                n -= 1
            if not n:
                continue
            bm.allocate(s, s.num_computed_tokens + 1 + n)
            s.draft_token_ids = d.tokens[:n]
            self._buckets[s.request_id] = d.buckets[:n]
            s.num_scheduled_tokens = 1 + n

    def _ngram_draft(self, seq: Sequence, k: int) -> Draft:
        st = self.states.get(seq.request_id)
        if st is None:
            st = self.states[seq.request_id] = NgramIndex(self.config.ngram_min, self.config.ngram_max)
        n, tokens, shares = st.lookup(seq.token_ids, k)
        buckets = [("ngram", "one" if f == 1 else "most" if f >= 0.5 else "few",
                    "replaced" if t in st.replaced else "kept", st.last, j, n)
                   for j, (f, t) in enumerate(zip(shares, tokens))]
        return Draft(tokens, [self.calibrator.confidence(b) for b in buckets], buckets)

    @torch.inference_mode()
    def _self_draft(self, seqs: list[Sequence], budgets: list[int]) -> list[Draft]:
        drafts = [Draft() for _ in seqs]
        runner = self.engine.runner
        alive = [1.0] * len(seqs)  # chance that every draft so far is accepted
        for t in range(max(budgets, default=0)):
            rows = [i for i, g in enumerate(budgets) if g > t and alive[i] >= self.config.draft_stop]
            if not rows:
                break
            tokens = [seqs[i].token_ids[-1] if t == 0 else drafts[i].tokens[-1] for i in rows]
            positions = [len(seqs[i].token_ids) - 1 + t for i in rows]
            logits = runner.draft_forward([seqs[i] for i in rows], tokens, positions, self.draft_layers)
            probs, ids = logits.softmax(dim=-1).max(dim=-1)
            for i, p, tok in zip(rows, probs.tolist(), ids.tolist()):
                bucket = ("draft", min(9, int(p * 10)))
                drafts[i].tokens.append(tok)
                drafts[i].buckets.append(bucket)
                drafts[i].confidences.append(self.calibrator.confidence(bucket))
                alive[i] *= drafts[i].confidences[-1]
        return drafts

    def _choose(self, seqs: list[Sequence], cands: list[Sequence], drafts: list[Draft],
                tokens_left: int) -> list[int]:
        """Drafts to verify per candidate: all of them (fixed) or DSpark Algorithm 1 (adaptive)."""
        if self.config.verify == "fixed":
            lengths, left = [], tokens_left
            for d in drafts:
                lengths.append(min(len(d.tokens), left))
                left -= lengths[-1]
            return lengths
        # the rate every draft must beat: the step's decode part, priced by the decode-step cost
        # model, plus its overhead besides the forward pass, and its tokens without any draft.
        # Prefill chunks sharing the step are left out: their compute is owed whatever is verified,
        # and counted in, they would dilute the rate and let unlikely drafts in.
        cost = self.cost()
        decode = [s for s in seqs if s.num_scheduled_tokens == 1 and s.num_computed_tokens + 1 >= len(s.token_ids)]
        step_s = self.overhead_s + cost.predict([(1, s.num_computed_tokens) for s in decode])
        tau = float(len(decode))
        best = tau / step_s if step_s > 0 else 0.0
        order = []
        for r, d in enumerate(drafts):
            a = 1.0
            for j, c in enumerate(d.confidences):
                a *= c
                order.append((-a, j, r))
        order.sort()
        # NOTE: Algorithm 1 stops at the first (r, j) that does not raise Θ; this scans them all and
        # keeps the best prefix of the order: the same answer when every token costs the same, and
        # right when they do not (a token's cost grows with its request's context).
        best_n = 0
        for n, (neg_a, j, r) in enumerate(order[:tokens_left], 1):
            # draft j of request r grows its piece from (1 + j, c) to (2 + j, c) tokens
            step_s += cost.b + cost.d * (cands[r].num_computed_tokens + j + 1.5) + cost.e
            tau += -neg_a
            if step_s > 0 and tau / step_s > best:
                best, best_n = tau / step_s, n
        lengths = [0] * len(drafts)
        for _, j, r in order[:best_n]:
            lengths[r] = max(lengths[r], j + 1)
        return lengths

    # --- step time -------------------------------------------------------------------
    def cost(self) -> StepCostModel:
        """The cost model adaptive verification prices steps by: the decode-step model once it
        has ``MIN_DECODE_STEPS`` decode steps, the engine's (calibrated at start-up) before."""
        return self.decode_cost if len(self.decode_cost.samples) >= MIN_DECODE_STEPS else self.engine.cost_model

    def observe_step(self, seqs: list[Sequence], pieces: list[tuple[int, int]], seconds: float) -> None:
        """The forward-pass seconds (``runner.execute``, no sampling or verification) of a step
        that fed ``pieces`` ((new tokens, context tokens) per sequence of ``seqs``). A decode step,
        where every sequence feeds its last token plus its drafts (no prefill chunk), refits the
        decode-step model's a and b (seconds per step, per token with the LM head). Its d and e
        (attention, KV gather: the same for any token) are the engine model's as it stands at
        the first decode step, i.e. fitted on its start-up calibration (prefills at contexts
        0..2048, which tell them apart) and the steps so far, and are kept: the engine's later refits over
        a window of decode steps alone, as in a decode worker, cannot tell the per-context cost
        from the fixed one (their least squares dropped e to 0 under load, which priced the
        no-draft baseline low and let too many drafts in). An engine without calibration
        (``EngineConfig.calibrate`` False) is followed until its first fit, whose d and e are
        then kept (in a decode-only worker that fit has no prefill steps to anchor it: run
        workers calibrated, as ``deepinfer serve`` does by default). The first decode step also starts
        a and b from the engine's (a coefficient keeps its value while its feature does not
        vary, e.g. b while every step feeds the same number of tokens)."""
        if not all(n == 1 + len(s.draft_token_ids) and c + n >= len(s.token_ids) for s, (n, c) in zip(seqs, pieces)):
            return
        model, engine = self.decode_cost, self.engine.cost_model
        if not model.samples:
            model.a, model.b = engine.a, engine.b
        if not self._kept_de:
            model.d, model.e = engine.d, engine.e
            self._kept_de = engine.num_fits > 0
        model.observe(pieces, seconds)

    def observe_overhead(self, seconds: float) -> None:
        """A whole step's seconds beyond its forward pass (scheduling, drafting, verification,
        bookkeeping): an exponential moving average added to every step's predicted time."""
        self.overhead_s += 0.1 * (max(0.0, seconds) - self.overhead_s)

    # --- verify ---------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, seqs: list[Sequence], sampling: list[int],
               generators: dict, eos_token_ids) -> SampleResult:
        """Tokens for the step's sampling sequences (``seqs[i]`` for i in ``sampling``) from
        its logits [R, V] (``ModelRunner.prepare``'s rows: 1 + drafts per sequence). Returns
        per sampling sequence the list of tokens it emits (accepted drafts, then one more)
        and their logprobs (a list, or None when not asked)."""
        offsets, row = [], 0
        for s in seqs:
            offsets.append(row)
            row += 1 + len(s.draft_token_ids)
        plain = [i for i in sampling if not seqs[i].draft_token_ids]
        spec = [i for i in sampling if seqs[i].draft_token_ids]
        tokens: dict[int, list[int]] = {}
        logprobs: dict[int, list | None] = {}
        structured = self.engine.structured
        if plain:
            ps = [seqs[i] for i in plain]
            res = sample(logits[[offsets[i] for i in plain]], ps, [generators.get(s.request_id) for s in ps],
                         eos_token_ids, structured.for_batch(ps) if structured is not None else None)
            for i, t, lp in zip(plain, res.token_ids, res.logprobs):
                tokens[i], logprobs[i] = [t], None if lp is None else [lp]
        if spec:
            self.num_verify_steps += 1
            rows = [offsets[i] + j for i in spec for j in range(1 + len(seqs[i].draft_token_ids))]
            row_seqs = [seqs[i] for i in spec for _ in range(1 + len(seqs[i].draft_token_ids))]
            bitmask = None
            matchers = structured.for_batch([seqs[i] for i in spec]) if structured is not None else None
            if matchers is not None:  # structured output: masks after the drafts
                bitmask, row = allocate_bitmask(len(rows), logits.shape[1]), 0
                for i, m in zip(spec, matchers):
                    if m is not None:
                        m.fill_bitmask_with_draft(bitmask, row, seqs[i].draft_token_ids)
                    row += 1 + len(seqs[i].draft_token_ids)
            row_matchers = (None if matchers is None else
                            [m for i, m in zip(spec, matchers) for _ in range(1 + len(seqs[i].draft_token_ids))])
            processed = apply_logits_processors(logits[rows], row_seqs, eos_token_ids, grammar_bitmask=bitmask,
                                                matchers=row_matchers)
            start = 0
            for i in spec:
                seq = seqs[i]
                n = 1 + len(seq.draft_token_ids)
                block = processed[start:start + n]
                out = self._verify_one(block, seq)
                tokens[i] = out
                if seq.sampling.logprobs:
                    logprobs[i] = _logprobs(block[:len(out)], out, [seq.sampling] * len(out))
                else:
                    logprobs[i] = None
                accepted = len(out) - 1
                self.num_draft_tokens += n - 1
                self.num_accepted_tokens += accepted
                seq.num_draft_tokens += n - 1
                seq.num_accepted_tokens += accepted
                self.num_spec_seqs += 1
                self.calibrator.observe(self._buckets.pop(seq.request_id, []), accepted)
                st = self.states.get(seq.request_id)
                if st is not None:  # (the n-gram drafter's)
                    st.last = "all" if accepted == n - 1 else "some" if accepted else "none"
                    if accepted < n - 1 and out[accepted] != seq.draft_token_ids[accepted]:
                        # (sampling's residual can fall back to the draft token itself: not replaced)
                        st.replaced.add(seq.draft_token_ids[accepted])
                start += n
        return SampleResult([tokens[i] for i in sampling], [logprobs[i] for i in sampling])

    @staticmethod
    def _verify_one(rows: torch.Tensor, seq: Sequence) -> list[int]:
        """One request: ``rows`` [1 + k, V] processed logits at the anchor and after each of its
        k drafts -> the emitted tokens (accepted drafts, then a correction or bonus token)."""
        drafts = seq.draft_token_ids
        sp = seq.sampling
        if sp.temperature < MIN_TEMPERATURE:
            target = rows.argmax(dim=-1).tolist()
            out = []
            for j, d in enumerate(drafts):
                if d != target[j]:
                    break
                out.append(d)
            return out + [target[len(out)]]
        weights = sampling_weights(rows, [sp] * rows.shape[0])
        probs = weights / weights.sum(dim=-1, keepdim=True)
        p_draft = probs[torch.arange(len(drafts)), torch.tensor(drafts)].tolist()
        u = torch.rand(len(drafts)).tolist()
        out = []
        for j, d in enumerate(drafts):
            if u[j] >= p_draft[j]:  # rejected: draw from the residual (p without the draft)
                residual = weights[j].clone()
                residual[d] = 0.0
                if not math.isfinite(float(residual.sum())) or float(residual.sum()) <= 0:
                    residual = weights[j]  # float rounding: p(d) just under 1 and u above it
                return out + [int(_draw(residual[None], [None])[0])]
            out.append(d)
        return out + [int(_draw(weights[len(drafts)][None], [None])[0])]
