"""RMSNorm, optionally fused with the residual add that precedes it (the backend's rms_norm)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.context import get_forward_context


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        return get_forward_context().backend.rms_norm(x, self.weight, self.eps, residual)
