"""The reasoning parsers' split of a reply's text, whole and streamed. The oracle is the text as
it was built: reasoning + markup + answer. Streamed, every way of cutting the text into two
pieces, and character by character, must give the same reasoning and answer as the whole text
(a tag cut across two deltas included), reasoning pieces before answer pieces."""

from __future__ import annotations

import pytest

from server.reasoning import CONTENT, PARSERS, REASONING, Reasoning

CHATML = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
HARMONY = "<|start|>user<|message|>Hi<|end|><|start|>assistant"


def _streamed(parser, pieces: list[str]) -> tuple[str, str, list[str]]:
    out = []
    for piece in pieces:
        out += parser.feed(piece)
    out += parser.finish()
    kinds = [kind for kind, _ in out]
    return ("".join(t for k, t in out if k == REASONING), "".join(t for k, t in out if k == CONTENT), kinds)


def _check_every_cut(name: str, prompt: str, text: str, reasoning: str, content: str, kwargs=None):
    r = Reasoning(name, prompt, kwargs or {})
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        got_r, got_c, kinds = _streamed(r.new_parser(), pieces)
        assert (got_r, got_c) == (reasoning, content), pieces
        assert kinds == sorted(kinds, key=lambda k: k == CONTENT), pieces  # all reasoning, then the answer


CASES = [
    # (parser, prompt, reply text, reasoning, answer)
    ("qwen3", CHATML, "<think>\nLet me see: 2 < 3.\n</think>\n\nYes.", "\nLet me see: 2 < 3.\n", "\n\nYes."),
    ("qwen3", CHATML, "  <think>a</think>b", "a", "b"),
    ("qwen3", CHATML, "No thought here.", "", "No thought here."),
    ("qwen3", CHATML, "<thin is not a tag", "", "<thin is not a tag"),
    ("qwen3", CHATML, "answer </think> later", "", "answer </think> later"),  # no opening: all answer
    ("qwen3", CHATML + "<think>\n", "thinking</think>answer", "thinking", "answer"),  # the template opened it
    ("qwen3", CHATML, "<think>cut short </thi", "cut short </thi", ""),
    ("deepseek_r1", CHATML, "no opening tag</think>The answer", "no opening tag", "The answer"),
    ("deepseek_r1", CHATML, "<think>\nwith one\n</think>\n\nok", "\nwith one\n", "\n\nok"),
    ("deepseek_r1", CHATML, "never closed <", "never closed <", ""),
    ("deepseek_r1", CHATML, "a</think>b</think>c", "a", "b</think>c"),
    ("gpt_oss", HARMONY, "<|channel|>analysis<|message|>User says hi. <|end|><|start|>assistant<|channel|>final"
                         "<|message|>Hello!", "User says hi. ", "Hello!"),
    ("gpt_oss", HARMONY, "<|channel|>final<|message|>Straight to it.", "", "Straight to it."),
    ("gpt_oss", HARMONY, "<|channel|>analysis<|message|>still thinking <|en", "still thinking <|en", ""),
    ("gpt_oss", HARMONY, "Plain text, no harmony.", "", "Plain text, no harmony."),
]


@pytest.mark.parametrize("name,prompt,text,reasoning,content", CASES)
def test_split_whole_and_at_every_cut(name, prompt, text, reasoning, content):
    whole = Reasoning(name, prompt, {}).new_parser().split(text)
    assert whole == (reasoning or None, content or None)
    _check_every_cut(name, prompt, text, reasoning, content)


def test_qwen3_thinking_off_is_all_answer():
    """enable_thinking false: the template wrote an empty thought; the reply is answer, tags and all."""
    text = "<think>not a thought</think>answer"
    _check_every_cut("qwen3", CHATML, text, "", text, {"enable_thinking": False})
    _check_every_cut("qwen3", CHATML + "<think>\n\n</think>\n\n", text, "", text)  # what the template wrote


def test_gpt_oss_commentary_is_answer_and_headers_are_markup():
    text = ("<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis<|message|>two<|end|>"
            "<|start|>assistant<|channel|>final <|constrain|>json<|message|>{\"a\": 1}")
    _check_every_cut("gpt_oss", HARMONY, text, "onetwo", "{\"a\": 1}")


@pytest.mark.parametrize("header", ["<|channel|>commentary to=functions.get_weather <|constrain|>json",
                                    " to=functions.get_weather<|channel|>commentary json"])
def test_gpt_oss_message_to_a_function_goes_to_the_answer_for_the_tool_parser(header):
    """Both places harmony puts a recipient; the call's header is handed on in one form."""
    text = f"<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant{header}<|message|>{{\"city\": 1}}"
    if header.startswith(" to="):  # the recipient before the channel, in the reply's first header
        text = f"{header}<|message|>{{\"city\": 1}}"
    call = "<|channel|>commentary to=functions.get_weather<|message|>{\"city\": 1}"
    _check_every_cut("gpt_oss", HARMONY, text, "" if header.startswith(" to=") else "Need weather.", call)


def test_grammar_waits_for_the_reasoning_end_only_where_the_reply_thinks():
    from engine.sampling_params import GrammarSpec, SamplingParams

    params = SamplingParams(structured_outputs=GrammarSpec.of("regex", "[a-z]+"))
    assert Reasoning("qwen3", CHATML).sampling_params(params).structured_outputs.reasoning_end == "</think>"
    off = Reasoning("qwen3", CHATML, {"enable_thinking": False}).sampling_params(params)
    assert off.structured_outputs.reasoning_end == ""
    oss = Reasoning("gpt_oss", HARMONY).sampling_params(params)
    assert oss.structured_outputs.reasoning_end == "<|channel|>final<|message|>" and not oss.skip_special_tokens
    assert Reasoning(None).sampling_params(params) is params


def test_parser_names_are_vllms():
    assert {"qwen3", "deepseek_r1", "gpt_oss", "openai_gptoss"} <= set(PARSERS)
