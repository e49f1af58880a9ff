"""The engine is built in layers, and imports point only downward (DESIGN.md: server -> engine ->
kernels; inside the engine: front end -> core -> executor -> runner -> models -> layers ->
distributed -> kernels, with plain data types and the config beneath them all). Checked on the
import graph read from the source, with no cycle anywhere."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Top to bottom: a module may import its own layer or any below it, never one above.
LAYERS = [
    ("entry points", ["server", "loadtest", "engine.cli", "engine.__main__", "engine.torchrun", "engine.bench",
                      "engine.planning.cli", "engine.planning.__main__", "engine"]),
    ("front end", ["engine.frontend"]),
    ("core", ["engine.core", "engine.scheduler", "engine.kv_cache"]),
    ("executor", ["engine.executor"]),
    ("runner", ["engine.model_runner", "engine.kv_sizing", "engine.step_inputs", "engine.step_outputs",
                "engine.runner_streams", "engine.cuda_graphs",
                "engine.sampler", "engine.structured_output", "engine.bad_words", "engine.host_memory"]),
    ("models", ["engine.models", "engine.loader", "engine.weights", "engine.safetensors_slices", "engine.gguf_loader",
                "engine.gguf_header", "engine.default_model", "engine.user_cache"]),
    ("layers", ["engine.layers", "engine.quant"]),  # quant: weight formats and the matmuls that read them
    ("distributed", ["engine.distributed"]),
    # planning is plain arithmetic: the engine sizes its KV cache with it (its CLI is an entry point).
    ("data, config and formulas", ["engine.config", "engine.arg_utils", "engine.sampling_params", "engine.moe_config",
                                   "engine.cpu_threads",
                                   "engine.request", "engine.outputs", "engine.scheduler_output",
                                   "engine.planning"]),
    ("kernels", ["kernels"]),
]


def _modules() -> dict[str, str]:
    mods = {}
    for top in ("engine", "kernels", "server", "loadtest"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                    mods[mod] = path
    return mods


def _imports(mod: str, path: str, mods: dict[str, str]) -> set[str]:
    package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            # `from package import module` depends on the module, not on the package's __init__
            names = [f"{base}.{a.name}" for a in node.names]
            names += [base] if not all(n in mods for n in names) else []
        else:
            continue
        found |= {n for n in names if n in mods}
    return found - {mod}


def _layer(mod: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"{mod} is in no layer: add it to LAYERS"
    return best[0]


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def test_no_import_points_up_a_layer():
    upward = [f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})"
              for m, deps in _graph().items() for d in deps if _layer(d) < _layer(m)]
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
