"""n > 1 shares the prompt's blocks; stop strings; incremental detokenization."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.frontend.detokenizer import IncrementalDetokenizer
from tests.engine.hf_oracle import hf_greedy


def test_n_choices_share_one_prefill(tiny_llm, tiny_models):
    prompt = list(range(10, 10 + 37))  # ends mid-block: the fork copies the partial block
    engine = tiny_llm.engine
    before = engine.stats()["num_scheduled_tokens"]
    out = tiny_llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0]
    computed = engine.stats()["num_scheduled_tokens"] - before
    expected = hf_greedy(tiny_models("llama"), prompt, 8)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == expected for c in out.outputs)
    # One prefill of 37 tokens, then 7 decode steps for each of the 3 choices.
    assert computed == len(prompt) + 3 * 7
    assert engine.stats()["num_used_blocks"] == 0


def test_seeded_choices_differ_and_reproduce(tiny_llm):
    p = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=11, ignore_eos=True)
    a = tiny_llm.generate([[5, 6, 7]], p, use_tqdm=False)[0]
    b = tiny_llm.generate([[5, 6, 7]], p, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert a.outputs[0].token_ids != a.outputs[1].token_ids


def test_stop_string_truncates_text(tiny_llm):
    prompt = "The capital of France"
    full = tiny_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop and text.find(stop) > 0
    cut = tiny_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert cut.text == text[: text.find(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = tiny_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop],
                                                      include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.find(stop) + len(stop)]


def test_length_finish_reason_and_stop_token_ids(tiny_llm):
    out = tiny_llm.generate([[4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    stop_id = out.token_ids[2]
    first = out.token_ids.index(stop_id)
    cut = tiny_llm.generate([[4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                        stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert cut.token_ids == out.token_ids[: first + 1]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop_id
    # The stop token's text is the text's end only when asked for (vLLM's include_stop_str_in_output).
    tok = tiny_llm.tokenizer
    assert cut.text == tok.decode(out.token_ids[:first], skip_special_tokens=True)
    kept = tiny_llm.generate([[4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                         stop_token_ids=[stop_id], include_stop_str_in_output=True),
                             use_tqdm=False)[0].outputs[0]
    assert kept.token_ids == cut.token_ids and kept.stop_reason == stop_id
    assert kept.text == tok.decode(out.token_ids[: first + 1], skip_special_tokens=True) != cut.text


def test_incremental_detokenization_never_emits_broken_characters(tiny_llm):
    tok = tiny_llm.tokenizer
    text = "héllo wörld — 日本語 🙂 naïve café"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split()) * 2, "multi-byte characters span several tokens here"
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    released = ""
    for t in ids:
        detok.add_token(t)
        piece = detok.take(finished=False)
        assert "\ufffd" not in piece
        released += piece
        assert text.startswith(released), "released text is only ever appended to, never taken back"
    assert released + detok.take(finished=True) == tok.decode(ids) == text


def test_an_output_that_ends_mid_character_keeps_its_bytes(tiny_llm):
    """Cut mid-character (max_tokens), the text ends in U+FFFD as the tokenizer's own decode of the
    output gives it, streamed or not; it lost those bytes before (held back for a next token
    that never came)."""
    tok = tiny_llm.tokenizer
    ids = tok("🙂🙂", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 4, "an emoji spans several byte tokens here"
    for cut in range(1, len(ids) + 1):
        want = tok.decode(ids[:cut])
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
        released = ""
        for t in ids[:cut]:
            detok.add_token(t)
            released += detok.take(finished=False)
        assert released + detok.take(finished=True) == want, cut
    assert any(tok.decode(ids[:cut]).endswith("\ufffd") for cut in range(1, len(ids)))
    # End to end: the output's text is the decode of its tokens (allowed_token_ids: one byte token,
    # never a whole character).
    byte = ids[0]
    out = tiny_llm.generate(["hi"], SamplingParams(max_tokens=3, temperature=0.0, allowed_token_ids=[byte]),
                            use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [byte] * 3 and out.text == tok.decode([byte] * 3) != ""


class _CharTokenizer:
    """Token i decodes to PIECES[i]: one token can complete several stop strings at once."""

    PIECES = ["<p>", "ab", "xyz", "cd"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids)


@pytest.mark.parametrize("stop, include, want_text, want_stop", [
    (["z", "y"], False, "abx", "y"),  # listed second, but earlier in the text
    (["yz", "y"], False, "abx", "yz"),  # same start: the longer one
    (["z", "xy"], True, "abxy", "xy"),
])
def test_the_earliest_stop_string_in_the_text_ends_it(stop, include, want_text, want_stop):
    detok = IncrementalDetokenizer(_CharTokenizer(), [0], stop=stop, include_stop_str_in_output=include)
    assert detok.add_token(1) is None
    assert detok.add_token(2) == want_stop
    assert detok.take(finished=True) == want_text
