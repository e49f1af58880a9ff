"""RMSNorm, optionally fused with the residual add that precedes it (kernels.rms_norm)."""

from __future__ import annotations

import torch
from torch import nn

import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, backend: str = "torch"):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        return kernels.rms_norm(x, self.weight, self.eps, residual, backend=backend)
