"""The guard in tests/conftest.py: a test that builds an engine with device "auto" fails on every
machine (on a GPU one "auto" is CUDA, which changes what a CPU test checks), unless it is marked
device_auto; a test that names its device is untouched."""

from __future__ import annotations

import pytest
import torch


def test_an_engine_left_on_auto_fails_its_test(tiny_model_dir):
    from engine import LLM

    with pytest.raises(AssertionError, match=r"device 'auto'.*device=\"cpu\".*device_auto"):
        LLM(tiny_model_dir, num_kv_blocks=16, max_model_len=64)


def test_a_named_device_is_untouched():
    from engine.runner.model_runner import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.device_auto
def test_the_marker_lets_auto_resolve():
    from engine.runner.model_runner import resolve_device

    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
