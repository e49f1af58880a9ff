"""A grammar that starts where the reasoning ends (GrammarSpec.reasoning_end), through the real
engine and xgrammar, on a scripted model (tests/scripted_model.py) whose greedy reply is
`<think>Hmm</think>Paris`: with the grammar waiting for `</think>` the thought is written as the
model wants and the answer follows the grammar; with the grammar from the first token there is no
thought at all. The oracle is the script."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.sampling_params import GrammarSpec
from tests.scripted_model import build_scripted_model

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")
SCRIPT = {"assistant": {"<think>": 10}, "<think>": {"Hmm": 10}, "Hmm": {"</think>": 10},
          "</think>": {"Paris": 10, "London": 5, "Rome": 4}, "Paris": {"<|im_end|>": 10},
          "London": {"<|im_end|>": 10}, "Rome": {"<|im_end|>": 10}}
ADDED = ["assistant", "<think>", "</think>", "Hmm", "Paris", "London", "Rome"]
ASK = [{"role": "user", "content": "Capital?"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = build_scripted_model(tmp_path_factory.mktemp("scripted"), SCRIPT, TEMPLATE, ADDED)
    with LLM(path, device="cpu", num_kv_blocks=64, max_model_len=256, seed=0) as engine:
        yield engine


def _reply(llm, spec: GrammarSpec | None) -> str:
    return llm.chat([ASK], SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=spec),
                    use_tqdm=False)[0].outputs[0].text


def test_the_grammar_applies_after_the_thought(llm):
    assert _reply(llm, None) == "<think>Hmm</think>Paris"  # the script, unconstrained
    choice = GrammarSpec.of("choice", ["London", "Rome"])
    assert _reply(llm, choice) in ("London", "Rome")  # from the first token: no room to think
    after = GrammarSpec("choice", choice.spec, reasoning_end="</think>")
    assert _reply(llm, after) == "<think>Hmm</think>London"  # the model's thought, then its best allowed answer
    regex = GrammarSpec("regex", "R[a-z]+", reasoning_end="</think>")
    assert _reply(llm, regex) == "<think>Hmm</think>Rome"


def test_a_reply_that_never_ends_its_thought_is_never_constrained(llm):
    """Until the end text appears every token is allowed, the end token included."""
    spec = GrammarSpec("choice", '["London"]', reasoning_end="</never>")
    assert _reply(llm, spec) == "<think>Hmm</think>Paris"


class _Recorder:
    """A matcher that records what it is given (and refuses strings starting with 'x')."""

    def __init__(self):
        self.tokens, self.strings, self.filled = [], [], 0

    def accept_token(self, token_id):
        self.tokens.append(token_id)
        return True

    def accept_string(self, text):
        self.strings.append(text)
        return not text.startswith("x")

    def fill_next_token_bitmask(self, bitmask, row):
        self.filled += 1

    def is_terminated(self):
        return False


def test_the_end_text_is_found_across_tokens_and_what_follows_it_in_its_token_goes_to_the_grammar():
    from engine.structured_output.after_reasoning import AfterReasoning

    pieces = {1: "I think </", 2: "thi", 3: "nk>\n", 4: "{", 5: "nk>ab", 6: "nk>xy"}
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    for tail, given, accepted in ((3, [], True), (5, ["ab"], True), (6, ["xy"], False)):
        inner = _Recorder()
        m = AfterReasoning(inner, "</think>", decode)
        assert m.accept_token(1) and m.accept_token(2)
        m.fill_next_token_bitmask(None, 0)
        assert m.reasoning and inner.filled == 0 and inner.tokens == []  # free while it reasons
        assert m.accept_token(tail) is accepted  # "\n" after the tag is left out; "xy" the grammar refuses
        assert not m.reasoning and inner.strings == given and inner.tokens == []
        m.accept_token(4)
        m.fill_next_token_bitmask(None, 0)
        assert inner.tokens == [4] and inner.filled == 1
