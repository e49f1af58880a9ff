"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # 16-bit: statistics in float32 as transformers' LlamaRMSNorm computes them, but from one
        # float32-accumulating reduction instead of an upcast copy of x (CPU's rms_norm makes two).
        rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        inv = torch.rsqrt(rms.square_().div_(x.shape[-1]).add_(self.eps))
        return self.weight * (x * inv).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
