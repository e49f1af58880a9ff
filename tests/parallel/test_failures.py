"""A worker that dies or hangs becomes a clear error within seconds, never a silent stall, and
nothing is left running afterwards: not after shutdown, not even after the engine's own
process is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from engine.frontend.llm import LLM
from engine.executor.procs import ChildProcesses, WorkerDiedError
from engine.sampling_params import SamplingParams
from tests.parallel.helpers import ENGINE_ARGS, PROMPTS, pid_alive

LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


def _signal_mid_run(llm: LLM, pid: int, sig: int) -> dict:
    """Send `sig` to `pid` once generation is under way; records when."""
    sent = {}

    def send():
        deadline = time.monotonic() + 60
        while llm.engine.generation_tokens_total < 20 and time.monotonic() < deadline:
            time.sleep(0.005)
        sent["at"] = time.monotonic()
        os.kill(pid, sig)

    threading.Thread(target=send, daemon=True).start()
    return sent


def _generate_until_error(llm: LLM) -> tuple[BaseException, float]:
    with pytest.raises(WorkerDiedError) as info:
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    return info.value, time.monotonic()


def test_killed_stage_fails_generate_within_seconds_and_leaves_nothing(gqa_model, new_processes):
    llm = LLM(gqa_model, pipeline_parallel_size=2, num_kv_blocks=256, **ENGINE_ARGS)
    try:
        (_, worker), = llm.engine.runner.children.procs
        sent = _signal_mid_run(llm, worker.pid, signal.SIGKILL)
        error, raised_at = _generate_until_error(llm)
        assert raised_at - sent["at"] < 5.0
        assert "pagewise-rank1" in str(error) and "SIGKILL" in str(error)
        with pytest.raises(WorkerDiedError, match="SIGKILL"):  # and at once from then on
            llm.generate(PROMPTS[0], use_tqdm=False)
    finally:
        llm.shutdown()
    assert new_processes() == []


def test_hung_worker_times_out_instead_of_stalling(gqa_model, new_processes):
    llm = LLM(gqa_model, tensor_parallel_size=2, num_kv_blocks=256, distributed_timeout_s=5, **ENGINE_ARGS)
    try:
        (_, worker), = llm.engine.runner.children.procs
        sent = _signal_mid_run(llm, worker.pid, signal.SIGSTOP)
        error, raised_at = _generate_until_error(llm)
        assert raised_at - sent["at"] < 15.0
        assert "distributed_timeout_s=5s" in str(error)
    finally:
        t = time.monotonic()
        llm.shutdown()  # the stopped worker cannot leave by itself: it is killed
        assert time.monotonic() - t < 10.0
    assert new_processes() == []


def test_child_death_is_noticed_while_idle(new_processes):
    children = ChildProcesses()
    proc = children.start("pagewise-test-child", time.sleep, 60)
    assert children.failure() is None
    os.kill(proc.pid, signal.SIGKILL)
    assert "pagewise-test-child" in (children.failure(wait_s=5.0) or "")
    with pytest.raises(WorkerDiedError, match="SIGKILL"):
        children.check()
    children.stop()
    assert new_processes() == []


def test_children_exit_when_their_parent_is_killed():
    """SIGKILL gives the engine process no chance to clean up: its children notice by themselves."""
    code = textwrap.dedent("""
        import sys, time
        from engine.executor.procs import ChildProcesses
        child = ChildProcesses().start("pagewise-grandchild", time.sleep, 600)
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    grandchild = int(parent.stdout.readline())
    assert pid_alive(grandchild)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while pid_alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(grandchild)
