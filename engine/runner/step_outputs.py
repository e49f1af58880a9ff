"""What a step hands back beyond its forward: sampling (a batch at once, or stream by stream to find
the one at fault), the verification of draft tokens, structured output's grammars, pooled
embeddings and prompt logprobs. The sampling rank's ModelRunner holds one and hands it each step's
logits and hidden states; a stream whose own data makes one of these raise is reported in the
step's output (`failed`), so the core fails that request alone."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from engine import structured_output
from engine.runner import verify_rows
from engine.runner.runner_streams import CachedRequestState
from engine.runner.sampler import Sampler
from engine.sampling_params import UnsatisfiableRequestError
from engine.scheduler_output import ModelRunnerOutput

logger = logging.getLogger(__name__)


def accepted_length(drafts: list[int], targets: list[int]) -> int:
    """How many drafts are accepted: those that equal the chosen token at their row, in order."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return accepted


class StepOutputs:
    def __init__(self, sampler: Sampler, grammar_offer: structured_output.Offer,
                 final_hidden: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        """final_hidden: the model's final norm over (hidden, residual) rows, for pooling."""
        self.sampler, self.grammar_offer, self.final_hidden = sampler, grammar_offer, final_hidden

    @staticmethod
    def failed(out: ModelRunnerOutput, state: CachedRequestState, error: Exception) -> None:
        """This stream's own data made the runner raise: report it (the core fails its request alone;
        as the client's error when its parameters asked for the impossible)."""
        if isinstance(error, UnsatisfiableRequestError):
            out.failed.append((state.req_id, type(error).__name__, str(error)))
            return
        logger.warning("stream %s failed in the runner: %r", state.req_id, error)
        out.failed.append((state.req_id, type(error).__name__, None))

    def sample(self, out: ModelRunnerOutput, logits: torch.Tensor, streams: list[CachedRequestState]) -> None:
        """Sample all rows at once; if the batch raises, sample each stream alone, so that only a
        stream whose own data makes it raise is failed."""
        offer = self.grammar_offer
        for state in streams:
            p = state.sampling_params
            if p.structured_outputs is not None and state.grammar is None:
                try:
                    self.sampler.grammars = offer.grammars()
                    state.grammar = self.sampler.grammars.matcher(p.structured_outputs, p.max_tokens,
                                                                  state.output_token_ids)
                except Exception as e:
                    self.failed(out, state, e)
        failed = {req_id for req_id, *_ in out.failed}
        keep = [i for i, s in enumerate(streams) if s.req_id not in failed]
        if len(keep) < len(streams):
            logits, streams = logits[keep], [streams[i] for i in keep]
        for state, token in self._sample_rows(out, logits, streams):
            if state.grammar is not None and not state.grammar.accept_token(token.token_id):
                # Only a grammar that allows nothing but a banned token gets here (say, EOS under min_tokens).
                self.failed(out, state, ValueError("the sampled token does not follow the stream's grammar"))
                continue
            out.sampled.append((state.req_id, token))

    def verify(self, out: ModelRunnerOutput, logits: torch.Tensor,
               streams: list[tuple[CachedRequestState, list[int]]]) -> None:
        """Each speculating stream's rows get the token the sampler chooses there, as it chooses a
        plain decode's (greedy: the argmax; sampled: a draw from the processed distribution p, the
        row following the drafts before it). The drafts that equal those choices, in order, are
        accepted, then the choice after the last of them. For a sampled row this is the rejection
        rule for a point-mass proposal: the draw equals the draft d with probability p(d), and
        otherwise follows p without d, renormalised (the residual); after every draft, a bonus
        token from p. A seeded stream keeps only the draws of the rows it used, so its tokens are
        the ones it samples without speculation (they differ only where the verify step's logits
        round differently)."""
        rows = [0]
        for _, drafts in streams:
            rows.append(rows[-1] + len(drafts) + 1)
        try:
            chosen, draws = self._choose_rows(logits, streams)
        except Exception:
            logger.warning("batched verification raised; verifying each stream alone to find the one at fault")
            chosen, draws = [], {}
            for i, item in enumerate(streams):
                try:
                    part, part_draws = self._choose_rows(logits[rows[i]:rows[i + 1]], [item])
                    chosen += part
                    draws.update((rows[i] + r, g) for r, g in part_draws.items())
                except Exception:
                    chosen.append(None)  # sampled below as a plain decode: it fails alone if that raises
        for i, ((state, drafts), targets) in enumerate(zip(streams, chosen)):
            if targets is None:
                for state, token in self._sample_rows(out, logits[rows[i]:rows[i] + 1], [state]):
                    out.verified.append((state.req_id, [token.token_id], [token.top_logprobs]))
                continue
            accepted = accepted_length(drafts, [t.token_id for t in targets])
            tokens = drafts[:accepted] + [targets[accepted].token_id]
            if rows[i] + accepted in draws:  # a seeded stream goes on after the last row it used
                state.generator.set_state(draws[rows[i] + accepted])
            if state.sampling_params.penalised:
                for token in tokens:
                    state.penalty_state.add(token)
            out.verified.append((state.req_id, tokens, [t.top_logprobs for t in targets[:accepted + 1]]))

    def _choose_rows(self, logits: torch.Tensor, streams: list[tuple[CachedRequestState, list[int]]]):
        """The sampler's token at every row, per stream, and the seeded rows' generator states after
        their draws, by row; a seeded generator is put back as it was if the sampler raises."""
        seeded = [s for s, _ in streams if not s.sampling_params.greedy and s.sampling_params.seed is not None]
        before = [(s, None if s.generator is None else s.generator.get_state()) for s in seeded]
        draws = {}
        views = verify_rows.row_views(streams, logits.shape[-1], logits.device)
        try:
            tokens, _, raw_logprobs = self.sampler.choose(logits, views, draws)
        except Exception:
            for s, state in before:
                if state is None:
                    s.generator = None
                else:
                    s.generator.set_state(state)
            raise
        results = self.sampler.results(tokens.tolist(), views, raw_logprobs)  # the target's logprobs at each row
        chosen, row = [], 0
        for _, drafts in streams:
            chosen.append(results[row:row + len(drafts) + 1])
            row += len(drafts) + 1
        return chosen, draws

    def _sample_rows(self, out: ModelRunnerOutput, logits: torch.Tensor, streams: list[CachedRequestState]):
        """(stream, token) for the streams sampling does not fail."""
        while streams:
            try:
                return list(zip(streams, self.sampler(logits, streams)))
            except Exception as e:
                if isinstance(e, UnsatisfiableRequestError) and e.rows:  # it names its rows: they end, the
                    for i, error in e.rows.items():                      # rest are sampled again at once
                        self.failed(out, streams[i], error)
                    keep = [i for i in range(len(streams)) if i not in e.rows]
                    logits, streams = logits[keep], [streams[i] for i in keep]
                    continue
                logger.warning("batched sampling raised; sampling each stream alone to find the one at fault")
                results = []
                for i, state in enumerate(streams):
                    try:
                        results.append((state, self.sampler(logits[i:i + 1], [state])[0]))
                    except Exception as e:
                        self.failed(out, state, e)
                return results
        return []

    def pool(self, out: ModelRunnerOutput, hidden: torch.Tensor, residual: torch.Tensor, chunks: list,
              ends: list) -> None:
        """Embedding requests: sum each chunk's final hidden states (mean pooling, across chunked
        prefill steps; a chunk from position 0 starts over, as after a preemption), and once a
        prompt is done, report the mean or the last token's state, L2-normalised, in float32."""
        for state, start, a, b in chunks:
            part = self.final_hidden(hidden[a:b], residual[a:b]).float().sum(0)
            state.pooled_sum = part if start == 0 else state.pooled_sum + part
        for state, row in ends:
            try:
                if state.sampling_params.pooling == "mean":
                    vector = state.pooled_sum / state.num_prompt_tokens
                else:
                    vector = self.final_hidden(hidden[row:row + 1], residual[row:row + 1]).float()[0]
                out.pooled.append((state.req_id, torch.nn.functional.normalize(vector, dim=-1).tolist()))
            except Exception as e:
                self.failed(out, state, e)

    @staticmethod
    def prompt_logprobs(out: ModelRunnerOutput, state: CachedRequestState, first_token: int,
                         rows: torch.Tensor) -> None:
        """Entries for the prompt tokens these rows score: the token's logprob, plus the top
        prompt_logprobs of the row."""
        n_top = state.sampling_params.prompt_logprobs
        lp = torch.log_softmax(rows, dim=-1)
        targets = state.prompt_token_ids[first_token:first_token + lp.shape[0]]
        chosen = lp.gather(-1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
        entries = [{} for _ in targets]
        if n_top:
            vals, top_ids = (x.tolist() for x in torch.topk(lp, n_top, dim=-1))
            entries = [dict(zip(i, v)) for i, v in zip(top_ids, vals)]
        for entry, tok, value in zip(entries, targets, chosen):
            entry[tok] = value
        out.prompt_logprobs.append((state.req_id, first_token, entries))


def offer_grammars(tokenizer, vocab_size: int, eos_token_ids: list[int], apply_token_bitmask,
                   config) -> structured_output.Offer:
    """How the sampling rank builds its grammars (at its first constrained stream), offered to the
    process when the runner is built, so that a server in this process compiles ahead of the steps."""
    args = (tokenizer, vocab_size, eos_token_ids, apply_token_bitmask, config)  # not the runner: the registry keeps it
    return structured_output.offer_sampler(lambda: structured_output.StructuredOutputs(*args))
