"""The package's modules import downward only: no import cycle among ``ternary_rs``'s own modules,
counting lazy (function-level) imports too — a cycle hidden in a function is still a cycle.

The import graph is read with ``ast`` from the sources, independent of import order at run time.
``ternary_rs.vllm`` is left out: its ``config`` module builds its linear/embedding methods (which
subclass nothing from it but read its constants) in vLLM's factory hook, the pattern vLLM's own
quantization backends use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ternary_rs

PACKAGE_DIR = Path(ternary_rs.__file__).parent


def _modules() -> dict[str, Path | None]:
    mods: dict[str, Path | None] = {"ternary_rs._core": None}  # the compiled extension
    for p in PACKAGE_DIR.rglob("*.py"):
        parts = p.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


def _graph(mods: dict[str, Path | None]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        if path is None:
            continue
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                found = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {m for m in found if m in mods and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_outside_vllm():
    mods = {k: v for k, v in _modules().items() if not k.startswith("ternary_rs.vllm")}
    assert _cycles(_graph(mods)) == []


def test_shared_storage_helpers_sit_below_convert_report_and_planner():
    graph = _graph(_modules())
    assert graph["ternary_rs.storage"] <= {"ternary_rs._core"}
    for low, high in (("ternary_rs.report", "ternary_rs.convert"), ("ternary_rs.planner", "ternary_rs.convert")):
        assert high not in graph[low], f"{low} imports {high}"
    assert "ternary_rs.report" not in graph["ternary_rs.convert"]
    assert "ternary_rs.planner" not in graph["ternary_rs.convert"]


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_test_only_code_is_not_in_the_package():
    # The NumPy reference codecs are the tests' oracle; the wheel ships what the package needs only.
    assert not (PACKAGE_DIR / "_reference.py").exists()
    assert (Path(__file__).parent / "format_reference.py").is_file()
