"""The engine: schedule -> execute -> update, one step at a time (vLLM v1 / nano-vllm).

A step takes the scheduler's sequences, runs one forward pass over all of
them, samples one token per sequence and returns ``StepOutput`` s. A
prefill-only engine (the prefill worker's) finishes every request after its
first token with reason ``"handoff"`` and exports the KV blocks of the prompt
so the caller can write them to the storage tier. A decode engine accepts
requests with imported KV (``add_request(..., kv_blocks=...)``) that go
straight into the running batch.

Hybrid sliding-window models (docs/architecture.md, "SWA bounded replay"): the
storage tier's blocks hold the full layers only (``load_prefix`` takes them);
the window layers' state of a prefix comes from the window pool, the host SWA
state cache (``swa_cache``, filled with each finished sequence's last window)
or a bounded replay (``hybrid_blocks``); ``StepOutput.prefix_path`` says which.

``step()`` runs one step synchronously. ``step_async()`` overlaps: the
forward pass and sampling of step t run on a forward thread while this
thread schedules and prepares step t+1 and hands off step t-1's outputs
(async scheduling, vLLM v1); ``step_gaps`` records the forward thread's idle
time between steps either way.
"""

from __future__ import annotations

import functools
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer import probe_cache
from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.hybrid_blocks import SWA_MODES, HybridBlockManager, WindowBlockManager
from deepinfer.engine.kv_connector import TierConnector
from deepinfer.engine.kv_layout import KVLayout
from deepinfer.engine.cost_model import StepCostModel, features
from deepinfer.engine.dtype_choice import Bf16WeightsChoice, choose_bf16_weight_rows, choose_dtype, time_linear_pass
from deepinfer.engine.model_runner import ModelRunner, StepInputs
from deepinfer.engine.sampler import SampleResult, sample
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import Sequence, SequenceStatus
from deepinfer.engine.spec_decode import SpecConfig, SpecDecoder
from deepinfer.engine.step_threads import StepThreads, choose_step_threads
from deepinfer.engine.structured import GrammarCompiler, StructuredOutputError, compile_grammar
from deepinfer.engine.swa_cache import SWAStateCache
from deepinfer.kernels import cpu_gemv
from deepinfer.kernels import select as kernel_select
from deepinfer.kvstore.hashing import model_fingerprint
from deepinfer.models.config import ModelConfig
from deepinfer.models.layers import Linear, tune_packed_rows
from deepinfer.models.loader import DTYPES, load_model
from deepinfer.models.moe import MoEBlock
from deepinfer.protocol import SamplingParams
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

# the process's intra-op threads before any engine switched them per step: an engine's default
DEFAULT_THREADS = torch.get_num_threads()

# (model dir, dtype, threads, OMP_WAIT_POLICY, GOMP_SPINCOUNT) -> the timed choice, once per process
_STEP_THREADS: dict[tuple, StepThreads] = {}


MAX_PROMPT_LOGPROBS = 20  # most likely tokens per prompt position (``SamplingParams.prompt_logprobs``)


class RequestError(ValueError):
    """A request the engine cannot take (too long, bad KV import); says why."""


@dataclass
class EngineConfig:
    """block_size: tokens per KV block. kv_cache_bytes: memory for the KV cache.
    max_model_len: None = the model's max_position_embeddings.
    step_time_budget_s: predicted compute per step that prefill chunks may fill
    (None = no time budget: whole prompts up to max_num_batched_tokens).
    calibrate: time a few forward passes at start-up to fit the step cost model.
    batch_invariant: a request's bits (logprobs, so seeded samples too) do not
    depend on the batch it shares, the prefix-cache state or how its prompt is
    chunked (``models.layers.Linear``, ``kernels.attention._per_sequence_attention``),
    for a given thread count; off by default on CPU because it roughly doubles
    batch-1 decode time there.
    dtype: weights and KV cache: "float32", "bfloat16", "float16", "bfloat16-weights"
    (weights rounded to bf16, fp32 activations and KV cache; decode-sized steps
    read bf16 copies of the linear weights) or "auto" (``engine.dtype_choice``:
    bf16 where this CPU's bf16 GEMMs clearly beat fp32 on the model's shapes,
    else bfloat16-weights where its start-up probe times faster, else fp32;
    resolved into this field).
    packed_weights: run linear layers from packed weights (CPU: MKL for fp32,
    oneDNN for bf16; one extra copy of the weights, 1.2-5x faster GEMMs at decode batch sizes), up to
    the rows where packed GEMM stops being faster, measured per weight shape at
    start-up (``models.layers.tune_packed_rows``) unless ``batch_invariant``.
    async_scheduling: workers drive the engine with ``step_async`` (schedule
    step t+1 while step t runs) instead of ``step``.
    swa_replay: hybrid sliding-window models, a cached prefix whose window state
    is gone: "bounded" (replay its last W tokens) or "exact"
    (recompute it); a request's ``SamplingParams.swa_replay`` overrides it.
    swa_cache_bytes: host memory for the SWA state cache (window layers' KV of
    recently finished prefixes; 0 = none).
    speculative: speculative decoding (``engine.spec_decode.SpecConfig``; None = off).
    Decode engines only (ignored when ``prefill_only``); steps then run synchronously
    (``async_scheduling`` is turned off: the next step's positions depend on how many
    drafts this one accepts); not on hybrid sliding-window models (ValueError).
    kernels: "auto", "torch" or "triton" (``kernels.select``; None = env
    DEEPINFER_KERNELS, else auto: Triton where the model is on CUDA, the torch
    reference otherwise). ValueError where "triton" cannot run.
    single_thread_max_tokens: steps feeding at most this many tokens run on one intra-op
    thread, larger ones on all (``engine.step_threads``; 0 = every step on all threads);
    None = timed at start-up on dummy steps of the model. Batch-invariant engines use 0."""

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
    async_scheduling: bool = True
    swa_replay: str = "bounded"
    swa_cache_bytes: int = 256 << 20
    speculative: SpecConfig | None = None
    kernels: str | None = None
    single_thread_max_tokens: int | None = None


@dataclass
class StepOutput:
    """What one step produced for one request.

    new_token_ids: tokens sampled this step (empty for an abort).
    kv_blocks: from a prefill-only engine, when its request finishes:
    [n, layers, 2, block_size, kv_heads, head_dim] covering the first
    ``num_kv_tokens`` tokens (the prompt): for ``"handoff"`` all of them, last
    block partial; when the first token already ended the request ("stop",
    "length") only the whole blocks (to store for reuse; None if there are none).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    kv_blocks: torch.Tensor | None = None
    num_kv_tokens: int = 0
    kv_first_block: int = 0  # ``add_request(export_prompt=True)``: the prompt block ``kv_blocks[0]`` is
    num_cached_tokens: int = 0
    logprobs: list | None = None  # [TokenLogprobs] per new token, when the request asked
    # how the prompt's cached prefix was reused (``Sequence.prefix_path``) and prefix tokens replayed
    prefix_path: str = ""
    num_replayed_tokens: int = 0
    # of ``kv_blocks``: leading blocks whose KV equals a cold run's (storable under their prefix
    # hash; fewer than all after a bounded replay), and the first block whose window layers hold
    # KV (hybrid models: earlier ones were released, zeros)
    num_exact_blocks: int = 0
    first_window_block: int = 0
    # speculative decoding, since the request started: draft tokens verified / accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # a prefill-only engine's finished request: ``Sequence.chunk_times`` (its prompt's steps)
    chunk_times: list = field(default_factory=list)
    # with the request's first token, when it asked (``SamplingParams.prompt_logprobs``): one entry
    # per prompt token, None for the first, else its ``TokenLogprobs``
    prompt_logprobs: list | None = None

    def wire_logprobs(self) -> list | None:
        """``TokenChunk.logprobs`` form: per token ``[logprob, [[token_id, logprob], ...]]``."""
        if self.logprobs is None:
            return None
        return [lp.to_wire() for lp in self.logprobs]

    def wire_prompt_logprobs(self) -> list | None:
        """``TokenChunk.prompt_logprobs`` form: None, then per prompt token
        ``[logprob, [[token_id, logprob], ...]]``."""
        if self.prompt_logprobs is None:
            return None
        return [None if lp is None else lp.to_wire() for lp in self.prompt_logprobs]


@dataclass
class _Step:
    """A launched step: its sequences, inputs, (tokens, context) pieces for the
    cost model, and the indices of the sequences that sample a token."""

    seqs: list[Sequence]
    inputs: StepInputs
    pieces: list[tuple[int, int]]
    sampling: list[int]
    started: float | None = None  # perf_counter when its forward pass began (None: not yet)
    ended: float | None = None  # perf_counter when it ended


class LLMEngine:
    engine_kind = "native"  # what load reports call this engine (``engine.mock.MockEngine``: "mock")
    spec: SpecDecoder | None = None  # speculative decoding (``EngineConfig.speculative``)
    step_threads: StepThreads | None = None  # intra-op threads per step (None: left as they are)

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        # NOTE: not ``torch.get_num_threads()`` now: an earlier engine in this process may have left
        # it at one thread (``step_threads`` switches per step), and a batch-invariant engine's bits
        # depend on its thread count
        torch.set_num_threads(config.num_threads or DEFAULT_THREADS)
        # the bf16-weights kernel reads weights on every thread, also in steps run on one intra-op thread
        cpu_gemv.set_threads(config.num_threads or DEFAULT_THREADS)
        self.model_dir = Path(model_dir)  # its tokenizer compiles structured-output grammars
        self.dtype_choice = choose_dtype(ModelConfig.from_dir(model_dir), config.dtype, config.batch_invariant)
        requested = config.dtype
        if requested == "auto":
            log.info("dtype chosen", **self.dtype_choice.log_fields())
        config.dtype = self.dtype_choice.dtype
        self.model, self.model_config = load_model(model_dir, config.dtype)
        linears = [m for m in self.model.modules() if isinstance(m, Linear)]
        for module in self.model.modules():
            if isinstance(module, (Linear, MoEBlock)):
                module.batch_invariant = config.batch_invariant
            if isinstance(module, Linear) and config.packed_weights:
                module.pack()
        if config.packed_weights and not config.batch_invariant:  # (batch-invariant mode stays packed)
            tune_packed_rows(linears)
        self.bf16_weights: Bf16WeightsChoice | None = None
        # (batch-invariant mode stays on the packed GEMM: the kernel's sums depend on the rows per call)
        try_kernel = config.dtype == "bfloat16" or (requested == "auto" and config.dtype == "float32")
        if config.dtype == "bfloat16-weights" or (try_kernel and not config.batch_invariant):
            self._choose_bf16_weights(linears)
        self.kernels = kernel_select.resolve(config.kernels, next(self.model.parameters()).device)
        kernel_select.use(self.model, self.kernels)
        dtype = DTYPES[config.dtype]
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.fingerprint = model_fingerprint(model_dir, config.dtype, config.block_size)
        windows = [a.sliding_window for a in self.model.attention_layers]
        num_window_layers = sum(w is not None for w in windows)
        self.swa_cache: SWAStateCache | None = None
        if config.swa_replay not in SWA_MODES:
            raise ValueError(f"swa_replay must be one of {SWA_MODES}, not {config.swa_replay!r}")
        if 0 < num_window_layers < len(windows):  # hybrid: window layers keep only the window's blocks
            # NOTE: the storage tier's blocks of a hybrid model hold the full layers only: a layout of
            # its own, so it gets a fingerprint (directory) of its own too.
            self.fingerprint = model_fingerprint(model_dir, config.dtype, config.block_size, layout="full-layers")
            if config.enable_prefix_caching and config.swa_cache_bytes > 0:
                self.swa_cache = SWAStateCache(config.swa_cache_bytes)
            window = max(w for w in windows if w is not None)
            num_full_layers = len(windows) - num_window_layers
            self.block_bytes = ModelRunner.block_bytes(mc, config.block_size, dtype, num_full_layers)
            window_block_bytes = ModelRunner.block_bytes(mc, config.block_size, dtype, num_window_layers)
            # Split the bytes by what a decoding sequence at max length holds: every block in
            # the full layers, W + one block of tokens in the window layers. The window pool
            # gets at least what one sequence's largest step needs (W + a full chunk), so a
            # lone sequence can always progress.
            held = window + config.block_size
            share = num_window_layers * held / (num_window_layers * held + num_full_layers * self.max_model_len)
            num_blocks = max(2, int(config.kv_cache_bytes * (1 - share)) // self.block_bytes)
            step_blocks = -(-min(window + config.max_num_batched_tokens, self.max_model_len) // config.block_size) + 1
            num_window_blocks = max(step_blocks, int(config.kv_cache_bytes * share) // window_block_bytes)
            self.block_manager = HybridBlockManager(
                num_blocks, config.block_size,
                WindowBlockManager(num_window_blocks, config.block_size, window, self.fingerprint,
                                   config.enable_prefix_caching),
                self.fingerprint, config.enable_prefix_caching, self.swa_cache, config.swa_replay)
        else:
            self.block_bytes = ModelRunner.block_bytes(mc, config.block_size, dtype)
            num_blocks, num_window_blocks = max(2, config.kv_cache_bytes // self.block_bytes), 0
            self.block_manager = BlockManager(num_blocks, config.block_size, self.fingerprint,
                                              config.enable_prefix_caching)
        self.runner = ModelRunner(self.model, config.block_size, num_blocks, dtype, config.batch_invariant,
                                  num_window_blocks)
        # a sequence longer than the KV cache could never finish: cap it (it ends with "length")
        self.max_model_len = min(self.max_model_len, num_blocks * config.block_size)
        self.step_threads = self._choose_step_threads()
        self._init_scheduling(mc.eos_token_ids)
        if config.speculative is not None and not config.prefill_only:
            if num_window_blocks:
                raise ValueError("speculative decoding is not supported on hybrid sliding-window models")
            config.async_scheduling = False
            self.spec = SpecDecoder(config.speculative, self)

    @torch.inference_mode()
    def _choose_bf16_weights(self, linears: list[Linear]) -> None:
        """Decode-sized steps read the linear weights as bf16 through ``kernels.cpu_gemv``
        (``dtype_choice``) where the start-up probe times them faster: asked for
        ("bfloat16-weights": the weights are rounded already); tried under ``--dtype auto`` when it
        kept fp32 (then the weights are rounded once chosen, and the dtype becomes
        "bfloat16-weights"); for a bf16 model, against oneDNN's bf16 GEMM (the weights as they are).
        Logged as ``bf16 weights chosen``."""
        dtype = self.config.dtype
        if not all([layer.keep_bf16_weight() for layer in linears]):
            for layer in linears:
                layer.weight_bf16 = layer.bias_f32 = None
            log.info("bf16 weights chosen", bf16_weights_max_rows=0,
                     reason=f"no bf16-weights kernel here: {cpu_gemv.unavailable_reason() or 'not a CPU model'}")
            return
        time_pass = functools.partial(time_linear_pass, linears)
        self.bf16_weights = choice = (choose_bf16_weight_rows(time_pass, baseline="bf16 GEMM", first_max_ratio=1.0)
                                      if dtype == "bfloat16" else choose_bf16_weight_rows(time_pass))
        log.info("bf16 weights chosen", **choice.log_fields())
        if not choice.max_rows:
            for layer in linears:
                layer.weight_bf16 = layer.bias_f32 = None
            return
        if dtype == "float32":  # auto: round the fp32 weights to the copies' values (in place: tied weights stay tied)
            for p in self.model.parameters():
                if p.is_floating_point():
                    p.copy_(p.to(torch.bfloat16))
            for layer in linears:
                if layer.packed is not None:
                    layer.pack()  # of the rounded values
            self.config.dtype = "bfloat16-weights"
        for layer in linears:
            layer.bf16w_max_rows = choice.max_rows
            if layer.packed_max_rows <= choice.max_rows:
                layer.packed = None  # every step it would serve reads the bf16 weights: its memory back

    def _init_scheduling(self, eos_token_ids: list[int]) -> None:
        """The model-independent part: cost model, scheduler, counters, optional calibration
        (needs ``config``, ``block_manager``, ``runner`` and ``max_model_len`` set)."""
        config = self.config
        self.cost_model = StepCostModel()
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, eos_token_ids, self.cost_model,
                                   config.step_time_budget_s, min_chunk=config.block_size)
        self.generators: dict[str, torch.Generator] = {}
        self.grammars: GrammarCompiler | None = None  # structured output, made by the first such request
        self.peak_batch_size = 0
        self.num_steps = 0
        self.num_computed_tokens_total = 0  # tokens fed through the model (not cache hits)
        self.last_step_s = 0.0  # forward time of the last step (s)
        self.busy_s_total = 0.0  # forward time of all steps (s)
        self.num_finished_requests = 0  # finished or handed off
        # forward-thread idle time between consecutive steps' forward passes (s)
        self.step_gaps: deque[float] = deque(maxlen=4096)
        self.num_overlapped_steps = 0  # steps scheduled while the previous one ran
        self._forward_end: float | None = None
        self._inflight: tuple[_Step, Future] | None = None
        self._launched: deque[_Step] = deque()  # launched, not finished (for queued_prefill)
        self._failed: list[StepOutput] = []  # requests ended at scheduling, returned with the next outputs
        self._pool: ThreadPoolExecutor | None = None
        if config.calibrate:
            self.calibrate()

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
            seq.num_computed_tokens = num_kv_tokens  # (window pools allocate only the window)
            if self.block_manager.can_allocate(seq, len(tokens)):
                self.block_manager.allocate(seq, len(tokens))
                if num_exact_tokens is not None and num_exact_tokens < num_kv_tokens:
                    seq.num_exact_tokens = num_exact_tokens
                if self._pool is not None:  # after the running step, which may still read released blocks
                    self._pool.submit(self.runner.write_blocks, seq, kv_blocks).result()
                else:
                    self.runner.write_blocks(seq, kv_blocks)
                seq.status = SequenceStatus.RUNNING
            else:  # no room now -> recompute from tokens when blocks free up
                seq.num_computed_tokens = 0
        if sampling.structured is not None:  # its grammar compiles on a pool thread meanwhile
            if self.grammars is None:
                self.grammars = GrammarCompiler(self.model_dir, self.model_config.vocab_size,
                                                self.model_config.eos_token_ids)
            seq.matcher = self.grammars.matcher(sampling.structured, list(output_token_ids))
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
        swa = getattr(self, "swa_cache", None)
        return dict(active_requests=self.num_running, waiting_requests=self.num_waiting,
                    kv_tokens_used=self.kv_tokens_used, kv_tokens_capacity=self.kv_tokens_capacity,
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
        """How many leading ``hashes`` this engine's prefix cache holds now (a hint: may
        change before the request is scheduled)."""
        n = 0
        while n < len(hashes) and hashes[n] in self.block_manager.cached:
            n += 1
        return n

    def load_prefix(self, hashes: list[str], blocks: torch.Tensor) -> int:
        """Put KV blocks loaded from the storage tier into the prefix cache, so the
        next request with this prefix hits them (the storage tier is the prefix
        cache's second level).

        hashes: chained prefix hashes of consecutive full blocks (the first may
        follow blocks already cached here); blocks: [n, num_layers, 2,
        block_size, num_kv_heads, head_dim] (``read_blocks``' layout) or, for
        hybrid sliding-window models, the storage tier's [n, num_full_layers,
        ...] (``kv_layout``): only the full layers' KV is loaded, the window
        layers' state is found or rebuilt when a request hits these blocks.
        Blocks whose hash is cached already are skipped; they wait,
        unreferenced, at the tail of the LRU free queue. Returns how many were
        inserted. Raises ValueError for blocks of another layer count.
        """
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return 0
        layout = self.kv_layout
        if layout.hybrid and blocks.shape[1] == layout.num_layers:
            blocks = blocks[:, layout.full_layers]
        if blocks.shape[1] != len(layout.full_layers):
            raise ValueError(f"blocks of {blocks.shape[1]} layers, expected {len(layout.full_layers)}")
        todo = [(h, i) for i, h in enumerate(hashes) if h not in bm.cached][: max(0, bm.num_free_blocks - 1)]
        if not todo:
            return 0
        ids = [bm._take_free() for _ in todo]
        if layout.hybrid:
            write = functools.partial(self.runner.write_full_blocks, ids, blocks[[i for _, i in todo]])
        else:
            tmp = Sequence("__load_prefix", [0], 1, SamplingParams(max_tokens=1))
            tmp.block_table = ids
            write = functools.partial(self.runner.write_blocks, tmp, blocks[[i for _, i in todo]])
        if self._pool is not None:  # after the running step, which may still read these blocks
            self._pool.submit(write).result()
        else:
            write()
        for block_id, (h, _) in zip(ids, todo):
            bm.blocks[block_id].block_hash = h
            bm.cached[h] = block_id
            bm._release(block_id)  # unreferenced, hashed: joins the free queue's tail
        return len(todo)

    def fail_all(self) -> list[Sequence]:
        """After a step raised: drop every request (queued, running, or in a launched step, even
        one that step had already finished) and free all their KV blocks. Returns the dropped
        sequences (finish reason "error"); the engine is then empty and usable."""
        seqs = {id(s): s for s in (*self.scheduler.waiting, *self.scheduler.running)}
        if self._inflight is not None:
            step, future = self._inflight
            self._inflight = None
            try:  # let the forward thread finish writing before the blocks are reused
                future.result()
            except BaseException:  # noqa: BLE001 - failing anyway
                pass
            self._launched.append(step)
        for step in self._launched:
            seqs.update((id(s), s) for s in step.seqs)
        self._launched.clear()
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        for seq in seqs.values():
            seq.num_inflight_steps = seq.num_inflight_tokens = 0
            if seq.block_table:
                self.block_manager.free(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
            seq.matcher = None
            self.generators.pop(seq.request_id, None)
        return list(seqs.values())

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its KV blocks; False if it is not here."""
        self.generators.pop(request_id, None)
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            seq.matcher = None
        return seq is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def between_steps(self, fn, *args):
        """``fn(*args)`` where no forward pass runs: at once in synchronous mode, else on the
        forward thread after the step in flight (its result or exception). Call it from the
        thread that steps the engine (``AsyncEngine.call``), so no step starts meanwhile; used
        to read and reset counters and to change weights (``models.moe`` placements)."""
        if self._pool is None:
            return fn(*args)
        return self._pool.submit(fn, *args).result()

    # --- the step ------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One synchronous step: schedule, prepare, forward + sample, update."""
        if self._inflight is not None:  # coming from step_async: collect that step first
            return self._collect(None)
        t0 = time.perf_counter()
        step = self._launch(can_preempt=True)
        if step is None:
            return self._take_failed()
        try:
            result = self._execute(step)
        except BaseException:
            self._drop(step)  # so aborting its sequences frees their blocks
            raise
        outputs = self._finish(step, result)
        if self.spec is not None:  # what a step costs besides its forward pass (drafting, sampling, ...)
            self.spec.observe_overhead(time.perf_counter() - t0 - self.last_step_s)
        return outputs

    def step_async(self) -> list[StepOutput]:
        """One iteration of the overlapped loop (async scheduling, vLLM v1).

        Schedules and prepares step t+1 while step t runs on the forward
        thread, then waits for step t, applies its tokens, launches step t+1 and
        returns step t's outputs (so the caller hands them off while t+1 runs).
        Call until ``has_unfinished()`` is False. Exceptions of the forward pass
        are raised here, with the launched steps' bookkeeping undone.
        """
        nxt = self._launch(can_preempt=self._inflight is None)
        if self._inflight is None:
            if nxt is not None:
                self._inflight = (nxt, self._forward_pool().submit(self._execute, nxt))
            return self._take_failed()
        return self._collect(nxt)

    def _collect(self, nxt: "_Step | None") -> list[StepOutput]:
        step, future = self._inflight
        self._inflight = None
        try:
            result = future.result()
        except BaseException:
            for s in (step, nxt):
                if s is not None:
                    self._drop(s)
            raise
        outputs = self._finish(step, result)
        if nxt is not None:
            self.num_overlapped_steps += 1
            self._inflight = (nxt, self._forward_pool().submit(self._execute, nxt))
        return outputs

    def _forward_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        return self._pool

    def _launch(self, can_preempt: bool) -> "_Step | None":
        """Schedule the next step, build its inputs and advance its sequences."""
        seqs = self._drop_unrecomputable(self.scheduler.schedule(can_preempt))
        if not seqs:
            self._forward_end = None  # idle: the next gap is not an inter-step gap
            return None
        if self.spec is not None:
            self.spec.plan(seqs, self.config.max_num_batched_tokens - sum(s.num_scheduled_tokens for s in seqs))
        pieces = [(s.num_scheduled_tokens, s.num_computed_tokens) for s in seqs]
        inputs = self.runner.prepare(seqs)
        if any(s.window_restore for s in seqs):
            inputs.window_restores = self._take_window_restores(seqs)
        sampling = self.scheduler.advance(seqs)
        self.num_steps += 1
        self.num_computed_tokens_total += sum(n for n, _ in pieces)
        self.peak_batch_size = max(self.peak_batch_size, len(seqs))
        step = _Step(seqs, inputs, pieces, sampling)
        self._launched.append(step)
        return step

    def _drop_unrecomputable(self, seqs: list[Sequence]) -> list[Sequence]:
        """``seqs`` less those that would feed image placeholder rows without the images'
        embeddings (a decode worker imports a multimodal prompt's KV without them; if
        preemption drops that KV it cannot recompute it): each of those ends alone with
        "error" (its output comes with the next step's) instead of failing the step."""
        keep = []
        for s in seqs:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens
            if s.images and s.image_embeds is None and any(max(start, o) < min(end, o + n) for o, n, _ in s.images):
                self.scheduler.abort(s.request_id)
                s.finish_reason = "error"
                self._failed.append(StepOutput(s.request_id, [], "error", s.num_prompt_tokens))
                log.error("image_rows_without_embeddings", request_id=s.request_id)
            else:
                keep.append(s)
        return keep

    def _take_failed(self) -> list[StepOutput]:
        failed, self._failed = self._failed, []
        return failed

    def _take_window_restores(self, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor]:
        """The SWA state cache's blocks for the window blocks newly admitted sequences
        restore (written by the runner on the forward thread, after the running step)."""
        ids, blocks = [], []
        for seq in seqs:
            for block_id, block_hash in seq.window_restore:
                block = self.swa_cache.get(block_hash)
                # NOTE: planned in this same schedule; only a finishing sequence's put evicts
                assert block is not None, "SWA state cache entry evicted between plan and launch"
                ids.append(block_id)
                blocks.append(block)
            seq.window_restore = []
        return ids, torch.stack(blocks)

    def _save_window_state(self, seq: Sequence) -> int:
        """Copy a finished sequence's window state (the window layers' blocks a query
        right after its last whole computed block can see) into the SWA state cache,
        unless it is approximate (``num_exact_tokens``). Returns the blocks added."""
        cache, bm = self.swa_cache, self.block_manager
        if cache is None or seq.num_exact_tokens is not None or not seq.window_block_table:
            return 0
        hashes = bm.hashes(seq)
        k = min(min(seq.num_computed_tokens, len(seq.token_ids)) // bm.block_size, len(hashes))
        table = seq.window_block_table
        todo = [i for i in range(bm.window.first_needed_block(k * bm.block_size), k) if hashes[i] not in cache]
        if not todo or any(table[i] == -1 for i in todo):
            return 0
        for i in todo:  # one tensor per block, so evicting one frees its memory
            cache.put(hashes[i], self.runner.read_window_blocks([table[i]])[0])
        return len(todo)

    def _execute(self, step: "_Step") -> SampleResult:
        """Forward pass and sampling (on the forward thread in async mode)."""
        self.runner.fill(step.inputs)
        if self.step_threads is not None:  # (this thread's OpenMP team size)
            torch.set_num_threads(self.step_threads.threads_for(sum(n for n, _ in step.pieces)))
        t0 = step.started = time.perf_counter()
        if self._forward_end is not None:
            self.step_gaps.append(t0 - self._forward_end)
        logits = self.runner.execute(step.inputs)
        step.ended = time.perf_counter()
        self.last_step_s = step.ended - t0
        self.busy_s_total += self.last_step_s
        self.cost_model.observe(step.pieces, self.last_step_s)
        if self.spec is not None:
            self.spec.observe_step(step.seqs, step.pieces, self.last_step_s)
        if self.spec is not None and any(s.draft_token_ids for s in step.seqs):
            result = self.spec.verify(logits, step.seqs, step.sampling, self.generators,
                                      self.model_config.eos_token_ids)
        else:
            seqs = [step.seqs[i] for i in step.sampling]
            result = sample(logits[step.sampling], seqs, [self.generators.get(s.request_id) for s in seqs],
                            self.model_config.eos_token_ids)
        result.prompt_logprobs = step.inputs.prompt_logprobs
        self._forward_end = time.perf_counter()
        return result

    def _drop(self, step: "_Step") -> None:
        """Undo ``advance`` of a step that never came back (its forward pass failed)."""
        self._forget_launched(step)
        for i, seq in enumerate(step.seqs):
            seq.num_inflight_steps -= 1
            if i in step.sampling:
                seq.num_inflight_tokens -= 1

    def _forget_launched(self, step: "_Step") -> None:
        try:
            self._launched.remove(step)
        except ValueError:
            pass

    def _finish(self, step: "_Step", result: SampleResult) -> list[StepOutput]:
        """Apply a step's sampled tokens; outputs for sequences still live; free finished ones.
        (The step leaves ``_launched`` only at the end: if this raises, ``fail_all`` finds it.)"""
        sampled = dict(zip(step.sampling, result.token_ids))
        logprobs = dict(zip(step.sampling, result.logprobs))
        live = {i for i in sampled if step.seqs[i].status != SequenceStatus.FINISHED}
        for seq, first, entries in result.prompt_logprobs:
            if seq.prompt_logprobs is not None:  # (None: aborted meanwhile)
                seq.prompt_logprobs[first + 1 : first + 1 + len(entries)] = entries
        finished = {id(s) for s in self.scheduler.update(step.seqs, sampled)}
        self._advance_matchers(step.seqs)
        self.num_finished_requests += len(finished)
        outputs = []
        for i, seq in enumerate(step.seqs):
            if seq.prefill_only and step.ended is not None:
                seq.chunk_times.append((step.started, step.ended, step.pieces[i][0]))
            if i in live:
                toks, lps = sampled[i], logprobs[i]
                if not isinstance(toks, list):  # one token (a speculative step gives lists)
                    toks, lps = [toks], None if lps is None else [lps]
                out = StepOutput(seq.request_id, toks, seq.finish_reason, seq.num_prompt_tokens,
                                 num_cached_tokens=seq.num_cached_tokens,
                                 logprobs=None if lps is None else lps[:len(toks)],
                                 prefix_path=seq.prefix_path, num_replayed_tokens=seq.num_replayed_tokens,
                                 num_draft_tokens=seq.num_draft_tokens,
                                 num_accepted_tokens=seq.num_accepted_tokens)
                if seq.prompt_logprobs is not None:  # the first token: the prompt is all computed
                    out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
                if id(seq) in finished and seq.prefill_only:
                    out.chunk_times = seq.chunk_times
                    self._export_kv(seq, out)
                elif seq.export_prompt:
                    self._export_prompt(seq, out)
                outputs.append(out)
            if seq.status == SequenceStatus.FINISHED and not seq.num_inflight_steps and seq.block_table:
                self._save_window_state(seq)
                self.block_manager.free(seq)
                self.generators.pop(seq.request_id, None)
        self._forget_launched(step)
        return self._take_failed() + outputs

    def _advance_matchers(self, seqs: list[Sequence]) -> None:
        """Structured output, after ``scheduler.update``: each running sequence's matcher consumes
        the output tokens appended since it last did (``matcher.num_tokens`` counts them); a
        finished sequence's matcher is dropped. A token the grammar refuses, or a grammar that
        failed to build, ends the request with "error" (a bug, never a silent bad output); a
        complete grammar ends an ``ignore_eos`` request with "stop" (nothing else may follow)."""
        for seq in seqs:
            m = seq.matcher
            if m is None:
                continue
            if seq.status == SequenceStatus.FINISHED:
                seq.matcher = None
                continue
            new = seq.output_token_ids[m.num_tokens:]
            if new and not m.accept(new):
                log.error("structured_output_failed", request_id=seq.request_id, error=m.error)
                self.scheduler.abort(seq.request_id)  # frees its blocks unless a launched step holds them
                self.generators.pop(seq.request_id, None)
                seq.finish_reason, seq.matcher = "error", None
            elif seq.sampling.ignore_eos and m.is_terminated:  # complete: EOS would not stop it, so stop here
                self.scheduler.abort(seq.request_id)
                self.generators.pop(seq.request_id, None)
                seq.finish_reason, seq.matcher = "stop", None

    def _export_kv(self, seq: Sequence, out: StepOutput) -> None:
        """A prefill-only engine's finished prompt: its KV blocks into ``out`` (see ``StepOutput``).
        A handoff gets every block (the last one partial); a request its first token ended gets
        its whole, exact blocks only (they are for the storage tier)."""
        bs = self.config.block_size
        out.num_kv_tokens = len(seq.token_ids) - 1
        n = -(-out.num_kv_tokens // bs) if seq.finish_reason == "handoff" else out.num_kv_tokens // bs
        exact = n if seq.num_exact_tokens is None else min(n, seq.num_exact_tokens // bs)
        if seq.finish_reason != "handoff":
            n = exact
        if not n:
            return
        out.kv_blocks = self.runner.read_blocks(seq, n)
        out.num_exact_blocks = exact
        if self.kv_layout.hybrid:
            out.first_window_block = next((i for i, b in enumerate(seq.window_block_table[:n]) if b != -1), n)

    def _export_prompt(self, seq: Sequence, out: StepOutput) -> None:
        """``add_request(export_prompt=True)``: the prompt's full, exact blocks past its cached
        prefix into ``out`` (``kv_blocks`` [n, num_layers, 2, block_size, kv_heads, head_dim],
        the first of them block ``kv_first_block`` of the prompt), once."""
        seq.export_prompt = False
        bs = self.config.block_size
        exact = seq.num_prompt_tokens if seq.num_exact_tokens is None else min(seq.num_prompt_tokens,
                                                                               seq.num_exact_tokens)
        first, n = seq.num_cached_tokens // bs, exact // bs
        if first < n:
            out.kv_blocks = self.runner.read_blocks(seq, n, start=first)
            out.kv_first_block = first
            out.num_exact_blocks = n - first

    # --- cost model ---------------------------------------------------------------
    def calibrate(self) -> None:
        """Fit the step cost model from a few timed forward passes on dummy sequences.

        Shapes: prefills of 16..256 tokens at contexts 0..2048, decode batches
        of 1..16 at contexts 128..1024 (a few seconds of compute on 2 CPU cores).
        The first shape runs twice; its first run (warm-up) is not recorded.
        """
        shapes = [[(16, 0)], [(16, 0)], [(64, 0)], [(256, 0)], [(64, 1024)], [(128, 512)], [(256, 2048)],
                  [(1, 128)], [(1, 1024)] * 8, [(1, 256)] * 16, [(1, 512)] * 4]
        key = [*self._probe_key(), self.step_threads.single_max_tokens]
        warmed = False

        def measure(pieces: list[tuple[int, int]]) -> float | None:
            nonlocal warmed
            if not warmed:  # the first timed step of a process warms up, once
                self._time_dummy_step(shapes[0])
                warmed = True
            return self._time_dummy_step(pieces)

        for pieces in shapes[1:]:  # (each timed once per machine and settings: ``probe_cache``)
            seconds = probe_cache.measured("calibrate", [*key, pieces], lambda: measure(pieces))
            if seconds is not None:
                self.cost_model.samples.append((features(pieces), seconds))
        if len(self.cost_model.samples) >= 3:
            self.cost_model.fit()

    def _probe_key(self) -> list:
        """What a dummy step's time depends on besides the machine (``probe_cache``)."""
        cfg = self.config
        bf16w_rows = max((m.bf16w_max_rows for m in self.model.modules() if isinstance(m, Linear)), default=0)
        return [self.fingerprint, cfg.dtype, cfg.block_size, cfg.batch_invariant, cfg.packed_weights,
                str(self.kernels), bf16w_rows]

    def _time_dummy_step(self, pieces: list[tuple[int, int]], threads: int | None = None) -> float | None:
        """Seconds of one forward pass feeding ``pieces`` [(new tokens, context tokens)], one dummy
        sequence each, on ``threads`` intra-op threads (default: ``step_threads``' choice for
        the step); None when they do not fit the KV cache or ``max_model_len``."""
        seqs = []
        for i, (n, c) in enumerate(pieces):
            seq = Sequence(f"__calibrate_{i}", [0] * (c + n), c + n, SamplingParams(max_tokens=1))
            if c + n > self.max_model_len or not self.block_manager.can_allocate(seq, c + n):
                break
            self.block_manager.allocate(seq, c + n)
            seq.num_computed_tokens, seq.num_scheduled_tokens = c, n
            seqs.append(seq)
        seconds = None
        if len(seqs) == len(pieces):
            torch.set_num_threads(threads or self.step_threads.threads_for(sum(n for n, _ in pieces)))
            t0 = time.perf_counter()
            self.runner.run(seqs)
            seconds = time.perf_counter() - t0
            torch.set_num_threads(self.step_threads.max_threads)
        for seq in seqs:
            self.block_manager.free(seq)
        return seconds

    def _choose_step_threads(self) -> StepThreads:
        """``EngineConfig.single_thread_max_tokens``, or (None) timed on dummy steps: decode batches
        at context 128 (``step_threads.choose_step_threads``; once per process for a model, dtype,
        thread count and wait policy)."""
        cfg, threads = self.config, torch.get_num_threads()
        if cfg.single_thread_max_tokens is not None or cfg.batch_invariant:  # (a row's bits may depend on threads)
            return StepThreads(threads, cfg.single_thread_max_tokens or 0, reason="configured")
        key = (str(self.model_dir), cfg.dtype, threads, os.environ.get("OMP_WAIT_POLICY"),
               os.environ.get("GOMP_SPINCOUNT"))
        if key not in _STEP_THREADS:
            def measure(n: int, t: int) -> float:
                pieces = [(1, 128)] * n
                times = [self._time_dummy_step(pieces, t) for _ in range(4)][1:]  # the first warms up
                return float("inf") if None in times else min(times)  # inf: the batch does not fit

            def time_step(n: int, t: int) -> float:
                return probe_cache.measured("step", [*self._probe_key(), n, t], lambda: measure(n, t))
            self.step_threads = StepThreads(threads)
            _STEP_THREADS[key] = choose_step_threads(time_step, threads)
            log.info("step threads chosen", **_STEP_THREADS[key].log_fields())
        return _STEP_THREADS[key]

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
            if seq.status == SequenceStatus.WAITING and not c and reads_cache:
                hashes = seq.block_hashes[: max(0, (total - 1) // bm.block_size)]
                hits = next((i for i, h in enumerate(hashes) if h not in bm.cached), len(hashes))
                c = hits * bm.block_size
            n = total - c
            if n <= 1 and seq.status == SequenceStatus.RUNNING:  # decoding: no prefill left
                continue
            tokens += n
            seconds += cost.piece_cost(n, c)
        return tokens, seconds
