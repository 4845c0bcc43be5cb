"""The package's one-way dependency rule, read from the source (every import, lazy ones included).

Layers, lowest first; a module may import its own unit and any lower layer, never a higher one
or a sibling of its own layer:

    errors -> {compat, files, child_process} -> {_env, tomlfile} -> targets -> model -> draft -> plan -> kernel
    -> compile -> estimate -> build -> {tune, export, decode} -> vllm -> cli

`tpumk/__init__.py` (the lazy public API) may import anything; any module may read
`tpumk.__version__` from the package root.

Named exceptions (UPWARD): the plan picks its auto knobs (KV tiles, expert slots) by walking
candidate plans with tpumk's timeline model, which reads plans, and its auto all-reduce
schedule by tpumk's interconnect model, which reads the all-reduce geometry; plan.py imports
both lazily, inside the choosing functions, so no import cycle forms at load time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tpumk

PACKAGE = Path(tpumk.__file__).resolve().parent
LAYERS = [
    {"errors"},
    {"compat", "files", "child_process"},
    {"_env", "tomlfile"},
    {"targets"},
    {"model"},
    {"draft"},
    {"plan"},
    {"kernel"},
    {"compile"},
    {"estimate"},
    {"build"},
    {"tune", "export", "decode"},
    {"vllm"},
    {"cli"},
]
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}
UPWARD = {("tpumk.plan.plan", "tpumk.estimate.timeline"),  # see the module doc
          ("tpumk.plan.plan", "tpumk.estimate.interconnect")}
MAX_TOP_LEVEL_MODULES = 12


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tpumk"


def _imports(path: Path, runtime_only: bool = False) -> list[str]:
    """The tpumk modules `path` imports (`from pkg import submodule` named as the submodule);
    `runtime_only` leaves out imports under `if TYPE_CHECKING:`, which never run."""
    tree = ast.parse(path.read_text())
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                node.body = []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("tpumk"):
            if node.module == "tpumk":
                out += [f"tpumk.{a.name}" if a.name != "__version__" else "tpumk" for a in node.names]
            else:
                out += [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULE_NAMES else node.module
                        for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "tpumk"]
    return out


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        yield ".".join(p for p in rel.parts if p != "__init__"), path


MODULE_NAMES = {m for m, _ in _modules()}


def test_every_unit_has_a_layer():
    units = {_unit(m) for m, _ in _modules()} - {"tpumk", "__main__"}
    assert units <= set(RANK), f"modules outside the layer table: {sorted(units - set(RANK))}"


def test_imports_only_go_down():
    bad = []
    for module, path in _modules():
        if module == "tpumk":
            continue
        mine = _unit(module)
        for target in _imports(path):
            theirs = _unit(target)
            if theirs in (mine, "tpumk") or (module, target) in UPWARD:
                continue
            if RANK[theirs] >= RANK[mine]:
                bad.append(f"{module} imports {target} ({mine} may not depend on {theirs})")
    assert not bad, "\n".join(bad)


# No import cycle between any two modules, lazy imports included.
def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

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
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_cycle_between_modules():
    modules = dict(_modules())
    names = set(modules) - {"tpumk"}  # the root's lazy public API imports everything, by design
    graph = {m: set(_imports(modules[m], runtime_only=True)) & names - {m} for m in names}
    assert _cycles(graph) == [], "import cycles between modules"


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert _cycles(graph) == [["a", "b", "c"], ["d", "e"]]


def test_no_relative_imports_and_few_top_level_modules():
    relative = [m for m, p in _modules() for n in ast.walk(ast.parse(p.read_text()))
                if isinstance(n, ast.ImportFrom) and n.level > 0]
    assert not relative, f"relative imports (the layer check reads absolute ones): {relative}"
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
