"""Multi-node through torchrun's environment: two torchrun 'nodes' on this machine (one process
each, pipeline_parallel_size 2, so the stages talk across the node boundary) run
`engine generate` as the README's two-node example does, and print what one process prints."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from engine.frontend.llm import LLM
from engine.sampling_params import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["The capital of France is", "Hello world! How are you"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_pipeline_parallel(gqa_model, tmp_path):
    port = _free_port()
    engine_args = ["generate", *PROMPTS, "--model", gqa_model, "--device", "cpu", "--max-tokens", "8",
                   "--num-kv-blocks", "64", "--num-threads", "1", "--pipeline-parallel-size", "2"]
    env = {**os.environ, "PYTHONPATH": ROOT}

    def node(rank: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "engine.torchrun", *engine_args]
        log = open(tmp_path / f"node{rank}.log", "w")
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE if rank == 0 else log,
                                stderr=log, text=True)

    follower, leader = node(1), node(0)
    out, _ = leader.communicate(timeout=240)
    assert leader.returncode == 0, (tmp_path / "node0.log").read_text()[-3000:]
    assert follower.wait(timeout=60) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    with LLM(gqa_model, device="cpu", num_kv_blocks=64, num_threads=1) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert out == "".join(p + o.outputs[0].text + "\n" for p, o in zip(PROMPTS, outs))
