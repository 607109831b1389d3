"""The package's modules import downward only, lazy (function-level) imports included — a cycle or an
upward import hidden in a function is still one. No module is exempt.

The package is a stack of floors (:data:`LAYERS`, docs/design.md#python-layers): a module may import from
its own floor and the floors below, never from a floor above, and no two modules may import each other
(directly or round a loop). The import graph is read with ``ast`` from the sources, independent of import
order at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ternary_rs

PACKAGE_DIR = Path(ternary_rs.__file__).parent

# Bottom to top. A name is a module or a package (with everything under it); ``ternary_rs`` itself is its
# ``__init__`` only, the public API, which re-exports from the floors below.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("ternary_rs._core", "ternary_rs.core")),  # type tables, codecs, Hadamard; the compiled core
    ("sources", ("ternary_rs.sources",)),  # open checkpoints, decode their tensors, GGUF -> HF side files
    ("sinks", ("ternary_rs.sinks",)),  # writers, staging / shards / manifest, HF -> GGUF metadata
    ("arch", ("ternary_rs.arch",)),  # per-architecture naming and conversion plans
    ("inspection", ("ternary_rs.inspection",)),  # inspect / verify / plan
    ("convert", ("ternary_rs.convert",)),  # the conversion orchestrator
    ("serving", ("ternary_rs.serving", "ternary_rs.ops")),  # torch ops, CPU settings, `serve`
    ("vllm", ("ternary_rs.vllm",)),  # the vLLM plugin
    ("cli", ("ternary_rs.cli", "ternary_rs.demo", "ternary_rs.__main__", "ternary_rs")),  # commands, public API
]


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


def floor_of(module: str) -> int:
    """Index in :data:`LAYERS` of the most specific name that holds ``module``."""
    best: tuple[int, int] | None = None  # (length of the matching name, floor)
    for i, (_, names) in enumerate(LAYERS):
        for n in names:
            holds = module == n if n == "ternary_rs" else module == n or module.startswith(n + ".")
            if holds and (best is None or len(n) > best[0]):
                best = (len(n), i)
    if best is None:
        raise AssertionError(f"{module} is on no floor of LAYERS: add it to one (docs/design.md#python-layers)")
    return best[1]


def test_every_module_is_on_a_floor():
    for module in _modules():
        floor_of(module)


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} ({LAYERS[floor_of(m)][0]}) imports {t} ({LAYERS[floor_of(t)][0]})"
            for m, targets in sorted(graph.items()) for t in sorted(targets) if floor_of(t) > floor_of(m)]


def test_imports_go_downward_only():
    assert _upward(_graph(_modules())) == []


def test_no_import_cycles():
    assert _cycles(_graph(_modules())) == []


def test_type_tables_sit_at_the_bottom():
    graph = _graph(_modules())
    assert graph["ternary_rs.core.formats"] <= {"ternary_rs._core"}


def test_floor_checker_finds_an_upward_import():
    assert LAYERS[floor_of("ternary_rs.sources.reader")][0] == "sources"
    assert LAYERS[floor_of("ternary_rs")][0] == "cli"
    assert LAYERS[floor_of("ternary_rs.ops")][0] == "serving"
    graph = {"ternary_rs.core.tensor": {"ternary_rs.sources.reader"}, "ternary_rs.sources.reader": {"ternary_rs._core"}}
    assert _upward(graph) == ["ternary_rs.core.tensor (core) imports ternary_rs.sources.reader (sources)"]


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_test_only_code_is_not_in_the_package():
    # The NumPy reference codecs are the tests' oracle; the wheel ships what the package needs only.
    assert not (PACKAGE_DIR / "_reference.py").exists()
    assert (Path(__file__).parent / "support" / "format_reference.py").is_file()
