"""A request inside the engine: its tokens, block table and state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from deepinfer.protocol import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in the engine (vLLM v1's ``RequestStatus``); the finished states say why it
    ended, and ``finish_reason`` is derived from them (the wire's ``finish_reason`` strings)."""

    WAITING = "waiting"  # needs a prefill (new, or preempted: recompute)
    RUNNING = "running"  # holds KV blocks; decodes one token per step
    FINISHED_STOPPED = "stop"  # an EOS or stop token
    FINISHED_LENGTH_CAPPED = "length"  # max_tokens or the model's max length
    FINISHED_HANDOFF = "handoff"  # a prefill-only engine's first token: decode continues elsewhere
    FINISHED_ABORTED = "abort"  # aborted by the caller
    FINISHED_ERROR = "error"  # ended by the engine: a failed step, a refused grammar token, lost image rows

    @property
    def is_finished(self) -> bool:
        return self.value not in ("waiting", "running")

    @property
    def finish_reason(self) -> str | None:
        """The wire's finish reason ("stop", "length", "handoff", "abort", "error"); None while live."""
        return self.value if self.is_finished else None


@dataclass(eq=False)  # identity: queues test membership / remove by object, not by comparing token lists
class Sequence:
    """Tokens are ``prompt + output``; the first ``num_computed_tokens`` have KV in the cache.

    A running sequence always has exactly one token without KV (the last one):
    the next step feeds it and samples the token after it.

    Async scheduling: when a step is launched the sequence is advanced at
    once (``num_computed_tokens`` grows by the fed tokens) and the token that
    step will sample is counted in ``num_inflight_tokens`` until it is known,
    so the next step can be scheduled while this one runs. ``len(seq)``
    counts in-flight tokens; ``token_ids`` holds only known ones.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Hybrid models: the sliding-window layers' blocks (-1 = released, outside the window).
    window_block_table: list[int] = field(default_factory=list)
    # Prefill-only engines stop after the first sampled token and hand off.
    prefill_only: bool = False
    # Export the prompt's computed full blocks with the first token sampled here (a worker that
    # computed the prompt itself writes them to the storage tier); cleared once exported.
    export_prompt: bool = False
    # Mixed into the first block's hash: tenants with different salts never share KV.
    cache_salt: bytes = b""
    # Full-block prefix hashes of token_ids, extended lazily by the block manager.
    block_hashes: list[str] = field(default_factory=list)
    # Vision-language prompts: (offset, length, content hash) of each image's placeholder run
    # (extra keys of the blocks it overlaps, ``kvstore.hashing``) and, where this engine computes the
    # prompt, each image's embeddings [length, hidden] fed for those rows (None: none here).
    images: list = field(default_factory=list)
    image_embeds: list | None = None
    # Prompt tokens whose KV came from the prefix cache instead of being computed.
    num_cached_tokens: int = 0
    # ``SamplingParams.prompt_logprobs`` asked of this engine (it computes the prompt): one entry per
    # prompt token (``sampler.TokenLogprobs``; None for the first and until computed), filled as the
    # prompt's chunks run and handed out with the first token (then None). While set, the prefix
    # cache is not read: a cached block's positions would have no logits.
    prompt_logprobs: list | None = None
    # Tokens fed in the step being scheduled (set by the scheduler).
    num_scheduled_tokens: int = 0
    # Tokens sampled by launched steps whose results are not back yet.
    num_inflight_tokens: int = 0
    # Launched steps that include this sequence and are not back yet (its blocks
    # are freed only when this is 0: a running forward pass may still write them).
    num_inflight_steps: int = 0
    # Times this sequence was preempted (its KV freed, recomputed later).
    num_preemptions: int = 0

    # --- hybrid sliding-window models: how the cached prefix was reused (``engine.hybrid_blocks``) ---
    # "cold" (no hit), "hit" (every layer's KV reused from this engine's pools), "swa_cache"
    # (window layers' KV restored from the host SWA state cache), "bounded_replay",
    # "exact_recompute" (a full-layer prefix was cached but the window state was not, and the
    # prefix was recomputed); "" for imported KV. Set when the sequence is admitted.
    prefix_path: str = ""
    # Bounded replay: positions [replay_start, replay_end) are fed again only to rebuild the
    # window layers' KV (their keys start at replay_start); the full layers keep the cached
    # KV of every position < replay_end. (0, 0) = no replay.
    replay_start: int = 0
    replay_end: int = 0
    # KV from this position on may differ from a cold run (computed after a bounded replay,
    # here or on the prefill worker that handed off): only full-layer blocks before it enter the
    # prefix cache, window-layer blocks never. None = every block is exact.
    num_exact_tokens: int | None = None
    # Scheduling scratch, set by ``find_cached_prefix`` and consumed by ``allocate``
    # (``hybrid_blocks.PrefixPlan``), and window blocks to fill from the SWA state cache
    # at launch: (window block id, prefix hash).
    prefix_plan: object | None = None
    window_restore: list[tuple[int, str]] = field(default_factory=list)
    # --- speculative decoding (``engine.spec_decode``) ---
    # Draft tokens the step being scheduled verifies after the last known token (fed at the
    # positions after it; cleared when the step is back); the drafter's own per-request state is
    # the ``SpecDecoder``'s, by request id.
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # draft tokens verified so far
    num_accepted_tokens: int = 0  # of which accepted
    # Prefill-only engines: (start, end) ``time.perf_counter()`` seconds and tokens fed of each
    # step that computed part of the prompt (the prefill worker's trace spans).
    chunk_times: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        """Why the request ended (``RequestStatus.finish_reason``); None while it runs."""
        return self.status.finish_reason

    def __len__(self) -> int:
        return len(self.token_ids) + self.num_inflight_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_new_tokens(self) -> int:
        """Tokens still to feed before the next token can be sampled (all those without KV)."""
        return len(self) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_new_tokens > 1

    @property
    def num_replayed_tokens(self) -> int:
        """Prefix tokens fed again by a bounded replay (0 without one)."""
        return self.replay_end - self.replay_start

    @property
    def feeds_missing_image_rows(self) -> bool:
        """Whether the scheduled tokens include an image's placeholder rows whose embeddings this
        engine lacks (a decode worker imports a multimodal prompt's KV without them: if
        preemption dropped that KV, it cannot be recomputed here)."""
        start, end = self.num_computed_tokens, self.num_computed_tokens + self.num_scheduled_tokens
        return (bool(self.images) and self.image_embeds is None
                and any(max(start, o) < min(end, o + n) for o, n, _ in self.images))

    def reset_kv_state(self) -> None:
        """Forget everything about KV this sequence held (its blocks were freed)."""
        self.num_computed_tokens = 0
        self.replay_start = self.replay_end = 0
        self.num_exact_tokens = None
        self.prefix_plan = None
        self.window_restore = []
