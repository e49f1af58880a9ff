"""The sampler's filters and penalties written one row at a time in float64, straight from their
definitions: the oracle for the batched sampler."""

from __future__ import annotations

import torch


def penalise_row(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], presence: float,
                 frequency: float, repetition: float) -> torch.Tensor:
    out = logits.clone().double()
    for t in set(prompt_ids) | set(output_ids):  # repetition: CTRL / transformers
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output_ids):  # presence / frequency: OpenAI
        out[t] -= frequency * output_ids.count(t) + presence
    return out


def kept_tokens(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens a row may sample: top-k (ties at the k-th value kept), then the smallest set of
    the most likely whose mass reaches top_p, then those with p >= min_p * p_max."""
    x = logits.double()
    order = sorted(range(len(x)), key=lambda t: -float(x[t]))
    keep = set(order)
    if top_k:
        kth = float(x[order[min(top_k, len(x)) - 1]])
        keep = {t for t in keep if float(x[t]) >= kth}
    if top_p < 1.0:
        p = torch.softmax(torch.tensor([float(x[t]) if t in keep else float("-inf") for t in range(len(x))]), 0)
        mass, nucleus = 0.0, set()
        for t in order:
            if t not in keep or mass >= top_p:
                continue
            nucleus.add(t)
            mass += float(p[t])
        floor = min(float(x[t]) for t in nucleus)
        keep = {t for t in keep if float(x[t]) >= floor}
    if min_p > 0.0:
        p = torch.softmax(torch.tensor([float(x[t]) if t in keep else float("-inf") for t in range(len(x))]), 0)
        keep = {t for t in keep if float(p[t]) >= min_p * float(p.max())}
    return keep
