"""Which kernels the model runs: the torch references or the Triton kernels.

The setting (``EngineConfig.kernels``, worker flag ``--kernels``, env
``DEEPINFER_KERNELS``; the first one given wins, in that order)::

    auto    (default) Triton when the model's tensors are on a CUDA device and
            triton imports; the torch reference otherwise (so on a CPU: torch)
    torch   the torch reference everywhere (libs/kernels/attention.py, models/layers.py,
            models/moe.py)
    triton  the Triton kernels (libs/kernels/triton_*.py); on a CPU only where they were
            built for the Triton interpreter (TRITON_INTERPRET=1 in the environment
            before they are first imported), which is slow and meant for tests.
            ValueError where that cannot run.

``use(model, backend)`` sets ``backend`` on every module that has a Triton path
(``Attention``: KV store, rotary, paged attention; ``RMSNorm`` and
``GemmaRMSNorm``; ``DecoderLayer``: residual add fused into its second norm;
``MoEBlock``: grouped-GEMM experts). The torch path of each is the code that ran
before the Triton kernels existed, unchanged.
"""

from __future__ import annotations

import importlib.util
import os

import torch

ENV = "DEEPINFER_KERNELS"
SETTINGS = ("auto", "torch", "triton")


def requested(setting: str | None = None) -> str:
    """The setting in force: ``setting``, else ``$DEEPINFER_KERNELS``, else "auto".
    Raises ValueError for anything but auto / torch / triton."""
    value = (setting or os.environ.get(ENV) or "auto").strip().lower()
    if value not in SETTINGS:
        raise ValueError(f"kernels must be one of {SETTINGS}, not {value!r}")
    return value


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether the Triton kernels run under the Triton interpreter (decided when
    ``kernels.triton_attention`` is first imported: TRITON_INTERPRET=1 then)."""
    from deepinfer.kernels import triton_attention

    return type(triton_attention._paged_attention_kernel).__name__ == "InterpretedFunction"


def resolve(setting: str | None, device: torch.device | str) -> str:
    """"torch" or "triton" for a model on ``device`` (see the module docstring).
    Raises ValueError when "triton" is asked for and cannot run there."""
    want = requested(setting)
    device = torch.device(device)
    if want == "torch":
        return "torch"
    if want == "auto":
        return "triton" if device.type == "cuda" and triton_importable() else "torch"
    if not triton_importable():
        raise ValueError("kernels=triton but triton is not installed (pip install 'triton>=3.4,<4')")
    if device.type != "cuda" and not interpreted():
        raise ValueError(f"kernels=triton on {device.type}: Triton compiles for GPUs; on a CPU set "
                         "TRITON_INTERPRET=1 before start (interpreter mode: correct but slow)")
    return "triton"


def use(model: torch.nn.Module, backend: str) -> None:
    """Make every module of ``model`` with a Triton path run ``backend`` ("torch" / "triton")."""
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be torch or triton, not {backend!r}")
    for m in model.modules():
        if hasattr(type(m), "backend"):
            m.backend = backend
