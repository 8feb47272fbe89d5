"""The engine: schedule -> execute -> update, one step at a time (vLLM v1 / nano-vllm).

A step takes the scheduler's sequences, runs one forward pass over all of
them, samples one token per sequence and returns ``StepOutput`` s. A
prefill-only engine (the prefill worker's) finishes every request after its
first token with reason ``"handoff"`` and exports the KV blocks of the prompt
so the caller can write them to the storage tier. A decode engine accepts
requests with imported KV (``add_request(..., kv_blocks=...)``) that go
straight into the running batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.cost_model import StepCostModel, features
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.sampler import sample
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import Sequence, SequenceStatus
from deepinfer.kvstore.hashing import model_fingerprint
from deepinfer.models.layers import Linear
from deepinfer.models.loader import DTYPES, load_model
from deepinfer.protocol import SamplingParams


class RequestError(ValueError):
    """A request the engine cannot take (too long, bad KV import); says why."""


@dataclass
class EngineConfig:
    """block_size: tokens per KV block. kv_cache_bytes: memory for the KV cache.
    max_model_len: None = the model's max_position_embeddings.
    step_time_budget_s: predicted compute per step that prefill chunks may fill
    (None = no time budget: whole prompts up to max_num_batched_tokens).
    calibrate: time a few forward passes at start-up to fit the step cost model.
    batch_invariant: a request's greedy output does not depend on the batch it
    shares (see ``models.layers.Linear``); off by default on CPU because it
    roughly doubles batch-1 decode time there.
    packed_weights: run linear layers from MKL-packed weights (CPU fp32; one
    extra copy of the weights, 1.2-5x faster GEMMs at decode batch sizes)."""

    block_size: int = 16
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    dtype: str = "float32"
    prefill_only: bool = False
    num_threads: int | None = None
    enable_prefix_caching: bool = True
    step_time_budget_s: float | None = None
    calibrate: bool = False
    batch_invariant: bool = False
    packed_weights: bool = True


@dataclass
class StepOutput:
    """What one step produced for one request.

    new_token_ids: tokens sampled this step (empty for an abort).
    kv_blocks: for ``"handoff"`` only: [n, layers, 2, block_size, kv_heads, head_dim]
    covering the first ``num_kv_tokens`` tokens (the prompt), last block partial.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    kv_blocks: torch.Tensor | None = None
    num_kv_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list | None = None  # [TokenLogprobs] per new token, when the request asked

    def wire_logprobs(self) -> list | None:
        """``TokenChunk.logprobs`` form: per token ``[logprob, [[token_id, logprob], ...]]``."""
        if self.logprobs is None:
            return None
        return [[lp.logprob, [[t, v] for t, v in lp.top]] for lp in self.logprobs]


class LLMEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model, self.model_config = load_model(model_dir, config.dtype)
        for module in self.model.modules():
            if isinstance(module, Linear):
                module.batch_invariant = config.batch_invariant
                if config.packed_weights:
                    module.pack()
        dtype = DTYPES[config.dtype]
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.block_bytes = ModelRunner.block_bytes(mc, config.block_size, dtype)
        num_blocks = max(2, config.kv_cache_bytes // self.block_bytes)
        self.fingerprint = model_fingerprint(model_dir, config.dtype, config.block_size)
        self.block_manager = BlockManager(num_blocks, config.block_size, self.fingerprint,
                                          config.enable_prefix_caching)
        self.runner = ModelRunner(self.model, config.block_size, num_blocks, dtype, config.batch_invariant)
        self.cost_model = StepCostModel()
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, mc.eos_token_ids, self.cost_model,
                                   config.step_time_budget_s, min_chunk=config.block_size)
        self.generators: dict[str, torch.Generator] = {}
        self.peak_batch_size = 0
        self.num_steps = 0
        self.num_computed_tokens_total = 0  # tokens fed through the model (not cache hits)
        self.last_step_s = 0.0
        if config.calibrate:
            self.calibrate()

    # --- requests -----------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    output_token_ids: list[int] = (), kv_blocks: torch.Tensor | None = None,
                    num_kv_tokens: int = 0, cache_salt: str | None = None) -> None:
        """Queue a request. With ``kv_blocks`` covering the first ``num_kv_tokens`` tokens
        (must be all tokens but the last), it joins the running batch without a prefill.

        Raises RequestError for an empty or too-long prompt or inconsistent KV.
        """
        tokens = list(prompt_token_ids) + list(output_token_ids)
        if not prompt_token_ids:
            raise RequestError("empty prompt")
        if len(tokens) >= self.max_model_len:
            raise RequestError(f"{len(tokens)} tokens >= max model length {self.max_model_len}")
        seq = Sequence(request_id, tokens, len(prompt_token_ids), sampling, prefill_only=self.config.prefill_only,
                       cache_salt=(cache_salt or "").encode())
        if sampling.seed is not None:
            g = torch.Generator().manual_seed(sampling.seed)
            if sampling.temperature > 0:
                # NOTE: the sampler draws one number per token; replay the draws of the tokens
                # already generated elsewhere (prefill) so a disaggregated run equals a single one.
                for _ in output_token_ids:
                    torch.rand(1, generator=g)
            self.generators[request_id] = g
        if kv_blocks is not None:
            if num_kv_tokens != len(tokens) - 1:
                raise RequestError(f"KV covers {num_kv_tokens} tokens, expected {len(tokens) - 1}")
            if kv_blocks.shape[0] * self.config.block_size < num_kv_tokens:
                raise RequestError("KV blocks do not cover num_kv_tokens")
            if self.block_manager.can_allocate(seq, len(tokens)):
                self.block_manager.allocate(seq, len(tokens))
                n = kv_blocks.shape[0]
                self.runner.write_blocks(seq.block_table[:n], kv_blocks)
                seq.num_computed_tokens = num_kv_tokens
                seq.status = SequenceStatus.RUNNING
            # else: no room now -> recompute from tokens when blocks free up
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its KV blocks; False if it is not here."""
        self.generators.pop(request_id, None)
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step ------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        seqs = self.scheduler.schedule()
        if not seqs:
            return []
        pieces = [(s.num_scheduled_tokens, s.num_computed_tokens) for s in seqs]
        t0 = time.perf_counter()
        logits = self.runner.run(seqs)
        self.last_step_s = time.perf_counter() - t0
        self.cost_model.observe(pieces, self.last_step_s)
        # only sequences whose fed tokens reach their end sample a token
        done = [i for i, s in enumerate(seqs) if s.num_computed_tokens + s.num_scheduled_tokens == len(s)]
        result = sample(logits[done], [seqs[i] for i in done],
                        [self.generators.get(seqs[i].request_id) for i in done], self.model_config.eos_token_ids)
        tokens = result.token_ids
        logprobs = dict(zip(done, result.logprobs))
        self.num_steps += 1
        self.num_computed_tokens_total += sum(n for n, _ in pieces)
        self.peak_batch_size = max(self.peak_batch_size, len(seqs))
        sampled = dict(zip(done, tokens))
        finished = {id(s) for s in self.scheduler.postprocess(seqs, sampled)}
        outputs = []
        for i, seq in enumerate(seqs):
            if i not in sampled:
                continue
            out = StepOutput(seq.request_id, [sampled[i]], seq.finish_reason, seq.num_prompt_tokens,
                             num_cached_tokens=seq.num_cached_tokens,
                             logprobs=[logprobs[i]] if logprobs[i] is not None else None)
            if id(seq) in finished:
                if seq.finish_reason == "handoff":
                    out.num_kv_tokens = seq.num_computed_tokens
                    n = -(-out.num_kv_tokens // self.config.block_size)
                    out.kv_blocks = self.runner.read_blocks(seq.block_table[:n])
                self.block_manager.free(seq)
                self.generators.pop(seq.request_id, None)
            outputs.append(out)
        return outputs

    # --- cost model ---------------------------------------------------------------
    def calibrate(self) -> None:
        """Fit the step cost model from a few timed forward passes on dummy sequences.

        Shapes: prefills of 16..256 tokens at contexts 0..1024, decode batches
        of 1..16 at contexts 128..1024 (a few seconds of compute on 2 CPU cores).
        The first shape runs twice; its first run (warm-up) is not recorded.
        """
        shapes = [[(16, 0)], [(16, 0)], [(64, 0)], [(256, 0)], [(64, 1024)], [(128, 512)],
                  [(1, 128)], [(1, 1024)] * 8, [(1, 256)] * 16, [(1, 512)] * 4]
        for k, pieces in enumerate(shapes):
            seqs = []
            for i, (n, c) in enumerate(pieces):
                seq = Sequence(f"__calibrate_{i}", [0] * (c + n), c + n, SamplingParams(max_tokens=1))
                if not self.block_manager.can_allocate(seq, c + n):
                    break
                self.block_manager.allocate(seq, c + n)
                seq.num_computed_tokens, seq.num_scheduled_tokens = c, n
                seqs.append(seq)
            if len(seqs) == len(pieces):
                t0 = time.perf_counter()
                self.runner.run(seqs)
                if k > 0:
                    self.cost_model.samples.append((features(pieces), time.perf_counter() - t0))
            for seq in seqs:
                self.block_manager.free(seq)
        if len(self.cost_model.samples) >= 3:
            self.cost_model.fit()

    # --- load -----------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_tokens_used(self) -> int:
        bm = self.block_manager
        return (bm.num_blocks - bm.num_free_blocks) * bm.block_size

    @property
    def kv_tokens_capacity(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size
