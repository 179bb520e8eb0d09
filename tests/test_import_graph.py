"""The arrows between modules point one way: no import cycle anywhere in ringctl or ringattn
(lazy imports inside functions count), ringattn never imports ringctl, and the planner is a
leaf that imports nothing of ringctl but itself and `errors`.

The graph is read from the source with `ast`, so a cycle hidden in a function body is found too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ringattn", "ringctl")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (the longest existing prefix of each name)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node)
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            for full in names:
                while full and full not in modules:
                    full = full.rpartition(".")[0]
                if full and full != name:
                    targets.add(full)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_ringattn_never_imports_ringctl():
    bad = {
        m: sorted(t for t in ts if t.startswith("ringctl"))
        for m, ts in import_graph().items()
        if m.startswith("ringattn")
    }
    assert not {m: ts for m, ts in bad.items() if ts}


def test_planner_is_a_leaf():
    def allowed(target: str) -> bool:
        return target in ("ringctl", "ringctl.errors") or target.startswith("ringctl.planner")

    bad = {}
    for module, targets in import_graph().items():
        if module.startswith("ringctl.planner"):
            out = sorted(t for t in targets if t.startswith("ringctl") and not allowed(t))
            private = sorted(t for t in targets if t.startswith("ringattn."))
            if out or private:
                bad[module] = out + private
    assert not bad, f"the planner imports outside itself: {bad}"


def test_the_checker_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
