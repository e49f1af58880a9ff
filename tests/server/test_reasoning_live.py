"""Reasoning output through a real server and the official openai client, whole and streamed, for
each --reasoning-parser, on scripted models (tests/scripted_model.py) that think before they
answer (greedy): the oracle is the script. With a grammar (structured output, a named tool, a grammar
forcing a hermes call) in the same request, the thought is the model's own and the grammar
shapes the answer after it, as vLLM applies structured output once the reasoning has ended."""

from __future__ import annotations

import json

import pytest

from tests.scripted_model import build_scripted_model
from tests.server.server_harness import ServerProcess

# An assistant turn's reasoning sent back is rendered, as Qwen3's template does.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.reasoning_content %}<think>"
          "{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")
# Qwen3's switch: an empty thought in the prompt when thinking is off.
QWEN3 = CHATML.replace("assistant{% endif %}", "assistant{% if enable_thinking is defined and enable_thinking "
                                               "is false %}<think></think>{% endif %}{% endif %}")
DEEPSEEK_R1 = CHATML.replace("assistant{% endif %}", "assistant<think>{% endif %}")  # the reply starts inside
# With tools the prompt ends in another token, so that the model follows its calling script.
HARMONY = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
           "<|start|>{% if tools %}caller{% else %}assistant{% endif %}")
ANSWERS = {"Paris": {"<|im_end|>": 10}, "London": {"<|im_end|>": 10}, "Rome": {"<|im_end|>": 10}}
THINK = {"assistant": {"<think>": 10}, "<think>": {"Hmm": 10}, "Hmm": {"</think>": 10},
         "</think>": {"Paris": 10, "London": 5, "Rome": 4}, **ANSWERS}
FINAL = "assistant<|channel|>final<|message|>"  # one added token, so that the script never repeats a token
OSS = {"assistant": {"<|channel|>": 10}, "<|channel|>": {"analysis": 10}, "analysis": {"<|message|>": 10},
       "<|message|>": {"Hmm": 10}, "Hmm": {"<|end|>": 10}, "<|end|>": {"<|start|>": 10}, "<|start|>": {FINAL: 10},
       FINAL: {"Paris": 10, "London": 5, "Rome": 4}, **ANSWERS}
# The calling script: its markup in added tokens of their own, so that no token repeats.
CALL = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
OSS_CALL = {"caller": {"<|channel|>analysis<|message|>": 10}, "<|channel|>analysis<|message|>": {"Weather?<|end|>": 10},
            "Weather?<|end|>": {CALL: 10}, CALL: {'{"city": "Rome"}': 10}, '{"city": "Rome"}': {"<|im_end|>": 10}}
WORDS = ["assistant", "Hmm", "Paris", "London", "Rome"]
ASK = [{"role": "user", "content": "Capital?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["London", "Rome"]}}, "required": ["city"]}}}


def _serve(tmp_path_factory, name: str, parser: str, edges: dict, template: str, added: list[str],
           special: tuple = (), tool_parser: str = "hermes") -> ServerProcess:
    path = build_scripted_model(tmp_path_factory.mktemp(name), edges, template, added, list(special))
    log = str(tmp_path_factory.mktemp(name + "-log") / "server.log")
    return ServerProcess(["--model", path, "--num-kv-blocks", "64", "--num-threads", "1", "--served-model-name", "m",
                          "--reasoning-parser", parser, "--enable-auto-tool-choice", "--tool-call-parser", tool_parser],
                         log)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    proc = _serve(tmp_path_factory, "qwen3", "qwen3", THINK, QWEN3, WORDS + ["<think>", "</think>"])
    yield proc
    proc.stop()


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def _streamed(client, **kw) -> tuple[str, str, list[str], list, object]:
    """(reasoning, content, the kinds of text deltas in the order they came (a run of one kind
    once), tool-call deltas, usage)."""
    reasoning, content, kinds, calls, usage = "", "", [], [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            r = _reasoning(choice.delta)
            if r:
                reasoning += r
                kinds += [] if kinds[-1:] == ["reasoning"] else ["reasoning"]
            if choice.delta.content:
                content += choice.delta.content
                kinds += [] if kinds[-1:] == ["content"] else ["content"]
            calls += choice.delta.tool_calls or []
    return reasoning, content, kinds, calls, usage


def _reasoning(message) -> str | None:
    """The reasoning, under both names the server sends it (vLLM's older and newer)."""
    extra = message.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")
    return extra.get("reasoning_content")


@pytest.mark.slow  # starts its server (~6 s)
def test_qwen3_whole_and_streamed(qwen3):
    with _client(qwen3) as client:
        whole = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=20)
        message = whole.choices[0].message
        assert (_reasoning(message), message.content) == ("Hmm", "Paris")
        # <think> Hmm </think> Paris <|im_end|>: the reasoning's three tokens are completion tokens
        assert whole.usage.completion_tokens == 5 and whole.usage.completion_tokens_details.reasoning_tokens == 3
        reasoning, content, kinds, _, usage = _streamed(client, model="m", messages=ASK, temperature=0, max_tokens=20)
        assert (reasoning, content) == ("Hmm", "Paris") and kinds == ["reasoning", "content"]
        assert usage.completion_tokens == 5 and usage.completion_tokens_details.reasoning_tokens == 3
        off = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=20,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert (_reasoning(off.choices[0].message), off.choices[0].message.content) == (None, "Paris")
        assert off.usage.completion_tokens_details.reasoning_tokens == 0
        # The reply sent back as the next turn: its reasoning reaches the template (<think> Hmm </think>).
        turn = message.model_dump(exclude_none=True)
        follow = [*ASK, turn, {"role": "user", "content": "Sure?"}]
        again = client.chat.completions.create(model="m", messages=follow, temperature=0, max_tokens=20)
        bare = [*ASK, {"role": "assistant", "content": "Paris"}, {"role": "user", "content": "Sure?"}]
        base = client.chat.completions.create(model="m", messages=bare, temperature=0, max_tokens=20)
        assert again.usage.prompt_tokens == base.usage.prompt_tokens + 3


@pytest.mark.slow  # shares the qwen3 server; six requests (~3 s)
def test_qwen3_grammar_tools_and_structured_output_after_the_thought(qwen3):
    """The script answers Paris; each grammar allows only London or Rome, and the model's best
    allowed answer (London) comes after its own thought, whole and streamed."""
    choice = {"structured_outputs": {"choice": ["London", "Rome"]}}
    with _client(qwen3) as client:
        whole = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=20, extra_body=choice)
        assert (_reasoning(whole.choices[0].message), whole.choices[0].message.content) == ("Hmm", "London")
        assert _streamed(client, model="m", messages=ASK, temperature=0, max_tokens=20, extra_body=choice)[:3] == (
            "Hmm", "London", ["reasoning", "content"])
        # A named function: its arguments follow the schema, after the thought.
        named = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=40,
                                               tools=[WEATHER], tool_choice={"type": "function",
                                                                             "function": {"name": "get_weather"}})
        message = named.choices[0].message
        assert _reasoning(message) == "Hmm" and message.content is None
        assert json.loads(message.tool_calls[0].function.arguments)["city"] in ("London", "Rome")
        # tool_choice auto with a grammar in the same request that writes a hermes call: read from the answer.
        call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
        forced = {"structured_outputs": {"regex": call.replace("{", r"\{").replace("}", r"\}")}}
        auto = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=120,
                                              tools=[WEATHER], tool_choice="auto", extra_body=forced)
        message = auto.choices[0].message
        assert _reasoning(message) == "Hmm" and auto.choices[0].finish_reason == "tool_calls"
        assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == [
            ("get_weather", {"city": "Rome"})]
        reasoning, content, kinds, calls, _ = _streamed(client, model="m", messages=ASK, temperature=0,
                                                        max_tokens=120, tools=[WEATHER], tool_choice="auto",
                                                        extra_body=forced)
        assert reasoning == "Hmm" and not content and kinds == ["reasoning"]
        assert calls[0].function.name == "get_weather"
        assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Rome"}


@pytest.mark.slow  # starts its server (~6 s)
def test_deepseek_r1_reply_starts_inside_the_thought(tmp_path_factory):
    proc = _serve(tmp_path_factory, "r1", "deepseek_r1", THINK, DEEPSEEK_R1, WORDS + ["<think>", "</think>"])
    try:
        with _client(proc) as client:
            whole = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=20)
            assert (_reasoning(whole.choices[0].message), whole.choices[0].message.content) == ("Hmm", "Paris")
            assert whole.usage.completion_tokens_details.reasoning_tokens == 2  # Hmm </think>
            reasoning, content, kinds, _, _ = _streamed(client, model="m", messages=ASK, temperature=0, max_tokens=20,
                                                        response_format={"type": "json_schema", "json_schema": {
                                                            "name": "city", "schema": {"enum": ["Rome"]}}})
            assert (reasoning, content, kinds) == ("Hmm", '"Rome"', ["reasoning", "content"])
    finally:
        proc.stop()


@pytest.mark.slow  # starts its server (~6 s)
def test_gpt_oss_analysis_is_reasoning_and_final_is_the_answer(tmp_path_factory):
    proc = _serve(tmp_path_factory, "oss", "gpt_oss", {**OSS, **OSS_CALL}, HARMONY,
                  WORDS + ["analysis", FINAL, "caller", *list(OSS_CALL)[1:], '{"city": "Rome"}'],
                  special=("<|channel|>", "<|message|>", "<|end|>", "<|start|>"), tool_parser="openai")
    try:
        with _client(proc) as client:
            whole = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=20)
            assert (_reasoning(whole.choices[0].message), whole.choices[0].message.content) == ("Hmm", "Paris")
            choice = {"structured_outputs": {"choice": ["London", "Rome"]}}
            reasoning, content, kinds, _, usage = _streamed(client, model="m", messages=ASK, temperature=0,
                                                            max_tokens=20, extra_body=choice)
            assert (reasoning, content, kinds) == ("Hmm", "London", ["reasoning", "content"])
            # <|channel|> analysis <|message|> Hmm <|end|> <|start|> FINAL: the reasoning and its markup
            assert usage.completion_tokens_details.reasoning_tokens == 7
            # A message to a function: a call (the openai tool-call parser), after the reasoning.
            tools = dict(tools=[WEATHER], tool_choice="auto")
            called = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=20, **tools)
            message = called.choices[0].message
            assert (_reasoning(message), message.content, called.choices[0].finish_reason) == (
                "Weather?", None, "tool_calls")
            assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == [
                ("get_weather", {"city": "Rome"})]
            reasoning, content, kinds, calls, _ = _streamed(client, model="m", messages=ASK, temperature=0,
                                                            max_tokens=20, **tools)
            assert (reasoning, content, kinds) == ("Weather?", "", ["reasoning"])
            assert calls[0].function.name == "get_weather"
            assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Rome"}
    finally:
        proc.stop()


@pytest.mark.slow  # the engine's imports, twice (~10 s)
@pytest.mark.parametrize("flags,names", [(["--enable-reasoning"], "--reasoning-parser"),
                                         (["--enable-auto-tool-choice", "--tool-call-parser", "openai"],
                                          "--reasoning-parser gpt_oss")])
def test_flags_that_need_a_reasoning_parser_are_one_line_and_exit_2(flags, names):
    import subprocess
    import sys

    from tests.server.server_harness import ROOT, clean_env

    r = subprocess.run([sys.executable, "-m", "engine", "serve", *flags], cwd=ROOT, env=clean_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and names in r.stderr and len(r.stderr.strip().splitlines()) == 1
