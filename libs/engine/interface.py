"""What every engine backend is to the worker services: the ``Engine`` protocol, its
configuration, the output of a step and the error for a request it refuses.

Three engines implement ``Engine``: ``LLMEngine`` (this project's model runner),
``MockEngine`` (the same scheduler and KV cache with no model) and ``VllmEngine`` (vLLM's
engine core in process). A worker service drives any of them the same way: ``check_request``
before accepting, ``add_request``, ``step`` (the native and mock engines also ``step_async``,
when ``config.async_scheduling``) until ``has_unfinished`` is False, ``abort`` on cancellation, ``fail_all`` after a step raised; it moves KV to and from the
storage tier only through ``kv_connector`` and reports load from ``load_fields``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from deepinfer.protocol import SamplingParams

if TYPE_CHECKING:
    import torch

    from deepinfer.engine.spec_decode import SpecConfig

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

    @classmethod
    def of(cls, seq, token_ids: list[int], logprobs: list | None) -> "StepOutput":
        """A live sequence's (``engine.sequence.Sequence``) output of a step: ``token_ids`` and their
        ``logprobs``, with its finish reason, prefix reuse and speculative decoding counts."""
        return cls(seq.request_id, token_ids, seq.finish_reason, seq.num_prompt_tokens,
                   num_cached_tokens=seq.num_cached_tokens, logprobs=logprobs, prefix_path=seq.prefix_path,
                   num_replayed_tokens=seq.num_replayed_tokens, num_draft_tokens=seq.num_draft_tokens,
                   num_accepted_tokens=seq.num_accepted_tokens)

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


@runtime_checkable
class Engine(Protocol):
    """One worker's engine (vLLM v1's ``EngineCoreClient`` surface, single process).

    Not thread-safe: one thread adds, aborts and steps; ``load_fields`` alone may be read from
    another thread (approximate counters).
    """

    engine_kind: str  # "native", "mock" or "vllm": what load reports call it
    config: EngineConfig  # as resolved (e.g. ``dtype`` "auto" replaced by the chosen dtype)
    fingerprint: str  # the storage tier's layout fingerprint of this engine's KV blocks
    max_model_len: int  # tokens (prompt + output) a request may reach
    num_steps: int  # steps run so far

    def check_request(self, prompt_token_ids: list[int], output_token_ids: list[int] = (),
                      sampling: SamplingParams | None = None) -> None:
        """Raise RequestError, saying why, for a request this engine would refuse."""

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    output_token_ids: list[int] = (), **kw: Any) -> None:
        """Queue a request whose first ``output_token_ids`` were sampled elsewhere. Keywords, all
        optional: ``kv_blocks`` ([n, layers, 2, block_size, kv_heads, head_dim]) holding the KV of
        the first ``num_kv_tokens`` tokens (it then decodes at once; ``num_exact_tokens`` of them
        are a cold run's), ``cache_salt``, ``images`` with ``image_embeds``, ``export_prompt``
        (its computed prompt blocks come back for the storage tier). A backend without a keyword's
        feature ignores what it can do without (a vLLM engine reads KV through its own connector)
        and raises RequestError for the rest."""

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its KV; False if it is not here."""

    def has_unfinished(self) -> bool:
        """Whether a request is queued, running or in a launched step."""

    def step(self) -> list[StepOutput]:
        """Run one step; the outputs of the requests it advanced or ended."""

    def fail_all(self) -> list:
        """After a step raised: drop every request and free its KV; the dropped requests."""

    def cached_prefix_blocks(self, hashes: list[str]) -> int:
        """How many leading prefix ``hashes`` this engine's own prefix cache holds now."""

    def load_fields(self) -> dict:
        """``protocol.LoadReport`` fields: queue, KV use, prefix-cache hits, counters."""

    def kv_connector(self, async_engine, store, io, index, async_store=None):
        """This engine's link to the storage tier (``engine.kv_connector``)."""
