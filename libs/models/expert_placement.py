"""Expert placement: which logical expert each physical slot of an MoE layer holds, on which EP rank.

Terms (deepseek-ai/EPLB):

* logical expert ``e`` in ``[0, E)``: an expert of the checkpoint;
* physical slot ``r`` in ``[0, R)``, ``R = E + redundant``: holds the weights of one
  replica of a logical expert;
* EP rank ``p`` in ``[0, P)``: owns the ``R / P`` consecutive slots
  ``[p * R/P, (p + 1) * R/P)``.

A placement has one row per MoE layer (``L`` rows), all int64::

    phy2log [L, R]     logical expert held by each slot
    log2phy [L, E, M]  slots holding each logical expert, ascending, padded with -1
                       (M = max_replicas, at least the largest logcnt)
    logcnt  [L, E]     replicas of each logical expert (>= 1)

    slot:     0  1  2 | 3  4  5          R = 6 slots, P = 2 ranks (rank 0 | rank 1), E = 4
    phy2log:  0  2  1 | 3  0  2
    log2phy:  [[0, 4], [2, -1], [1, 5], [3, -1]]     logcnt: [2, 1, 2, 1]

``log2phy`` and ``logcnt`` follow from ``phy2log`` (``log2phy_from_phy2log``);
a placement whose three tensors disagree is refused with ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def log2phy_from_phy2log(phy2log: torch.Tensor, num_experts: int,
                         max_replicas: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log2phy [L, E, M], logcnt [L, E])`` int64 from ``phy2log [L, R]``; slots ascending, -1 padded.

    ``max_replicas`` (M): default the largest replica count. Raises ValueError when an
    entry is outside ``[0, num_experts)``, when a logical expert has no slot, or when
    ``max_replicas`` is smaller than the largest replica count.
    """
    phy2log = torch.as_tensor(phy2log, dtype=torch.int64)
    if phy2log.dim() != 2:
        raise ValueError(f"phy2log must be [layers, slots], got shape {tuple(phy2log.shape)}")
    num_layers, num_slots = phy2log.shape
    if num_slots and (int(phy2log.min()) < 0 or int(phy2log.max()) >= num_experts):
        raise ValueError(f"phy2log holds expert ids outside [0, {num_experts})")
    logcnt = torch.zeros(num_layers, num_experts, dtype=torch.int64)
    logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    if num_experts and int(logcnt.min()) < 1:
        layer, expert = (logcnt < 1).nonzero()[0].tolist()
        raise ValueError(f"logical expert {expert} of MoE layer {layer} has no slot")
    most = int(logcnt.max()) if logcnt.numel() else 1
    m = most if max_replicas is None else max_replicas
    if m < most:
        raise ValueError(f"max_replicas {m} < the largest replica count {most}")
    # slots sorted by (expert, slot): each expert's slots are contiguous and ascending
    order = torch.argsort(phy2log * num_slots + torch.arange(num_slots), dim=1)
    experts = phy2log.gather(1, order)
    first = logcnt.cumsum(1) - logcnt  # index in ``order`` of each expert's first slot
    replica = torch.arange(num_slots).expand(num_layers, -1) - first.gather(1, experts)
    log2phy = torch.full((num_layers, num_experts, m), -1, dtype=torch.int64)
    log2phy.view(num_layers, -1).scatter_(1, experts * m + replica, order)
    return log2phy, logcnt


@dataclass
class ExpertPlacement:
    """One placement of every MoE layer (tensors as in the module docstring, int64, CPU).

    num_ranks: EP ranks P (must divide the slot count R). version: the balancer's
    counter (0 = the identity placement a worker starts with). Construction checks
    shapes and consistency and raises ValueError on any disagreement.
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor
    num_ranks: int = 1
    version: int = 0

    def __post_init__(self):
        self.phy2log = torch.as_tensor(self.phy2log, dtype=torch.int64).cpu()
        self.log2phy = torch.as_tensor(self.log2phy, dtype=torch.int64).cpu()
        self.logcnt = torch.as_tensor(self.logcnt, dtype=torch.int64).cpu()
        if self.phy2log.dim() != 2 or self.logcnt.dim() != 2 or self.log2phy.dim() != 3:
            raise ValueError("want phy2log [L, R], log2phy [L, E, M], logcnt [L, E]; got shapes "
                             f"{tuple(self.phy2log.shape)}, {tuple(self.log2phy.shape)}, {tuple(self.logcnt.shape)}")
        num_layers, num_slots = self.phy2log.shape
        if self.log2phy.shape[:2] != self.logcnt.shape or self.logcnt.shape[0] != num_layers:
            raise ValueError(f"layer / expert dims disagree: phy2log {tuple(self.phy2log.shape)}, "
                             f"log2phy {tuple(self.log2phy.shape)}, logcnt {tuple(self.logcnt.shape)}")
        if self.num_ranks < 1 or num_slots % self.num_ranks:
            raise ValueError(f"{num_slots} slots do not split evenly over {self.num_ranks} EP ranks")
        if num_slots < self.num_experts:
            raise ValueError(f"{num_slots} slots < {self.num_experts} logical experts")
        log2phy, logcnt = log2phy_from_phy2log(self.phy2log, self.num_experts, self.log2phy.shape[2])
        if not torch.equal(logcnt, self.logcnt):
            raise ValueError("logcnt disagrees with phy2log")
        if not torch.equal(log2phy, self.log2phy):
            raise ValueError("log2phy disagrees with phy2log (want each expert's slots ascending, -1 padded)")

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor, num_experts: int, num_ranks: int = 1,
                     version: int = 0) -> "ExpertPlacement":
        """The placement whose slots hold ``phy2log [L, R]``; log2phy and logcnt derived."""
        log2phy, logcnt = log2phy_from_phy2log(phy2log, num_experts)
        return cls(phy2log, log2phy, logcnt, num_ranks, version)

    @classmethod
    def identity(cls, num_layers: int, num_experts: int, num_ranks: int = 1) -> "ExpertPlacement":
        """Slot e holds expert e (no replicas): the checkpoint's layout, split over ``num_ranks``."""
        return cls.from_phy2log(torch.arange(num_experts).repeat(num_layers, 1), num_experts, num_ranks)

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_experts(self) -> int:
        return self.logcnt.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    @property
    def max_replicas(self) -> int:
        return self.log2phy.shape[2]

    def to_lists(self) -> dict:
        """Plain nested lists (the wire form): phy2log, log2phy, logcnt, num_ranks, version."""
        return {"phy2log": self.phy2log.tolist(), "log2phy": self.log2phy.tolist(),
                "logcnt": self.logcnt.tolist(), "num_ranks": self.num_ranks, "version": self.version}

    @classmethod
    def from_lists(cls, phy2log: list, log2phy: list, logcnt: list, num_ranks: int,
                   version: int) -> "ExpertPlacement":
        """Inverse of ``to_lists``. Raises ValueError on ragged lists or an inconsistent placement."""
        try:
            tensors = [torch.tensor(x, dtype=torch.int64) for x in (phy2log, log2phy, logcnt)]
        except (TypeError, ValueError) as e:  # ragged or non-integer lists
            raise ValueError(f"bad placement lists: {e}") from e
        return cls(*tensors, num_ranks=int(num_ranks), version=int(version))
