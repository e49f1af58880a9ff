"""ZeRO-3 communication against a real fully sharded training step on CPU: torch FSDP2 over gloo, 2 and 4 ranks.

FSDP2 (`torch.distributed.fsdp.fully_shard`) moves parameters and gradients with two collectives only,
`dist.all_gather_single` (unshard a group's parameters) and `dist.reduce_scatter_single` (a group's gradients),
both looked up on `torch.distributed` at call time (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py,
DefaultAllGather / DefaultReduceScatter). Here both are replaced by explicit rings of point-to-point send / recv
that count every byte they send, as test_comm_measured.py does for DDP's all-reduce.

Every decoder layer, the embedding, the final norm and the LM head are their own FSDP group, so the root
holds no parameter of its own (FSDP2 keeps the root's parameters gathered between forward and backward) and
every group reshards after its forward (FSDP2's default). One step then all-gathers each parameter in the
forward, all-gathers it again in the backward, and reduce-scatters its gradient: 3 x (N - 1) / N x K per rank,
K the parameter (= gradient) bytes, which is 1.5x DDP's ring all-reduce of 2 (N - 1) / N x K (Rajbhandari et
al. 2020, "ZeRO", §7.2.2; Zhao et al. 2023, "PyTorch FSDP", §3.2, the same schedule). The planner's ZeRO-3 DP
sync (comm.dp_sync) must equal the measured count exactly, and each phase must be one third of it.
"""

import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
dist = torch.distributed
mp = torch.multiprocessing

from engine.planning.layout import Layout  # noqa: E402
from engine.planning.spec import ModelSpec  # noqa: E402
from engine.planning.training import plan_training  # noqa: E402

SEQ, BATCH, VOCAB, STEPS = 32, 2, 512, 2


def tiny_config():
    # every parameter's first dimension divides by 4, so FSDP2 pads nothing when it shards over 2 or 4 ranks
    return transformers.LlamaConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=6,
                                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                    use_cache=False, tie_word_embeddings=False)


class Done:
    """What FSDP2 waits on: the ring below has finished when it returns."""

    def wait(self, *args, **kwargs):
        return True


def ring_all_gather(output, input, rank, world, sent):
    """N - 1 steps: pass along the chunk received last (Patarasuk & Yuan 2009); each rank sends (N - 1) chunks."""
    chunks = output.view(-1).tensor_split(world)
    chunks[rank].copy_(input.view(-1))
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        out, into = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        request = dist.isend(out.contiguous(), right)
        buffer = torch.empty_like(into)
        dist.recv(buffer, left)
        request.wait()
        into.copy_(buffer)
        sent[0] += out.nbytes


def ring_reduce_scatter(output, input, op, rank, world, sent):
    """N - 1 steps of send-partial-sum-right, add-what-comes-from-the-left; rank r ends with chunk r summed."""
    chunks = [c.clone() for c in input.view(-1).tensor_split(world)]
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        out, into = chunks[(rank - step - 1) % world], chunks[(rank - step - 2) % world]
        request = dist.isend(out.contiguous(), right)
        buffer = torch.empty_like(into)
        dist.recv(buffer, left)
        request.wait()
        into.add_(buffer)
        sent[0] += out.nbytes
    assert op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG), op
    output.view(-1).copy_(chunks[rank] / (world if op == dist.ReduceOp.AVG else 1))


def worker(rank, world, store_path, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config())
    for module in (*model.model.layers, model.model.embed_tokens, model.model.norm, model.lm_head):
        fully_shard(module)
    fully_shard(model)
    assert not [n for n, p in model.named_parameters(recurse=False)]
    sent = {"forward all-gather": [0], "backward all-gather": [0], "reduce-scatter": [0]}
    phase = ["forward"]

    def all_gather(output, input, group=None, async_op=False):
        ring_all_gather(output, input, rank, world, sent[f"{phase[0]} all-gather"])
        return Done() if async_op else None

    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        ring_reduce_scatter(output, input, op, rank, world, sent["reduce-scatter"])
        return Done() if async_op else None

    dist.all_gather_single, dist.reduce_scatter_single = all_gather, reduce_scatter
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    for step in range(STEPS):
        for counter in sent.values():
            counter[0] = 0
        phase[0] = "forward"
        loss = model(input_ids=ids, labels=ids).loss
        phase[0] = "backward"
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({name: counter[0] for name, counter in sent.items()}, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_bytes_equal_the_zero_3_formula(tmp_path, world):
    mp.spawn(worker, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    spec = ModelSpec.from_hf_config(tiny_config().to_dict())
    kw = dict(seq_len=SEQ, precision="float32", optimizer="sgd", tokens=world * BATCH * SEQ)
    zero3 = plan_training(spec, Layout(nodes=1, gpus_per_node=world, micro_batch=BATCH, zero=3), **kw)
    ddp = plan_training(spec, Layout(nodes=1, gpus_per_node=world, micro_batch=BATCH), **kw)
    (sync,) = [c for c in zero3.communication if c["name"] == "DP gradient sync"]
    (all_reduce,) = [c for c in ddp.communication if c["name"] == "DP gradient sync"]
    k = spec.params * 4  # float32 parameters, float32 gradients
    for r in ranks:  # each rank sends (N - 1) / N x K in each of the three phases: no padding, nothing else
        assert r == {name: (world - 1) * k // world for name in r}, r
        assert sum(r.values()) == pytest.approx(sync["bytes"], rel=1e-12)
    assert sync["bytes"] == pytest.approx(1.5 * all_reduce["bytes"], rel=1e-12)
    print(f"world {world}: per rank {ranks[0]}, planner ZeRO-3 {sync['bytes']:,.0f} B = 1.5 x DDP's "
          f"{all_reduce['bytes']:,.0f} B")
