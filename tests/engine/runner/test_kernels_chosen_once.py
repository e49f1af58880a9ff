"""Kernels are chosen once: the runner resolves one Backend object at start-up and every layer
reaches it through the forward context; no layer or model takes or passes a backend."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pkgutil
import threading

import pytest
import torch

import kernels
from engine import LLM, SamplingParams
from engine.layers.context import AttentionMetadata, forward_context, get_forward_context

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PACKAGES = ("engine.layers", "engine.models")
CARRIER = "engine.layers.context"  # where the runner hands the backend in: the one module that takes it


def _modules():
    for package in PACKAGES:
        pkg = importlib.import_module(package)
        for info in pkgutil.iter_modules(pkg.__path__):
            yield importlib.import_module(f"{package}.{info.name}")


def _functions(module):
    """(qualified name, function) of every function and method defined in `module`."""
    for name, obj in vars(module).items():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj):
            for attr, member in vars(obj).items():
                member = member.fget if isinstance(member, property) else member
                member = getattr(member, "__func__", member)  # staticmethod / classmethod
                if inspect.isfunction(member):
                    yield f"{name}.{attr}", member


def test_no_layer_or_model_function_takes_a_backend():
    found = {f"{m.__name__}.{name}": fn for m in _modules() if m.__name__ != CARRIER for name, fn in _functions(m)}
    assert "engine.layers.norm.RMSNorm.forward" in found and "engine.models.llama.MLP.forward" in found
    takers = [name for name, fn in found.items() if "backend" in inspect.signature(fn).parameters]
    assert not takers, f"take a `backend` parameter (read get_forward_context().backend instead): {takers}"


def test_no_layer_or_model_passes_a_backend():
    passing = []
    for package in PACKAGES:
        folder = os.path.join(ROOT, *package.split("."))
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                tree = ast.parse(open(os.path.join(folder, name)).read())
                passing += [f"{package}.{name}:{node.lineno}" for node in ast.walk(tree)
                            if isinstance(node, ast.Call) and any(k.arg == "backend" for k in node.keywords)]
    assert not passing, f"pass backend=...: {passing}"


def test_get_backend_gives_one_object_per_backend():
    torch_ops = kernels.get_backend("torch")
    assert torch_ops is kernels.get_backend("torch") and torch_ops.name == "torch"
    with pytest.raises(ValueError, match="resolve_backend"):
        kernels.get_backend("auto")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_the_runner_resolves_its_backend_once(backend, tiny_models, monkeypatch):
    if backend == "cpu" and kernels.resolve_backend("auto", "cpu") != "cpu":
        pytest.skip("the CPU kernels do not build here")
    calls = []
    real = kernels.get_backend
    monkeypatch.setattr(kernels, "get_backend", lambda name: calls.append(name) or real(name))
    llm = LLM(tiny_models("qwen3"), device="cpu", num_kv_blocks=64, max_model_len=256, attention_backend=backend)
    runner = llm.engine.runner
    assert calls == [backend] and runner.backend is real(backend) and runner.backend.name == runner.attn_backend

    # From here on nothing may look a backend up again: every op is a call on the runner's object.
    def refuse(name):
        raise AssertionError(f"get_backend({name!r}) called during a step")

    monkeypatch.setattr(kernels, "get_backend", refuse)
    forwards, heads = [], []
    hooks = [runner.model.register_forward_pre_hook(lambda *_: forwards.append(get_forward_context())),
             runner.model.lm_head.register_forward_pre_hook(lambda *_: heads.append(get_forward_context()))]
    try:
        llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(forwards) >= 4 and heads, "a prefill and decodes"
    assert all(ctx.backend is runner.backend for ctx in forwards + heads)
    assert len({id(ctx) for ctx in forwards}) == len(forwards), "a fresh context (this step's metadata) per step"
    assert {id(ctx) for ctx in heads} <= {id(ctx) for ctx in forwards}, "the LM head runs in its step's context"
    with pytest.raises(AssertionError, match="no forward context"):
        get_forward_context()  # reset after each step


def _meta() -> AttentionMetadata:
    empty = torch.zeros(0, dtype=torch.int32)
    return AttentionMetadata(empty, empty, empty, empty)


def test_the_context_is_per_thread_and_reset_on_error():
    mine = kernels.get_backend("torch")
    seen = []
    with forward_context(_meta(), mine):
        thread = threading.Thread(target=lambda: seen.append(getattr(_try_context(), "backend", None)))
        thread.start()
        thread.join()
        assert get_forward_context().backend is mine
    assert seen == [None], "another thread does not see this thread's step"
    with pytest.raises(RuntimeError, match="boom"):
        with forward_context(_meta(), mine):
            raise RuntimeError("boom")
    assert _try_context() is None


def _try_context():
    try:
        return get_forward_context()
    except AssertionError:
        return None
