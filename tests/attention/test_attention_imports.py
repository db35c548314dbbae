"""The attention package's modules import one way: no cycle, counting imports inside functions too."""
from __future__ import annotations

import ast
from pathlib import Path

import sparsebalance_ft.attention as attention

ROOT = Path(attention.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Modules of the attention package that `path` imports (relative imports, at any depth of the file)."""
    package = _module_name(path).split(".") if path.name == "__init__.py" else _module_name(path).split(".")[:-1]
    package = [p for p in package if p]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.add(target)
    return found


def test_no_import_cycle_in_the_attention_package():
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    # edges between modules; the package root ("") and a module's own parent package are left out
    graph = {name: {t for t in _imports(path) if t in modules and t not in ("", name) and not name.startswith(t + ".")}
             for name, path in modules.items()}
    assert "budget" in graph["register"] or "register" in graph["budget"]  # the pair the check is about is seen

    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [node, nxt])}")
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [])
