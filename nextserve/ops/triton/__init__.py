"""Triton GPU kernels. Each has a plain PyTorch reference in nextserve/ops (its oracle, C4)."""
