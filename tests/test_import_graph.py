"""The arrows between modules point one way: no import cycle anywhere in ringctl, ringattn or
benchmarks (lazy imports inside functions count), ringattn never imports ringctl, and the
planner is a leaf that imports nothing of ringctl but itself and `errors`. No private name
crosses a module boundary, the benchmarks' imports of ringattn, ringctl and one another
included.

The graph is read from the source with `ast`, so a cycle hidden in a function body is found too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ringattn", "ringctl")
CONSUMERS = ("benchmarks",)  # they use the packages as a user would: public names only


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES + CONSUMERS:
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


def test_the_graph_holds_the_benchmarks():
    """The benchmarks are in the graph the cycle check walks, their lazy imports included
    (`--pairings` loads benchmarks.pairing inside a function); what the attention benchmark
    and its pairings both need is a module of its own, so the arrows run one way."""
    graph = import_graph()
    assert "benchmarks.pairing" in graph["benchmarks.attention"]
    assert "benchmarks.attention_workers" in graph["benchmarks.pairing"]
    assert "benchmarks.attention" not in graph["benchmarks.pairing"]
    assert find_cycle({**graph, "benchmarks.attention_workers": {"benchmarks.attention"}})


def test_ringattn_never_imports_ringctl():
    bad = {
        m: sorted(t for t in ts if t.startswith("ringctl"))
        for m, ts in import_graph().items()
        if m.startswith("ringattn")
    }
    assert not {m: ts for m, ts in bad.items() if ts}


def test_planner_is_a_leaf():
    """The planner imports nothing of ringctl but itself, `errors` and the readers and
    printers of foreign text and files (`text`, `bounded_read`, `terminal`: leaves
    themselves), and of ringattn only its torch-free geometry (the engine's own rules:
    padding, plans, reach)."""

    def allowed(target: str) -> bool:
        return target in (
            "ringctl",
            "ringctl.errors",
            "ringctl.text",
            "ringctl.bounded_read",
            "ringctl.terminal",
            "ringattn",
            "ringattn.geometry",
        ) or target.startswith("ringctl.planner")

    bad = {}
    for module, targets in import_graph().items():
        if module.startswith("ringctl.planner"):
            out = sorted(t for t in targets if t.startswith(PACKAGES) and not allowed(t))
            if out:
                bad[module] = out
    assert not bad, f"the planner imports outside itself: {bad}"


def test_the_geometry_and_the_planner_load_without_torch():
    """`import ringattn.geometry` (and so the planner) does not load torch: ringattn's face is
    lazy and the geometry imports nothing of the engine."""
    code = (
        "import sys; import ringattn.geometry, ringctl.planner.cost, ringctl.planner.window; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr or "torch was imported"
    geometry = import_graph()["ringattn.geometry"]
    assert not {t for t in geometry if t.startswith(PACKAGES)}


def test_every_bundled_job_is_read_and_checked_without_torch():
    """Reading and checking a job config (`ringctl config`, status, render, the first step of
    submit) does not load torch: the long-document job's check imported the model loader for
    a model name and compute.fsdp for model.shard's values, 2 s of every command of it."""
    code = (
        "import sys; from ringctl.config import load_job; "
        "[load_job(j) for j in ('smoke', 'attention', 'longdoc', 'train')]; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr or "torch was imported"


def test_the_checker_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# --- no private name crosses a module boundary ---------------------------------------------------


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(root: Path = ROOT) -> list[str]:
    """`from M import _x` and `M._x` (M a module imported from the project), in every module of
    the packages and the consumers: a helper another module needs is public where it lives."""
    modules = _modules()
    found = []
    for package in PACKAGES + CONSUMERS:
        for path in sorted((root / package).rglob("*.py")):
            name = _module_name(path)
            tree = ast.parse(path.read_text(), str(path))
            found += _private_uses(tree, name, path.name == "__init__.py", modules, path)
    return found


def _private_uses(tree, name: str, is_package: bool, modules, path: Path) -> list[str]:
    found, aliases = [], set()
    where = path.relative_to(ROOT)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node) if node.level else node.module or ""
            if not base.startswith(PACKAGES + CONSUMERS):
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:  # a module: its attributes are checked
                    aliases.add(alias.asname or alias.name)
                elif _is_private(alias.name):
                    found.append(f"{where}:{node.lineno}: from {base} import {alias.name}")
        elif isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.asname and a.name in modules}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in aliases:
                found.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_private_name_is_imported_across_modules():
    found = private_imports()
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_checker_sees_a_private_import(tmp_path):
    tree = ast.parse("from .placement import _hop, plan_ring\nfrom . import slurm\nslurm._x()\n")
    path = ROOT / "ringctl" / "topology" / "example.py"
    found = _private_uses(tree, "ringctl.topology.example", False, _modules(), path)
    assert found == [
        "ringctl/topology/example.py:1: from ringctl.topology.placement import _hop",
        "ringctl/topology/example.py:3: slurm._x",
    ]


def test_the_checker_sees_a_private_import_between_benchmarks():
    tree = ast.parse(
        "from benchmarks.attention import Config, _device_kind\n"
        "from benchmarks import overhead\n"
        "overhead._engine()\n"
    )
    path = ROOT / "benchmarks" / "example.py"
    found = _private_uses(tree, "benchmarks.example", False, _modules(), path)
    assert found == [
        "benchmarks/example.py:1: from benchmarks.attention import _device_kind",
        "benchmarks/example.py:3: overhead._engine",
    ]


# --- the long-document package: a top and four wings ---------------------------------------------

LONGDOC = "ringctl.longdoc"
WINGS = ("inputs", "model", "compute", "output")


def _wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if module.startswith(LONGDOC + ".") and parts[2] in WINGS else None


def test_no_longdoc_wing_imports_the_top():
    """inputs/, model/, compute/ and output/ import each other and what lies outside the
    package, never run, params, schedule, probe, consensus, agreement or the package face:
    those import the wings (an arrow points down or across, never up)."""
    graph = import_graph()
    top = {m for m in graph if (m == LONGDOC or m.startswith(LONGDOC + ".")) and not _wing(m)}
    assert {"ringctl.longdoc.run", "ringctl.longdoc.params"} <= top
    up = {m: sorted(graph[m] & top) for m in graph if _wing(m) and graph[m] & top}
    assert not up, f"wing modules importing the top of ringctl.longdoc: {up}"


def test_longdoc_never_imports_the_tasks():
    """The long-document package is what its task runs; the task (ringctl.tasks.longdoc) reads
    the config for it, so the package never imports the tasks back (TaskParams, its base, is
    in the root leaf ringctl.task_params)."""
    bad = {
        m: sorted(t for t in ts if t.startswith("ringctl.tasks"))
        for m, ts in import_graph().items()
        if m == LONGDOC or m.startswith(LONGDOC + ".")
    }
    assert not {m: ts for m, ts in bad.items() if ts}
