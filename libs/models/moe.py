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

``expert_counts`` [E] int64 accumulates, per layer, how many (token, expert)
pairs were routed to each expert since the last ``reset_expert_counts()``
(every forward: prefill, decode and recomputation after preemption).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.models.layers import GatedMLP


class MoEBlock(nn.Module):
    """Base of the MoE MLPs: routed-token counters and the sorted-token dispatch.

    A subclass provides ``route(x) -> (weights [T, k], expert ids [T, k])`` and
    ``expert(e, x [n, hidden]) -> [n, hidden]``.
    """

    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.init_buffers()

    def init_buffers(self, device: torch.device | str = "cpu") -> None:
        self.register_buffer("expert_counts", torch.zeros(self.num_experts, dtype=torch.int64, device=device),
                             persistent=False)

    def reset_expert_counts(self) -> None:
        with torch.inference_mode():  # NOTE: also valid if the buffer was made in inference mode
            self.expert_counts.zero_()

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum over each token's k experts of weight * expert(x), experts run in id order."""
        flat = experts.flatten()  # [T * k], pair p is token p // k
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.expert_counts += counts
        tokens = order // self.top_k
        pair_weights = weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                idx = tokens[start:start + n]
                y = self.expert(e, x[idx]) * pair_weights[start:start + n, None]
                out.index_add_(0, idx, y.to(out.dtype))
                start += n
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dispatch(x, *self.route(x))


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

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.experts[e](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.dispatch(x, *self.route(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoECounters:
    """Mixin for MoE models: the balancer reads ``expert_counts()`` and calls ``reset_expert_counts()``."""

    def moe_blocks(self) -> list[MoEBlock]:
        return [m for m in self.modules() if isinstance(m, MoEBlock)]

    def expert_counts(self) -> torch.Tensor:
        """[num_moe_layers, num_experts] int64: (token, expert) pairs routed since the last reset."""
        return torch.stack([b.expert_counts for b in self.moe_blocks()])

    def reset_expert_counts(self) -> None:
        for b in self.moe_blocks():
            b.reset_expert_counts()
