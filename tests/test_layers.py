"""The engine is built in layers, and imports point only downward (server -> engine -> kernels;
inside the engine: front end -> core -> executor -> runner -> loading -> models -> layers ->
distributed -> kernels, with plain data types and the config beneath them all). Each layer is a folder
of engine/ (the root keeps only entry points and plain data); checked on the import graph read from
the source, with no cycle anywhere."""

from __future__ import annotations

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = os.path.join(ROOT, "engine")
MAX_ROOT_MODULES = 12  # entry points and plain data; everything else lives in its layer's folder

# Top to bottom: a module may import its own layer or any below it, never one above. Inside engine/
# a layer is a list of folders; the only modules named one by one are the root's and planning's CLI.
LAYERS = [
    ("entry points", ["server", "loadtest", "engine", "engine.__main__", "engine.cli", "engine.torchrun",
                      "engine.bench", "engine.planning.cli", "engine.planning.__main__"]),
    ("front end", ["engine.frontend"]),
    ("core", ["engine.core"]),
    ("executor", ["engine.executor"]),
    ("runner", ["engine.runner", "engine.structured_output"]),
    ("loading", ["engine.loading"]),
    ("models", ["engine.models"]),
    ("layers", ["engine.layers", "engine.quant"]),  # quant: weight formats and the matmuls that read them
    ("distributed", ["engine.distributed"]),
    # planning is plain arithmetic: the engine sizes its KV cache with it (its CLI is an entry point).
    ("data, config and formulas", ["engine.arg_utils", "engine.config", "engine.moe_config", "engine.outputs",
                                   "engine.request", "engine.sampling_params", "engine.scheduler_output",
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


def _named() -> list[str]:
    return [name for _, names in LAYERS for name in names]


def test_every_engine_folder_is_one_layer():
    folders = sorted(f"engine.{os.path.basename(os.path.dirname(p))}" for p in glob.glob(f"{ENGINE}/*/__init__.py"))
    named = _named()
    assert [f for f in folders if named.count(f) != 1] == [], "each engine/ folder is named in exactly one layer"
    assert [n for n in named if n.count(".") == 1 and n.startswith("engine.")
            and n not in folders and not os.path.exists(os.path.join(ENGINE, n.split(".")[1] + ".py"))] == [], \
        "LAYERS names an engine/ folder or module that does not exist"


def test_engine_root_holds_entry_points_and_plain_data_only():
    root = sorted(f"engine.{os.path.basename(p)[:-3]}" for p in glob.glob(f"{ENGINE}/*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at engine/'s root: move some into a layer's folder"
    named = _named()
    # each root module is named by itself (the package's __init__ is "engine"), never by a folder
    assert [m for m in root if named.count(m.replace(".__init__", "")) != 1] == []
