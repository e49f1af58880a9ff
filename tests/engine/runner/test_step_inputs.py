"""The runner's persistent step inputs (engine/runner/step_inputs.py): the block table kept per stream and
updated only where blocks changed, the staging of one step with its padding, and the runner's
steps built through them (oracle: the block tables and flat tensors written out from the streams'
own lists, as the runner built them before)."""

from __future__ import annotations

import random

import torch

from engine import LLM, SamplingParams
from engine.runner.step_inputs import StepInputs
from tests.engine.hf_oracle import hf_greedy


class Stream:
    """What StepInputs reads and keeps on a stream (the runner's CachedRequestState)."""

    def __init__(self, blocks):
        self.block_ids = list(blocks)
        self.table_row, self.table_blocks, self.table_step = None, 0, 0


def _step(inputs: StepInputs, streams: list[Stream]) -> tuple[list[int], int]:
    """Stage one step of these streams; (their rows, the block-table entries it updates)."""
    inputs.begin_step()
    rows = [inputs.table_row(s) for s in streams]
    updates = inputs._num_updates
    n = len(streams)
    inputs.stage([1] * n, [0] * n, [0] * n, list(range(n + 1)), [1] * n, rows, [], n, n)
    inputs.upload()
    return rows, updates


def _tables_hold(inputs: StepInputs, streams: list[Stream]) -> bool:
    """Row i of the step's table starts with stream i's blocks (entries past them are never read:
    the sequence lengths bound every read)."""
    table = inputs.block_tables(len(streams))
    return all(table[i, :len(s.block_ids)].tolist() == s.block_ids for i, s in enumerate(streams))


def test_block_table_is_updated_only_where_blocks_changed():
    inputs = StepInputs(max_num_tokens=16, max_num_seqs=4, max_blocks_per_seq=6, device=torch.device("cpu"))
    a, b = Stream([7, 3]), Stream([5])
    rows, updates = _step(inputs, [a, b])
    assert updates == 3 and sorted(rows) == [0, 1]
    assert _tables_hold(inputs, [a, b])
    # A decode step without new blocks writes nothing; a new block writes one entry.
    assert _step(inputs, [a, b])[1] == 0
    b.block_ids.append(9)
    rows2, updates = _step(inputs, [b, a])  # batch order changes; rows stay with their streams
    assert updates == 1 and rows2 == rows[::-1]
    assert _tables_hold(inputs, [b, a])
    # Resumed after preemption: new blocks replace the row (the runner resets table_blocks).
    a.block_ids, a.table_blocks = [11], 0
    assert _step(inputs, [a])[1] == 1
    assert inputs.block_tables(1, 1).tolist() == [[11]]


def test_rows_are_released_and_taken_from_streams_not_in_the_step():
    inputs = StepInputs(max_num_tokens=16, max_num_seqs=2, max_blocks_per_seq=4, device=torch.device("cpu"))
    a, b, c = Stream([1]), Stream([2, 3]), Stream([4])
    _step(inputs, [a, b])
    # Both rows are held; c's step does not include b (say, preempted): c takes b's row, and b,
    # scheduled again later, gets a row back and has it rewritten whole.
    _step(inputs, [a, c])
    assert b.table_row is None and c.table_row is not None
    rows, updates = _step(inputs, [b, c])
    assert updates == 2 and a.table_row is None
    assert _tables_hold(inputs, [b, c])
    inputs.release(b)
    assert b.table_row is None and len(inputs._free_rows) == 1


def test_padding_rows_compute_on_token_0_store_nothing_and_see_one_key():
    inputs = StepInputs(max_num_tokens=8, max_num_seqs=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    inputs.begin_step()
    s = Stream([6, 2])
    row = inputs.table_row(s)
    # Stale values a previous step left behind must not survive as padding.
    inputs.input_ids.fill_(99), inputs.slot_mapping.fill_(99), inputs.seq_lens.fill_(99)
    inputs.stage([42, 43], [20, 21], [36, 37], [0, 2], [22], [row], [1], num_padded_tokens=4, num_padded_seqs=3)
    inputs.upload()
    assert inputs.input_ids[:4].tolist() == [42, 43, 0, 0]
    assert inputs.positions[:4].tolist() == [20, 21, 0, 0]
    assert inputs.slot_mapping[:4].tolist() == [36, 37, -1, -1]
    assert inputs.query_start_loc[:4].tolist() == [0, 2, 3, 4]  # one padding token per padding sequence
    assert inputs.seq_lens[:3].tolist() == [22, 1, 1]
    assert inputs.table_rows[:3].tolist() == [row, 0, 0]
    assert inputs.sample_rows[:3].tolist() == [1, 0, 0]


def test_runner_steps_see_the_tables_and_slots_of_their_streams(tiny_models):
    """Every eager forward's block table, slots and positions equal what the streams' own block
    lists give, through chunked prefill, preemption (rows rewritten) and finished streams (rows
    reused); and the greedy tokens match transformers."""
    path = tiny_models("llama")
    llm = LLM(path, device="cpu", num_kv_blocks=16, block_size=8, max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=128, seed=0)
    runner = llm.engine.runner
    forward, execute = runner._forward, runner.execute_model
    scheduled, checked = [], []

    def execute_and_remember(sched):
        scheduled[:] = sched.num_scheduled_tokens
        return execute(sched)

    def check(step):
        out = forward(step)
        meta, inputs, bs = step.meta, runner.inputs, runner.block_size
        starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        assert len(lens) == len(scheduled)
        for i, (req_id, n) in enumerate(scheduled):
            blocks = runner.requests[req_id].block_ids
            assert meta.block_tables[i, :len(blocks)].tolist() == blocks
            pos = list(range(lens[i] - n, lens[i]))
            assert inputs.positions[starts[i]:starts[i + 1]].tolist() == pos
            assert meta.slot_mapping[starts[i]:starts[i + 1]].tolist() == [blocks[p // bs] * bs + p % bs for p in pos]
        checked.append(len(lens))
        return out

    runner._forward, runner.execute_model = check, execute_and_remember
    rng = random.Random(5)
    prompts = [[rng.randrange(3, llm.engine.vocab_size) for _ in range(n)] for n in (5, 40, 17, 60, 3, 33)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert llm.engine.stats()["num_preemptions"] > 0, "the test must exercise preemption"
    assert checked and max(checked) > 1
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 12)
