"""The shape of src/linnet (docs/architecture.md): layers point one way. Imports inside
functions count; a package's __init__ is a module of its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "src" / "linnet"
MAX_LINES = 650
# Backend-neutral: no torch, no JAX when imported (the JAX backend, tokenizer workers and
# the planner use them).
NEUTRAL = ["cards", "hardware", "plan.memory", "plan.parts", "packing", "paths", "files.atomic", "run",
           "schedules", "files.checkpoints", "files.reference_cache", "rl.rollouts", "rl.sandbox", "files.adapters",
           "report.metrics", "report.tables", "report.progress", "plan", "config", "pretrain.recipe", "data.corpus",
           "pretrain.tokenize", "commands.plan"]


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _nodes(node: ast.AST):
    """Every node, leaving out `if TYPE_CHECKING:` blocks (annotations only, never run)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", "")) == "TYPE_CHECKING":
            continue
        yield from _nodes(child)


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The linnet modules `name` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(dotted: str) -> None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        if dotted and dotted != name:
            found.add(dotted)

    for node in _nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("linnet"):
                    resolve(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("linnet"):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    resolve(sub if sub in known else base)
    return found


GRAPH = {name: imports(name, path, modules()) for name, path in modules().items()}


def test_no_import_cycle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert cycles == []


# The layers, lowest first (docs/architecture.md): a module may import its own layer and the
# ones below, never one above. A module's layer is its longest listed prefix's.
LAYERS = [
    # plain data and backend-neutral pieces
    ["linnet", "linnet.cards", "linnet.hardware", "linnet.paths", "linnet.packing", "linnet.schedules", "linnet.run",
     "linnet.files", "linnet.report", "linnet.config", "linnet.plan", "linnet.data", "linnet.rl"],
    ["linnet.torch", "linnet.jax"],  # the backends: models, losses, adapters, their engines
    ["linnet.serve"],  # sampling's front: the Engine and vLLM
    ["linnet.nest", "linnet.export"],  # the backend factory and the export of a trained model
    ["linnet.train", "linnet.pretrain", "linnet.rl.rewards"],  # trainers (rewards load reward models)
    ["linnet.commands"],
    ["linnet.cli"],
]


def layer(module: str) -> int:
    prefix, found = max((p, i) for i, names in enumerate(LAYERS) for p in names
                        if module == p or module.startswith(p + "."))  # the longest prefix sorts last
    return found


def test_every_module_has_a_layer_and_no_import_runs_up_a_layer():
    upward = [f"{name} ({layer(name)}) -> {m} ({layer(m)})" for name, found in GRAPH.items() for m in sorted(found)
              if layer(m) > layer(name)]
    assert upward == []


def test_the_library_never_imports_a_command():
    for name, found in GRAPH.items():
        if name != "linnet.cli" and not name.startswith("linnet.commands"):
            assert not {m for m in found if m.startswith("linnet.commands")}, name


def test_jax_imports_no_pytorch_trainer_and_cards_no_backend():
    for name, found in GRAPH.items():
        if name.startswith("linnet.jax"):
            assert not {m for m in found if m.startswith("linnet.train")}, name
    assert not {m for m in GRAPH["linnet.cards"] if m.startswith(("linnet.torch", "linnet.jax"))}


def test_no_module_over_the_size_limit():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_neutral_modules_import_neither_torch_nor_jax():
    code = (f"import importlib, sys\nfor m in {NEUTRAL!r}: importlib.import_module('linnet.' + m)\n"
            "assert 'torch' not in sys.modules and 'jax' not in sys.modules, "
            "[m for m in sys.modules if m.startswith(('torch', 'jax'))][:3]")
    subprocess.run([sys.executable, "-c", code], check=True)
