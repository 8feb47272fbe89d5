"""Which layers' KV a block carries where, for hybrid sliding-window models.

Three shapes of one block (B = block_size tokens; Hkv, D: KV heads, head dim)::

    handoff / export (``ModelRunner.read_blocks``):  [num_layers,        2, B, Hkv, D]
    storage-tier prefix file (``full_part``):        [num_full_layers,   2, B, Hkv, D]
    window part, handoff only (``window_part``):     [num_window_layers, 2, B, Hkv, D]

The storage tier persists only the full-attention layers' blocks under their
prefix hash: a window layer's KV matters for the last W tokens of a prefix
only, and is rebuilt from the SWA state cache or by bounded replay. A
prefill -> decode handoff still needs the window layers' KV of the prompt's
last window: it travels as ephemeral per-request blocks beside the full
parts (``DecodeRequest.window_block_keys``), and ``join`` puts the two back
together. Models without window layers (or engines that keep every layer in
one pool) have ``window_layers == ()`` and every part is the whole block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """num_layers: attention layers in model order; window_layers: indices of the
    sliding-window layers whose KV lives in the window pool (empty: none)."""

    num_layers: int
    window_layers: tuple[int, ...] = ()

    @property
    def hybrid(self) -> bool:
        return bool(self.window_layers)

    @property
    def full_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if i not in self.window_layers]

    def full_part(self, block: torch.Tensor) -> torch.Tensor:
        """[num_layers, ...] -> the full layers' [num_full_layers, ...] (a contiguous copy
        for hybrid models, ``block`` itself otherwise)."""
        return block[self.full_layers] if self.hybrid else block

    def window_part(self, block: torch.Tensor) -> torch.Tensor:
        """[num_layers, ...] -> the window layers' [num_window_layers, ...] (a copy).
        Raises ValueError for a model without window layers."""
        if not self.hybrid:
            raise ValueError("no window layers")
        return block[list(self.window_layers)]

    def join(self, full: torch.Tensor, window: torch.Tensor | None) -> torch.Tensor:
        """Full part [num_full_layers, ...] + window part [num_window_layers, ...] (None:
        released, zeros) -> [num_layers, ...]. Raises ValueError on mismatched shapes."""
        if not self.hybrid:
            return full
        nf = self.num_layers - len(self.window_layers)
        if full.shape[0] != nf or (window is not None and (window.shape[0] != len(self.window_layers)
                                                           or window.shape[1:] != full.shape[1:])):
            raise ValueError(f"parts {tuple(full.shape)} / {None if window is None else tuple(window.shape)} "
                             f"do not fit {nf} full + {len(self.window_layers)} window layers")
        out = full.new_zeros(self.num_layers, *full.shape[1:])
        out[self.full_layers] = full
        if window is not None:
            out[list(self.window_layers)] = window.to(full.dtype)
        return out
