"""Turn one logits row per sampling stream into a token, for the whole batch at once: penalties,
logit_bias, allowed_token_ids, bad_words, min_tokens, grammar masks (structured output), then
greedy or temperature / top-k / top-p / min-p sampling. Logprobs are of the model's own
distribution (log_softmax of the raw logits, before penalties and temperature), as OpenAI
reports them.

Every step is a tensor op over the batch driven by per-row parameter tensors; Python touches
rows only to build those tensors, to draw noise for seeded rows from their own generators (so a
seeded request samples the same whatever else is in the batch), and to hand results back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kernels import reference

from engine.runner import bad_words
from engine.sampling_params import SamplingParams, UnsatisfiableRequestError
from engine.scheduler_output import SampledToken


class Stream(Protocol):
    """What the sampler reads of a stream (the runner's per-stream state), and what it keeps
    there: the stream's seeded generator, its penalty counts, its logit_bias and allowed_token_ids
    as tensors."""

    index: int
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    penalty_state: PenaltyState | None
    logit_bias_tensors: tuple[torch.Tensor, torch.Tensor] | None
    allowed_token_tensor: torch.Tensor | None
    grammar: object | None  # the stream's xgrammar matcher, when its output is constrained (read here, never advanced)


class PenaltyState:
    """One request's penalty terms over the vocabulary, kept up to date as it samples, so that a
    penalty costs O(vocabulary) per step however long the output grows: which tokens were seen
    (prompt or output: the repetition penalty) and the OpenAI term
    frequency * count_in_output + presence * (count > 0) to subtract."""

    def __init__(self, req: Stream, vocab_size: int, device: torch.device):
        p = req.sampling_params
        self.frequency, self.presence = p.frequency_penalty, p.presence_penalty
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        ids = torch.tensor(req.output_token_ids, dtype=torch.long, device=device)
        self.output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.seen[torch.tensor(req.prompt_token_ids, dtype=torch.long, device=device)] = True
        self.seen |= self.output_counts > 0
        self.subtract = self.frequency * self.output_counts + self.presence * (self.output_counts > 0).float()
        self.num_counted = len(req.output_token_ids)

    def add(self, token_id: int) -> None:
        count = float(self.output_counts[token_id]) + 1
        self.output_counts[token_id] = count
        self.subtract[token_id] = self.frequency * count + self.presence
        self.seen[token_id] = True
        self.num_counted += 1


def penalty_state(req: Stream, vocab_size: int, device: torch.device) -> PenaltyState:
    """The stream's penalty state, made again when its output grew past what it counted."""
    state = req.penalty_state
    if state is None or state.num_counted != len(req.output_token_ids):
        state = req.penalty_state = PenaltyState(req, vocab_size, device)
    return state


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, subtract: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """Penalise [B, V] rows in place, given each row's seen tokens, OpenAI term and [B] penalty.
    repetition (CTRL / transformers): each token seen in prompt or output has its logit divided
      by the penalty if positive, multiplied if negative.
    presence / frequency (OpenAI): logit -= frequency * count_in_output + presence * (count > 0)."""
    rep = repetition[:, None]
    logits.mul_(torch.where(seen, torch.where(logits > 0, 1.0 / rep, rep), 1.0))
    logits.sub_(subtract)
    return logits


NUCLEUS_CANDIDATES = 256  # top-p looks for its nucleus among this many first; a full sort only if it is wider


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k (0: off), top-p nucleus and min-p floor.
    Thresholds are values, so ties at the k-th (or last nucleus) value are all kept."""
    vocab = logits.shape[-1]
    inf = float("-inf")
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    if bool((k < vocab).any()):
        ordered = logits.topk(int(k[k < vocab].max()), dim=-1).values  # the k largest are enough
        kth = ordered.gather(-1, (k.clamp(max=ordered.shape[-1]) - 1)[:, None])
        kth = kth.masked_fill((k == vocab)[:, None], inf)  # rows without top-k keep everything
        logits = logits.masked_fill(logits < kth, inf)
    if bool((top_p < 1.0).any()):
        logits = logits.masked_fill(logits < _nucleus_floor(logits, top_p), inf)
    return _min_p(logits, min_p)


def _nucleus_floor(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's smallest logit in its nucleus: the smallest prefix (most likely first) whose mass
    reaches top_p, the token that crosses it included. Searched among the NUCLEUS_CANDIDATES
    largest (probabilities against the whole row's normaliser); rows whose nucleus is wider are
    sorted in full."""
    top = logits.topk(min(NUCLEUS_CANDIDATES, logits.shape[-1]), dim=-1).values
    probs = (top - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
    drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
    floor = top.gather(-1, _last_kept(drop))
    wide = ~drop[:, -1] & (top_p < 1.0) & (top.shape[-1] < logits.shape[-1])
    if bool(wide.any()):
        rows = wide.nonzero()[:, 0]
        ordered = logits[rows].sort(dim=-1, descending=True).values
        probs = ordered.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= top_p[rows][:, None]
        floor[rows] = ordered.gather(-1, _last_kept(drop))
    # A row without top-p keeps everything (its cumulative sum may round past 1.0 before the end).
    return floor.masked_fill((top_p >= 1.0)[:, None], float("-inf"))


def _last_kept(drop: torch.Tensor) -> torch.Tensor:
    """The position of the last token kept; the most likely one always is (a top_p that float32
    rounds to 0, e.g. 1e-300, keeps it alone)."""
    return (~drop).sum(-1, keepdim=True).clamp(min=1) - 1


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    if bool((min_p > 0.0).any()):
        # p < min_p * p_max  <=>  logit < log(min_p) + max logit (softmax's normaliser cancels).
        floor = torch.log(min_p)[:, None] + logits.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


class Sampler:
    def __init__(self, eos_token_ids: list[int], seed: int, device: torch.device,
                 argmax: Callable[[torch.Tensor], torch.Tensor] = reference.argmax):
        self.eos_token_ids = eos_token_ids
        self.argmax = argmax  # the kernel backend's: greedy rows are most of a batch's sampling
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.grammars = None  # engine.structured_output.StructuredOutputs, set by the runner on first use

    def _generator(self, req: Stream) -> torch.Generator:
        if req.generator is None:
            # Each choice of an n > 1 request gets its own stream: seed + index. A 64-bit signed
            # seed (SamplingParams checks it) plus an index < MAX_N stays inside the
            # [-2**63, 2**64) that manual_seed takes.
            req.generator = torch.Generator(device=self.device).manual_seed(req.sampling_params.seed + req.index)
        return req.generator

    def __call__(self, logits: torch.Tensor, reqs: list[Stream]) -> list[SampledToken]:
        tokens, states, raw_logprobs = self.choose(logits, reqs)
        token_ids = tokens.tolist()
        for i, state in states.items():  # only once every row has its token: a retry counts nothing twice
            state.add(token_ids[i])
        return self.results(token_ids, reqs, raw_logprobs)

    def choose(self, logits: torch.Tensor, reqs: list[Stream], draws: dict | None = None):
        """Each row's token (a tensor), the penalty states its rows read (to count the tokens in),
        and the raw logprobs when a row asks for them. `draws`, when given, gets each seeded row's
        generator state after its noise (a speculating stream keeps the draws of the rows it used)."""
        params = [r.sampling_params for r in reqs]
        want_logprobs = any(p.logprobs is not None for p in params)
        penalised = [i for i, p in enumerate(params) if p.penalised]
        banning = [i for i, (r, p) in enumerate(zip(reqs, params)) if len(r.output_token_ids) < p.min_tokens]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        restricted = [i for i, p in enumerate(params) if p.allowed_token_ids]
        worded = [i for i, p in enumerate(params) if p.bad_words_token_ids]
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        edits = bool(penalised or banning or biased or restricted or worded or constrained)
        if want_logprobs or edits or sampled:
            # float32 for everything but a plain argmax (which is exact on 16-bit logits too);
            # a copy when editing, so penalties and masks never touch the caller's tensor.
            logits = logits.to(torch.float32, copy=edits)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        states = self._penalise(logits, reqs, penalised) if penalised else {}
        if biased:
            self._add_logit_bias(logits, reqs, biased)
        if restricted:
            self._keep_allowed(logits, reqs, restricted)
        if worded:
            self._ban_bad_words(logits, reqs, worded)
        if constrained:
            bitmask = self.grammars.bitmask(logits.shape[0], [reqs[i].grammar for i in constrained], constrained)
            # A grammar that can only end here ends the output, under min_tokens too (vLLM's rule):
            # banning its end token would leave no token at all.
            banning = [i for i in banning if reqs[i].grammar is None or not self.grammars.only_ends(bitmask, i)]
        if banning:
            self._ban_stop_tokens(logits, reqs, banning)
        if constrained:
            self.grammars.apply(logits, bitmask)
        tokens = self.argmax(logits)
        if restricted or worded or banning or constrained:
            # before any noise is drawn: a seeded stream sampled again after another's failure draws
            # what it would have drawn
            self._check_left(logits, tokens, reqs, sorted({*restricted, *worded, *banning, *constrained}), banning)
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            row_draws = {} if draws is not None else None
            tokens[rows] = self._sample(logits[rows], [reqs[i] for i in sampled], row_draws)
            if draws is not None:
                draws.update((sampled[i], state) for i, state in row_draws.items())
        return tokens, states, raw_logprobs

    def _penalise(self, logits: torch.Tensor, reqs: list[Stream], rows: list[int]) -> dict[int, PenaltyState]:
        states = {i: penalty_state(reqs[i], logits.shape[-1], logits.device) for i in rows}
        index = torch.tensor(rows, device=logits.device)
        repetition = torch.tensor([reqs[i].sampling_params.repetition_penalty for i in rows], dtype=torch.float32,
                                  device=logits.device)
        block = logits[index]
        apply_penalties(block, torch.stack([s.seen for s in states.values()]),
                        torch.stack([s.subtract for s in states.values()]), repetition)
        logits[index] = block
        return states

    @staticmethod
    def _add_logit_bias(logits: torch.Tensor, reqs: list[Stream], rows: list[int]) -> None:
        """Add each row's logit_bias (OpenAI: to the logits, before sampling, greedy included), in
        one scatter for the batch; each stream's bias is made a tensor once."""
        index, cols, vals = [], [], []
        for i in rows:
            req = reqs[i]
            if req.logit_bias_tensors is None:
                bias = req.sampling_params.logit_bias
                req.logit_bias_tensors = (torch.tensor(list(bias), dtype=torch.long, device=logits.device),
                                          torch.tensor(list(bias.values()), dtype=torch.float32, device=logits.device))
            c, v = req.logit_bias_tensors
            index.append(torch.full_like(c, i))
            cols.append(c)
            vals.append(v)
        logits.index_put_((torch.cat(index), torch.cat(cols)), torch.cat(vals), accumulate=True)

    @staticmethod
    def _keep_allowed(logits: torch.Tensor, reqs: list[Stream], rows: list[int]) -> None:
        """Every logit of these rows but their allowed_token_ids' to -inf (vLLM's allowed_token_ids)."""
        for i in rows:
            req = reqs[i]
            if req.allowed_token_tensor is None:
                req.allowed_token_tensor = torch.tensor(req.sampling_params.allowed_token_ids, dtype=torch.long,
                                                        device=logits.device)
            kept = logits[i, req.allowed_token_tensor]
            logits[i] = float("-inf")
            logits[i, req.allowed_token_tensor] = kept

    @staticmethod
    def _forbid(logits: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """-inf at each (row, token id) of `pairs`: those tokens get no probability."""
        if pairs:
            r, c = zip(*pairs)
            logits[torch.tensor(r, device=logits.device), torch.tensor(c, device=logits.device)] = float("-inf")

    def _ban_bad_words(self, logits: torch.Tensor, reqs: list[Stream], rows: list[int]) -> None:
        """Each token that would complete one of the row's bad words (engine/runner/bad_words.py)."""
        self._forbid(logits, [(i, t) for i in rows for t in bad_words.banned_next(
            reqs[i].sampling_params.bad_words_token_ids, reqs[i].output_token_ids)])

    def _ban_stop_tokens(self, logits: torch.Tensor, reqs: list[Stream], rows: list[int]) -> None:
        """Below min_tokens a request may not stop: its stop ids (and EOS) get no probability."""
        self._forbid(logits, [(i, t) for i in rows for t in reqs[i].sampling_params.stop_token_ids
                              + ([] if reqs[i].sampling_params.ignore_eos else self.eos_token_ids)])

    @staticmethod
    def _check_left(logits: torch.Tensor, tokens: torch.Tensor, reqs: list[Stream], rows: list[int],
                    banning: list[int]) -> None:
        """Raise UnsatisfiableRequestError if the masks left one of these rows no token: its argmax
        (token 0 in a row of -inf) is one none of them allowed. Only the argmax's logit is read."""
        index = torch.tensor(rows, device=logits.device)
        empty = torch.isneginf(logits[index, tokens[index]]).tolist()
        errors = {}
        for i, none_left in zip(rows, empty):
            if not none_left:
                continue
            req, p = reqs[i], reqs[i].sampling_params
            fields = [name for name, on in (("allowed_token_ids", bool(p.allowed_token_ids)),
                                            ("bad_words", bool(p.bad_words_token_ids)),
                                            ("min_tokens", i in banning),
                                            ("structured_outputs", req.grammar is not None)) if on]
            after = f"after {len(req.output_token_ids)} output tokens"
            if len(fields) > 1:
                why = f"{after}, {' and '.join(fields)} together leave no token to sample: loosen one of them"
            elif fields[0] == "structured_outputs":
                why = f"{after} the grammar allows no token (a rule that only refers to itself?)"
            else:
                why = f"{after} it leaves no token to sample"
            errors[i] = UnsatisfiableRequestError(fields[0], f": {why}")
        if errors:
            first = next(iter(errors.values()))
            raise UnsatisfiableRequestError(first.field, first.rest, errors)

    def _sample(self, logits: torch.Tensor, reqs: list[Stream], draws: dict | None = None) -> torch.Tensor:
        device = logits.device
        params = [r.sampling_params for r in reqs]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        vocab = logits.shape[-1]
        scaled = filter_logits(logits / temperature[:, None],  # a top-k past the vocabulary is no top-k
                               torch.tensor([min(p.top_k, vocab) for p in params], dtype=torch.long, device=device),
                               torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
                               torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device))
        # Exponential race (Gumbel-max in another form): argmax(p / E), E ~ Exp(1), samples from p;
        # p need not be normalised for the argmax, so exp(logit - max) stands in for softmax.
        probs = (scaled - scaled.max(dim=-1, keepdim=True).values).exp_()
        # E = -log(U), U ~ Uniform[0, 1): the same law as Tensor.exponential_, which on CPU draws
        # six times slower than torch.rand (measured: 59 vs 9.5 ms for 64 x 49152).
        noise = torch.empty_like(probs)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if len(seeded) < len(reqs):
            torch.rand(noise.shape, generator=self.generator, device=device, out=noise)  # every unseeded row at once
        for i in seeded:  # a seeded row's noise comes from its own stream alone
            generator = self._generator(reqs[i])
            torch.rand(noise.shape[-1], generator=generator, device=device, out=noise[i])
            if draws is not None:
                draws[i] = generator.get_state()
        return (probs / noise.log_().neg_()).argmax(dim=-1)

    @staticmethod
    def results(token_ids: list[int], reqs: list[Stream], raw_logprobs: torch.Tensor | None) -> list[SampledToken]:
        """Each row's token with its logprob and top logprobs, where its stream asks for them."""
        if raw_logprobs is None:
            return [SampledToken(t, 0.0, None) for t in token_ids]
        n_tops = [r.sampling_params.logprobs for r in reqs]
        widest = max(n or 0 for n in n_tops)
        top_vals = top_ids = None
        if widest:
            top_vals, top_ids = (x.tolist() for x in torch.topk(raw_logprobs, widest, dim=-1))
        chosen = raw_logprobs.gather(-1, torch.tensor(token_ids, device=raw_logprobs.device)[:, None])[:, 0].tolist()
        results = []
        for i, (tok, n_top) in enumerate(zip(token_ids, n_tops)):
            if n_top is None:
                results.append(SampledToken(tok, 0.0, None))
                continue
            top = dict(zip(top_ids[i][:n_top], top_vals[i][:n_top])) if n_top else {}
            top[tok] = chosen[i]
            results.append(SampledToken(tok, chosen[i], top))
        return results
