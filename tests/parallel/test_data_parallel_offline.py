"""LLM(data_parallel_size=2, tensor_parallel_size=2): two replicas, each two ranks (five processes
in all), behind the offline API; both replicas take work, the tokens are one process's, and
shutdown leaves nothing running."""

from __future__ import annotations

from engine.frontend.llm import LLM
from tests.parallel.helpers import ENGINE_ARGS, NUM_BLOCKS, PROMPTS, greedy


def test_replicas_of_tensor_parallel_engines(gqa_model, single_process_outputs, new_processes):
    expected, _, _ = single_process_outputs
    with LLM(gqa_model, data_parallel_size=2, tensor_parallel_size=2, num_kv_blocks=NUM_BLOCKS,
             **ENGINE_ARGS) as llm:
        assert len(new_processes()) == 4  # two replicas, each with its TP worker
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        replicas = llm.engine.stats()["replicas"]
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs] == expected
    routed = [r["num_requests_routed"] for r in replicas]
    assert sum(routed) == len(PROMPTS) and min(routed) >= 4, routed  # least loaded, give or take affinity
    assert all(r["generation_tokens_total"] > 0 for r in replicas)
    assert new_processes() == []
