"""KV connectors: how an engine's KV blocks move to and from the storage tier, for the worker services.

A worker service (prefill, decode) asks its engine for a connector (``engine.kv_connector(...)``) and
calls only these methods, whatever the engine, so the services hold no tensor code and no backend
branches. The two sides follow vLLM's ``KVConnectorBase_V1``:

* load side (before the engine schedules a request): ``load_stored_prefix`` (a prompt's longest
  stored prefix into the engine's prefix cache), ``read_request_kv`` and ``load_prefix`` (a request
  handed to decode with the keys of its blocks);
* save side (after the engine computed a prompt): ``save_prompt`` (prefill: every block of the
  prompt, the partial last one under an ephemeral key, for a handoff) and ``save_computed`` (decode:
  the whole blocks of a prompt it computed itself).

``TierConnector`` serves the native and mock engines: it reads and writes block files itself
(``kvstore.BlockStore`` on the worker's I/O threads) and moves tensors in and out of the engine
(``LLMEngine.load_prefix``, ``StepOutput.kv_blocks``). ``VllmTierConnector`` serves ``VllmEngine``,
whose own vLLM KV connector (``engine.vllm_connector``) reads and writes the same files inside
vLLM's steps: loads are no-ops here, and a save only finds which blocks vLLM wrote and announces them.
Either way every stored block is announced to the kvindex (``KVIndexClient.publish_stored``).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from deepinfer.kvstore import block_hashes, ephemeral_key
from deepinfer.kvstore.store import EPHEMERAL, is_ephemeral
from deepinfer.telemetry import get_logger

if TYPE_CHECKING:
    import torch

    from deepinfer.engine.async_engine import AsyncEngine
    from deepinfer.engine.interface import StepOutput
    from deepinfer.kvstore import AsyncBlockStore, BlockStore, KVIndexClient
    from deepinfer.protocol import DecodeRequest, PrefillRequest

log = get_logger(__name__)


class TierConnector:
    """The storage tier for an engine with its own paged KV cache (``LLMEngine``, ``MockEngine``).

    engine: the engine (``config.block_size``, ``fingerprint``, ``kv_layout``, ``model_config``,
    ``runner.kv_cache``, ``cached_prefix_blocks``, ``load_prefix``); async_engine: its thread
    (``call`` runs ``load_prefix`` between steps); store: the tier (block files, rooted at the
    engine's fingerprint); io: the executor for file I/O; index: the kvindex client (lookups,
    announcements); async_store: batched reads (``read_prefix_into``; prefill only, None elsewhere).
    """

    def __init__(self, engine, async_engine: AsyncEngine, store: BlockStore, io: Executor, index: KVIndexClient,
                 async_store: AsyncBlockStore | None = None):
        self.engine, self.async_engine, self.store, self.io = engine, async_engine, store, io
        self.index, self.async_store = index, async_store
        self.num_loaded_blocks = 0  # blocks read from the tier into the engine's prefix cache, since start

    @property
    def block_size(self) -> int:
        return self.engine.config.block_size

    def prompt_hashes(self, req: PrefillRequest | DecodeRequest) -> list[str]:
        """Chained hashes of the prompt's full blocks (the engine's own chain, with the salt and the
        images' content hashes)."""
        return block_hashes(req.prompt_token_ids, self.block_size, self.engine.fingerprint,
                            (req.cache_salt or "").encode(), [tuple(i) for i in req.images])

    # --- load side ----------------------------------------------------------------------------------
    async def load_stored_prefix(self, req: PrefillRequest) -> int:
        """Load the longest stored prefix of ``req``'s prompt that this engine does not cache yet into
        its prefix cache. At least one prompt token is always left to compute (its logits give the
        first token); nothing is loaded for a request that wants prompt logprobs (the engine computes
        its whole prompt). A block the index names but the tier no longer has is reported removed.
        Returns the number of blocks loaded. Raises what the tier or the index raise (the caller
        treats the cache as an optimisation)."""
        import torch

        if req.sampling.prompt_logprobs is not None:
            return 0
        bs, e = self.block_size, self.engine
        hashes = self.prompt_hashes(req)[: (len(req.prompt_token_ids) - 1) // bs]
        local = e.cached_prefix_blocks(hashes)  # NOTE: a read-only hint from another thread
        if local == len(hashes):
            return 0
        stored = await self.index.lookup(hashes, req.traffic_class, num_tokens=len(req.prompt_token_ids))
        if stored <= local:
            return 0
        keys = hashes[local:stored]
        cfg = e.model_config
        # hybrid sliding-window models store their full layers only (``engine.kv_layout``)
        staging = torch.empty(len(keys), len(e.kv_layout.full_layers), 2, bs, cfg.num_key_value_heads,
                              cfg.head_dim, dtype=e.runner.kv_cache.dtype)
        got = await self.async_store.read_prefix_into(keys, req.traffic_class, staging)
        if got < len(keys):  # the index named a block the tier no longer has (or a corrupt one)
            self.index.publish_removed([keys[got]], req.traffic_class)
        if got:
            got = await self.async_engine.call(e.load_prefix, keys[:got], staging[:got])
            self.num_loaded_blocks += got
        return got

    async def read_request_kv(self, req: DecodeRequest, start: int = 0) -> tuple[torch.Tensor | None, bool]:
        """``read_blocks`` on the I/O threads."""
        return await asyncio.get_running_loop().run_in_executor(self.io, self.read_blocks, req, start)

    def read_blocks(self, req: DecodeRequest, start: int = 0) -> tuple[torch.Tensor | None, bool]:
        """Read the request's blocks (``req.kv_block_keys``) from ``start`` on, in order, up to the
        first missing, corrupt or misshapen one; ephemeral blocks are deleted either way. Returns
        (blocks, complete): complete when every block (hybrid models: and the window part of each
        block that has one) was read; the blocks are then [n, num_layers, 2, block_size,
        num_kv_heads, head_dim] in the KV cache's dtype, every layer; else the full layers' part of
        the leading blocks read (None if none)."""
        import torch

        layout, cfg = self.engine.kv_layout, self.engine.model_config
        tail = (2, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        window_keys = req.window_block_keys if layout.hybrid else []
        full, windows, ok = [], [], True
        for i, key in enumerate(req.kv_block_keys[start:], start):
            block = self._read_block(req, key, ok, (len(layout.full_layers), *tail))
            if ok and block is None:  # (a prefix looked up, ``num_kv_tokens`` 0: the end of what is stored)
                (log.warning if req.num_kv_tokens else log.debug)("kv_block_miss", request_id=req.request_id, key=key)
                ok = False
            if ok:
                full.append(block)
            window_key = window_keys[i] if i < len(window_keys) else ""
            part = self._read_block(req, window_key, ok, (len(layout.window_layers), *tail)) if window_key else None
            windows.append(part)
            if ok and window_key and part is None:
                log.warning("kv_block_miss", request_id=req.request_id, key=window_key)
                window_keys = []  # the window state is gone: the full parts still make a prefix
        if not full:
            return None, False
        if layout.hybrid and (len(window_keys) != len(req.kv_block_keys) or not ok):
            return torch.stack(full), False
        return torch.stack([layout.join(f, w) for f, w in zip(full, windows)]), ok

    def _read_block(self, req: DecodeRequest, key: str, read: bool, shape: tuple) -> torch.Tensor | None:
        """Block ``key`` if ``read`` and it is there with ``shape`` (else None); an ephemeral block is
        deleted either way."""
        eph = is_ephemeral(key)
        block = self.store.get(key, EPHEMERAL if eph else req.traffic_class) if read else None
        if eph:
            self.store.delete(key, EPHEMERAL)
        return block if block is not None and tuple(block.shape) == shape else None

    async def load_prefix(self, req: DecodeRequest, kv: torch.Tensor, num_tokens: int, start: int = 0) -> int:
        """Put the leading full blocks of ``kv`` (``read_blocks``' blocks: the prompt's blocks from
        ``start`` on, keyed by their prefix hash) into the engine's prefix cache, so computing the
        request's ``num_tokens`` tokens computes only what they do not cover. At least one token is
        left to compute; blocks with ephemeral keys (past ``num_exact_blocks``) stay out. Returns the
        number of blocks inserted."""
        keys = req.kv_block_keys[start:]
        n = 0
        while n < min(len(kv), (num_tokens - 1) // self.block_size - start) and not is_ephemeral(keys[n]):
            n += 1
        if n <= 0:
            return 0
        got = await self.async_engine.call(self.engine.load_prefix, keys[:n], kv[:n])
        log.info("kv_prefix_loaded", request_id=req.request_id, blocks=got, tokens=num_tokens)
        return got

    # --- save side ----------------------------------------------------------------------------------
    async def save_prompt(self, req: PrefillRequest, out: StepOutput) -> tuple[list[str], list[str]]:
        """Write a prefill's blocks (``out.kv_blocks``) to the tier on the I/O threads, then announce
        the whole ones to the kvindex. Returns the keys of all blocks in order and of their window
        parts ("" = none; an empty list for models without window layers), for the handoff."""
        keys, window_keys, stored = await asyncio.get_running_loop().run_in_executor(
            self.io, self._write_prompt, req, out)
        self._announce(stored, req.traffic_class, out.kv_blocks)
        return keys, window_keys

    def _announce(self, stored: list[str], traffic_class: str, blocks: torch.Tensor) -> None:
        """Tell the kvindex that ``stored`` are in the tier (each the full layers' part of a block
        of ``blocks``: that part's bytes are the stored size)."""
        if stored:
            part = self.engine.kv_layout.full_part(blocks[0])
            self.index.publish_stored(stored, traffic_class, part.numel() * part.element_size(), self.block_size)

    def _write_prompt(self, req: PrefillRequest, out: StepOutput) -> tuple[list[str], list[str], list[str]]:
        """The first ``out.num_exact_blocks`` blocks under their prefix hash, the others (partial, or
        computed after a bounded replay) under ephemeral keys; hybrid sliding-window models store
        the full layers' part (``engine.kv_layout``) so, and for a handoff each block's window part
        that holds KV under an ephemeral key too. Returns (keys of all blocks, keys of their window
        parts, hashes of the blocks now in the tier). A failed write is skipped and counted (decode
        then recomputes)."""
        bs, layout = self.block_size, self.engine.kv_layout
        full = block_hashes(req.prompt_token_ids[: out.num_kv_tokens], bs, self.engine.fingerprint,
                            (req.cache_salt or "").encode(), [tuple(i) for i in req.images])[: out.num_exact_blocks]
        handoff = out.finish_reason == "handoff"
        keys, window_keys, stored = [], [], []
        for i in range(out.kv_blocks.shape[0]):
            block = layout.full_part(out.kv_blocks[i])
            window_key = ""
            try:
                if i < len(full):
                    key = full[i]
                    if not self.store.contains(key, req.traffic_class):
                        self.store.put(key, block, req.traffic_class, num_tokens=bs)
                    stored.append(key)
                else:
                    key = ephemeral_key(req.request_id, i)
                    self.store.put(key, block, EPHEMERAL)
                if layout.hybrid and handoff and i >= out.first_window_block:
                    window_key = ephemeral_key(req.request_id, i, part="w")
                    self.store.put(window_key, layout.window_part(out.kv_blocks[i]), EPHEMERAL)
            except OSError as e:
                self.store.stats.write_errors += 1
                log.warning("kv_store_write_failed", request_id=req.request_id, error=str(e))
            keys.append(key)
            if layout.hybrid:
                window_keys.append(window_key)
        return keys, window_keys, stored

    async def save_computed(self, req: DecodeRequest, out: StepOutput) -> None:
        """Write the whole prompt blocks a decode engine computed itself (``out.kv_blocks`` from
        ``out.kv_first_block`` on: aggregated serving, a resume) under their prefix hashes, and
        announce them. Never raises: the tier is an optimisation."""
        try:
            keys = self.prompt_hashes(req)[out.kv_first_block : out.kv_first_block + out.num_exact_blocks]
            stored = await asyncio.get_running_loop().run_in_executor(
                self.io, self._write_blocks, keys, out.kv_blocks, req.traffic_class)
            self._announce(stored, req.traffic_class, out.kv_blocks)
        except Exception as e:
            log.warning("kv_store_failed", request_id=req.request_id, error=str(e))

    def _write_blocks(self, keys: list[str], blocks: torch.Tensor, traffic_class: str) -> list[str]:
        """Write ``blocks`` (their full layers' part) under ``keys`` unless there already; returns the
        keys now in the tier. A failed write ends it (counted)."""
        stored = []
        for key, block in zip(keys, blocks):
            try:
                if not self.store.contains(key, traffic_class):
                    self.store.put(key, self.engine.kv_layout.full_part(block), traffic_class,
                                   num_tokens=self.block_size)
            except OSError as e:
                self.store.stats.write_errors += 1
                log.warning("kv_store_write_failed", key=key, error=str(e))
                break
            stored.append(key)
        return stored


class VllmTierConnector(TierConnector):
    """The storage tier for ``VllmEngine``: vLLM's own KV connector (``engine.vllm_connector``) looks
    prompts up in the tier, loads them and writes computed blocks (retention class "chat") inside
    vLLM's steps, so nothing is loaded here and a save announces what it finds written."""

    async def load_stored_prefix(self, req: PrefillRequest) -> int:
        return 0

    async def read_request_kv(self, req: DecodeRequest, start: int = 0) -> tuple[None, bool]:
        return None, False

    async def load_prefix(self, req: DecodeRequest, kv, num_tokens: int, start: int = 0) -> int:
        return 0

    async def save_prompt(self, req: PrefillRequest, out: StepOutput) -> tuple[list[str], list[str]]:
        """The leading run of the prompt's whole blocks that vLLM wrote during the step, announced to
        the kvindex; returns their keys (handed off as the prompt's blocks) and no window keys."""
        keys = self.prompt_hashes(req)[: len(req.prompt_token_ids) // self.block_size]
        n = await asyncio.get_running_loop().run_in_executor(
            self.io, lambda: next((i for i, k in enumerate(keys) if not self.store.contains(k, "chat")), len(keys)))
        stored = keys[:n]
        if stored:
            self.index.publish_stored(stored, "chat", self.engine.block_bytes, self.block_size)
        return stored, []

    async def save_computed(self, req: DecodeRequest, out: StepOutput) -> None:
        return None  # (vLLM wrote them during its steps; ``out.kv_blocks`` is always None here)
