"""The parallel knobs are EngineConfig fields (flags of every engine command), validated at the
edge with a message naming the field; nothing in the engine reads an environment variable for a
knob, and the variables that once were knobs only earn a warning naming their flag."""

from __future__ import annotations

import logging
import os
import re

import pytest

import engine.config
from engine.arg_utils import engine_config_from_args
from engine.cli import build_parser, main
from engine.config import REMOVED_ENV_KNOBS, EngineConfig

ENGINE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "engine")
FLAGS = ("--pipeline-micro-batches", "--pipeline-layer-partition", "--distributed-timeout-s")

# PAGEWISE_ variables a module may read, and why none of them is an engine knob.
ALLOWED_ENV = {
    "loading/user_cache.py": {"PAGEWISE_CACHE_DIR"},  # where the default model and GGUF tokenizers are cached
    "bench/backends/openai_http.py": {"PAGEWISE_API_KEY"},  # the bench client's credential
    "bench/cli.py": {"PAGEWISE_API_KEY"},  # named in --api-key's help
    "config.py": set(REMOVED_ENV_KNOBS),  # only to warn that they are no longer read
}


@pytest.mark.parametrize("kwargs, field", [
    (dict(pipeline_parallel_size=2, pipeline_layer_partition="3,x"), "pipeline_layer_partition"),
    (dict(pipeline_parallel_size=2, pipeline_layer_partition="3"), "pipeline_layer_partition"),
    (dict(pipeline_parallel_size=2, pipeline_layer_partition="4,0"), "pipeline_layer_partition"),
    (dict(pipeline_parallel_size=2, pipeline_layer_partition=""), "pipeline_layer_partition"),
    (dict(pipeline_micro_batches=0), "pipeline_micro_batches"),
    (dict(pipeline_micro_batches=-2), "pipeline_micro_batches"),
    (dict(distributed_timeout_s=0), "distributed_timeout_s"),
    (dict(distributed_timeout_s=-5.0), "distributed_timeout_s"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        EngineConfig(**kwargs)


def test_good_values():
    config = EngineConfig(pipeline_parallel_size=2, pipeline_layer_partition=" 3, 1", pipeline_micro_batches=4,
                          distributed_timeout_s=2.5)
    assert config.pipeline_layer_partition == "3,1" and config.layer_partition == (3, 1)
    assert EngineConfig(pipeline_parallel_size=2, pipeline_layer_partition=(1, 3)).layer_partition == (1, 3)
    defaults = EngineConfig()
    assert (defaults.pipeline_micro_batches, defaults.layer_partition, defaults.distributed_timeout_s) == \
        (None, None, 60.0)


def test_flags_with_help_parse_into_the_config():
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    for flag in FLAGS:
        assert flag in help_text
    assert "layers per pipeline stage, comma-separated, e.g. 3,1" in help_text
    args = build_parser().parse_args(["serve", "-pp", "2", "--pipeline-micro-batches", "4",
                                      "--pipeline-layer-partition", "3,1", "--distributed-timeout-s", "7.5"])
    config = engine_config_from_args(args)
    assert (config.pipeline_micro_batches, config.layer_partition, config.distributed_timeout_s) == (4, (3, 1), 7.5)


def test_cli_rejects_a_bad_partition_in_one_line(capsys):
    assert main(["generate", "hi", "-pp", "2", "--pipeline-layer-partition", "3;1"]) == 2
    assert "pipeline_layer_partition must be 2 positive layer count(s)" in capsys.readouterr().err


def test_removed_env_var_is_not_read_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(engine.config, "_warned_env", set())
    monkeypatch.setenv("PAGEWISE_PP_MICRO_BATCHES", "3")
    monkeypatch.setenv("PAGEWISE_DIST_TIMEOUT_S", "5")
    with caplog.at_level(logging.WARNING, logger="engine.config"):
        config = EngineConfig()
        EngineConfig()
    assert config.pipeline_micro_batches is None and config.distributed_timeout_s == 60.0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert any("PAGEWISE_PP_MICRO_BATCHES" in w and "--pipeline-micro-batches" in w for w in warnings)
    assert any("PAGEWISE_DIST_TIMEOUT_S" in w and "--distributed-timeout-s" in w for w in warnings)


def _engine_modules():
    for root, _, files in os.walk(ENGINE_DIR):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                yield os.path.relpath(path, ENGINE_DIR).replace(os.sep, "/"), open(path, encoding="utf-8").read()


def test_no_engine_module_reads_a_pagewise_knob_from_the_environment():
    problems = []
    for rel, text in _engine_modules():
        if not re.search(r"os\.environ|os\.getenv|environ\.get", text):
            continue
        names = set(re.findall(r"PAGEWISE_[A-Z0-9_]+", text)) - ALLOWED_ENV.get(rel, set())
        if names:
            problems.append(f"engine/{rel}: {sorted(names)}")
    assert not problems, "environment variables used as knobs (make them EngineConfig fields): " + \
        "; ".join(problems)


def test_removed_knobs_are_named_only_by_the_warning():
    users = [rel for rel, text in _engine_modules() if rel != "config.py" and any(n in text for n in REMOVED_ENV_KNOBS)]
    assert users == []


def test_one_micro_batch_per_step_gives_the_same_tokens(gqa_model, single_process_outputs, new_processes):
    """pipeline_micro_batches reaches the executor: one micro-batch (no overlap) changes nothing."""
    from engine.frontend.llm import LLM
    from tests.parallel.helpers import ENGINE_ARGS, NUM_BLOCKS, PROMPTS, greedy

    expected, _, _ = single_process_outputs
    with LLM(gqa_model, pipeline_parallel_size=2, pipeline_micro_batches=1, pipeline_layer_partition="3,1",
             num_kv_blocks=NUM_BLOCKS, **ENGINE_ARGS) as llm:
        assert llm.engine.runner.num_micro_batches == 1
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        reports = llm.engine.runner.rank_reports()
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs] == expected
    assert [r["num_layers"] for r in reports] == [3, 1]
    assert new_processes() == []
