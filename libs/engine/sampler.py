"""Token sampling: greedy, temperature and top-p (nucleus, Holtzman et al. 2019)."""

from __future__ import annotations

import torch

from deepinfer.protocol import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row of ``logits`` [B, V] float32.

    temperature == 0 -> argmax. Otherwise softmax(logits / temperature),
    restricted to the smallest set of tokens whose mass reaches ``top_p``,
    then one draw with the row's generator (seeded per request when it set a
    seed, so its output is reproducible; None uses torch's global RNG).
    """
    out = logits.argmax(dim=-1).tolist()
    for i, sp in enumerate(params):
        if sp.temperature <= 0:
            continue
        probs = torch.softmax(logits[i] / sp.temperature, dim=-1)
        if sp.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < sp.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]))
    return out
