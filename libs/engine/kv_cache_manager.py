"""The KV cache of one engine: block pools, prefix cache, SWA state cache, tier import and export.

``KVCacheManager`` is the only owner of the block managers' internals (vLLM v1's
``KVCacheManager`` plays the same part): the step loop asks it to admit KV a request brings,
to load a stored prefix, to export a prompt's blocks and to free a finished sequence; the
scheduler allocates and frees through the block manager's public methods.

``plan_kv_pools`` sizes the pools of a model from ``EngineConfig.kv_cache_bytes``: one pool
of full blocks, and for hybrid sliding-window models a window pool beside it (the window
layers keep only the last W tokens of a sequence). The KV tensors themselves live in the
model runner (``ModelRunner.kv_cache``), which reads and writes blocks by id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.hybrid_blocks import HybridBlockManager, WindowBlockManager
from deepinfer.engine.kv_layout import KVLayout
from deepinfer.engine.interface import StepOutput
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.swa_cache import SWAStateCache
from deepinfer.kvstore.hashing import model_fingerprint
from deepinfer.models.config import ModelConfig
from deepinfer.protocol import SamplingParams


@dataclass
class KVPools:
    """What ``plan_kv_pools`` decided: the block manager over ``num_blocks`` full blocks (and
    ``num_window_blocks`` window blocks for hybrid models), bytes per full block over the layers
    the storage tier keeps, the storage tier's layout fingerprint and the SWA state cache (None:
    not hybrid, or prefix caching or ``swa_cache_bytes`` off)."""

    block_manager: BlockManager
    num_blocks: int
    num_window_blocks: int
    block_bytes: int
    fingerprint: str
    swa_cache: SWAStateCache | None


def plan_kv_pools(model_dir, mc: ModelConfig, windows: list[int | None], config, max_model_len: int,
                  dtype: torch.dtype) -> KVPools:
    """Size the pools for ``config.kv_cache_bytes`` (``EngineConfig``). ``windows``: each attention
    layer's sliding window in tokens (None: full attention).

    Hybrid models split the bytes by what a sequence at ``max_model_len`` holds: every block in
    the full layers, W + one block of tokens in the window layers; the window pool gets at least
    what one sequence's largest step needs (W + a full chunk), so a lone sequence always
    progresses. Their storage-tier blocks hold the full layers only: a layout of its own, so a
    fingerprint (directory) of its own."""
    bs = config.block_size
    num_window_layers = sum(w is not None for w in windows)
    if not 0 < num_window_layers < len(windows):
        fingerprint = model_fingerprint(model_dir, config.dtype, bs)
        block_bytes = ModelRunner.block_bytes(mc, bs, dtype)
        num_blocks = max(2, config.kv_cache_bytes // block_bytes)
        bm = BlockManager(num_blocks, bs, fingerprint, config.enable_prefix_caching)
        return KVPools(bm, num_blocks, 0, block_bytes, fingerprint, None)
    fingerprint = model_fingerprint(model_dir, config.dtype, bs, layout="full-layers")
    swa_cache = (SWAStateCache(config.swa_cache_bytes)
                 if config.enable_prefix_caching and config.swa_cache_bytes > 0 else None)
    window = max(w for w in windows if w is not None)
    num_full_layers = len(windows) - num_window_layers
    block_bytes = ModelRunner.block_bytes(mc, bs, dtype, num_full_layers)
    window_block_bytes = ModelRunner.block_bytes(mc, bs, dtype, num_window_layers)
    held = window + bs
    share = num_window_layers * held / (num_window_layers * held + num_full_layers * max_model_len)
    num_blocks = max(2, int(config.kv_cache_bytes * (1 - share)) // block_bytes)
    step_blocks = -(-min(window + config.max_num_batched_tokens, max_model_len) // bs) + 1
    num_window_blocks = max(step_blocks, int(config.kv_cache_bytes * share) // window_block_bytes)
    bm = HybridBlockManager(
        num_blocks, bs,
        WindowBlockManager(num_window_blocks, bs, window, fingerprint, config.enable_prefix_caching),
        fingerprint, config.enable_prefix_caching, swa_cache, config.swa_replay)
    return KVPools(bm, num_blocks, num_window_blocks, block_bytes, fingerprint, swa_cache)


class KVCacheManager:
    """One engine's KV cache beside the scheduler: storage-tier import and export, the SWA state
    cache, freeing finished sequences.

    block_manager: the pools (``plan_kv_pools``); runner: reads and writes block contents
    (``ModelRunner`` or the mock's); layout: which layers a block carries; between_steps: runs a
    function where no forward pass reads the KV cache (``EngineCore.between_steps``): a write
    into blocks that the running step may still read waits for it.
    """

    def __init__(self, block_manager: BlockManager, runner, layout: KVLayout,
                 swa_cache: SWAStateCache | None, between_steps: Callable):
        self.block_manager = block_manager
        self.runner = runner
        self.layout = layout
        self.swa_cache = swa_cache
        self.between_steps = between_steps

    # --- occupancy ------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    @property
    def tokens_used(self) -> int:
        bm = self.block_manager
        return (bm.num_blocks - bm.num_free_blocks) * bm.block_size

    @property
    def tokens_capacity(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def cached_prefix_blocks(self, hashes: list[str]) -> int:
        """How many leading ``hashes`` the prefix cache holds now (a hint: may change before
        the request is scheduled)."""
        n = 0
        while n < len(hashes) and hashes[n] in self.block_manager.cached:
            n += 1
        return n

    # --- import -----------------------------------------------------------------
    def load_prefix(self, hashes: list[str], blocks: torch.Tensor) -> int:
        """Put KV blocks loaded from the storage tier into the prefix cache, so the next request
        with this prefix hits them (the storage tier is the prefix cache's second level).

        hashes: chained prefix hashes of consecutive full blocks (the first may follow blocks
        cached already); blocks: [n, num_layers, 2, block_size, num_kv_heads, head_dim]
        (``ModelRunner.read_blocks``' layout) or, for hybrid sliding-window models, the storage
        tier's [n, num_full_layers, ...] (``KVLayout``): only the full layers' KV is loaded, the
        window layers' state is found or rebuilt when a request hits these blocks. Blocks whose
        hash is cached already are skipped; the others wait, unreferenced, at the tail of the
        LRU free queue (one free block always stays free). Returns how many were inserted.
        Raises ValueError for blocks of another layer count.
        """
        bm, layout = self.block_manager, self.layout
        if not bm.enable_prefix_caching:
            return 0
        if layout.hybrid and blocks.shape[1] == layout.num_layers:
            blocks = blocks[:, layout.full_layers]
        if blocks.shape[1] != len(layout.full_layers):
            raise ValueError(f"blocks of {blocks.shape[1]} layers, expected {len(layout.full_layers)}")
        todo = [(h, i) for i, h in enumerate(hashes) if h not in bm.cached][: max(0, bm.num_free_blocks - 1)]
        if not todo:
            return 0
        ids = bm.take_free_blocks(len(todo))
        rows = blocks[[i for _, i in todo]]
        if layout.hybrid:
            self.between_steps(self.runner.write_full_blocks, ids, rows)
        else:
            tmp = Sequence("__load_prefix", [0], 1, SamplingParams(max_tokens=1))
            tmp.block_table = ids
            self.between_steps(self.runner.write_blocks, tmp, rows)
        bm.publish_cached(ids, [h for h, _ in todo])
        return len(todo)

    def import_request_kv(self, seq: Sequence, kv_blocks: torch.Tensor, num_exact_tokens: int | None) -> bool:
        """Give ``seq`` blocks holding ``kv_blocks`` ([n, num_layers, 2, block_size, kv_heads,
        head_dim]) for its first ``seq.num_computed_tokens`` tokens (window pools allocate only
        the window). ``num_exact_tokens``: how many of them hold a cold run's KV (None = all;
        the rest never enters the prefix cache). False, with nothing allocated, when the pools
        have no room now: the caller recomputes the request from its tokens instead."""
        bm, total = self.block_manager, len(seq.token_ids)
        if not bm.can_allocate(seq, total):
            return False
        bm.allocate(seq, total)
        if num_exact_tokens is not None and num_exact_tokens < seq.num_computed_tokens:
            seq.num_exact_tokens = num_exact_tokens
        self.between_steps(self.runner.write_blocks, seq, kv_blocks)
        return True

    def take_window_restores(self, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor]:
        """The SWA state cache's blocks for the window blocks newly admitted sequences restore
        (``Sequence.window_restore``; the runner writes them on the forward thread, after the
        running step): (window block ids, [n, num_window_layers, 2, block_size, kv_heads, head_dim])."""
        ids, blocks = [], []
        for seq in seqs:
            for block_id, block_hash in seq.window_restore:
                block = self.swa_cache.get(block_hash)
                # planned in this same schedule; only a finishing sequence's put evicts
                assert block is not None, "SWA state cache entry evicted between plan and launch"
                ids.append(block_id)
                blocks.append(block)
            seq.window_restore = []
        return ids, torch.stack(blocks)

    # --- export -----------------------------------------------------------------
    def export(self, seq: Sequence, out: StepOutput, finished: bool) -> None:
        """The KV blocks a worker writes to the storage tier, into ``out``: a prefill-only request's
        when it ends (``export_handoff``), else a prompt computed here, once (``export_prompt``)."""
        if finished and seq.prefill_only:
            self.export_handoff(seq, out)
        elif seq.export_prompt:
            self.export_prompt(seq, out)

    def export_handoff(self, seq: Sequence, out: StepOutput) -> None:
        """A prefill-only engine's finished prompt: its KV blocks into ``out`` (``StepOutput``).
        A handoff gets every block (the last one partial); a request its first token ended gets
        its whole, exact blocks only (they are for the storage tier)."""
        bs = self.block_size
        out.num_kv_tokens = len(seq.token_ids) - 1
        n = -(-out.num_kv_tokens // bs) if seq.finish_reason == "handoff" else out.num_kv_tokens // bs
        exact = n if seq.num_exact_tokens is None else min(n, seq.num_exact_tokens // bs)
        if seq.finish_reason != "handoff":
            n = exact
        if not n:
            return
        out.kv_blocks = self.runner.read_blocks(seq, n)
        out.num_exact_blocks = exact
        if self.layout.hybrid:
            out.first_window_block = next((i for i, b in enumerate(seq.window_block_table[:n]) if b != -1), n)

    def export_prompt(self, seq: Sequence, out: StepOutput) -> None:
        """``add_request(export_prompt=True)``: the prompt's full, exact blocks past its cached
        prefix into ``out`` (``kv_blocks`` [n, num_layers, 2, block_size, kv_heads, head_dim],
        the first of them block ``kv_first_block`` of the prompt), once."""
        seq.export_prompt = False
        bs = self.block_size
        exact = seq.num_prompt_tokens if seq.num_exact_tokens is None else min(seq.num_prompt_tokens,
                                                                               seq.num_exact_tokens)
        first, n = seq.num_cached_tokens // bs, exact // bs
        if first < n:
            out.kv_blocks = self.runner.read_blocks(seq, n, start=first)
            out.kv_first_block = first
            out.num_exact_blocks = n - first

    # --- free -------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """A finished sequence no launched step reads any more: its window state into the SWA
        state cache (``save_window_state``), then its blocks back to the pools."""
        self.save_window_state(seq)
        self.block_manager.free(seq)

    def save_window_state(self, seq: Sequence) -> int:
        """Copy a finished sequence's window state (the window layers' blocks a query right
        after its last whole computed block can see) into the SWA state cache, unless it is
        approximate (``num_exact_tokens``). Returns the blocks added."""
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
