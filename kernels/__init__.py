"""Attention and cache kernels: torch reference implementations (Triton versions arrive with issue #14)."""
