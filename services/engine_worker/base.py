"""Base of the engine workers (prefill, decode): an engine (``engine.interface.Engine``) on its thread
inside a mesh ``Service``.

It owns what both workers share: the engine (``LLMEngine``, ``MockEngine``
with ``--engine mock``, or ``VllmEngine`` with ``--engine vllm``) and its thread, the storage-tier
``BlockStore`` (rooted at the engine's model fingerprint, so both sides agree
on block names), the I/O thread pool, load reports (every ``--heartbeat-s``:
queue, KV use, queued prefill compute, cost model, prefix hits), draining (wait for
in-flight requests, bounded) and, for MoE models, the link to the balancer
(``engine.experts``: expert load reports out, placements in). Subclasses subscribe their handlers in
``setup()`` and turn engine outputs into messages in ``on_outputs()``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from deepinfer.engine.args import add_engine_args, build_engine, engine_config, mock_config, refusals
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.experts import ExpertLink, add_expert_args, is_moe, model_id
from deepinfer.engine.interface import Engine, EngineConfig, StepOutput
from deepinfer.engine.mock import MockConfig
from deepinfer.kernels import select as kernel_select
from deepinfer.kvstore import BlockStore
from deepinfer.kvstore.index_client import KVIndexClient
from deepinfer.mesh import Service, run_service
from deepinfer.mesh.args import service_parser
from deepinfer.models.convert import resolve_model
from deepinfer.protocol import LoadReport
from deepinfer.telemetry import configure_logging, metrics


class EngineWorker(Service):
    prefill_only = False
    drain_timeout_s = 30.0

    def __init__(self, nats_url: str, model_dir: str, engine_cfg: EngineConfig, kv_root: str,
                 worker_id: str | None = None, mock: MockConfig | None = None, heartbeat_s: float = 1.0,
                 expert_stats_s: float = 5.0, ep_ranks: int = 1, backend: str = "native"):
        super().__init__(nats_url, worker_id, heartbeat_s)
        self.engine: Engine = build_engine(backend, model_dir, engine_cfg, kv_root, mock)
        self.experts = (ExpertLink(self.engine, model_id(model_dir), self.worker_id, self.role, expert_stats_s,
                                   ep_ranks) if is_moe(self.engine) else None)
        self.store = BlockStore(kv_root, self.engine.fingerprint)
        # request id -> the worker's state of the request (``PrefillJob``, ``DecodeJob``; its ``req`` is
        # the submit message), from its accepted submit until the engine is done with it
        self.requests: dict = {}
        self.num_aborted = 0  # requests stopped here on an abort, since start
        self.io = ThreadPoolExecutor(2, thread_name_prefix="kvstore")
        self.async_engine: AsyncEngine | None = None
        self.index: KVIndexClient | None = None  # set up by the prefill / decode service

    def start_engine(self) -> None:
        self.async_engine = AsyncEngine(self.engine, self.on_outputs)
        self.async_engine.start()

    async def start(self) -> None:
        await super().start()
        if self.experts is not None:
            await self.experts.start(self.mesh, self.async_engine)

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        """One engine step's outputs, on the service's event loop (``AsyncEngine`` calls it): the
        subclass publishes them (prefill: first tokens and handoffs; decode: token chunks)."""
        raise NotImplementedError

    def load_report(self) -> LoadReport:
        """The engine's load now (runs on the service's loop while the engine thread steps: the
        engine's ``load_fields`` reads counters that are safe to read from here)."""
        return LoadReport(role=self.role, worker_id=self.worker_id, aborted_requests=self.num_aborted,
                          tier_id=self.store.tier_id, **self.engine.load_fields())

    async def metric_families(self) -> list:
        """Load (the ``LoadReport``), KV blocks, storage-tier traffic and speculative decoding."""
        fams = [*await super().metric_families(), *metrics.load_report_families(self.load_report()),
                *metrics.store_families(self.store.stats.snapshot())]
        spec = getattr(self.engine, "spec", None)
        return fams + metrics.spec_decode_families(spec) if spec is not None else fams

    def busy(self) -> bool:
        return bool(self.requests)

    async def finish_inflight(self) -> None:
        for _ in range(int(self.drain_timeout_s * 10)):
            if not self.busy():
                break
            await asyncio.sleep(0.1)
        if self.index is not None:  # the KV events still queued: the kvindex should hear of those blocks
            await self.index.close()

    async def teardown(self) -> None:
        if self.experts is not None:
            await self.experts.stop()
        if self.async_engine is not None:
            self.async_engine.stop()
        self.io.shutdown(wait=False)

    @classmethod
    def main(cls, argv: list[str] | None, description: str) -> None:
        """Parse the common worker options and run the service until SIGINT/SIGTERM."""
        p = service_parser(cls.role, description)
        add_engine_args(p)
        add_expert_args(p)
        args = p.parse_args(argv)
        # now, not in run_service: the engine logs its start-up choices while it loads, and a logger
        # keeps the configuration of its first use
        configure_logging(cls.role, args.worker_id or "", args.log_level)
        try:  # NOTE: the engine places models on the CPU: an impossible --kernels is refused before loading
            kernel_select.resolve(args.kernels, "cpu")
        except ValueError as e:
            p.error(str(e))
        model_dir, cfg = str(resolve_model(args.model)), engine_config(args, prefill_only=cls.prefill_only)
        why = refusals(args.engine, cfg, model_dir)  # mesh features a backend lacks: refused, never ignored
        if why:
            p.error(f"not available on --engine {args.engine}: " + "; ".join(why))
        svc = cls(args.nats, model_dir, cfg, args.kv_root, args.worker_id, mock=mock_config(args),
                  heartbeat_s=args.heartbeat_s, expert_stats_s=args.expert_stats_s, ep_ranks=args.ep_ranks,
                  backend=args.engine)
        run_service(svc, args.log_level, metrics_port=args.metrics_port)
