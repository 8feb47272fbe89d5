"""EPLB (deepseek-ai/EPLB): the algorithm and the placement tensors on hand-made load matrices."""

import pytest
import torch

from deepinfer.balancer.eplb import (balanced_packing, check_topology, imbalance, keep_slots, rank_loads,
                                     rebalance_experts, replicate)
from deepinfer.models.expert_placement import ExpertPlacement, log2phy_from_phy2log

# 2 layers x 16 experts: skewed, a zero-load expert, two very hot experts in layer 1
LOADS = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86, 0, 12, 7, 30],
                      [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27, 900, 3, 5, 600]])


def zipf_loads(num_layers, num_experts, seed, s=1.2):
    g = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(num_layers)]) + 1
    return 1e5 / ranks.double() ** s


def assert_valid(phy2log, log2phy, logcnt, num_experts, num_slots, num_ranks):
    """Every expert has >= 1 replica, each rank exactly R/P slots holding experts, the three agree."""
    num_layers = phy2log.shape[0]
    assert phy2log.shape == (num_layers, num_slots) and logcnt.shape == (num_layers, num_experts)
    assert ((phy2log >= 0) & (phy2log < num_experts)).all()  # every slot holds a real expert
    assert (logcnt >= 1).all() and (logcnt.sum(1) == num_slots).all()
    per_rank = phy2log.view(num_layers, num_ranks, -1)
    assert per_rank.shape[2] == num_slots // num_ranks and (per_rank >= 0).all()
    for layer in range(num_layers):
        seen = []
        for e in range(num_experts):
            n = int(logcnt[layer, e])
            slots = log2phy[layer, e, :n].tolist()
            assert (log2phy[layer, e, n:] == -1).all() and slots == sorted(slots)
            assert all(int(phy2log[layer, s]) == e for s in slots)
            seen += slots
        assert sorted(seen) == list(range(num_slots))  # each slot belongs to exactly one expert
    ExpertPlacement(phy2log, log2phy, logcnt, num_ranks)  # its own consistency check agrees


def test_balanced_packing_puts_the_heaviest_item_in_the_lightest_pack_with_room():
    pack, index = balanced_packing(torch.tensor([[9.0, 7, 6, 5, 4, 3]]), 3)
    # 9->p0, 7->p1, 6->p2, 5->p2 (6 is lightest), 4->p1 (7), 3->p0: loads 12, 11, 11
    assert pack.tolist() == [[0, 1, 2, 2, 1, 0]]
    assert index.tolist() == [[0, 0, 0, 1, 1, 1]]
    with pytest.raises(ValueError, match="evenly"):
        balanced_packing(torch.ones(1, 5), 2)


def test_replicate_gives_each_spare_slot_to_the_largest_load_per_replica():
    slot2expert, count = replicate(torch.tensor([[6.0, 3, 2], [1, 8, 1]]), 6)
    # row 0: expert 0 (6 -> 3 each); tie 3 vs 3 -> the lower id, 0 (2 each); then expert 1 (3)
    assert slot2expert.tolist() == [[0, 1, 2, 0, 0, 1], [0, 1, 2, 1, 1, 1]]
    assert count.tolist() == [[3, 2, 1], [1, 4, 1]]


def test_one_hot_expert_gets_the_spare_slots_and_the_ranks_are_packed_greedily():
    phy2log, log2phy, logcnt = rebalance_experts(torch.tensor([[100, 1, 1, 1]]), num_slots=8, num_ranks=4)
    assert logcnt.tolist() == [[5, 1, 1, 1]]  # 100/5 = 20 per replica, still above the others
    assert_valid(phy2log, log2phy, logcnt, 4, 8, 4)
    loads = rank_loads(torch.tensor([[100.0, 1, 1, 1]]), phy2log, logcnt, 4)
    # 5 replicas of 20 over 4 ranks of 2 slots: one rank must take two
    assert loads.tolist() == [[40.0, 21.0, 21.0, 21.0]]
    assert log2phy.shape == (1, 4, 5)  # M = R - E + 1


def test_uniform_load_is_perfectly_balanced():
    phy2log, log2phy, logcnt = rebalance_experts(torch.full((3, 16), 7.0), num_slots=16, num_ranks=4)
    assert (logcnt == 1).all()
    assert torch.equal(imbalance(rank_loads(torch.full((3, 16), 7.0), phy2log, logcnt, 4)), torch.ones(3,
                                                                                                  dtype=torch.float64))


@pytest.mark.parametrize("groups,nodes,ranks,redundant", [(4, 2, 8, 8), (8, 4, 8, 16), (4, 1, 4, 4), (1, 1, 4, 0),
                                                          (3, 2, 8, 8), (16, 4, 4, 4)])
def test_every_expert_has_a_replica_and_each_rank_holds_slots_over_ranks(groups, nodes, ranks, redundant):
    loads = LOADS if 16 % groups == 0 else LOADS[:, :15]
    num_experts = loads.shape[1]
    num_slots = num_experts + redundant + (-(num_experts + redundant) % ranks)
    phy2log, log2phy, logcnt = rebalance_experts(loads, num_slots, groups, nodes, ranks)
    assert_valid(phy2log, log2phy, logcnt, num_experts, num_slots, ranks)


@pytest.mark.parametrize("groups,nodes,ranks", [(4, 2, 8), (8, 4, 8), (8, 2, 4)])
def test_hierarchical_keeps_each_group_on_one_node(groups, nodes, ranks):
    loads = zipf_loads(6, 32, seed=groups * nodes)
    phy2log, _, _ = rebalance_experts(loads, 32 + ranks * 2, groups, nodes, ranks)
    slots_per_node = phy2log.shape[1] // nodes
    node_of_slot = torch.arange(phy2log.shape[1]) // slots_per_node
    for layer in range(6):
        for g in range(groups):
            members = (phy2log[layer] // (32 // groups)) == g
            assert node_of_slot[members].unique().numel() == 1, f"layer {layer}: group {g} spans nodes"
        # and every node holds exactly groups / nodes whole groups
        for n in range(nodes):
            held = (phy2log[layer, node_of_slot == n] // (32 // groups)).unique()
            assert held.numel() == groups // nodes


def test_global_policy_when_groups_do_not_divide_over_nodes_may_split_a_group():
    # 3 groups over 2 nodes -> global: one hot group's experts spread over both nodes
    loads = torch.tensor([[50.0, 50, 50, 50, 1, 1, 1, 1, 1, 1, 1, 1]])
    phy2log, log2phy, logcnt = rebalance_experts(loads, 16, num_groups=3, num_nodes=2, num_ranks=4)
    assert_valid(phy2log, log2phy, logcnt, 12, 16, 4)
    node_of_slot = torch.arange(16) // 8
    assert node_of_slot[phy2log[0] < 4].unique().numel() == 2
    assert not check_topology(12, 16, 3, 2, 4)


def test_rebalancing_beats_the_identity_placement_on_skewed_loads():
    loads = zipf_loads(8, 64, seed=3)
    identity = ExpertPlacement.identity(8, 64, 8)
    before = imbalance(rank_loads(loads, identity.phy2log, identity.logcnt, 8))
    phy2log, log2phy, logcnt = rebalance_experts(loads, 80, num_ranks=8)
    after = imbalance(rank_loads(loads, phy2log, logcnt, 8))
    assert before.min() > 1.5 and after.max() < 1.05
    assert (after <= before).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_slots=15), "slots < 16 experts"),
    (dict(num_slots=18, num_ranks=4), "split evenly over 4 EP ranks"),
    (dict(num_slots=16, num_groups=6, num_nodes=2, num_ranks=4), "16 experts do not split evenly into 6 groups"),
    (dict(num_slots=24, num_groups=4, num_nodes=4, num_ranks=6), "6 EP ranks do not split evenly over 4 nodes"),
    (dict(num_slots=16, num_ranks=0), ">= 1"),
])
def test_a_topology_that_cannot_hold_the_experts_is_a_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rebalance_experts(LOADS, **kwargs)


def test_loads_must_be_a_finite_non_negative_matrix():
    with pytest.raises(ValueError, match="finite"):
        rebalance_experts(torch.tensor([[1.0, -1.0]]), 2)
    with pytest.raises(ValueError, match="finite"):
        rebalance_experts(torch.tensor([[1.0, float("nan")]]), 2)
    with pytest.raises(ValueError, match="layers, experts"):
        rebalance_experts(torch.ones(4), 4)


def test_log2phy_lists_each_experts_slots_ascending_padded_with_minus_one():
    # the example of the placement module's docstring
    log2phy, logcnt = log2phy_from_phy2log(torch.tensor([[0, 2, 1, 3, 0, 2]]), 4)
    assert log2phy.tolist() == [[[0, 4], [2, -1], [1, 5], [3, -1]]]
    assert logcnt.tolist() == [[2, 1, 2, 1]]
    with pytest.raises(ValueError, match="expert 3 of MoE layer 0 has no slot"):
        log2phy_from_phy2log(torch.tensor([[0, 1, 2, 0]]), 4)
    with pytest.raises(ValueError, match="outside"):
        log2phy_from_phy2log(torch.tensor([[0, 1, 4]]), 4)


def test_a_placement_whose_tensors_disagree_is_refused():
    good = ExpertPlacement.from_phy2log(torch.tensor([[0, 2, 1, 3, 0, 2]]), 4, num_ranks=2)
    assert good.slots_per_rank == 3 and good.max_replicas == 2
    with pytest.raises(ValueError, match="log2phy disagrees"):
        ExpertPlacement(good.phy2log, good.log2phy.flip(2), good.logcnt, 2)
    with pytest.raises(ValueError, match="logcnt disagrees"):
        ExpertPlacement(good.phy2log, good.log2phy, good.logcnt + 1, 2)
    with pytest.raises(ValueError, match="split evenly over 4"):
        ExpertPlacement(good.phy2log, good.log2phy, good.logcnt, 4)
    with pytest.raises(ValueError, match="bad placement lists"):
        ExpertPlacement.from_lists([[0, 1], [0]], [], [], 1, 1)
    wire = good.to_lists()
    again = ExpertPlacement.from_lists(wire["phy2log"], wire["log2phy"], wire["logcnt"], 2, 7)
    assert torch.equal(again.log2phy, good.log2phy) and again.version == 7


def rank_multisets(phy2log, num_ranks):
    return [sorted(sorted(r) for r in row.view(num_ranks, -1).tolist()) for row in phy2log]


def test_keep_slots_renumbers_a_placement_to_move_as_few_weights_as_possible():
    g = torch.Generator().manual_seed(0)
    current, _, _ = rebalance_experts(zipf_loads(4, 16, seed=1), 24, num_ranks=4)
    # the same placement with its ranks and each rank's slots shuffled: nothing needs to move
    shuffled = torch.stack([row.view(4, 6)[torch.randperm(4, generator=g)][:, torch.randperm(6, generator=g)]
                            .flatten() for row in current])
    assert (shuffled != current).sum() > 40
    assert torch.equal(keep_slots(shuffled, current, 4), current)
    # another placement: the same experts per rank (so the same loads), fewer slots change
    candidate, _, _ = rebalance_experts(zipf_loads(4, 16, seed=2), 24, num_ranks=4)
    kept = keep_slots(candidate, current, 4)
    assert rank_multisets(kept, 4) == rank_multisets(candidate, 4)
    assert (kept != current).sum() < (candidate != current).sum()
    assert_valid(kept, *log2phy_from_phy2log(kept, 16, 9), 16, 24, 4)


def test_keep_slots_permutes_ranks_only_within_their_node():
    current, _, _ = rebalance_experts(zipf_loads(3, 32, seed=4), 48, num_groups=4, num_nodes=2, num_ranks=8)
    candidate, _, _ = rebalance_experts(zipf_loads(3, 32, seed=5), 48, num_groups=4, num_nodes=2, num_ranks=8)
    kept = keep_slots(candidate, current, 8, num_nodes=2)
    for half in (slice(0, 24), slice(24, 48)):  # each node keeps its experts
        assert torch.equal(kept[:, half].sort(1).values, candidate[:, half].sort(1).values)
    assert (kept != current).sum() <= (candidate != current).sum()
