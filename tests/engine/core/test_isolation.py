"""Beneath validation, isolation: when one request's step data makes the engine raise (here a
request whose sampling parameters are corrupted after admission, which validation can no longer
see), that request alone ends with an error; the others finish exactly as transformers'
greedy generation, and no KV block stays in use."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.engine.hf_oracle import hf_greedy


def _poison_stop_ids(p: SamplingParams) -> None:
    p.stop_token_ids.append(10**6)  # out of the vocabulary: the min_tokens ban indexes past the logits


def _poison_seed(p: SamplingParams) -> None:
    p.seed = 2**70  # beyond what a torch.Generator takes


@pytest.mark.parametrize("poison,extra", [(_poison_stop_ids, dict(min_tokens=3)),
                                          (_poison_seed, dict(temperature=1.0))])
def test_a_failing_request_ends_alone(tiny_llm, tiny_models, poison, extra):
    engine = tiny_llm.engine
    good = {"good-a": [5, 6, 7, 8], "good-b": list(range(20, 50))}
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for rid, ids in good.items():
        engine.add_request(rid, ids, greedy)
    bad = SamplingParams(max_tokens=8, ignore_eos=True, n=2, **extra)
    engine.add_request("bad", [11, 12, 13], bad)
    poison(bad)
    tokens, failed = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error is not None:
                failed.append(out)
            else:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [o.request_id for o in failed] == ["bad"]
    assert failed[0].request_finished and failed[0].finish_reason == "abort"
    path = tiny_models("llama")
    assert {rid: tokens[rid] for rid in good} == {rid: hf_greedy(path, ids, 8) for rid, ids in good.items()}
    assert engine.stats()["num_used_blocks"] == 0 and not engine.parents
    # The engine still serves.
    assert (tiny_llm.generate([[9, 9, 9]], greedy, use_tqdm=False)[0].outputs[0].token_ids
            == hf_greedy(path, [9, 9, 9], 8))
