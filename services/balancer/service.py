"""Balancer service: expert load statistics from MoE workers -> EPLB placements back to them.

Lifecycle of what this service handles (docs/architecture.md, "Expert load balancing"):
  1. Stats. MoE workers publish ``ExpertStats`` on ``deepinfer.experts.stats``
     (every ``--expert-stats-s``, ``engine.experts``): per MoE layer, the (token,
     expert) pairs routed to each logical expert and computed on each EP rank.
     The first report of a model creates its state (``tracker.ExpertLoad``; the
     model's current placement is read from the KV bucket ``DEEPINFER_EXPERTS``,
     else taken as the identity split the worker reports); later ones add to
     the current window. A report that does not fit (other shape, a topology
     that cannot hold the model's experts) is logged and dropped.
  2. Ticks, every ``--window-s``: each model's window is folded into its moving
     average; when a rebalance is due (``--period-s``, or the measured imbalance
     above ``--threshold``) and the EPLB candidate gains at least ``--min-gain``,
     it is published as ``ExpertPlacementUpdate`` (version + 1) on
     ``deepinfer.experts.placement`` and stored under ``placement.<model>`` in the
     KV bucket (so workers that start later, and this service after a restart,
     read it).
  3. Workers apply it between two forward passes and report under the new
     version; the measured imbalance of the next windows shows the effect.
  4. Status: ``deepinfer.balancer.status`` -> ``BalancerStatus`` (per model:
     version, workers, measured and predicted imbalance, replica bytes).
Run one balancer per mesh (the stats subscription is not a queue group). With no
MoE worker it receives nothing and stays idle, so ``deepinfer up`` starts it.

Topology and triggers (``config.BalancerConfig``, defaults): ``--redundant-experts``
0, ``--groups`` 1, ``--nodes`` 1, ``--ranks`` 1, ``--window-s`` 5, ``--ema-alpha``
0.3, ``--period-s`` 60, ``--threshold`` 1.1, ``--min-interval-s`` 10,
``--min-gain`` 0.01, ``--min-tokens`` 1000.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Callable

from nats.js.errors import BucketNotFoundError

from deepinfer.balancer.config import BalancerConfig
from deepinfer.mesh import Service, run_service, stream_replicas
from deepinfer.mesh.args import service_parser
from deepinfer.protocol import (BalancerStatus, BalancerStatusRequest, ExpertPlacementUpdate, ExpertStats, pack,
                                subjects, unpack)
from deepinfer.telemetry import get_logger

if TYPE_CHECKING:  # the tracker (torch) is imported when an MoE model first reports: a dense mesh's
    # balancer starts and idles without torch
    from deepinfer.balancer.tracker import ExpertLoad
    from deepinfer.models.expert_placement import ExpertPlacement

log = get_logger(__name__)


class BalancerService(Service):
    role = "balancer"

    def __init__(self, nats_url: str, config: BalancerConfig, worker_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(nats_url, worker_id)
        self.config = config
        self.clock = clock
        self.models: dict[str, ExpertLoad] = {}
        self.refused: set[str] = set()  # models whose experts the topology cannot hold (logged once)
        self.kv = None
        self._tick_task: asyncio.Task | None = None

    async def setup(self) -> None:
        self.kv = await self.open_bucket()
        await self.mesh.subscribe(subjects.EXPERTS_STATS, self.on_stats, span_name="balancer.stats")
        await self.mesh.subscribe(subjects.BALANCER_STATUS, self.on_status, span_name="balancer.status")
        self._tick_task = asyncio.create_task(self._tick_loop())

    async def teardown(self) -> None:
        if self._tick_task is not None:
            self._tick_task.cancel()

    # --- handlers -------------------------------------------------------------------
    async def on_stats(self, stats: ExpertStats) -> None:
        state = self.models.get(stats.model)
        if state is None:
            if stats.model in self.refused:
                return
            state = await self.new_model(stats)
            if state is None:
                return
        try:
            state.add(stats)
        except ValueError as e:
            log.warning("expert_stats_dropped", model=stats.model, error=str(e))

    async def on_status(self, _req: BalancerStatusRequest) -> BalancerStatus:
        return BalancerStatus(worker_id=self.worker_id, models=[{
            "model": m.model, "version": m.version, "workers": sorted(m.workers),
            "measured_imbalance": m.measured_imbalance, "predicted_imbalance": m.predicted_imbalance(),
            "rebalances": m.rebalances, "replica_bytes": max(m.workers.values(), default=0),
        } for m in self.models.values()])

    async def metric_families(self) -> list:
        """Expert imbalance and placements per model, as ``on_status`` reports them."""
        from deepinfer.telemetry.metrics import balancer_families

        return [*await super().metric_families(), *balancer_families(await self.on_status(BalancerStatusRequest()))]

    async def tick(self) -> list[ExpertPlacementUpdate]:
        """One tick over every model; publishes (and returns) the new placements."""
        out = []
        for state in self.models.values():
            placement = state.tick(self.clock())
            if placement is not None:
                msg = self.placement_message(state, placement)
                await self.publish(msg)
                out.append(msg)
        return out

    # --- helpers ----------------------------------------------------------------------
    async def new_model(self, stats: ExpertStats) -> ExpertLoad | None:
        from deepinfer.balancer.tracker import ExpertLoad
        from deepinfer.models.expert_placement import ExpertPlacement

        num_layers, num_experts = len(stats.counts), len(stats.counts[0]) if stats.counts else 0
        placement = await self.stored_placement(stats.model)
        if placement is None and stats.num_slots == num_experts:  # workers run the identity split
            placement = ExpertPlacement.identity(num_layers, num_experts, stats.num_ranks)
        try:
            state = ExpertLoad(stats.model, num_layers, num_experts, self.config, placement, self.clock())
        except ValueError as e:
            self.refused.add(stats.model)
            log.error("expert_topology_refused", model=stats.model, experts=num_experts, error=str(e))
            return None
        self.models[stats.model] = state
        log.info("expert_model_seen", model=stats.model, layers=num_layers, experts=num_experts,
                 version=state.version, policy="hierarchical" if state.hierarchical else "global")
        return state

    def placement_message(self, state: ExpertLoad, placement: ExpertPlacement) -> ExpertPlacementUpdate:
        cfg = self.config
        wire = placement.to_lists()
        return ExpertPlacementUpdate(
            model=state.model, version=placement.version, phy2log=wire["phy2log"], log2phy=wire["log2phy"],
            logcnt=wire["logcnt"], num_ranks=placement.num_ranks, num_nodes=cfg.num_nodes, num_groups=cfg.num_groups,
            policy="hierarchical" if state.hierarchical else "global", imbalance_before=state.imbalance_before,
            imbalance_after=state.predicted_imbalance())

    async def publish(self, msg: ExpertPlacementUpdate) -> None:
        log.info("expert_placement_published", model=msg.model, version=msg.version, policy=msg.policy,
                 imbalance_before=round(msg.imbalance_before, 4), imbalance_after=round(msg.imbalance_after, 4))
        if self.kv is not None:  # stored first: a worker that starts now reads it or gets the message
            try:
                await self.kv.put(subjects.placement_key(msg.model), pack(msg))
            except Exception as e:
                log.warning("expert_placement_store_failed", error=str(e))
        await self.mesh.publish(subjects.EXPERTS_PLACEMENT, msg)

    async def open_bucket(self):
        """The KV bucket of latest placements (created if missing); None without JetStream."""
        js = self.mesh.nc.jetstream()
        try:
            try:  # an existing bucket is kept as it is (its replicas an operator's choice)
                return await js.key_value(subjects.EXPERTS_BUCKET)
            except BucketNotFoundError:
                return await js.create_key_value(bucket=subjects.EXPERTS_BUCKET, history=1, replicas=stream_replicas())
        except Exception as e:
            log.warning("expert_bucket_unavailable", error=str(e))
            return None

    async def stored_placement(self, model: str) -> ExpertPlacement | None:
        from deepinfer.models.expert_placement import ExpertPlacement

        if self.kv is None:
            return None
        try:
            msg = unpack((await self.kv.get(subjects.placement_key(model))).value, ExpertPlacementUpdate)
            return ExpertPlacement.from_lists(msg.phy2log, msg.log2phy, msg.logcnt, msg.num_ranks, msg.version)
        except Exception:  # none stored (KeyNotFoundError), or unreadable: start from the reports
            return None

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.window_s)
            try:
                await self.tick()
            except Exception:  # never let one bad tick stop balancing
                log.exception("balancer_tick_failed")


def config_from_args(args) -> BalancerConfig:
    return BalancerConfig(redundant_experts=args.redundant_experts, num_groups=args.groups, num_nodes=args.nodes,
                          num_ranks=args.ranks, window_s=args.window_s, ema_alpha=args.ema_alpha,
                          period_s=args.period_s, threshold=args.threshold, min_interval_s=args.min_interval_s,
                          min_gain=args.min_gain, min_tokens=args.min_tokens)


def main(argv: list[str] | None = None) -> None:
    p = service_parser("balancer", "Expert-parallel load balancer (EPLB) for MoE workers")
    env = os.environ.get
    p.add_argument("--redundant-experts", type=int, default=int(env("DEEPINFER_EP_REDUNDANT", 0)),
                   help="replica slots beyond one per expert: slots = experts + this (default 0)")
    p.add_argument("--ranks", type=int, default=int(env("DEEPINFER_EP_RANKS", 1)), help="EP ranks (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes the EP ranks span (default 1)")
    p.add_argument("--groups", type=int, default=1,
                   help="expert groups kept on one node by the hierarchical policy (default 1)")
    p.add_argument("--window-s", type=float, default=5.0, help="seconds between ticks (default 5)")
    p.add_argument("--ema-alpha", type=float, default=0.3, help="moving-average weight of a new window (0.3)")
    p.add_argument("--period-s", type=float, default=60.0, help="rebalance at least every this many s; 0 = off")
    p.add_argument("--threshold", type=float, default=1.1,
                   help="rebalance at once above this measured max/mean tokens per EP rank; 0 = off (1.1)")
    p.add_argument("--min-interval-s", type=float, default=10.0, help="seconds between attempts (default 10)")
    p.add_argument("--min-gain", type=float, default=0.01, help="predicted imbalance a placement must save")
    p.add_argument("--min-tokens", type=float, default=1000.0, help="pairs per layer averaged before placing")
    args = p.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        p.error(str(e))
    run_service(BalancerService(args.nats, config, args.worker_id), args.log_level, metrics_port=args.metrics_port)
