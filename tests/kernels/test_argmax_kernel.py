"""Greedy sampling's argmax on every backend against numpy's (float64 rows; numpy's argmax is the
first maximum and the first NaN, the rule torch.max(dim).indices follows): ties, NaN, all -inf,
rows shorter than a vector and not a multiple of one."""

import numpy as np
import pytest
import torch

from kernels import cpu_build, cpu_ops, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = {"torch": reference.argmax, "cpu": cpu_ops.argmax, "chunked": reference.chunked_argmax}


def oracle(x: torch.Tensor) -> list[int]:
    return np.argmax(x.double().numpy(), axis=-1).tolist()


@pytest.fixture(params=list(IMPLS))
def argmax(request):
    if request.param == "cpu" and cpu_build.available() is not None:
        pytest.skip(f"CPU kernels unavailable: {cpu_build.available()}")
    return IMPLS[request.param]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 15), (2, 16), (5, 17), (4, 1000), (2, 49152), (3, 128256)])
def test_random_rows(argmax, dtype, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)
    assert argmax(x).tolist() == oracle(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_nan_and_infinities(argmax, dtype):
    x = torch.randn(6, 100, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[0, 3] = x[0, 90] = x[0, 40] = 100.0      # a tie across vector lanes: the first index wins
    x[1, 70] = x[1, 50] = float("nan")          # the first NaN, whatever the other values
    x[2] = float("-inf")                        # nothing larger than -inf: index 0
    x[3, 99] = float("nan")                     # a NaN in the scalar tail
    x[4, 17] = float("inf")
    x[5] = -3.0                                 # every value tied
    assert argmax(x).tolist() == oracle(x) == [3, 50, 0, 99, 17, 0]
    assert argmax(x).dtype == torch.int64


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_nan_and_infinities_across_chunks(argmax, dtype):
    """Rows wide enough for chunked_argmax's two passes, and not a whole number of its chunks."""
    x = torch.randn(6, 5000, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[0, 1500] = x[0, 1023] = x[0, 4999] = 100.0  # tied maxima in different chunks: the first wins
    x[1, 4100] = x[1, 2048] = float("nan")        # the first NaN, in a later chunk than the max
    x[1, 7] = float("inf")
    x[2] = float("-inf")                          # nothing larger than -inf, nor the padding: index 0
    x[3, 4998] = float("nan")                     # a NaN in the last, padded chunk
    x[4, 4999] = float("inf")
    x[5] = -3.0
    assert argmax(x).tolist() == oracle(x) == [1023, 2048, 0, 4998, 4999, 0]
