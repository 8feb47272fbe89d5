"""Attention, cache, norm, rotary and MoE kernels: torch references (attention.py; the norms, rotary and
experts in models/) and their Triton twins (triton_*.py; docs/kernels.md), chosen by select.py."""
