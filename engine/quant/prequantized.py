"""Pre-quantized safetensors checkpoints in the layouts vLLM loads, converted at load into GGUF block
formats (engine/quant/formats.py) so that the kernels already tested for GGUF files serve them:
4-bit symmetric -> Q4_0, 4-bit asymmetric -> Q4_1, 8-bit -> Q8_0, each group's scale (and min)
repeated in each of its 32-blocks (a group of 128 spans four). The method is read from config.json's
`quantization_config` (its `quant_method`, vLLM's names).

Every layout quantizes a linear weight W [N out, K in] in groups of g inputs (g = K: per channel),
with unsigned codes q in [0, 2^b) and per group a scale s and a zero point z: W = s * (q - z).
  GPTQ (AutoGPTQ / GPTQModel): `qweight` int32 [K / 8, N], 8 codes per word packed along the input
    dim (code i of a word at bits 4i..4i+3, for input row 8r + i); `qzeros` int32 [K / g, N / 8]
    packed the same way along the output dim; `scales` fp16 [K / g, N]; `g_idx` int32 [K], each
    input's group. checkpoint_format "gptq" (v1) stores z - 1, "gptq_v2" stores z. sym: z = 2^(b-1).
    8-bit: 4 codes per word. An act-order `g_idx` (not i // g) is refused: its groups are not runs of
    inputs, and a block holds a run of 32.
  AWQ (AutoAWQ, version "gemm"): `qweight` int32 [K, N / 8] packed along the output dim, nibble i of
    a word holding output column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; `qzeros` int32 [K / g, N / 8]
    likewise; `scales` fp16 [K / g, N]; always asymmetric (zero_point true), z as stored.
  compressed-tensors: "pack-quantized": `weight_packed` int32 [N, K / (32 / b)] packed along the
    input dim (code i of a word for input column 8c + i), codes stored as signed value + 2^(b-1);
    `weight_scale` [N, K / g] (strategy "group"), [N, 1] ("channel") or [1] ("tensor");
    `weight_zero_point` absent when symmetric (z = 2^(b-1) unsigned), else int32 packed along the
    output dim [N / (32 / b), K / g] (older files: int8 [N, K / g], signed); `weight_shape` [N, K].
    "int-quantized" / "naive-quantized": `weight` int8 [N, K] (signed), `weight_scale`, optional
    `weight_zero_point` int8. Only weight-only int schemes (W4A16, W8A16); quantized activations
    are refused.

The blocks: W = s * (q - z) = s * q + (-s * z), so Q4_1 gets d = s, m = -s * z, and Q4_0 (z = 8) or
Q8_0 (q - z stored as int8) get d = s. GPTQ and AWQ scales are fp16 already, so d is exact; scales of
another dtype are rounded to fp16 (exact for bf16 in fp16's normal range; the start-up log says when
any changed). m = -d * z is rounded to fp16: |m - (-d z)| <= 2^-11 * |d z| <= 2^-11 * 15 d in fp16's
normal range, the only inexact step; symmetric 4-bit and 8-bit are exact.
"""

from __future__ import annotations

import abc
import logging
import re
from dataclasses import dataclass

import torch

from engine.quant.formats import BLOCK_SIZE, FORMATS, BlockFormat
from engine.quant.quantize import pack_q4_0, pack_q4_1, pack_q8_0, per_block, to_fp16
from engine.quant.tensor import QuantizedTensor

logger = logging.getLogger(__name__)

METHODS = ("gptq", "awq", "compressed-tensors")
# AWQ's nibble order: nibble i of a word holds output column AWQ_ORDER[i] of its 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = tuple(AWQ_ORDER.index(j) for j in range(8))  # column j sits in nibble _AWQ_UNDO[j]
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


@dataclass(frozen=True)
class WeightScheme:
    """How one quantized linear's weights were quantized: bits, inputs per group (-1: a whole row)."""

    bits: int
    group_size: int
    symmetric: bool

    @property
    def block_format(self) -> BlockFormat:
        if self.bits == 8:
            return FORMATS["Q8_0"]
        return FORMATS["Q4_0" if self.symmetric else "Q4_1"]

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"{self.bits}-bit {'symmetric' if self.symmetric else 'asymmetric'}, {group}"


def _check_scheme(method: str, bits, group_size, symmetric: bool) -> WeightScheme:
    if bits not in (4, 8):
        raise ValueError(f"{method} checkpoint with {bits}-bit weights: supported are 4 and 8 bits")
    if group_size is None or group_size == -1:
        group_size = -1
    elif not isinstance(group_size, int) or group_size <= 0 or group_size % BLOCK_SIZE:
        raise ValueError(f"{method} checkpoint with group_size {group_size}: the block formats it is served from "
                         f"hold {BLOCK_SIZE} inputs, so groups must be a multiple of {BLOCK_SIZE} (or -1, per channel)")
    if bits == 8 and not symmetric:
        raise ValueError(f"{method} checkpoint with 8-bit asymmetric weights: served as Q8_0 blocks, which are "
                         "symmetric; 8-bit symmetric and 4-bit either way are supported")
    return WeightScheme(bits, group_size, symmetric)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits unsigned codes (int64), low bits first, laid out along `dim`:
    code i of word r (along dim) lands at index r * (32 / bits) + i."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:
        codes = (p.unsqueeze(1) >> shifts.view(1, per_word, 1)) & mask  # [R, per_word, C]
        return codes.reshape(p.shape[0] * per_word, p.shape[1]).long()
    codes = (p.unsqueeze(2) >> shifts) & mask  # [R, C, per_word]
    return codes.reshape(p.shape[0], p.shape[1] * per_word).long()


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ words [R, C] -> codes [R, 8 C] in column order (undoing AWQ_ORDER)."""
    codes = unpack_int32(packed, 4, dim=1).reshape(packed.shape[0], -1, 8)
    return codes[:, :, list(_AWQ_UNDO)].reshape(packed.shape[0], -1)


def blocks_from_groups(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, scheme: WeightScheme,
                       what: str) -> tuple[QuantizedTensor, float]:
    """codes q [N, K] (unsigned), zero points [N, K / g] (unsigned), scales [N, K / g] -> the scheme's
    blocks, and the largest relative change rounding the scales to fp16 made (0.0 for fp16 scales)."""
    n, k = q.shape
    groups = scales.shape[1]
    if k % BLOCK_SIZE or groups == 0 or k % groups or (k // groups) % BLOCK_SIZE:
        raise ValueError(f"{what}: {k} inputs in {groups} quantization groups: served as blocks of {BLOCK_SIZE} "
                         f"inputs, it needs whole blocks per group")
    g = k // groups
    if zeros.shape != scales.shape:
        raise ValueError(f"{what}: zero points of shape {tuple(zeros.shape)} do not match scales "
                         f"{tuple(scales.shape)}")
    d = to_fp16(scales.double())
    if not torch.isfinite(d).all():
        raise ValueError(f"{what}: a scale is not finite in fp16 (the block formats' scale type)")
    s = scales.double()
    changed = ((d.double() - s).abs() / s.abs().clamp_min(1e-300)).max().item() if s.numel() else 0.0
    if scheme.bits == 8:
        signed = q - zeros.repeat_interleave(g, dim=1)
        if signed.min() < -128 or signed.max() > 127:
            raise ValueError(f"{what}: 8-bit codes minus zero points leave int8's range: not a symmetric "
                             "8-bit checkpoint")
        return QuantizedTensor(pack_q8_0(per_block(d, g), signed.to(torch.int8)), FORMATS["Q8_0"]), changed
    if q.min() < 0 or q.max() > 15:
        raise ValueError(f"{what}: 4-bit codes outside [0, 15]")
    if scheme.symmetric:
        if (zeros != 8).any():
            raise ValueError(f"{what}: the checkpoint says symmetric, but zero points other than 8 are stored: "
                             "its config's symmetric flag does not match its tensors")
        return QuantizedTensor(pack_q4_0(per_block(d, g), q), FORMATS["Q4_0"]), changed
    m = to_fp16(-(d.double() * zeros))
    if not torch.isfinite(m).all():
        raise ValueError(f"{what}: a zero point times its scale is not finite in fp16 (the blocks' min type)")
    return QuantizedTensor(pack_q4_1(per_block(d, g), per_block(m, g), q), FORMATS["Q4_1"]), changed


class Prequantized(abc.ABC):
    """One method's reader. `marker`: the tensor suffix whose presence makes a module a quantized
    linear; `parts`: every suffix of such a module (all consumed by to_blocks)."""

    method: str
    marker: str
    parts: tuple[str, ...]

    @abc.abstractmethod
    def scheme_for(self, module: str) -> WeightScheme:
        """How `module`'s weight is quantized (bits, group, symmetry) and the block format it becomes."""

    @abc.abstractmethod
    def to_blocks(self, module: str, parts: dict[str, torch.Tensor]) -> tuple[QuantizedTensor, float]:
        """The module's parts as blocks, and the largest relative change fp16 rounding made to a scale."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The checkpoint's scheme in words, for the start-up log."""


class GPTQ(Prequantized):
    method, marker, parts = "gptq", "qweight", ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, qc: dict):
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r}: supported are 'gptq' and 'gptq_v2' (re-save it "
                             "with AutoGPTQ / GPTQModel in one of those)")
        if qc.get("dynamic"):
            raise ValueError("GPTQ checkpoint with per-module 'dynamic' overrides: not supported; one scheme for "
                             "every layer is")
        self.v1 = fmt == "gptq"  # stores z - 1
        self.scheme = _check_scheme("GPTQ", qc.get("bits"), qc.get("group_size", -1), bool(qc.get("sym", True)))
        self.desc_act = bool(qc.get("desc_act", False))

    def scheme_for(self, module: str) -> WeightScheme:
        return self.scheme

    def to_blocks(self, module: str, parts: dict[str, torch.Tensor]) -> tuple[QuantizedTensor, float]:
        bits = self.scheme.bits
        q = unpack_int32(parts["qweight"], bits, dim=0).T  # [N, K]
        n, k = q.shape
        scales = parts["scales"].T  # [N, G]
        zeros = unpack_int32(parts["qzeros"], bits, dim=1)[:, :n].T + (1 if self.v1 else 0)
        if "g_idx" in parts:
            g = k // scales.shape[1]
            if not torch.equal(parts["g_idx"].long().cpu(), torch.arange(k) // g):
                raise ValueError(f"{module}: GPTQ act-order (desc_act) checkpoint: its g_idx is not input // "
                                 f"{g}, and a {BLOCK_SIZE}-input block needs one group; not supported, use a "
                                 "checkpoint quantized with desc_act=False (or a static-groups one)")
        return blocks_from_groups(q, zeros, scales, self.scheme, module)

    def describe(self) -> str:
        return f"GPTQ ({self.scheme.describe()}{', desc_act' if self.desc_act else ''})"


class AWQ(Prequantized):
    method, marker, parts = "awq", "qweight", ("qweight", "qzeros", "scales")

    def __init__(self, qc: dict):
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r}: supported is 'gemm' (vLLM's AWQ layout)")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ checkpoint without zero points: not supported (vLLM's AWQ layout has them)")
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ValueError(f"AWQ checkpoint with {bits}-bit weights: AWQ is served as 4-bit only")
        self.scheme = _check_scheme("AWQ", bits, qc.get("group_size", qc.get("q_group_size", -1)), False)

    def scheme_for(self, module: str) -> WeightScheme:
        return self.scheme

    def to_blocks(self, module: str, parts: dict[str, torch.Tensor]) -> tuple[QuantizedTensor, float]:
        q = unpack_awq(parts["qweight"]).T  # [N, K]
        zeros = unpack_awq(parts["qzeros"]).T
        return blocks_from_groups(q, zeros, parts["scales"].T, self.scheme, module)

    def describe(self) -> str:
        return f"AWQ ({self.scheme.describe()})"


class CompressedTensors(Prequantized):
    method, marker = "compressed-tensors", "weight_scale"
    parts = ("weight_packed", "weight", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")

    def __init__(self, qc: dict):
        default_format = qc.get("format")
        self.groups: list[tuple[list[str], WeightScheme, str]] = []
        for name, group in (qc.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            what = f"compressed-tensors config group {name!r}"
            if group.get("input_activations") or group.get("output_activations"):
                raise ValueError(f"{what} quantizes activations too (e.g. W8A8): not supported; weight-only int "
                                 "schemes (W4A16, W8A16) are")
            if weights.get("type", "int") != "int":
                raise ValueError(f"{what} has {weights.get('type')} weights: supported are int weights (W4A16, "
                                 "W8A16)")
            strategy = weights.get("strategy", "tensor")
            if strategy not in ("group", "channel", "tensor"):
                raise ValueError(f"{what}: strategy {strategy!r} is not supported (group, channel, tensor are)")
            fmt = group.get("format") or default_format
            if fmt not in CT_FORMATS:
                raise ValueError(f"{what}: format {fmt!r} is not supported; supported: {', '.join(CT_FORMATS)}")
            group_size = weights.get("group_size") if strategy == "group" else -1
            scheme = _check_scheme("compressed-tensors", weights.get("num_bits"), group_size,
                                   bool(weights.get("symmetric", True)))
            if fmt != "pack-quantized" and scheme.bits != 8:
                raise ValueError(f"{what}: {fmt} with {scheme.bits}-bit weights: supported is 8-bit")
            self.groups.append((list(group.get("targets") or ["Linear"]), scheme, fmt))
        if not self.groups:
            raise ValueError("compressed-tensors checkpoint without config_groups: nothing says how it is quantized")

    def scheme_for(self, module: str) -> WeightScheme:
        for targets, scheme, _ in self.groups:
            if any(_matches(t, module) for t in targets):
                return scheme
        if len(self.groups) == 1:
            return self.groups[0][1]
        raise ValueError(f"{module}: quantized, but no compressed-tensors config group targets it")

    def to_blocks(self, module: str, parts: dict[str, torch.Tensor]) -> tuple[QuantizedTensor, float]:
        scheme = self.scheme_for(module)
        offset = 1 << (scheme.bits - 1)  # stored code = signed value + offset
        if "weight_packed" in parts:
            n, k = (int(x) for x in parts["weight_shape"].tolist())
            q = unpack_int32(parts["weight_packed"], scheme.bits, dim=1)[:n, :k]
        else:
            q = parts["weight"].long() + offset
            n, k = q.shape
        scales = parts["weight_scale"].reshape(n, -1) if parts["weight_scale"].numel() != 1 else \
            parts["weight_scale"].reshape(1, 1).expand(n, 1)
        zp = parts.get("weight_zero_point")
        if zp is None or scheme.symmetric and not zp.any():
            zeros = torch.full(scales.shape, offset, dtype=torch.long)
        elif zp.dtype == torch.int32:  # packed along the output dim (group, channel)
            zeros = unpack_int32(zp, scheme.bits, dim=0)[:n]
        elif zp.numel() == 1:  # strategy "tensor": one signed int8
            zeros = torch.full(scales.shape, int(zp.reshape(())) + offset, dtype=torch.long)
        else:
            zeros = zp.long().reshape(scales.shape) + offset
        g_idx = parts.get("weight_g_idx")
        if g_idx is not None and not torch.equal(g_idx.long().cpu(), torch.arange(k) // (k // scales.shape[1])):
            raise ValueError(f"{module}: compressed-tensors activation ordering (weight_g_idx not input // group): "
                             "not supported, use a checkpoint quantized without actorder='group'")
        return blocks_from_groups(q, zeros, scales, scheme, module)

    def describe(self) -> str:
        schemes = ", ".join(f"{s.describe()} ({fmt})" for _, s, fmt in self.groups)
        return f"compressed-tensors ({schemes})"


def _matches(target: str, module: str) -> bool:
    """compressed-tensors' target rules: "re:" a regular expression, else a layer type or a name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or module == target or module.endswith("." + target)


def read_quantization_config(config: dict) -> Prequantized | None:
    """The reader for a checkpoint's config.json (its `quantization_config`), None for a float one;
    ValueError for a method or scheme not supported, naming what is."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method == "mxfp4" and config.get("model_type") == "gpt_oss":
        return None  # its MXFP4 experts are dequantized as they load (engine/models/gpt_oss.py)
    if method == "gptq":
        return GPTQ(qc)
    if method == "awq":
        return AWQ(qc)
    if method == "compressed-tensors":
        return CompressedTensors(qc)
    raise ValueError(f"the checkpoint is quantized with {qc.get('quant_method')!r}: supported pre-quantized "
                     f"methods are {', '.join(METHODS)} (or a float checkpoint, with --quantization int8 / int4)")
