"""Sparse Mixture-of-Experts MLPs with top-k routing, and their routed-token counters.

``MoEBlock`` (counters + dispatch) is shared with ``gpt_oss.GptOssMLP``;
``SparseMoeBlock`` is the Qwen2/Qwen3-MoE block.

Source: ``transformers`` modeling_qwen2_moe / modeling_qwen3_moe
(``*TopKRouter``, ``*Experts``, ``Qwen2MoeSparseMoeBlock``); Shazeer et al.
2017 (sparsely-gated MoE), Fedus et al. 2021 (top-k dispatch).

Per token ``x`` [hidden]::

    p = softmax(x @ gate.weight^T)                      # [E], fp32
    w, e = topk(p, k); w /= sum(w) if norm_topk_prob      # k experts, their weights
    y = sum_j w_j * experts[e_j](x)                      # SwiGLU experts
    y += sigmoid(shared_expert_gate(x)) * shared_expert(x)   # Qwen2-MoE only

Dispatch is sorted by expert: the ``[T * k]`` (token, expert) pairs are
stably sorted by expert id, each expert runs once on its contiguous slice of
tokens, and weighted outputs are scatter-added back (``index_add_``) in
expert order, the same summation order as transformers.

Expert parallelism (EP; deepseek-ai/EPLB): the experts' weights
live in physical *slots* (``R`` of them: every logical expert once, plus
replicas of popular ones), and EP rank ``p`` owns slots ``[p*R/P, (p+1)*R/P)``
(``expert_placement``). Here the ranks are partitions of one process's slots: the
accounting per rank is real, the parallelism simulated. Each (token, expert)
pair goes to one replica of its expert, round-robin over the tokens routed to
that expert (a cursor per expert carries over between steps, so one-token
decode steps rotate too)::

    sorted pair j of expert e -> replica (cursor[e] + j - first[e]) % logcnt[e]
                              -> slot log2phy[e, replica] -> that slot's weights

Each slot runs once on its pairs (rank by rank, slot by slot), and the weighted
outputs are added back in *logical* expert order, as above: a placement never
changes what a token receives, nor the summation order, only which copy of the
weights computes it and with how many other rows. In batch-invariant mode
(``EngineConfig.batch_invariant``) a slot's rows are padded to 16, so logits are
bit-identical under any placement; otherwise a placement changes GEMM row counts
as batching does (CPU GEMMs of 1-11 rows take other kernels: ~1e-6 differences).

Counters, per layer, since the last ``reset_expert_counts()`` (every forward:
prefill, decode and recomputation after preemption): ``expert_counts`` [E]
int64, (token, expert) pairs routed to each logical expert; ``rank_counts``
[P] int64, pairs computed on each EP rank.

A new placement is applied by ``apply_placement``: the slots whose expert
changes get a copy of the weights from a slot that holds that expert now (the
same rank's first if any), then the routing table (``phy2log``, ``log2phy``,
``logcnt``) is swapped. Callers run it between forward passes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.models.expert_placement import ExpertPlacement
from deepinfer.models.layers import GatedMLP, Linear


class MoEBlock(nn.Module):
    """Base of the MoE MLPs: routed-token counters, the routing table and the sorted-token dispatch.

    A subclass provides ``route(x) -> (weights [T, k], expert ids [T, k])``,
    ``expert(slot, x [n, hidden]) -> [n, hidden]`` and its slot storage:
    ``slot_tensors(slot)`` (the tensors that hold one slot's weights, writable,
    in a fixed order), ``resize_slots(n)`` and, if it caches derived weights,
    ``slot_written(slot)``. At load, slot e holds logical expert e.

    ``backend`` "triton" (set by ``kernels.select.use``): the slots' GEMMs run as two
    grouped GEMMs over all pairs (``kernels.triton_moe``); a subclass then provides
    ``expert_weights()`` and ``expert_activation(h)``. Routing, counters, replica
    choice and the summation order stay as below.
    """

    batch_invariant = False  # set by the engine (``EngineConfig.batch_invariant``)
    backend = "torch"

    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.num_ranks = 1
        self.init_buffers()

    def init_buffers(self, device: torch.device | str = "cpu") -> None:
        """Counters and the identity routing table (slot e = expert e, one EP rank)."""
        e, i64 = self.num_experts, dict(dtype=torch.int64, device=device)
        self.num_ranks = 1
        for name, value in (("expert_counts", torch.zeros(e, **i64)), ("rank_counts", torch.zeros(1, **i64)),
                            ("rr_cursor", torch.zeros(e, **i64)), ("phy2log", torch.arange(e, **i64)),
                            ("log2phy", torch.arange(e, **i64)[:, None]), ("logcnt", torch.ones(e, **i64))):
            self.register_buffer(name, value, persistent=False)

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[0]

    def reset_expert_counts(self) -> None:
        with torch.inference_mode():  # NOTE: also valid if the buffer was made in inference mode
            self.expert_counts.zero_()
            self.rank_counts.zero_()

    # --- dispatch ----------------------------------------------------------------
    def slots_of(self, experts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Physical slot of each pair: ``experts`` [n] sorted logical ids, ``counts`` [E] pairs per
        expert. Round-robin over each expert's replicas; advances the cursors."""
        first = counts.cumsum(0) - counts
        j = torch.arange(experts.numel(), device=experts.device) - first[experts]
        replica = (self.rr_cursor[experts] + j) % self.logcnt[experts]
        self.rr_cursor.copy_((self.rr_cursor + counts) % self.logcnt)
        return self.log2phy[experts, replica]

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum over each token's k experts of weight * expert(x): slots run rank by rank,
        outputs summed in logical expert order."""
        flat = experts.flatten()  # [T * k], pair p is token p // k
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.expert_counts += counts
        tokens = order // self.top_k
        pair_weights = weights.flatten()[order]
        slots = self.slots_of(flat[order], counts)
        slot_counts = torch.bincount(slots, minlength=self.num_slots)
        self.rank_counts += slot_counts.view(self.num_ranks, -1).sum(1)
        if self.backend == "triton":
            from deepinfer.kernels import triton_moe

            y = triton_moe.moe_experts(x, tokens, pair_weights, slots, self.num_slots, *self.expert_weights(),
                                       self.expert_activation)
            return self._sum_in_expert_order(x, tokens, y, counts)
        by_slot = torch.argsort(slots, stable=True)  # rank-major: slots of rank 0 first
        y = torch.empty(flat.numel(), x.shape[1], dtype=x.dtype, device=x.device)  # per sorted pair
        start = 0
        for slot, n in enumerate(slot_counts.tolist()):
            if n:
                pos = by_slot[start:start + n]
                rows = x[tokens[pos]]
                if self.batch_invariant and n < Linear.INVARIANT_MIN_ROWS:
                    # NOTE: GEMMs of a few rows take other kernels (other bits); padded, a row's
                    # result does not depend on how many rows share its slot (the placement)
                    rows = F.pad(rows, (0, 0, 0, Linear.INVARIANT_MIN_ROWS - n))
                y[pos] = (self.expert(slot, rows)[:n] * pair_weights[pos, None]).to(y.dtype)
                start += n
        return self._sum_in_expert_order(x, tokens, y, counts)

    @staticmethod
    def _sum_in_expert_order(x: torch.Tensor, tokens: torch.Tensor, y: torch.Tensor,
                             counts: torch.Tensor) -> torch.Tensor:
        """Scatter-add the sorted pairs' outputs ``y`` [T * k, hidden] to their tokens."""
        out = torch.zeros_like(x)
        start = 0
        for n in counts.tolist():  # logical expert order: transformers' summation order
            if n:
                out.index_add_(0, tokens[start:start + n], y[start:start + n])
                start += n
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dispatch(x, *self.route(x))

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Triton path: every slot's weights as (w1 [R, hidden, N1], b1 [R, N1] or None,
        w2 [R, I, hidden], b2 [R, hidden] or None); strided views are fine."""
        raise NotImplementedError

    def expert_activation(self, h: torch.Tensor) -> torch.Tensor:
        """Triton path: [P, N1] first-GEMM outputs -> [P, I] inputs of the second."""
        raise NotImplementedError

    # --- placement ---------------------------------------------------------------
    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        raise NotImplementedError

    def resize_slots(self, num_slots: int) -> None:
        raise NotImplementedError

    def slot_written(self, slot: int) -> None:
        """Called after a slot's tensors were overwritten (rebuild what is derived from them)."""

    def slot_bytes(self) -> int:
        """Bytes of one slot's weights."""
        return sum(t.numel() * t.element_size() for t in self.slot_tensors(0))

    @torch.no_grad()
    def apply_placement(self, phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor,
                        num_ranks: int) -> int:
        """Make this layer's slots hold ``phy2log`` [R]: copy weights into the slots whose expert
        changes (from a slot holding that expert now, the same EP rank's first), then swap the
        routing table (``log2phy`` [E, M], ``logcnt`` [E], int64) and reset ``rank_counts`` to
        ``num_ranks`` zeros. Returns the number of slots copied. Not thread-safe: run it
        between forward passes. The tensors are trusted (``ExpertPlacement`` checks them).
        """
        old, new = self.phy2log.tolist(), [int(e) for e in phy2log.tolist()]
        old_per_rank, new_per_rank = len(old) // self.num_ranks, len(new) // num_ranks
        holders: dict[int, list[int]] = {}
        for slot, e in enumerate(old):
            holders.setdefault(e, []).append(slot)
        sources = {}  # slot to overwrite -> slot to copy from (old numbering)
        for slot, e in enumerate(new):
            if slot < len(old) and old[slot] == e:
                continue
            same_rank = [s for s in holders[e] if s // old_per_rank == slot // new_per_rank]
            sources[slot] = (same_rank or holders[e])[0]
        # NOTE: a source that is itself overwritten (or dropped) is read before any write
        lost = set(sources) | set(range(len(new), len(old)))
        staged = {s: [t.clone() for t in self.slot_tensors(s)] for s in set(sources.values()) & lost}
        if len(new) > len(old):
            self.resize_slots(len(new))
        for slot, src in sorted(sources.items()):
            for dst, t in zip(self.slot_tensors(slot), staged[src] if src in staged else self.slot_tensors(src)):
                dst.copy_(t)
            self.slot_written(slot)
        if len(new) < len(old):
            self.resize_slots(len(new))
        device = self.expert_counts.device
        self.phy2log = torch.tensor(new, dtype=torch.int64, device=device)
        self.log2phy = log2phy.to(device=device, dtype=torch.int64).clone()
        self.logcnt = logcnt.to(device=device, dtype=torch.int64).clone()
        self.num_ranks = num_ranks
        # NOTE: new tensors, not in-place writes: the old ones may be inference tensors
        self.rank_counts = torch.zeros(num_ranks, dtype=torch.int64, device=device)
        self.rr_cursor = torch.zeros_like(self.logcnt)
        return len(sources)


class SparseMoeBlock(MoEBlock):
    """Qwen2/Qwen3-MoE block: forward(x [T, hidden]) -> [T, hidden]. Parameter names match HF
    checkpoints: ``gate.weight`` [E, hidden], ``experts.N.{gate,up,down}_proj.weight``,
    ``shared_expert.*`` and ``shared_expert_gate.weight`` [1, hidden] when shared."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 act: str = "silu", shared_intermediate: int = 0):
        super().__init__(num_experts, top_k)
        self.norm_topk_prob = norm_topk_prob
        # NOTE: the router and shared gate use plain nn.Linear (F.linear), exactly like
        # transformers: routing is discrete, so its logits must match bit for bit.
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden, intermediate, act) for _ in range(num_experts))
        if shared_intermediate:
            self.shared_expert = GatedMLP(hidden, shared_intermediate, act)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax over all experts, then top-k (renormalised if ``norm_topk_prob``)."""
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts

    def expert(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        return self.experts[slot](x)

    _stacked: tuple | None = None  # triton path: the slots' weights stacked, built on first use

    def expert_weights(self):
        """Gate and up stacked as w1 [R, hidden, 2I] (gate first), down as w2 [R, I, hidden]:
        views of [R, out, in] copies (one extra copy of the experts' weights, dropped
        when a slot is rewritten)."""
        if self._stacked is None:
            e = self.experts

            def stack(get):
                return torch.stack([get(m) for m in e])

            w1 = stack(lambda m: torch.cat([m.gate_proj.weight, m.up_proj.weight]))
            w2 = stack(lambda m: m.down_proj.weight)
            b1 = b2 = None
            if e[0].gate_proj.bias is not None:
                b1 = stack(lambda m: torch.cat([m.gate_proj.bias, m.up_proj.bias]))
                b2 = stack(lambda m: m.down_proj.bias)
            self._stacked = (w1.transpose(1, 2), b1, w2.transpose(1, 2), b2)
        return self._stacked

    def expert_activation(self, h: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` (``GatedMLP``)."""
        gate, up = h.chunk(2, dim=-1)
        return self.experts[0].act(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.dispatch(x, *self.route(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    # --- slot storage: ``experts.N`` is slot N (expert N until a placement moves it) ---
    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        return list(self.experts[slot].parameters())

    def resize_slots(self, num_slots: int) -> None:
        """Keep the first ``num_slots`` slots; new ones are uninitialised (written next)."""
        slots = list(self.experts[:num_slots])
        template = self.experts[0]
        w = template.gate_proj.weight
        while len(slots) < num_slots:
            with torch.device("meta"):
                m = GatedMLP(w.shape[1], w.shape[0], bias=template.gate_proj.bias is not None)
            m = m.to_empty(device=w.device).to(w.dtype).requires_grad_(False)
            m.act = template.act
            for a, b in zip(m.modules(), template.modules()):
                if isinstance(a, Linear):
                    a.batch_invariant, a.packed_max_rows = b.batch_invariant, b.packed_max_rows
                    a.bf16w_max_rows = b.bf16w_max_rows
            slots.append(m)
        self.experts = nn.ModuleList(slots)
        self._stacked = None

    def _packed(self) -> bool:
        return self.experts[0].gate_proj.packed is not None

    def slot_written(self, slot: int) -> None:
        """Re-pack the slot's GEMM weights when the layer runs packed (``layers.Linear``), renew
        their bf16 copies when decode steps read those (``Linear.keep_bf16_weight``); drop the
        Triton path's stacked copy."""
        self._stacked = None
        bf16w = self.experts[0].gate_proj.bf16w_max_rows > 0
        for m in self.experts[slot].modules():
            if isinstance(m, Linear):
                if self._packed():
                    m.pack()
                if bf16w:
                    m.keep_bf16_weight()

    def slot_bytes(self) -> int:
        """Bytes of one slot: its weights, twice when packed (``Linear.pack`` keeps a copy; MKL's
        opaque packed buffer does not expose its size, so it is counted at the weight's)."""
        return super().slot_bytes() * (2 if self._packed() else 1)


class MoECounters:
    """Mixin for MoE models: the worker reads and resets the counters, and applies placements.

    Every method covers the MoE layers in model order (``L`` of them; dense layers skipped).
    """

    expert_placement_version = 0

    def moe_blocks(self) -> list[MoEBlock]:
        return [m for m in self.modules() if isinstance(m, MoEBlock)]

    def expert_counts(self) -> torch.Tensor:
        """[num_moe_layers, num_experts] int64: (token, expert) pairs routed since the last reset."""
        return torch.stack([b.expert_counts for b in self.moe_blocks()])

    def rank_counts(self) -> torch.Tensor:
        """[num_moe_layers, num_ranks] int64: (token, expert) pairs computed per EP rank since the last reset."""
        return torch.stack([b.rank_counts for b in self.moe_blocks()])

    def reset_expert_counts(self) -> None:
        for b in self.moe_blocks():
            b.reset_expert_counts()

    def take_expert_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert_counts, rank_counts) copies, then reset. Call between forward passes, or counts are lost."""
        counts = self.expert_counts().clone(), self.rank_counts().clone()
        self.reset_expert_counts()
        return counts

    def expert_placement(self) -> ExpertPlacement:
        """The placement the MoE layers run now."""
        blocks = self.moe_blocks()
        return ExpertPlacement(torch.stack([b.phy2log for b in blocks]), torch.stack([b.log2phy for b in blocks]),
                               torch.stack([b.logcnt for b in blocks]), blocks[0].num_ranks,
                               self.expert_placement_version)

    def check_expert_placement(self, placement: ExpertPlacement) -> None:
        """Raise ValueError unless the placement has this model's MoE layers and experts."""
        blocks = self.moe_blocks()
        if (placement.num_layers, placement.num_experts) != (len(blocks), blocks[0].num_experts):
            raise ValueError(f"placement for {placement.num_layers} MoE layers x {placement.num_experts} experts; "
                             f"the model has {len(blocks)} x {blocks[0].num_experts}")

    def apply_expert_placement(self, placement: ExpertPlacement) -> int:
        """Copy replica weights into their slots, then swap each layer's routing table (see
        ``MoEBlock.apply_placement``; counters are reset: take them first). Returns the number
        of slots copied. Raises ValueError when the placement's layers or experts do not match
        the model. Not thread-safe: run it between forward passes.
        """
        self.check_expert_placement(placement)
        blocks = self.moe_blocks()
        copied = sum(b.apply_placement(placement.phy2log[i], placement.log2phy[i], placement.logcnt[i],
                                       placement.num_ranks) for i, b in enumerate(blocks))
        self.reset_expert_counts()
        self.expert_placement_version = placement.version
        return copied

    def expert_memory(self) -> tuple[int, int]:
        """(bytes of the logical experts' weights, extra bytes of the replicas), over all MoE layers:
        ``E * slot_bytes`` and ``(R - E) * slot_bytes`` per layer."""
        blocks = self.moe_blocks()
        return (sum(b.num_experts * b.slot_bytes() for b in blocks),
                sum((b.num_slots - b.num_experts) * b.slot_bytes() for b in blocks))
