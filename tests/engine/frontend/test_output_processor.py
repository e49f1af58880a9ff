"""OutputProcessor as a unit, on synthetic core outputs and a tokenizer whose tokens are fixed
pieces of text: the streamed deltas always concatenate to the final text, stop strings are found
across token boundaries, text a stop string may still claim is held back, choices of an n > 1
request are kept apart, and logprobs follow their tokens."""

from __future__ import annotations

import random

import pytest

from engine.frontend.output_processor import OutputProcessor
from engine.outputs import CoreOutput
from engine.sampling_params import SamplingParams

PIECES = ["<p>", "Hel", "lo", " wor", "ld", "!", " St", "OP", " end", "s", "top"]


class PieceTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(PIECES[i] for i in ids)


def _run(token_lists, params, delta=True, finish=None):
    """Feed each choice one token a step; returns (outputs per step, stops, the processor)."""
    proc = OutputProcessor(PieceTokenizer())
    proc.add_request("r", None, [0], params, delta=delta)
    steps, stops = [], []
    length = max(len(t) for t in token_lists)
    for step in range(length):
        core = []
        for i, toks in enumerate(token_lists):
            if step < len(toks) and all(not (s.index == i) for s in stops):
                last = step == len(toks) - 1
                core.append(CoreOutput("r", i, [toks[step]], [{toks[step]: -0.5 * (step + 1)}],
                                       finish_reason=(finish or "length") if last else None))
        outs, new_stops = proc.process(core)
        steps.append(outs)
        stops += new_stops
    return steps, stops, proc


def _joined(steps, index):
    return "".join(c.text for outs in steps for o in outs for c in o.outputs if c.index == index)


def test_deltas_concatenate_to_the_whole_text():
    tokens = [1, 2, 3, 4, 5]
    steps, stops, proc = _run([tokens], SamplingParams(max_tokens=5, logprobs=0))
    assert _joined(steps, 0) == "Hello world!" and not stops and not proc.has_unfinished()
    ids = [t for outs in steps for o in outs for c in o.outputs for t in c.token_ids]
    assert ids == tokens
    last = steps[-1][0]
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert last.outputs[0].cumulative_logprob == pytest.approx(-0.5 * sum(range(1, 6)))
    assert [lp for outs in steps for o in outs for c in o.outputs for lp in c.logprobs] == [
        {t: -0.5 * (i + 1)} for i, t in enumerate(tokens)]


def test_a_stop_string_across_tokens_ends_the_choice_and_is_reported():
    # " St" + "OP" completes " StOP": the text ends before it, and the core is told to end the choice.
    steps, stops, _ = _run([[1, 2, 6, 7, 8]], SamplingParams(max_tokens=10, stop=[" StOP"]))
    assert _joined(steps, 0) == "Hello"
    assert [(s.index, s.stop) for s in stops] == [(0, " StOP")]
    final = steps[3][0].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == " StOP"


def test_text_a_stop_string_may_claim_is_held_back():
    # "Hel" could start "Help" (a stop string): nothing of it is released until "lo" rules that out.
    steps, _, _ = _run([[1, 2, 5]], SamplingParams(max_tokens=3, stop=["Help"]))
    released = [_joined([s], 0) for s in steps]
    assert released[0] == ""  # 3 characters held back: the longest stop string is 4
    assert "".join(released) == "Hello!"
    for i in range(len(released)):
        assert "Hello!".startswith("".join(released[:i + 1]))


def test_stop_strings_count_only_from_min_tokens():
    steps, stops, _ = _run([[6, 7, 1, 6, 7]], SamplingParams(max_tokens=5, stop=[" StOP"], min_tokens=3))
    assert _joined(steps, 0) == " StOPHel" and stops and stops[0].index == 0


def test_choices_stay_apart_and_final_mode_returns_them_complete():
    choices = [[1, 2, 5], [3, 4], [6, 7, 9]]
    params = SamplingParams(n=3, max_tokens=3, stop=["OPs"])
    steps, stops, _ = _run(choices, params)
    assert [_joined(steps, i) for i in range(3)] == ["Hello!", " world", " St"]
    assert [(s.index, s.stop) for s in stops] == [(2, "OPs")]
    final_steps, _, _ = _run(choices, params, delta=False)
    finals = [o for outs in final_steps for o in outs]
    assert len(finals) == 1 and finals[0].finished  # one output, once every choice has ended
    assert [c.text for c in finals[0].outputs] == ["Hello!", " world", " St"]
    assert [c.token_ids for c in finals[0].outputs] == [[1, 2, 5], [3, 4], [6, 7, 9]]


def test_random_streams_match_the_direct_definition():
    """Random tokens and stop strings: the released deltas equal the text decoded at once, cut
    at the first stop string (the oracle written from the definition)."""
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randrange(1, len(PIECES)) for _ in range(rng.randint(1, 12))]
        stop = ["".join(rng.sample("HeloStOPnds!", rng.randint(1, 3))) for _ in range(rng.randint(0, 2))]
        steps, stops, _ = _run([tokens], SamplingParams(max_tokens=12, stop=stop))
        text = "".join(PIECES[t] for t in tokens)
        # Oracle: the earliest stop string that is complete once some prefix of tokens is decoded.
        want, prefix = text, ""
        for t in tokens:
            prefix += PIECES[t]
            hits = [(prefix.find(s), -len(s), s) for s in stop if s in prefix]
            if hits:
                idx, _, s = min(hits)
                want = prefix[:idx]
                break
        assert _joined(steps, 0) == want, (tokens, stop)
        assert bool(stops) == (want != text or any(s in text for s in stop))
