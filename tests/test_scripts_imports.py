"""scripts/ import each other by file name: no import cycle among them (imports inside functions count
too), and benchlib.py, the benchmarks' shared library, imports no other script."""

from __future__ import annotations

import ast
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def sibling_imports(path: Path, siblings: set[str]) -> set[str]:
    """The scripts that `path` imports anywhere in its body (module level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {name.split(".")[0] for name in names} & siblings
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, str] = {}  # absent: unvisited, "open": on the current path, "done"
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def script_graph() -> dict[str, set[str]]:
    files = {p.stem: p for p in SCRIPTS.glob("*.py")}
    return {name: sibling_imports(path, set(files) - {name}) for name, path in files.items()}


def test_scripts_import_each_other_without_a_cycle():
    graph = script_graph()
    assert {"benchlib", "bench_ffn", "bench_train", "bench_long_rows"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle among scripts/: " + " -> ".join(cycle)
    assert graph["benchlib"] == set(), f"benchlib.py must import no script, it imports {graph['benchlib']}"
    # every benchmark writes its JSON through the shared library
    for name in ("bench_ffn", "bench_train", "bench_gate", "bench_long_rows", "bench_prefix", "bench_model"):
        assert "benchlib" in graph[name], name


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import(tmp_path):
    """The check above can fail: two files that import each other, one inside a function, as
    bench_ffn.py and bench_train.py once did."""
    (tmp_path / "a.py").write_text("import os\nfrom b import run\n")
    (tmp_path / "b.py").write_text("def run():\n    from a import thing\n    import c.sub\n")
    (tmp_path / "c.py").write_text("")
    names = {"a", "b", "c"}
    graph = {n: sibling_imports(tmp_path / f"{n}.py", names - {n}) for n in names}
    assert graph == {"a": {"b"}, "b": {"a", "c"}, "c": set()}
    assert find_cycle(graph) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
