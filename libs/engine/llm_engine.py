"""``LLMEngine``: this project's engine for one model, built on ``EngineCore``'s step loop.

It loads the model in the dtype chosen at start-up (``dtype_choice``), sizes the KV cache
(``kv_cache_manager.plan_kv_pools``), times its own steps (``calibration``) and takes
requests: ``add_request`` builds a ``Sequence`` (with KV a prefill worker computed, it joins
the running batch at once), ``step``/``step_async`` (``EngineCore``) run it.

A prefill-only engine (the prefill worker's) finishes every request after its first token
with reason ``"handoff"`` and exports the prompt's KV blocks for the storage tier; a decode
engine accepts requests with imported KV (``add_request(..., kv_blocks=...)``).

Hybrid sliding-window models (docs/architecture.md, "SWA bounded replay"): the storage tier's
blocks hold the full layers only (``load_prefix`` takes them); the window layers' state of a
prefix comes from the window pool, the host SWA state cache (``swa_cache``, filled with each
finished sequence's last window) or a bounded replay (``hybrid_blocks``);
``StepOutput.prefix_path`` says which.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from deepinfer.engine import calibration
from deepinfer.engine.cost_model import StepCostModel
from deepinfer.engine.dtype_choice import apply_bf16_weights, choose_dtype
from deepinfer.engine.engine_core import EngineCore
from deepinfer.engine.hybrid_blocks import SWA_MODES
from deepinfer.engine.interface import MAX_PROMPT_LOGPROBS, EngineConfig, RequestError
from deepinfer.engine.kv_cache_manager import KVCacheManager, plan_kv_pools
from deepinfer.engine.kv_connector import TierConnector
from deepinfer.engine.kv_layout import KVLayout
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import RequestStatus, Sequence
from deepinfer.engine.spec_decode import SpecDecoder
from deepinfer.engine.structured import StructuredOutputError, StructuredOutputManager, compile_grammar
from deepinfer.kernels import cpu_gemv
from deepinfer.kernels import select as kernel_select
from deepinfer.models.config import ModelConfig
from deepinfer.models.layers import Linear, tune_packed_rows
from deepinfer.models.loader import DTYPES, load_model
from deepinfer.models.moe import MoEBlock
from deepinfer.protocol import SamplingParams
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

# the process's intra-op threads before any engine switched them per step: an engine's default
DEFAULT_THREADS = torch.get_num_threads()


class LLMEngine(EngineCore):
    """The native engine (``interface.Engine``). Raises ValueError at construction for a
    configuration it cannot run (a bad ``swa_replay``, speculation on a hybrid model, Triton
    kernels where they cannot run)."""

    engine_kind = "native"  # what load reports call this engine (``engine.mock.MockEngine``: "mock")
    bf16_weights = None  # ``dtype_choice.Bf16WeightsChoice`` where the bf16-weights kernel was timed

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        if config.swa_replay not in SWA_MODES:
            raise ValueError(f"swa_replay must be one of {SWA_MODES}, not {config.swa_replay!r}")
        # NOTE: not ``torch.get_num_threads()`` now: an earlier engine in this process may have left
        # it at one thread (``step_threads`` switches per step), and a batch-invariant engine's bits
        # depend on its thread count
        torch.set_num_threads(config.num_threads or DEFAULT_THREADS)
        # the bf16-weights kernel reads weights on every thread, also in steps run on one intra-op thread
        cpu_gemv.set_threads(config.num_threads or DEFAULT_THREADS)
        self.model_dir = Path(model_dir)
        self.dtype_choice = choose_dtype(ModelConfig.from_dir(model_dir), config.dtype, config.batch_invariant)
        requested = config.dtype
        if requested == "auto":
            log.info("dtype chosen", **self.dtype_choice.log_fields())
        config.dtype = self.dtype_choice.dtype
        self.model, self.model_config = load_model(model_dir, config.dtype)
        self._prepare_linears(requested)
        self.kernels = kernel_select.resolve(config.kernels, next(self.model.parameters()).device)
        kernel_select.use(self.model, self.kernels)
        mc, dtype = self.model_config, DTYPES[config.dtype]
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        windows = [a.sliding_window for a in self.model.attention_layers]
        pools = plan_kv_pools(model_dir, mc, windows, config, self.max_model_len, dtype)
        self.fingerprint, self.block_bytes = pools.fingerprint, pools.block_bytes
        self.runner = ModelRunner(self.model, config.block_size, pools.num_blocks, dtype, config.batch_invariant,
                                  pools.num_window_blocks)
        self._init_scheduling(pools.block_manager, pools.swa_cache, mc.eos_token_ids)
        self.structured = StructuredOutputManager(model_dir, mc.vocab_size, mc.eos_token_ids)  # the model's tokenizer
        self.step_threads = calibration.choose_engine_step_threads(self)
        if config.calibrate:
            self.calibrate()
        if config.speculative is not None and not config.prefill_only:
            if pools.num_window_blocks:
                raise ValueError("speculative decoding is not supported on hybrid sliding-window models")
            config.async_scheduling = False
            self.spec = SpecDecoder(config.speculative, self)

    def _prepare_linears(self, requested_dtype: str) -> None:
        """Batch invariance, packed weights (row cut timed per shape) and the bf16-weights kernel
        (timed: ``dtype_choice.apply_bf16_weights``) on every linear layer."""
        config = self.config
        linears = [m for m in self.model.modules() if isinstance(m, Linear)]
        for module in self.model.modules():
            if isinstance(module, (Linear, MoEBlock)):
                module.batch_invariant = config.batch_invariant
            if isinstance(module, Linear) and config.packed_weights:
                module.pack()
        if config.packed_weights and not config.batch_invariant:  # (batch-invariant mode stays packed)
            tune_packed_rows(linears)
        # (batch-invariant mode stays on the packed GEMM: the kernel's sums depend on the rows per call)
        try_kernel = config.dtype == "bfloat16" or (requested_dtype == "auto" and config.dtype == "float32")
        if config.dtype == "bfloat16-weights" or (try_kernel and not config.batch_invariant):
            self.bf16_weights, config.dtype = apply_bf16_weights(self.model, linears, config.dtype)

    def _init_scheduling(self, block_manager, swa_cache, eos_token_ids: list[int]) -> None:
        """The model-independent part, once ``runner`` and ``max_model_len`` are set: the KV cache
        manager, cost model, scheduler and step loop. A
        sequence longer than the KV cache could never finish: ``max_model_len`` is capped there (it
        ends with "length")."""
        config = self.config
        self.max_model_len = min(self.max_model_len, block_manager.num_blocks * config.block_size)
        self.block_manager = block_manager
        self.kv = KVCacheManager(block_manager, self.runner, self.kv_layout, swa_cache, self.between_steps)
        self.cost_model = StepCostModel()
        self.scheduler = Scheduler(block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, eos_token_ids, self.cost_model,
                                   config.step_time_budget_s, min_chunk=config.block_size)
        self._init_core()

    def calibrate(self) -> None:
        """Fit the step cost model from timed forward passes on dummy sequences (``calibration``)."""
        calibration.calibrate(self)

    @property
    def swa_cache(self):
        """The host SWA state cache (hybrid sliding-window models; None otherwise)."""
        return self.kv.swa_cache

    @property
    def kv_layout(self) -> KVLayout:
        """Which layers a handoff block, a storage-tier block and a window part hold."""
        return KVLayout(self.model_config.num_hidden_layers, tuple(getattr(self.runner, "window_layers", ())))

    # --- requests -----------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    output_token_ids: list[int] = (), kv_blocks: torch.Tensor | None = None,
                    num_kv_tokens: int = 0, cache_salt: str | None = None,
                    num_exact_tokens: int | None = None, images=(), image_embeds=None,
                    export_prompt: bool = False) -> None:
        """Queue a request. With ``kv_blocks`` covering the first ``num_kv_tokens`` tokens
        (must be all tokens but the last), it joins the running batch without a prefill;
        ``num_exact_tokens``: how many of them hold a cold run's KV (None = all; fewer after
        a bounded replay on the prefill worker: the rest never enters the prefix cache).
        images: ``(offset, length, content hash)`` of each image's placeholder run (hashed into
        the blocks it overlaps); image_embeds: each image's embeddings [length, hidden], fed for
        its placeholder rows (None: only hashed; recomputing those rows then fails the request).
        export_prompt: with the first token sampled here, the output carries the prompt's full,
        exact blocks this engine computed (``StepOutput.kv_blocks`` from ``kv_first_block``;
        not those hit in the prefix cache), for the storage tier.
        ``sampling.prompt_logprobs`` is honoured where the prompt is computed here, from nothing
        (no ``kv_blocks``, no ``output_token_ids``): the whole prompt is then computed, never hit
        in the prefix cache, and its logprobs come with the first token (``StepOutput.prompt_logprobs``).

        Raises RequestError for an empty or too-long prompt, a bad ``swa_replay``, an unsupported
        ``structured`` spec or inconsistent KV. A structured request's matcher consumes
        ``output_token_ids`` (tokens sampled elsewhere under the same grammar).
        """
        self.check_request(prompt_token_ids, output_token_ids, sampling)
        if any(s.request_id == request_id for q in (self.scheduler.waiting, self.scheduler.running) for s in q):
            raise RequestError(f"request {request_id} is already in the engine")
        tokens = list(prompt_token_ids) + list(output_token_ids)
        seq = Sequence(request_id, tokens, len(prompt_token_ids), sampling, prefill_only=self.config.prefill_only,
                       cache_salt=(cache_salt or "").encode(), export_prompt=export_prompt and kv_blocks is None)
        if sampling.prompt_logprobs is not None and kv_blocks is None and not output_token_ids:
            seq.prompt_logprobs = [None] * len(prompt_token_ids)
        if images:
            seq.images = [(int(o), int(n), str(h)) for o, n, h in images]
            if any(o < 0 or o + n > len(prompt_token_ids) for o, n, _ in seq.images):
                raise RequestError("an image's placeholder run lies outside the prompt")
            if image_embeds is not None:
                if len(image_embeds) != len(seq.images) or any(
                        e.shape[0] != n for e, (_, n, _) in zip(image_embeds, seq.images)):
                    raise RequestError("image embeddings do not match the images' placeholder runs")
                seq.image_embeds = list(image_embeds)
        if self.block_manager.enable_prefix_caching:
            # NOTE: the hash chain the scheduler computes anyway (cached on the sequence),
            # taken now so ``queued_prefill`` can see a waiting request's cached prefix.
            self.block_manager.hashes(seq)
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
            seq.num_computed_tokens = num_kv_tokens
            if self.kv.import_request_kv(seq, kv_blocks, num_exact_tokens):
                seq.status = RequestStatus.RUNNING
            else:  # no room now -> recompute from tokens when blocks free up
                seq.num_computed_tokens = 0
        if sampling.structured is not None:  # its grammar compiles on a pool thread meanwhile
            self.structured.add(request_id, sampling.structured, output_token_ids)
        self.scheduler.add(seq)

    def check_request(self, prompt_token_ids: list[int], output_token_ids: list[int] = (),
                      sampling: SamplingParams | None = None) -> None:
        """Raise RequestError unless the prompt is non-empty, every token id is in the
        vocabulary, prompt + output stay below ``max_model_len``, ``sampling.swa_replay``
        is None, "bounded" or "exact", ``sampling.prompt_logprobs`` is None or 0-``MAX_PROMPT_LOGPROBS``
        and ``sampling.structured`` is None or a spec llguidance supports
        (``structured.compile_grammar``, cached; pure: any thread)."""
        if not prompt_token_ids:
            raise RequestError("empty prompt")
        k = None if sampling is None else sampling.prompt_logprobs
        if k is not None and not 0 <= k <= MAX_PROMPT_LOGPROBS:
            raise RequestError(f"prompt_logprobs must be between 0 and {MAX_PROMPT_LOGPROBS}, got {k}")
        if sampling is not None and sampling.swa_replay not in (None, *SWA_MODES):
            raise RequestError(f"swa_replay must be one of {SWA_MODES}, not {sampling.swa_replay!r}")
        if sampling is not None and sampling.structured is not None:
            try:
                compile_grammar(sampling.structured)  # cached
            except StructuredOutputError as e:
                raise RequestError(str(e)) from None
        vocab = self.model_config.vocab_size
        tokens = list(prompt_token_ids) + list(output_token_ids)
        if any(not 0 <= t < vocab for t in tokens):
            raise RequestError(f"token ids must be in [0, {vocab})")
        if len(tokens) >= self.max_model_len:
            raise RequestError(f"{len(tokens)} tokens >= max model length {self.max_model_len}")

    def load_fields(self) -> dict:
        """``LoadReport`` fields of this engine now: queue, KV use, queued prefill compute, cost model,
        prefix-cache hits and paths, SWA state cache. Safe to call from another thread while the engine
        steps (counters and ``queued_prefill``; approximate)."""
        cm, bm = self.cost_model, self.block_manager
        queued_tokens, queued_s = self.queued_prefill()
        swa = self.kv.swa_cache
        return dict(active_requests=self.num_running, waiting_requests=self.num_waiting,
                    kv_tokens_used=self.kv.tokens_used, kv_tokens_capacity=self.kv.tokens_capacity,
                    peak_batch_size=self.peak_batch_size, steps=self.num_steps, queued_prefill_tokens=queued_tokens,
                    queued_prefill_s=queued_s, cost_a=cm.a, cost_b=cm.b, cost_d=cm.d, cost_e=cm.e,
                    step_time_budget_s=self.config.step_time_budget_s or 0.0, block_size=bm.block_size,
                    prefix_hit_tokens=bm.num_hit_tokens, prefix_queried_tokens=bm.num_queried_tokens,
                    engine=self.engine_kind, fingerprint=self.fingerprint, kv_block_bytes=self.block_bytes,
                    finished_requests=self.num_finished_requests, computed_tokens=self.num_computed_tokens_total,
                    busy_s=self.busy_s_total, prefix_paths=dict(bm.prefix_paths),
                    replayed_tokens=bm.num_replayed_tokens, swa_cache_bytes=swa.nbytes if swa else 0,
                    swa_cache_hits=swa.hits if swa else 0, swa_cache_misses=swa.misses if swa else 0,
                    max_model_len=self.max_model_len, max_num_seqs=self.config.max_num_seqs)


    def kv_connector(self, async_engine, store, io, index, async_store=None) -> TierConnector:
        """This engine's link to the storage tier for a worker service (``engine.kv_connector``):
        the connector reads and writes block files and moves them in and out of this engine."""
        return TierConnector(self, async_engine, store, io, index, async_store)

    def cached_prefix_blocks(self, hashes: list[str]) -> int:
        """How many leading ``hashes`` this engine's prefix cache holds now (a hint)."""
        return self.kv.cached_prefix_blocks(hashes)

    def load_prefix(self, hashes: list[str], blocks: torch.Tensor) -> int:
        """Storage-tier blocks into the prefix cache (``KVCacheManager.load_prefix``)."""
        return self.kv.load_prefix(hashes, blocks)

    # --- load -----------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_tokens_used(self) -> int:
        return self.kv.tokens_used

    @property
    def kv_tokens_capacity(self) -> int:
        return self.kv.tokens_capacity

    def queued_prefill(self) -> tuple[int, float]:
        """(tokens, predicted seconds) of prompt compute still queued here: over the
        waiting and running sequences, the tokens without KV beyond one decode token,
        priced by the cost model's ``piece_cost(n, c)`` (one piece per sequence; the
        per-step cost ``a`` and re-gathering across chunks are not included).

        A waiting sequence's context ``c`` is its prefix now in the prefix cache (its
        hash chain is taken at ``add_request``). Chunks already launched (a sequence's
        ``num_computed_tokens`` counts them at launch) are counted from their steps: the
        prefill pieces of a step not started yet in full, of the running one the part of
        its predicted time not elapsed yet; with async scheduling that is up to two steps
        of work the queues no longer show. NOTE: read-only and safe to call from
        another thread than the engine's (the load report does): it copies the queues
        and reads ints, hashes and dict membership only.
        """
        bm, cost = self.block_manager, self.cost_model
        tokens, seconds = 0, 0.0
        now = time.perf_counter()
        for step in list(self._launched):
            prefill = [(n, c) for n, c in step.pieces if n > 1]
            if not prefill:
                continue
            left = 1.0
            if step.started is not None:
                predicted = cost.predict(step.pieces)
                left = max(0.0, 1.0 - (now - step.started) / predicted) if predicted > 0 else 0.0
            tokens += round(left * sum(n for n, _ in prefill))
            seconds += left * sum(cost.piece_cost(n, c) for n, c in prefill)
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            total, c = len(seq), seq.num_computed_tokens
            reads_cache = bm.enable_prefix_caching and seq.prompt_logprobs is None
            if seq.status == RequestStatus.WAITING and not c and reads_cache:
                hashes = seq.block_hashes[: max(0, (total - 1) // bm.block_size)]
                hits = next((i for i, h in enumerate(hashes) if h not in bm.cached), len(hashes))
                c = hits * bm.block_size
            n = total - c
            if n <= 1 and seq.status == RequestStatus.RUNNING:  # decoding: no prefill left
                continue
            tokens += n
            seconds += cost.piece_cost(n, c)
        return tokens, seconds
