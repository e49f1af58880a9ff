"""Shared pytest fixtures. The tiny model is built once per session (a few seconds)."""

from __future__ import annotations

import os
import sys

import pytest

# Tests import `tests.tiny_model` and the packages from the repo root, installed or not.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama (2 layers, hidden 64, vocab 512) with a real tokenizer and chat template."""
    from tests.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
