"""bfloat16 under Triton's interpreter, computed as a GPU computes it (for the kernel tests only).

The interpreter keeps bfloat16 values as their raw uint16 bits in numpy, which has no bfloat16:
tl.dot then multiplies the bit patterns as integers, arithmetic on bf16 values adds and compares
integers, and a float32 -> bfloat16 cast truncates instead of rounding to nearest even (a known
upstream limitation). install() patches the interpreter's builder for the test run so that
bf16 operands are widened to float32 (exact: bf16 is float32's top half), computed on, and rounded
back to nearest even as the GPU's cvt.rn.bf16.f32 does (NaN stays NaN). Reductions (tl.sum / tl.max
of a bf16 tensor) are not patched: the kernels reduce in float32.

test_interpreter_bf16.py fails if the patch stops taking effect (a new triton renames what it
replaces), so bf16 cannot silently go back to being checked against garbage.
"""

from __future__ import annotations

import numpy as np

_PATCHED = "_pagewise_bf16_patch"  # marks the builder methods install() replaced
_METHODS = ("cast_impl", "create_dot", "binary_op", "unary_op", "create_fma")


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Raw bfloat16 bits (uint16) -> float32, exactly."""
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> raw bfloat16 bits, rounded to nearest even; NaN -> a quiet NaN of the same sign."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet_nan = (bits >> np.uint32(16)) | np.uint32(0x40)
    return np.where(np.isnan(x), quiet_nan, rounded).astype(np.uint16)


def installed() -> bool:
    from triton.runtime.interpreter import InterpreterBuilder

    return all(getattr(getattr(InterpreterBuilder, name), _PATCHED, False) for name in _METHODS)


def install() -> None:
    """Patch triton's interpreter (idempotent)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    if installed():
        return
    bf16, f32 = tl.bfloat16, tl.float32

    def widen(h):
        return TensorHandle(bf16_bits_to_f32(h.data), f32) if h.dtype.scalar == bf16 else h

    def narrow(data):
        # Float results back to bf16 bits; comparisons (bool) stay as they are, as in the original.
        return f32_to_bf16_bits(data) if data.dtype == np.float32 else data

    cast_impl, create_dot = InterpreterBuilder.cast_impl, InterpreterBuilder.create_dot
    binary_op, unary_op = InterpreterBuilder.binary_op, InterpreterBuilder.unary_op
    create_fma = InterpreterBuilder.create_fma

    def patched_cast_impl(self, src, dst_type):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if src_ty == bf16 and dst_ty != bf16:  # through float32: int / fp16 / fp64 casts too
            src = widen(src)
            return src if dst_ty == f32 else cast_impl(self, src, dst_type)
        if dst_ty == bf16 and src_ty != bf16:
            if src_ty != f32:
                src = cast_impl(self, src, f32)
            return TensorHandle(f32_to_bf16_bits(src.data), bf16)
        return cast_impl(self, src, dst_type)

    def patched_create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if bf16 not in (a.dtype.scalar, b.dtype.scalar, d.dtype.scalar):
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        # bf16 products are exact in float32 and the tensor cores accumulate in float32.
        out = create_dot(self, widen(a), widen(b), widen(d), input_precision, max_num_imprecise_acc)
        return TensorHandle(f32_to_bf16_bits(out.data), bf16) if d.dtype.scalar == bf16 else out

    def patched_binary_op(self, lhs, rhs, op):
        if lhs.dtype.scalar != bf16:
            return binary_op(self, lhs, rhs, op)
        out = binary_op(self, widen(lhs), widen(rhs), op)
        return TensorHandle(narrow(out.data), bf16)

    def patched_unary_op(self, arg, op):
        if arg.dtype.scalar != bf16:
            return unary_op(self, arg, op)
        return TensorHandle(narrow(unary_op(self, widen(arg), op).data), bf16)

    def patched_create_fma(self, x, y, z):
        if z.dtype.scalar != bf16:
            return create_fma(self, x, y, z)
        return TensorHandle(f32_to_bf16_bits(create_fma(self, widen(x), widen(y), widen(z)).data), bf16)

    for name, fn in (("cast_impl", patched_cast_impl), ("create_dot", patched_create_dot),
                     ("binary_op", patched_binary_op), ("unary_op", patched_unary_op),
                     ("create_fma", patched_create_fma)):
        setattr(fn, _PATCHED, True)
        setattr(InterpreterBuilder, name, fn)
