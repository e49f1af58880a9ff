"""`--core-process`: the engine core steps in a process of its own (vLLM's process split) while the
server's process keeps HTTP, tokenization and detokenization. It answers exactly what one process
answers, offline and served; a dead core ends the server with exit 1 and a line naming it, and a
dead server takes its core process with it."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.parallel.helpers import BLOCK_SIZE, ENGINE_ARGS, NUM_BLOCKS, PROMPTS, engine_processes, greedy, pid_alive
from tests.server.server_harness import ServerProcess

SERVER_ARGS = ["--core-process", "--num-kv-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
               "--max-num-batched-tokens", "32", "--max-model-len", "128", "--num-threads", "1", "--seed", "0"]


@pytest.mark.slow  # starts a core process (~5 s)
def test_offline_answers_as_one_process(gqa_model, single_process_outputs):
    from engine.frontend.llm import LLM

    expected, _, _ = single_process_outputs
    with LLM(gqa_model, num_kv_blocks=NUM_BLOCKS, core_process=True, **ENGINE_ARGS) as llm:
        assert len(engine_processes()) == 1  # the core, in its own process
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert llm.engine.stats()["num_used_blocks"] == 0
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs] == expected
    assert engine_processes() == []


@pytest.mark.slow  # starts a server and its core process (~8 s)
def test_served_answers_as_one_process_and_a_dead_core_stops_the_server(gqa_model, single_process_outputs, tmp_path):
    expected, _, _ = single_process_outputs
    proc = ServerProcess(["--model", gqa_model, *SERVER_ARGS], str(tmp_path / "server.log"))
    try:
        (core,) = engine_processes(proc.proc.pid)
        for prompt, (_, text) in zip(PROMPTS[:3], expected):
            r = httpx.post(proc.url + "/v1/completions", timeout=60, json={
                "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
        os.kill(core, signal.SIGKILL)
        assert proc.proc.wait(30) == 1
        assert "the engine core process: pagewise-core" in proc.log() and "killed by SIGKILL" in proc.log()
    finally:
        proc.stop()


@pytest.mark.slow  # starts a server and its core process (~8 s)
def test_a_killed_server_takes_its_core_process_with_it(gqa_model, tmp_path):
    proc = ServerProcess(["--model", gqa_model, *SERVER_ARGS], str(tmp_path / "server.log"))
    try:
        (core,) = engine_processes(proc.proc.pid)
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait(10)
        deadline = time.monotonic() + 15
        while pid_alive(core) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(core)
    finally:
        proc.stop()
