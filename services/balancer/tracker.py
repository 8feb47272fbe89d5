"""The balancer's state for one model: a moving average of expert load, and when to rebalance.

Every ``window_s`` (a tick) the counts that workers reported since the last tick
(summed over workers) are folded into an exponential moving average per layer and
expert: ``load = (1 - ema_alpha) * load + ema_alpha * window`` (the first window
is taken as is; a tick without reports leaves it unchanged). A rebalance is due when

* ``period_s`` passed since the last one (or since the first report), or
* the *measured* imbalance of the last window, max/mean tokens per EP rank from the
  workers' ``rank_counts`` under the current placement (mean over layers), exceeds
  ``threshold``,

and at least ``min_interval_s`` passed since the last attempt, and every layer's
average holds at least ``min_tokens`` (token, expert) pairs. Then EPLB
(``eplb.rebalance_experts``) computes a candidate for the configured topology,
renumbered to keep as many slots' experts as possible (``eplb.keep_slots``: fewer
weight copies); it is published only if its predicted imbalance
(``eplb.rank_loads`` on the average) is lower than the current placement's by at
least ``min_gain``.
"""

from __future__ import annotations

import torch

from deepinfer.balancer.config import BalancerConfig  # noqa: F401 (the tracker's settings)
from deepinfer.balancer.eplb import imbalance, keep_slots, rank_loads, rebalance_experts
from deepinfer.models.expert_placement import ExpertPlacement, log2phy_from_phy2log
from deepinfer.protocol import ExpertStats


def mean_imbalance(loads: torch.Tensor) -> float:
    """max/mean per EP rank, per layer, averaged over layers (``loads [L, P]``)."""
    return float(imbalance(loads).mean())


class ExpertLoad:
    """One model's moving average, current placement and rebalance decisions (module docstring).

    ``placement``: the placement workers run now (the last published, the stored one after a
    restart, or None when unknown: then the first candidate is published). Raises ValueError
    (``BalancerConfig.check``) when the topology cannot hold ``num_experts``.
    """

    def __init__(self, model: str, num_layers: int, num_experts: int, config: BalancerConfig,
                 placement: ExpertPlacement | None, now: float):
        # NOTE: on one node the hierarchical steps reduce to the global policy; named so
        self.hierarchical = config.check(num_experts) and config.num_nodes > 1
        self.model, self.num_layers, self.num_experts, self.config = model, num_layers, num_experts, config
        self.placement = placement
        self.version = placement.version if placement is not None else 0
        self.load: torch.Tensor | None = None  # [L, E] float64 moving average
        self.window = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.window_reports = 0
        self.measured = None  # [L, P] rank counts of this window under the current placement
        self.measured_imbalance = 0.0
        self.imbalance_before = 0.0  # predicted, of the placement the last new one replaced
        self.last_attempt = now
        self.rebalances = 0
        self.workers: dict[str, int] = {}  # worker id -> its last replica_bytes

    def add(self, stats: ExpertStats) -> None:
        """Count a worker's report into this window. Raises ValueError if its shape differs."""
        counts = torch.tensor(stats.counts, dtype=torch.float64)
        if counts.shape != (self.num_layers, self.num_experts) or (counts < 0).any():
            raise ValueError(f"{stats.worker_id}: counts of shape {tuple(counts.shape)}, want "
                             f"{self.num_layers} x {self.num_experts} non-negative")
        self.window += counts
        self.window_reports += 1
        self.workers[stats.worker_id] = stats.replica_bytes
        self.version = max(self.version, stats.placement_version)
        p = self.placement
        if p is not None and stats.placement_version == p.version and stats.num_ranks == p.num_ranks:
            ranks = torch.tensor(stats.rank_counts, dtype=torch.float64)
            if ranks.shape == (self.num_layers, p.num_ranks):
                self.measured = ranks if self.measured is None else self.measured + ranks

    def predicted_imbalance(self, placement: ExpertPlacement | None = None) -> float:
        """Mean over layers of max/mean per EP rank of ``placement`` (default the current) on the
        moving average; 0 when there is no average or no placement."""
        p = placement or self.placement
        if p is None or self.load is None:
            return 0.0
        return mean_imbalance(rank_loads(self.load, p.phy2log, p.logcnt, p.num_ranks))

    def tick(self, now: float) -> ExpertPlacement | None:
        """Fold the window into the average; return a new placement (version + 1) when one is due
        and worth it, else None."""
        if self.window_reports:
            a = self.config.ema_alpha
            self.load = self.window.clone() if self.load is None else (1 - a) * self.load + a * self.window
        self.measured_imbalance = mean_imbalance(self.measured) if self.measured is not None else 0.0
        self.window.zero_()
        self.window_reports, self.measured = 0, None
        cfg = self.config
        if self.load is None or now - self.last_attempt < cfg.min_interval_s:
            return None
        periodic = cfg.period_s > 0 and now - self.last_attempt >= cfg.period_s
        over = cfg.threshold > 0 and self.measured_imbalance > cfg.threshold
        if not (periodic or over or self.placement is None) or float(self.load.sum(1).min()) < cfg.min_tokens:
            return None
        self.last_attempt = now
        phy2log, log2phy, _ = rebalance_experts(self.load, cfg.num_slots(self.num_experts), cfg.num_groups,
                                                cfg.num_nodes, cfg.num_ranks)
        current = self.placement
        if current is not None and current.num_ranks == cfg.num_ranks and current.phy2log.shape == phy2log.shape:
            phy2log = keep_slots(phy2log, current.phy2log, cfg.num_ranks, cfg.num_nodes if self.hierarchical else 1)
        candidate = ExpertPlacement(phy2log, *log2phy_from_phy2log(phy2log, self.num_experts, log2phy.shape[2]),
                                    cfg.num_ranks, self.version + 1)
        before = self.predicted_imbalance()
        if self.placement is not None:
            same = (self.placement.num_ranks == cfg.num_ranks and torch.equal(self.placement.phy2log, phy2log))
            if same or self.predicted_imbalance(candidate) > before - cfg.min_gain:
                return None
        self.placement, self.version, self.imbalance_before = candidate, candidate.version, before
        self.rebalances += 1
        return candidate
