"""LoRA on a linear layer, batched across adapters (Punica's shrink / expand): each resident adapter
holds a slot of the layer's stacked A and B matrices, and every token of a step names its slot (-1:
the base model alone), so one forward serves tokens of many adapters and of the base model together.

A fused projection (q/k/v as one matmul, gate/up as one) has a part per checkpoint module: their A
matrices are stacked (one shrink reads them all) and their B matrices sit at their outputs' offsets
(one expand writes them all). A slot holds max_lora_rank; a smaller rank's rows are zeros, and PEFT's
scaling is folded into B when the slot is filled. Under tensor parallelism each rank holds the A and B
rows its base weight's shard needs (the linear layer says which: lora_shard)."""

from __future__ import annotations

import torch

from engine.layers.context import get_forward_context


class LoRAWeights:
    """One linear layer's adapter slots: A [slots, parts * rank, in], B [slots, out, rank]."""

    def __init__(self, in_features: int, out_slices: tuple[int, ...], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.out_slices = tuple(out_slices)
        self.rank = max_rank
        self.offsets = [sum(self.out_slices[:i]) for i in range(len(self.out_slices))]
        self.a = torch.zeros(max_loras, len(self.out_slices) * max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, sum(self.out_slices), max_rank, dtype=dtype, device=device)
        # The slots whose adapter targets this layer (on the host, read by the fused CPU layers too): a step
        # whose adapters all leave it alone (say q/v-only ones at an MLP) skips its shrink and expand.
        self.filled = torch.zeros(max_loras, dtype=torch.bool)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.filled[slot] = False

    def adapts(self, step_slots: tuple[int, ...]) -> bool:
        """Whether an adapter of this step (its slots) targets this layer."""
        return any(self.filled[s] for s in step_slots)

    def set_part(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Part `part`'s A [r, in] and B [out of the part, r] (this rank's shard) into slot `slot`."""
        r = a.shape[0]
        rows = slice(part * self.rank, part * self.rank + r)
        self.a[slot, rows].copy_(a)
        outs = slice(self.offsets[part], self.offsets[part] + self.out_slices[part])
        self.b[slot, outs, :r].copy_(b.float() * scaling)
        self.filled[slot] = True

    def add_to(self, y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
        """y += each token's adapter's B A x (in place; y returned), by the step's backend."""
        backend = get_forward_context().backend
        buf = backend.lora_shrink(x, self.a, token_slots)
        backend.lora_expand(y, buf, self.b, token_slots, self.out_slices)
        return y

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes
