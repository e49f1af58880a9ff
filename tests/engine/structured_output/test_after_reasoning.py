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
