"""The import structure docs/design.md describes: no two modules of jssl import each other in
a loop (deferred imports inside functions and imports for type checking only included), and no
package imports one above it in the design's table. Read from the source files' syntax trees;
nothing is imported."""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# docs/design.md's package table, top to bottom: a package may import those below it.
LAYERS = (
    ("jssl", "jssl.cli", "jssl.process"),
    ("jssl.engines",),
    ("jssl.evaluation",),
    ("jssl.training",),
    ("jssl.checkpoints",),
    ("jssl.methods",),
    ("jssl.optim",),
    ("jssl.losses",),
    ("jssl.models",),
    ("jssl.data",),
    ("jssl.parallel",),
)


def _modules() -> dict[str, str]:
    """{dotted module name: path} of every module under jssl/ (a package as its name)."""
    found = {}
    for root, _, files in os.walk(os.path.join(REPO, "jssl")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                found[module.removesuffix(".__init__")] = path
    return found


class _Imports(ast.NodeVisitor):
    """The jssl modules one file imports, at any depth (``if TYPE_CHECKING`` blocks too: a loop
    of annotations is still a loop of the design)."""

    def __init__(self, modules: dict[str, str]):
        self.modules, self.found = modules, set()

    def visit_Import(self, node: ast.Import) -> None:
        self.found.update(a.name for a in node.names if a.name in self.modules)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if not node.module or node.level or node.module.split(".")[0] != "jssl":
            return
        # ``from jssl.data import crops`` imports the module jssl.data.crops; ``from jssl.data
        # import crop_groups`` a name of the package jssl.data.
        submodules = {f"{node.module}.{a.name}" for a in node.names} & set(self.modules)
        self.found.update(submodules)
        if len(submodules) < len(node.names):
            self.found.add(node.module)


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        with open(path) as f:
            visitor = _Imports(modules)
            visitor.visit(ast.parse(f.read(), path))
        graph[module] = visitor.found - {module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _layer(module: str) -> int:
    for depth, packages in enumerate(LAYERS):
        if module in packages[1:] or any(
            module == p or module.startswith(p + ".") for p in packages[:1] if p != "jssl"
        ):
            return depth
    return 0  # jssl itself (the package's train API)


def test_no_modules_import_each_other_in_a_loop():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_loop():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_package_imports_one_above_it():
    upward = [
        f"{module} imports {other}"
        for module, imports in _graph().items()
        for other in imports
        if _layer(other) < _layer(module)
    ]
    assert upward == []
