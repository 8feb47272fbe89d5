"""EPLB: replicate and place MoE experts so every EP rank gets the same load.

The algorithm of deepseek-ai/EPLB (this is an implementation from a description
of it, not a port of its code). Input: the predicted load of every
logical expert of every MoE layer, ``weight [L, E]`` (e.g. a moving average of
routed-token counts), and a topology: ``num_slots`` physical slots R (= E +
redundant), ``num_groups`` expert groups G (consecutive experts, E/G each),
``num_nodes`` N, ``num_ranks`` P (EP ranks, P/N per node, R/P slots each).
Output: ``phy2log [L, R]``, ``log2phy [L, E, M]`` (-1 padded), ``logcnt [L, E]``
(``deepinfer.models.expert_placement`` describes them). Every layer is solved
independently (the layers run one after another; each is a synchronisation point).

Hierarchical policy, when G % N == 0 (e.g. DeepSeek-V3's node-limited routing:
a group's experts stay on one node, so a token's experts span few nodes):

  1. pack the G groups onto the N nodes, G/N each: heaviest group first, into the
     lightest node that still has room (``balanced_packing``);
  2. within each node (E/N experts, R/N slots), give each spare slot to the expert
     with the largest load / replicas (``replicate``);
  3. pack each node's R/N replicas (load = expert load / its replicas) onto the
     node's P/N ranks, exactly R/P per rank, the same greedy way.

Global policy, otherwise: the same with one group and one node (replicas may land
on any rank). Slots are numbered rank by rank: rank p holds ``[p*R/P, (p+1)*R/P)``,
node n holds ranks ``[n*P/N, (n+1)*P/N)``.

Metric: max / mean tokens per EP rank, per layer (``imbalance``);
``rank_loads`` predicts the tokens per rank of a placement, with each expert's
tokens spread evenly over its replicas (the workers spread them round-robin).
"""

from __future__ import annotations

import torch

from deepinfer.models.expert_placement import log2phy_from_phy2log


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack n items into ``num_packs`` packs of exactly n / num_packs items each, per row.

    weight: [B, n] float (B independent problems). Items go heaviest first (ties: lower
    index first) into the pack with the least load among those not full (ties: lower
    pack). Returns ``(pack [B, n], index_in_pack [B, n])`` int64, the index being the
    order in which the pack received the item. Raises ValueError unless n % num_packs == 0.
    """
    batch, n = weight.shape
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"{n} items do not split evenly into {num_packs} packs")
    per_pack = n // num_packs
    order = torch.sort(weight, dim=1, descending=True, stable=True).indices
    load = torch.zeros(batch, num_packs, dtype=torch.float64)
    filled = torch.zeros(batch, num_packs, dtype=torch.int64)
    pack = torch.empty(batch, n, dtype=torch.int64)
    index = torch.empty(batch, n, dtype=torch.int64)
    rows = torch.arange(batch)
    for j in range(n):  # one item per row at a time, all rows at once
        item = order[:, j]
        target = load.masked_fill(filled >= per_pack, float("inf")).argmin(1)  # first minimum
        pack[rows, item] = target
        index[rows, item] = filled[rows, target]
        load[rows, target] += weight[rows, item].double()
        filled[rows, target] += 1
    return pack, index


def replicate(weight: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Give ``num_slots - n`` spare slots, one at a time, to the expert with the largest load / replicas.

    weight: [B, n] float, n experts per row. Returns ``(slot2expert [B, num_slots],
    count [B, n])`` int64: slots 0..n-1 hold experts 0..n-1, the spare ones follow in
    the order they were given. Raises ValueError if num_slots < n.
    """
    batch, n = weight.shape
    if num_slots < n:
        raise ValueError(f"{num_slots} slots < {n} experts")
    slot2expert = torch.cat([torch.arange(n).expand(batch, n), torch.empty(batch, num_slots - n, dtype=torch.int64)], 1)
    count = torch.ones(batch, n, dtype=torch.int64)
    rows = torch.arange(batch)
    for slot in range(n, num_slots):
        best = (weight.double() / count).argmax(1)  # ties: lower expert id
        slot2expert[:, slot] = best
        count[rows, best] += 1
    return slot2expert, count


def check_topology(num_experts: int, num_slots: int, num_groups: int, num_nodes: int, num_ranks: int) -> bool:
    """True for the hierarchical policy, False for the global one. Raises ValueError when the
    topology cannot hold the experts: sizes < 1, slots < experts, slots not divisible by ranks,
    or (hierarchical) experts not divisible by groups, ranks not divisible by nodes."""
    if min(num_experts, num_slots, num_groups, num_nodes, num_ranks) < 1:
        raise ValueError("experts, slots, groups, nodes and ranks must all be >= 1")
    if num_slots < num_experts:
        raise ValueError(f"{num_slots} slots < {num_experts} experts (slots = experts + redundant)")
    if num_slots % num_ranks:
        raise ValueError(f"{num_slots} slots do not split evenly over {num_ranks} EP ranks")
    if num_groups % num_nodes:
        return False
    if num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not split evenly into {num_groups} groups")
    if num_ranks % num_nodes:
        raise ValueError(f"{num_ranks} EP ranks do not split evenly over {num_nodes} nodes")
    return True


def rebalance_experts(weight: torch.Tensor, num_slots: int, num_groups: int = 1, num_nodes: int = 1,
                      num_ranks: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EPLB placement for ``weight [L, E]`` (loads >= 0, any float or int dtype).

    Returns ``(phy2log [L, R], log2phy [L, E, M], logcnt [L, E])`` int64, R = ``num_slots``,
    M = R - E + 1 (the most replicas an expert can get), so every placement of one topology has
    the same shapes. Hierarchical when ``num_groups % num_nodes == 0``, global otherwise (module
    docstring). Raises ValueError for a bad topology (``check_topology``) or a weight that is
    not 2-D, has negative or non-finite entries.
    """
    weight = torch.as_tensor(weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be [layers, experts], got shape {tuple(weight.shape)}")
    weight = weight.double()
    if not torch.isfinite(weight).all() or (weight < 0).any():
        raise ValueError("expert loads must be finite and >= 0")
    num_layers, num_experts = weight.shape
    if not check_topology(num_experts, num_slots, num_groups, num_nodes, num_ranks):
        num_groups = num_nodes = 1
    # 1. groups -> nodes
    group_size = num_experts // num_groups
    group_node, group_index = balanced_packing(weight.view(num_layers, num_groups, group_size).sum(2), num_nodes)
    # node_experts[l, n, i]: the i-th logical expert on node n (its groups in packing order)
    position = (group_node * (num_groups // num_nodes) + group_index) * group_size  # first position per group
    position = (position[:, :, None] + torch.arange(group_size)).view(num_layers, num_experts)
    node_experts = torch.empty_like(position).scatter_(1, position, torch.arange(num_experts).expand_as(position))
    # 2. replicas within each node: one row per (layer, node) from here on
    node_load = weight.gather(1, node_experts).view(num_layers * num_nodes, num_experts // num_nodes)
    node_experts = node_experts.view_as(node_load)
    slots_per_node = num_slots // num_nodes
    slot2local, count = replicate(node_load, slots_per_node)
    # 3. replicas -> ranks of the node, R/P each
    replica_load = (node_load / count).gather(1, slot2local)
    rank, index = balanced_packing(replica_load, num_ranks // num_nodes)
    slot_in_node = rank * (num_slots // num_ranks) + index
    phy2local = torch.empty_like(slot2local).scatter_(1, slot_in_node, slot2local)
    phy2log = node_experts.gather(1, phy2local).view(num_layers, num_slots)
    log2phy, logcnt = log2phy_from_phy2log(phy2log, num_experts, num_slots - num_experts + 1)
    return phy2log, log2phy, logcnt


def keep_slots(phy2log: torch.Tensor, current: torch.Tensor, num_ranks: int, num_nodes: int = 1) -> torch.Tensor:
    """Renumber the slots of ``phy2log [L, R]`` so that as many as possible hold the expert they hold
    in ``current [L, R]`` (the same topology), i.e. fewer weight copies when it is applied.

    No rank's experts (so no rank's load) and no node's experts change: ranks are permuted within
    their node (greedily, the pair of ranks sharing the most experts first), then each rank's
    experts are ordered so that those it holds now keep their slot. Not part of deepseek-ai/EPLB
    (which places from scratch each time). Returns a new int64 tensor; raises ValueError if the
    shapes differ or R is not divisible by ``num_ranks``, ``num_ranks`` by ``num_nodes``.
    """
    if phy2log.shape != current.shape or phy2log.shape[1] % num_ranks or num_ranks % num_nodes:
        raise ValueError(f"cannot align {tuple(phy2log.shape)} to {tuple(current.shape)} over "
                         f"{num_ranks} ranks, {num_nodes} nodes")
    num_layers, num_slots = phy2log.shape
    per_rank, per_node = num_slots // num_ranks, num_ranks // num_nodes
    num_experts = int(max(phy2log.max(), current.max())) + 1

    def held(ranks: torch.Tensor) -> torch.Tensor:  # [ranks, per_rank] -> replicas of each expert [ranks, E]
        return torch.zeros(len(ranks), num_experts, dtype=torch.int64).scatter_add_(1, ranks, torch.ones_like(ranks))

    out = torch.empty_like(phy2log)
    for layer in range(num_layers):
        new_ranks = phy2log[layer].view(num_ranks, per_rank)
        old_ranks = current[layer].view(num_ranks, per_rank)
        shared = torch.minimum(held(new_ranks)[:, None], held(old_ranks)[None]).sum(2).tolist()  # [new, old]
        new_lists, old_lists = new_ranks.tolist(), old_ranks.tolist()
        for node in range(num_nodes):
            ranks = range(node * per_node, (node + 1) * per_node)
            pairs = sorted(((-shared[a][b], a, b) for a in ranks for b in ranks))
            free_new, free_old = set(ranks), set(ranks)
            for _, a, b in pairs:  # a's experts go to old rank b's slots
                if a in free_new and b in free_old:
                    free_new.discard(a)
                    free_old.discard(b)
                    experts, row = list(new_lists[a]), []
                    for e in old_lists[b]:  # an expert it holds now keeps its slot
                        row.append(e if e in experts else None)
                        if e in experts:
                            experts.remove(e)
                    row = [e if e is not None else experts.pop(0) for e in row]
                    out[layer, b * per_rank:(b + 1) * per_rank] = torch.tensor(row)
    return out


def rank_loads(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Predicted load per EP rank, [L, P] float64: each expert's ``weight [L, E]`` split evenly over
    its ``logcnt`` replicas, summed over the slots of each rank (``phy2log [L, R]``)."""
    per_replica = weight.double() / logcnt
    return per_replica.gather(1, phy2log).view(phy2log.shape[0], num_ranks, -1).sum(2)


def imbalance(loads: torch.Tensor) -> torch.Tensor:
    """max / mean load over the EP ranks, per layer: ``loads [L, P]`` -> [L] float64 (1.0 for an idle layer)."""
    loads = loads.double()
    mean = loads.mean(1)
    return torch.where(mean > 0, loads.max(1).values / mean.clamp(min=1e-300), torch.ones_like(mean))
