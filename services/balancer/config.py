"""The balancer's topology and rebalance triggers: plain settings, read without torch (the
service imports the tracker, and with it torch, only when an MoE model first reports)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BalancerConfig:
    """Topology and triggers (defaults in brackets).

    redundant_experts: replica slots beyond one per logical expert, R = E + redundant [0].
    num_groups / num_nodes / num_ranks: expert groups G, nodes N, EP ranks P [1, 1, 1];
    hierarchical placement when G % N == 0, global otherwise (``eplb``).
    window_s: seconds between ticks [5]. ema_alpha: weight of the newest window, in (0, 1] [0.3].
    period_s: rebalance at least this often, seconds; 0 = only on the threshold [60].
    threshold: measured max/mean tokens per EP rank that triggers a rebalance at once; 0 = off [1.1].
    min_interval_s: seconds between two attempts [10]. min_gain: predicted imbalance a new
    placement must save [0.01]. min_tokens: pairs per layer in the average before placing [1000].
    """

    redundant_experts: int = 0
    num_groups: int = 1
    num_nodes: int = 1
    num_ranks: int = 1
    window_s: float = 5.0
    ema_alpha: float = 0.3
    period_s: float = 60.0
    threshold: float = 1.1
    min_interval_s: float = 10.0
    min_gain: float = 0.01
    min_tokens: float = 1000.0

    def __post_init__(self):
        if self.redundant_experts < 0:
            raise ValueError(f"redundant_experts must be >= 0, got {self.redundant_experts}")
        if min(self.num_groups, self.num_nodes, self.num_ranks) < 1:
            raise ValueError("num_groups, num_nodes and num_ranks must be >= 1")
        if self.num_ranks % self.num_nodes:
            raise ValueError(f"{self.num_ranks} EP ranks do not split evenly over {self.num_nodes} nodes")
        if self.window_s <= 0 or not 0 < self.ema_alpha <= 1:
            raise ValueError("window_s must be > 0 and ema_alpha in (0, 1]")
        if self.period_s < 0 or self.min_interval_s < 0 or self.min_gain < 0 or self.min_tokens < 0:
            raise ValueError("period_s, min_interval_s, min_gain and min_tokens must be >= 0")
        if self.threshold and self.threshold < 1:
            raise ValueError(f"threshold is a max/mean ratio: 0 (off) or >= 1, got {self.threshold}")

    def num_slots(self, num_experts: int) -> int:
        return num_experts + self.redundant_experts

    def check(self, num_experts: int) -> bool:
        """True: hierarchical policy for this many experts. Raises ValueError when the topology
        cannot hold them (``eplb.check_topology``)."""
        from deepinfer.balancer.eplb import check_topology  # torch: only once a model's experts are seen

        return check_topology(num_experts, self.num_slots(num_experts), self.num_groups, self.num_nodes,
                              self.num_ranks)
