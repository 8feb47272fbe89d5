"""A worker's side of expert load balancing: report routed tokens, apply placements.

Only for MoE models (``models.moe.MoECounters``); a dense model's worker runs none of it.
Lifecycle, in an engine worker (``engine_worker.base.EngineWorker``):

  1. Start: the MoE layers are split over ``--ep-ranks`` EP ranks (the identity
     placement: slot e holds expert e); the worker subscribes to
     ``deepinfer.experts.placement``, then reads its model's latest placement from
     the JetStream KV bucket ``DEEPINFER_EXPERTS`` and applies it when newer.
  2. Every ``--expert-stats-s``: the counters (pairs per layer and logical expert,
     per layer and EP rank) are taken and reset between two forward passes, and
     published as ``ExpertStats`` on ``deepinfer.experts.stats`` (skipped when
     nothing was routed).
  3. An ``ExpertPlacementUpdate`` for this model with a newer version is checked
     (``ExpertPlacement``: shapes, consistency), then applied between two forward
     passes: the counters of the old placement are taken (published as its last
     window), replica weights are copied into their slots, the routing tables
     swapped (``MoECounters.apply_expert_placement``). Requests keep running: the
     step in flight finishes on the old placement, the next runs on the new one.
     A placement that does not fit the model is logged and ignored.

The model's id (``ExpertStats.model``) is the fingerprint of its weights: workers
of one model, prefill and decode alike, form one balance domain.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.kvstore.hashing import model_fingerprint
from deepinfer.mesh import MeshClient
from deepinfer.models.expert_placement import ExpertPlacement
from deepinfer.models.moe import MoECounters
from deepinfer.protocol import ExpertPlacementUpdate, ExpertStats, subjects, unpack
from deepinfer.telemetry import get_logger

log = get_logger(__name__)


def add_expert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ep-ranks", type=int, default=int(os.environ.get("DEEPINFER_EP_RANKS", 1)),
                   help="MoE models: EP ranks the experts are split over until the balancer places them "
                        "(env DEEPINFER_EP_RANKS; default 1)")
    p.add_argument("--expert-stats-s", type=float, default=float(os.environ.get("DEEPINFER_EXPERT_STATS_S", 5.0)),
                   help="MoE models: seconds between expert load reports to the balancer (default 5)")


def is_moe(engine) -> bool:
    return isinstance(getattr(engine, "model", None), MoECounters)


def model_id(model_dir: str | Path) -> str:
    """The balance domain of a model: the fingerprint of its weights (config and safetensors
    headers; no dtype or block size: those do not change which experts tokens pick)."""
    return model_fingerprint(model_dir, dtype="weights", block_size=0)


class ExpertLink:
    """Stats out, placements in, for one worker's engine (lifecycle in the module docstring).

    Build it before the engine thread starts (it splits the experts over ``ep_ranks`` at once).
    Raises ValueError when ``ep_ranks`` < 1, ``stats_s`` <= 0 or the experts do not split
    evenly over ``ep_ranks``.
    """

    def __init__(self, engine: LLMEngine, model: str, worker_id: str, role: str, stats_s: float = 5.0,
                 ep_ranks: int = 1):
        if stats_s <= 0:
            raise ValueError(f"--expert-stats-s must be > 0, got {stats_s}")
        self.engine = engine
        self.model: MoECounters = engine.model
        self.model_id, self.worker_id, self.role, self.stats_s = model, worker_id, role, stats_s
        blocks = self.model.moe_blocks()
        if ep_ranks < 1 or blocks[0].num_experts % ep_ranks:
            raise ValueError(f"--ep-ranks {ep_ranks}: {blocks[0].num_experts} experts do not split evenly")
        if ep_ranks != self.model.expert_placement().num_ranks:
            self.model.apply_expert_placement(ExpertPlacement.identity(len(blocks), blocks[0].num_experts, ep_ranks))
        self.mesh: MeshClient | None = None
        self.async_engine: AsyncEngine | None = None
        self.replica_bytes = 0
        self.refused = 0  # placements that did not fit the model or were inconsistent
        self.window_start = time.monotonic()
        self._lock = asyncio.Lock()  # one placement or report at a time
        self._task: asyncio.Task | None = None

    async def start(self, mesh: MeshClient, async_engine: AsyncEngine) -> None:
        """Subscribe to placements, apply the latest stored one, start reporting."""
        self.mesh, self.async_engine = mesh, async_engine
        await mesh.subscribe(subjects.EXPERTS_PLACEMENT, self.on_placement, span_name="experts.placement")
        latest = await self.latest_placement()
        if latest is not None:
            await self.on_placement(latest)
        self._task = asyncio.create_task(self._report_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # --- handlers -------------------------------------------------------------
    async def on_placement(self, msg: ExpertPlacementUpdate) -> None:
        if msg.model != self.model_id:
            return
        async with self._lock:
            if msg.version <= self.model.expert_placement_version:
                return
            try:
                placement = ExpertPlacement.from_lists(msg.phy2log, msg.log2phy, msg.logcnt, msg.num_ranks,
                                                       msg.version)
                self.model.check_expert_placement(placement)  # before the counters are taken
                t0 = time.perf_counter()
                stats, copied = await self.async_engine.call(self.engine.between_steps, self._swap, placement)
            except ValueError as e:
                self.refused += 1
                log.error("expert_placement_refused", version=msg.version, error=str(e))
                return
            log.info("expert_placement_applied", version=msg.version, slots_copied=copied,
                     replica_bytes=self.replica_bytes, seconds=round(time.perf_counter() - t0, 4))
            if stats is not None:
                await self._publish(stats)

    async def latest_placement(self) -> ExpertPlacementUpdate | None:
        """This model's placement in the KV bucket, or None (none yet, or JetStream unavailable)."""
        try:
            kv = await self.mesh.nc.jetstream().key_value(subjects.EXPERTS_BUCKET)
            entry = await kv.get(subjects.placement_key(self.model_id))
            return unpack(entry.value, ExpertPlacementUpdate)
        except (BucketNotFoundError, KeyNotFoundError):
            return None
        except Exception as e:  # no JetStream, timeouts, a bad entry: the subject still works
            log.warning("expert_placement_lookup_failed", error=str(e))
            return None

    # --- helpers ----------------------------------------------------------------
    def _take(self) -> ExpertStats | None:
        """The window's counters as a message (None if nothing was routed), then reset. Between steps."""
        counts, ranks = self.model.take_expert_counts()
        start, self.window_start = self.window_start, time.monotonic()
        if not int(counts.sum()):
            return None
        placement = self.model.expert_placement()
        expert_bytes, self.replica_bytes = self.model.expert_memory()
        return ExpertStats(model=self.model_id, worker_id=self.worker_id, role=self.role, counts=counts.tolist(),
                           rank_counts=ranks.tolist(), num_ranks=placement.num_ranks,
                           num_slots=placement.num_slots, placement_version=placement.version,
                           window_s=self.window_start - start, expert_bytes=expert_bytes,
                           replica_bytes=self.replica_bytes)

    def _swap(self, placement: ExpertPlacement) -> tuple[ExpertStats | None, int]:
        stats = self._take()
        copied = self.model.apply_expert_placement(placement)
        self.replica_bytes = self.model.expert_memory()[1]
        return stats, copied

    async def _publish(self, stats: ExpertStats) -> None:
        try:
            await self.mesh.publish(subjects.EXPERTS_STATS, stats)
        except Exception as e:  # NATS down: this window is lost, the next one is not
            log.warning("expert_stats_publish_failed", error=str(e))

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.stats_s)
            try:
                async with self._lock:
                    stats = await self.async_engine.call(self.engine.between_steps, self._take)
            except Exception:  # never let one failed read stop the reports
                log.exception("expert_stats_failed")
                continue
            if stats is not None:
                await self._publish(stats)
