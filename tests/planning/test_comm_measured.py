"""Communication against a real data-parallel training step on CPU: torch DDP over gloo, 2 and 4 processes.

A DDP communication hook runs each gradient bucket's all-reduce as an explicit ring (reduce-scatter, then
all-gather, by point-to-point send / recv) and counts every byte it sends. The planner's DP gradient sync for
the same model and layout must equal that count exactly.

Then the step time, predicted as the planner does (compute + communication not hidden), with both rates
measured on the spot while every rank runs at once (they share the cores): the compute rate is the FLOPs of
a step over the time of the same step without DDP (an achieved rate: on a CPU a tiny model's norms,
softmax and framework overhead take as long as its matmuls, so the matmul peak alone predicts half the
step), the link is the bus bandwidth of a ring all-reduce of a separate 8 MiB buffer, as nccl-tests measures
it, and nothing overlaps (the hook blocks the backward while
it runs). Within 30% of the measured DDP step.
"""

import json
import os
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
dist = torch.distributed
mp = torch.multiprocessing

from engine.planning.layout import Layout  # noqa: E402
from engine.planning.spec import ModelSpec  # noqa: E402
from engine.planning.steptime import Throughput  # noqa: E402
from engine.planning.training import plan_training  # noqa: E402

SEQ, BATCH, VOCAB, STEPS = 64, 2, 512, 4


def tiny_config():
    return transformers.LlamaConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=6,
                                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                    use_cache=False)


def ring_all_reduce(flat, rank, world, sent):
    """Patarasuk & Yuan's ring: N - 1 reduce-scatter steps, N - 1 all-gather steps; counts bytes sent."""
    chunks = flat.tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(world - 1):
            offset = 0 if phase == "reduce-scatter" else 1
            out, into = chunks[(rank - step + offset) % world], chunks[(rank - step - 1 + offset) % world]
            buffer = torch.empty_like(into)
            request = dist.isend(out.contiguous(), right)
            dist.recv(buffer, left)
            request.wait()
            sent[0] += out.nbytes
            into.add_(buffer) if phase == "reduce-scatter" else into.copy_(buffer)
    return flat.div_(world)


def matmul_rate(seconds=0.5):
    a, b = torch.randn(BATCH * SEQ, 384), torch.randn(384, 1024)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] * n / (time.perf_counter() - start)


def bus_bandwidth(rank, world, nbytes=8 << 20, repeats=5):
    """nccl-tests' "bus bandwidth" (doc/PERFORMANCE.md): bytes a rank sends in a ring all-reduce of a test
    buffer, 2 (N - 1) / N x size, over the time it takes."""
    buffer, sent = torch.ones(nbytes // 4), [0]
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        ring_all_reduce(buffer, rank, world, sent)
    return sent[0] / (time.perf_counter() - start)


def median(values):
    return sorted(values)[len(values) // 2]


def worker(rank, world, store_path, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    sent, in_hook = [0], [0.0]

    def hook(state, bucket):
        future = torch.futures.Future()
        start = time.perf_counter()
        future.set_result(ring_all_reduce(bucket.buffer(), rank, world, sent))
        in_hook[0] += time.perf_counter() - start
        return future

    ddp.register_comm_hook(None, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    rate = matmul_rate()
    bandwidth = bus_bandwidth(rank, world)
    local = []
    for step in range(STEPS + 1):  # the same step, no communication
        dist.barrier()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        local.append(time.perf_counter() - start)
    times, hooks = [], []
    for step in range(STEPS + 1):
        sent[0], in_hook[0] = 0, 0.0
        dist.barrier()
        start = time.perf_counter()
        ddp(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        hooks.append(in_hook[0])
    result = {"sent": sent[0], "step_s": median(times[1:]), "local_s": median(local[1:]), "hook_s": median(hooks[1:]),
              "rate": rate, "bw": bandwidth}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.serial  # the step time it predicts is measured on the spot: a parallel test's load skews it
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_bytes_equal_the_formula_and_step_time_within_30_percent(tmp_path, world):
    mp.spawn(worker, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    spec = ModelSpec.from_hf_config(tiny_config().to_dict())
    layout = Layout(nodes=1, gpus_per_node=world, micro_batch=BATCH)
    bandwidth = min(r["bw"] for r in ranks)
    kw = dict(seq_len=SEQ, precision="float32", optimizer="sgd", flops_method="exact", tokens=world * BATCH * SEQ)
    at_peak = plan_training(spec, layout, **kw, throughput=Throughput(
        peak=min(r["rate"] for r in ranks), compute_efficiency=1.0, intra_node_bw=bandwidth, dp_overlap=0.0))
    achieved = at_peak.flops / world / max(r["local_s"] for r in ranks)
    plan = plan_training(spec, layout, **kw, throughput=Throughput(
        peak=achieved, compute_efficiency=1.0, intra_node_bw=bandwidth, dp_overlap=0.0))
    (sync,) = [c for c in plan.communication if c["name"] == "DP gradient sync"]
    # every chunk is sent N - 1 times in each phase: the ranks' mean is the per-GPU formula, exactly
    assert sum(r["sent"] for r in ranks) / world == pytest.approx(sync["bytes"], rel=1e-12)
    measured = max(r["step_s"] for r in ranks)
    print(f"world {world}: predicted {plan.step.total:.4f} s (compute {plan.step.compute:.4f}, communication "
          f"{plan.step.exposed_communication:.4f}), measured {measured:.4f} s; from the matmul peak "
          f"{at_peak.step.total:.4f} s; bus bandwidth {bandwidth / 1e9:.2f} GB/s")
    assert plan.step.total == pytest.approx(measured, rel=0.30)
