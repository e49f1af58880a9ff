"""A speculating stream as the sampler sees it at each of its verify rows: row j follows the
stream's output and its first j drafts, so everything the sampler reads of earlier tokens
(penalties, bad_words, a pending min_tokens) is what it would read there had those drafts been
sampled. The sampler then chooses each row's token as it chooses a plain decode's."""

from __future__ import annotations

import torch

from engine.runner.sampler import PenaltyState, Stream, penalty_state


class RowPenalty:
    """One verify row's penalty terms: the stream's, with the drafts before the row counted as output."""

    def __init__(self, seen: torch.Tensor, subtract: torch.Tensor, num_counted: int):
        self.seen, self.subtract, self.num_counted = seen, subtract, num_counted


def row_penalties(state: PenaltyState, drafts: list[int], device: torch.device) -> list[RowPenalty]:
    """The k + 1 rows' terms from the stream's, in [k + 1, vocab] tensor ops."""
    vocab = state.output_counts.shape[0]
    added = torch.zeros(len(drafts) + 1, vocab, dtype=torch.float32, device=device)
    added[1:] = torch.nn.functional.one_hot(torch.tensor(drafts, device=device), vocab).float().cumsum(0)
    counts = state.output_counts + added
    # A counted draft's term as PenaltyState.add makes it (in float64, rounded once), so a row's
    # logits are the ones a plain decode at that position would penalise.
    terms = (state.frequency * counts.double() + state.presence).float()
    subtract = torch.where(added > 0, terms, state.subtract)
    seen = state.seen | (added > 0)
    return [RowPenalty(seen[j], subtract[j], state.num_counted + j) for j in range(len(drafts) + 1)]


class RowView:
    """A stream at one verify row: its output then the drafts before the row. The seeded generator
    and the logit_bias / allowed_token_ids tensors are the stream's own (made once, kept there)."""

    def __init__(self, stream: Stream, history: list[int], penalty: RowPenalty | None):
        self.stream = stream
        self.index, self.sampling_params = stream.index, stream.sampling_params
        self.prompt_token_ids, self.output_token_ids = stream.prompt_token_ids, history
        self.penalty_state = penalty
        self.grammar = stream.grammar  # None: a constrained stream does not speculate

    def _shared(name: str):  # noqa: N805 (a property factory, run in the class body)
        return property(lambda self: getattr(self.stream, name), lambda self, v: setattr(self.stream, name, v))

    generator = _shared("generator")
    logit_bias_tensors = _shared("logit_bias_tensors")
    allowed_token_tensor = _shared("allowed_token_tensor")
    del _shared


def row_views(streams: list[tuple[Stream, list[int]]], vocab: int, device: torch.device) -> list[RowView]:
    """One view per verify row, in row order."""
    views = []
    for stream, drafts in streams:
        penalties = [None] * (len(drafts) + 1)
        if stream.sampling_params.penalised:
            penalties = row_penalties(penalty_state(stream, vocab, device), drafts, device)
        history = stream.output_token_ids
        views += [RowView(stream, history + drafts[:j], penalty) for j, penalty in enumerate(penalties)]
    return views
