"""Structured output under TP 2 (rank 0 samples in this process), PP 2 (the last stage samples in a
worker, which compiles the grammars itself) and DP 2 (each replica compiles its own): every output
follows its grammar and equals the single process's, greedy."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.frontend.llm import LLM
from engine.sampling_params import GrammarSpec, SamplingParams
from tests.parallel.helpers import ENGINE_ARGS, NUM_BLOCKS, PROMPTS

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n", "s"]}
SPECS = [GrammarSpec.of("json", SCHEMA), GrammarSpec.of("regex", r"[0-9]{2}-[a-z]{3}"),
         GrammarSpec.of("choice", ["red", "green", "blue"])]


def _run(model: str, **layout) -> list[str]:
    params = [SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=SPECS[i % 3]) for i in range(6)]
    with LLM(model, num_kv_blocks=NUM_BLOCKS * 8, **layout, **{**ENGINE_ARGS, "max_model_len": 256}) as llm:
        outs = llm.generate(PROMPTS[:6], params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), [o.outputs[0].text for o in outs]
    return [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                    dict(data_parallel_size=2)], ids=["tp2", "pp2", "dp2"])
def test_grammars_hold_and_match_one_process(gqa_model, layout, new_processes):
    texts = _run(gqa_model, **layout)
    assert texts == _run(gqa_model)
    for i, text in enumerate(texts):
        if i % 3 == 0:
            jsonschema.validate(json.loads(text), SCHEMA)
        elif i % 3 == 1:
            assert re.fullmatch(r"[0-9]{2}-[a-z]{3}", text), text
        else:
            assert text in ("red", "green", "blue")
    assert new_processes() == []
