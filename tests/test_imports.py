"""Imports run one way: no cycle between the package's layers or its modules; cost/ is a pure library.

Read from the source with `ast` (every import statement, including the ones inside functions),
so a lazy import cannot hide a dependency that runs against the layers.
"""
from __future__ import annotations

import ast
from pathlib import Path

import sparsebalance_ft

PACKAGE = Path(sparsebalance_ft.__file__).parent
# Cycles another change removes (issue 13); each entry must still exist, so a fixed one is deleted here.
KNOWN_MODULE_CYCLES: list[set[str]] = []


def _module_name(path: Path) -> str:
    parts = ["sparsebalance_ft", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a `from X import name` counts X and X.name if a module)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                targets |= {target, *(f"{target}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def layer_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out.setdefault(layer(module), set()).update(layer(t) for t in targets if layer(t) != layer(module))
    for targets in list(out.values()):
        for t in targets:
            out.setdefault(t, set())
    return out


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_cycle_between_layers():
    assert cycles(layer_graph(import_graph())) == []


def test_no_cycle_between_modules_beyond_the_known_ones():
    found = cycles(import_graph())
    assert [c for c in found if c not in KNOWN_MODULE_CYCLES] == []
    assert [c for c in KNOWN_MODULE_CYCLES if c not in found] == [], "a known cycle is gone: delete it from the list"


def test_cost_is_a_pure_library():
    graph = import_graph()
    reached = {t for m, targets in graph.items() if layer(m) == "cost" for t in targets}
    assert not {layer(t) for t in reached} & {"train", "profiling", "bench", "eval", "sim"}, sorted(reached)
