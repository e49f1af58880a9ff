"""The fused mixture-of-experts op of the cpu and triton backends against kernels/reference.py's
expert loop, and that loop (and routing) against a float64 definition computed token by token.

Triton runs under the interpreter on CPU (tests/kernels/conftest.py) in float32 and float16; the
shapes are small and odd (hidden 40 / 72, ffn 24 / 56) so every tile is partly masked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import cpu_build, reference

NUM_EXPERTS, TOP_K = 8, 2
# Outputs are O(1) (weights scaled by 1/sqrt(fan-in)); 16-bit: a few roundings of the intermediates.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 2e-2)}


@pytest.fixture(params=["cpu", "triton"])
def backend(request):
    """A backend name whose kernels run here, or a skip saying why not."""
    if request.param == "cpu" and cpu_build.available() is not None:
        pytest.skip(f"CPU KERNELS NOT TESTED: they did not build ({cpu_build.available()})")
    if request.param == "triton":
        request.getfixturevalue("triton_ops")
    return request.param


def skip_unsupported(backend: str, dtype: torch.dtype) -> None:
    if backend == "triton" and dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("bfloat16 Triton kernels run on CUDA only (the interpreter computes in numpy, which has no bf16)")


def device_for(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def make_layer(num_tokens, hidden, ffn, dtype, seed, num_experts=NUM_EXPERTS, device="cpu"):
    """x, w13, w2 and router logits, weights scaled so every output is O(1)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * ffn, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, ffn, generator=gen) / ffn ** 0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    return [t.to(dtype).to(device) for t in (x, w13, w2)] + [logits.to(device)]


def moe64(x, topk_weights, topk_ids, w13, w2, expert_offset=0) -> torch.Tensor:
    """The definition in float64, one (token, chosen expert) at a time."""
    x, w13, w2 = x.double().cpu(), w13.double().cpu(), w2.double().cpu()
    ffn = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, expert in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            e = expert - expert_offset
            if 0 <= e < w13.shape[0]:
                gate, up = w13[e, :ffn] @ x[t], w13[e, ffn:] @ x[t]
                out[t] += weight * (w2[e] @ (F.silu(gate) * up))
    return out


def close(got, want, dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("expert_offset, num_local", [(0, 8), (3, 3)])
def test_reference_matches_float64(expert_offset, num_local):
    x, w13, w2, logits = make_layer(33, 72, 56, torch.float32, seed=1)
    weights, ids = reference.select_experts(logits, TOP_K, True)
    w13, w2 = w13[expert_offset:expert_offset + num_local], w2[expert_offset:expert_offset + num_local]
    got = reference.fused_moe(x, weights, ids, w13, w2, expert_offset)
    close(got, moe64(x, weights, ids, w13, w2, expert_offset), torch.float32)


def test_the_torch_backend_is_the_reference():
    ops = kernels.get_backend("torch")
    assert ops.fused_moe is reference.fused_moe and ops.select_experts is reference.select_experts
    assert ops.pack_moe_weights(torch.zeros(2, 4, 3), torch.zeros(2, 3, 2)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("hidden, ffn", [(40, 24), (72, 56)])
def test_fused_moe_matches_reference(backend, dtype, num_tokens, hidden, ffn):
    skip_unsupported(backend, dtype)
    x, w13, w2, logits = make_layer(num_tokens, hidden, ffn, dtype, seed=num_tokens + hidden,
                                    device=device_for(backend))
    weights, ids = kernels.select_experts(logits, TOP_K, renormalize=True, backend=backend)
    got = kernels.fused_moe(x, weights, ids, w13, w2, backend=backend)
    assert got.dtype == dtype and got.shape == x.shape
    close(got, reference.fused_moe(x, weights, ids, w13, w2), dtype)
    if dtype == torch.float32:
        close(got, moe64(x, weights, ids, w13, w2), dtype)


def test_triton_prefill_tiles(triton_ops):
    """Enough tokens per expert for the 64-row blocks (more slots than 16 per expert)."""
    from kernels import triton_moe

    backend, num_tokens = "triton", 80
    assert triton_moe.moe_tiles(num_tokens * TOP_K, NUM_EXPERTS).block_m == 64
    x, w13, w2, logits = make_layer(num_tokens, 40, 24, torch.float32, seed=5, device=device_for(backend))
    weights, ids = kernels.select_experts(logits, TOP_K, renormalize=False, backend=backend)
    close(kernels.fused_moe(x, weights, ids, w13, w2, backend=backend),
          reference.fused_moe(x, weights, ids, w13, w2), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_local_expert_slice(backend, dtype):
    """A rank holding experts 3..5 of 8: tokens routed to none of them get zero rows, and the
    three ranks' partial outputs ([0, 3), [3, 6), [6, 8)) sum to the whole layer's."""
    skip_unsupported(backend, dtype)
    dev = device_for(backend)
    x, w13, w2, logits = make_layer(33, 72, 56, dtype, seed=7, device=dev)
    logits[:4, [0, 7]] += 20  # tokens 0..3 go to experts 0 and 7: held elsewhere
    logits[4, 4] += 20  # token 4: one local expert and one elsewhere
    weights, ids = kernels.select_experts(logits, TOP_K, renormalize=True, backend=backend)
    partials = []
    for first, last in ((0, 3), (3, 6), (6, 8)):
        local13, local2 = w13[first:last].contiguous(), w2[first:last].contiguous()
        got = kernels.fused_moe(x, weights, ids, local13, local2, expert_offset=first, backend=backend)
        close(got, reference.fused_moe(x, weights, ids, local13, local2, first), dtype)
        partials.append(got)
    middle, routed_here = partials[1], ((ids >= 3) & (ids < 6)).any(dim=1)
    assert not bool(routed_here[:4].any()) and bool(routed_here[4])
    assert torch.equal((middle != 0).any(dim=1), routed_here), "tokens routed to no local expert must be zero rows"
    if dtype == torch.float32:
        close(middle, moe64(x, weights, ids, w13[3:6], w2[3:6], 3), dtype)
        close(sum(partials), reference.fused_moe(x, weights, ids, w13, w2), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("expert_offset", [0, 3])
def test_packed_weights_without_the_plain_copy(backend, dtype, expert_offset):
    """As the engine's MoE layer does: pack, then free the plain weights; the answer stays the
    reference's. Where packing does not pay (every dtype but the cpu backend's bf16) or can not (bf16
    on a CPU without native bf16, e.g. AVX2 only, whose sizes are not whole blocks of 32 as here) pack
    says None and the plain weights stay."""
    skip_unsupported(backend, dtype)
    dev = device_for(backend)
    x, w13, w2, _ = make_layer(33, 72, 56, dtype, seed=3, num_experts=3, device=dev)
    logits = torch.randn(33, 6, generator=torch.Generator().manual_seed(4)).to(dev)  # this rank holds 3 of 6
    weights, ids = kernels.select_experts(logits, TOP_K, renormalize=False, backend=backend)
    want = reference.fused_moe(x, weights, ids, w13, w2, expert_offset)
    plain = kernels.fused_moe(x, weights, ids, w13, w2, expert_offset, backend=backend)
    packed = kernels.pack_moe_weights(w13, w2, backend=backend)
    if backend != "cpu" or dtype != torch.bfloat16 or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert packed is None
        return
    assert packed is not None and packed.num_experts == 3 and packed.nbytes >= w13.nbytes + w2.nbytes
    w13.data, w2.data = w13.data.new_empty(0), w2.data.new_empty(0)
    got = kernels.fused_moe(x, weights, ids, w13, w2, expert_offset, packed=packed, backend=backend)
    close(got, want, dtype)
    close(got, plain, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_no_tokens(backend, dtype):
    x, w13, w2, logits = make_layer(0, 40, 24, dtype, seed=0, device=device_for(backend))
    weights, ids = kernels.select_experts(logits, TOP_K, renormalize=True, backend=backend)
    assert weights.shape == ids.shape == (0, TOP_K)
    out = kernels.fused_moe(x, weights, ids, w13, w2, backend=backend)
    assert out.shape == (0, 40) and out.dtype == dtype
    packed = kernels.pack_moe_weights(w13, w2, backend=backend)
    if packed is not None:
        assert kernels.fused_moe(x, weights, ids, w13, w2, packed=packed, backend=backend).shape == (0, 40)


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_select_experts_matches_float64(request, name, renormalize, logits_dtype):
    if name == "triton":
        request.getfixturevalue("triton_ops")
    gen = torch.Generator().manual_seed(11)
    logits = (2 * torch.randn(57, NUM_EXPERTS, generator=gen)).to(logits_dtype)
    weights, ids = kernels.select_experts(logits, 3, renormalize, backend=name)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (57, 3)
    probs = torch.softmax(logits.double(), dim=-1)
    want_weights, want_ids = torch.topk(probs, 3, dim=-1)
    if renormalize:
        want_weights = want_weights / want_weights.sum(dim=-1, keepdim=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.double(), want_weights, atol=1e-6, rtol=1e-6)


def test_cpu_expert_segments_pad_as_steps_do():
    """The C++ op pads each expert's rows to the sizes padded_num_tokens gives a step (so oneDNN
    sees a bounded set of row counts): the two formulas must agree."""
    if cpu_build.available() is not None:
        pytest.skip(f"CPU KERNELS NOT TESTED: they did not build ({cpu_build.available()})")
    from kernels.cpu_ops import padded_num_tokens

    padded_rows = cpu_build.load().padded_rows
    assert [padded_rows(n) for n in range(0, 8193)] == [0] + [padded_num_tokens(n) for n in range(1, 8193)]


def test_triton_expert_blocks_layout():
    """moe_align_block_size's invariants: every held slot exactly once, in its expert's blocks;
    blocks of one expert each, padded with num_slots; no block past the end holds a slot."""
    pytest.importorskip("triton")
    from kernels.triton_moe import expert_blocks

    gen = torch.Generator().manual_seed(2)
    num_tokens, top_k, block_m, offset, num_local = 37, 3, 16, 2, 4
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:top_k] for _ in range(num_tokens)])
    sorted_slots, block_experts = expert_blocks(ids, num_local, offset, block_m)
    num_slots = ids.numel()
    assert sorted_slots.numel() == block_experts.numel() * block_m
    flat = ids.flatten() - offset
    held = [s for s in range(num_slots) if 0 <= flat[s] < num_local]
    blocks = sorted_slots.view(-1, block_m).tolist()
    seen = []
    for b, expert in enumerate(block_experts.tolist()):
        real = [s for s in blocks[b] if s != num_slots]
        if expert < 0:
            assert not real
            continue
        assert real and all(flat[s] == expert for s in real)
        assert blocks[b][:len(real)] == real, "a block's padding comes after its slots"
        seen += real
    assert sorted(seen) == held and seen == sorted(held, key=lambda s: (int(flat[s]), s))


def cpu_ops_module():
    """kernels.cpu_ops where the CPU kernels built, or a skip saying why not."""
    if cpu_build.available() is not None:
        pytest.skip(f"CPU KERNELS NOT TESTED: they did not build ({cpu_build.available()})")
    from kernels import cpu_ops

    return cpu_ops


def brgemm_ops():
    """The cpu backend's module where its brgemm expert layout runs here, or a skip saying why not."""
    cpu_ops = cpu_ops_module()
    if not cpu_ops.load().moe_brgemm_available():
        pytest.skip("BRGEMM MoE LAYOUT NOT TESTED: this CPU has no AMX (pack_moe_weights falls back to matmul)")
    return cpu_ops


def routed_layer(num_tokens, hidden, ffn, held, pushed):
    """A bf16 layer of `held` experts and top-2 routing over NUM_EXPERTS (every token pushed onto the
    experts in `pushed`, when given): x, w13, w2, weights, ids."""
    x, w13, w2, _ = make_layer(num_tokens, hidden, ffn, torch.bfloat16, seed=num_tokens + ffn, num_experts=held)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=torch.Generator().manual_seed(9))
    if pushed is not None:
        logits[:, list(pushed)] += 20
    weights, ids = reference.select_experts(logits, TOP_K, True)
    return x, w13, w2, weights, ids


# (tokens, hidden, ffn, experts held, expert_offset, the experts every token is pushed to). The
# kernel runs rows in tiles of 32 and columns in tiles of 32 padded to 16: hidden 72 and ffn 40 / 56
# end in partial tiles (8 and 8 / 24 columns); 70 tokens all on experts 1 and 2 give one expert 70 rows
# (two full row tiles and a 6-row one) and leave the others with none.
BRGEMM_CASES = {
    "one token": (1, 64, 48, 8, 0, None),
    "partial tiles": (33, 72, 40, 8, 0, None),
    "70 rows on two experts": (70, 72, 56, 8, 0, (1, 2)),
    "experts on another rank": (33, 72, 56, 3, 3, None),
    "mixtral shape": (64, 576, 768, 8, 0, None),
}


@pytest.mark.parametrize("case", list(BRGEMM_CASES))
def test_cpu_brgemm_layout(case):
    """The brgemm layout (bf16 on AMX) against the reference, the float64 definition and the matmul
    layout, at its edges: experts with no tokens or one, row and column counts that are not multiples
    of its tiles, experts held by another rank."""
    cpu_ops = brgemm_ops()
    num_tokens, hidden, ffn, held, offset, pushed = BRGEMM_CASES[case]
    x, w13, w2, weights, ids = routed_layer(num_tokens, hidden, ffn, held, pushed)
    local = ids - offset
    counts = torch.bincount(local[(local >= 0) & (local < held)], minlength=held)
    if pushed is not None:
        assert counts.max() == num_tokens and (counts == 0).any()  # the edges this case is for
    packed = cpu_ops.pack_moe_weights(w13, w2)
    assert packed.layout == "brgemm" and packed.num_experts == held and packed.nbytes >= w13.nbytes + w2.nbytes
    got = cpu_ops.fused_moe(x, weights, ids, w13.new_empty(0), w2.new_empty(0), offset, packed)
    close(got, reference.fused_moe(x, weights, ids, w13, w2, offset), torch.bfloat16)
    close(got, moe64(x, weights, ids, w13, w2, offset), torch.bfloat16)
    close(got, cpu_ops.fused_moe(x, weights, ids, w13, w2, offset, cpu_ops.pack_moe_weights(w13, w2, "matmul")),
          torch.bfloat16)
    routed_here = ((ids >= offset) & (ids < offset + held)).any(dim=1)
    assert torch.equal((got != 0).any(dim=1), routed_here), "tokens routed to no local expert must be zero rows"


def test_cpu_brgemm_layout_does_not_depend_on_threads():
    """Work items go to whichever thread asks first, but each writes only its own rows and columns and
    the combine sums per token: one thread and two give the same bits."""
    cpu_ops = brgemm_ops()
    x, w13, w2, logits = make_layer(96, 72, 56, torch.bfloat16, seed=12)
    weights, ids = reference.select_experts(logits, TOP_K, True)
    packed = cpu_ops.pack_moe_weights(w13, w2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.fused_moe(x, weights, ids, w13, w2, 0, packed)
        torch.set_num_threads(2)
        two = [cpu_ops.fused_moe(x, weights, ids, w13, w2, 0, packed) for _ in range(3)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(one, t) for t in two)


def test_cpu_pack_moe_weights_layouts():
    """layout names what to pack; brgemm asked of weights it cannot take is a ValueError, auto falls back."""
    cpu_ops = brgemm_ops()
    x, w13, w2, logits = make_layer(5, 41, 24, torch.bfloat16, seed=2)  # odd hidden: no VNNI pairs
    with pytest.raises(ValueError, match="even hidden size"):
        cpu_ops.pack_moe_weights(w13, w2, "brgemm")
    with pytest.raises(ValueError, match="layout must be"):
        cpu_ops.pack_moe_weights(w13, w2, "vnni")
    packed = cpu_ops.pack_moe_weights(w13, w2)
    assert packed.layout == "matmul"
    weights, ids = reference.select_experts(logits, TOP_K, True)
    close(cpu_ops.fused_moe(x, weights, ids, w13, w2, 0, packed), reference.fused_moe(x, weights, ids, w13, w2),
          torch.bfloat16)
    assert cpu_ops.pack_moe_weights(w13.float(), w2.float(), "brgemm") is None  # float32: plain weights


# (tokens, hidden, ffn, experts held, expert_offset, the experts every token is pushed to): sizes in
# whole blocks of 32; an expert's rows take the register kernel up to 16, the tiled one above.
BLOCKS_CASES = {
    "one token": (1, 64, 32, 8, 0, None),
    "16 rows on two experts": (16, 96, 64, 8, 0, (1, 2)),
    "17 rows on two experts": (17, 96, 64, 8, 0, (1, 2)),
    "70 rows on two experts": (70, 64, 96, 8, 0, (5, 6)),
    "experts on another rank": (33, 64, 64, 3, 3, None),
}


@pytest.mark.parametrize("case", list(BLOCKS_CASES))
def test_cpu_blocks_layout(case):
    """The blocks layout (bf16 experts read as stored, widened to float32 in cpu_quant's kernels; the
    one an AVX2 CPU picks) against the reference, the float64 definition and the plain weights, with
    the plain copies freed as the engine frees them, on either side of the register kernel's rows."""
    cpu_ops = cpu_ops_module()
    num_tokens, hidden, ffn, held, offset, pushed = BLOCKS_CASES[case]
    x, w13, w2, weights, ids = routed_layer(num_tokens, hidden, ffn, held, pushed)
    packed = cpu_ops.pack_moe_weights(w13, w2, "blocks")
    assert packed.layout == "blocks" and packed.num_experts == held and packed.nbytes == w13.nbytes + w2.nbytes
    want = reference.fused_moe(x, weights, ids, w13, w2, offset)
    want64 = moe64(x, weights, ids, w13, w2, offset)
    plain = cpu_ops.fused_moe(x, weights, ids, w13, w2, offset, None)
    w13.data, w2.data = w13.data.new_empty(0), w2.data.new_empty(0)  # the views keep the bytes
    got = cpu_ops.fused_moe(x, weights, ids, w13, w2, offset, packed)
    close(got, want, torch.bfloat16)
    close(got, want64, torch.bfloat16)
    close(got, plain, torch.bfloat16)
    routed_here = ((ids >= offset) & (ids < offset + held)).any(dim=1)
    assert torch.equal((got != 0).any(dim=1), routed_here), "tokens routed to no local expert must be zero rows"


def test_cpu_auto_layout_without_native_bf16():
    """auto: on a CPU without native bf16 matmuls, bf16 experts of whole blocks read as stored
    (blocks); sizes that are not whole blocks keep oneDNN's matmul, which then packs nothing (None)."""
    cpu_ops = cpu_ops_module()
    if cpu_ops.native_bf16_matmul():
        pytest.skip("this CPU multiplies bf16 natively: auto picks brgemm or matmul (tested above)")
    _, w13, w2, _ = make_layer(4, 64, 32, torch.bfloat16, seed=1)
    assert cpu_ops.pack_moe_weights(w13, w2).layout == "blocks"
    _, w13, w2, _ = make_layer(4, 72, 56, torch.bfloat16, seed=1)
    assert cpu_ops.pack_moe_weights(w13, w2) is None
    with pytest.raises(ValueError, match="whole blocks of 32"):
        cpu_ops.pack_moe_weights(w13, w2, "blocks")
