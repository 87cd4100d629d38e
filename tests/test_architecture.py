"""The repository's plan, held by its sources: floors that only look down, no import cycle.

Floors, by package (the longest dotted prefix that FLOORS names): the model library `laplace` <- the
data sets and transforms `laplace.data` <- the loop and run harness `train` (with the Hydra plugin
that serves its `model` group) <- the consumers `eval`, `analysis` <- the tools `bench`, `scripts`
and the entry scripts at the root (train.py). A module may import from its own floor or lower ones. Every import in the source counts, also one inside
a function (the graph is read from the AST, not from what a run happens to import), and so does
a "package.module:Name" string (a registry naming a class to import by path).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"laplace": 0, "laplace.data": 1, "train": 2, "hydra_plugins": 2, "eval": 3, "analysis": 3, "bench": 4,
          "scripts": 4}
FLOOR_NAMES = {0: "library", 1: "data", 2: "loop", 3: "consumers", 4: "tools"}
ROOT_SCRIPTS = 4  # train.py and any other entry script beside the packages
# Folders of the repository that hold no code of a floor (tests may import every floor).
NOT_CODE = {"tests", "configs", "docs", "slurm", "runs", "outputs", "multirun", "wandb", "data", "shared",
            "build", "dist"}
MAX_LINES = 450
# The run harness is train/'s, not the library's that users import (issue 52): its libraries (Hydra's
# entry and config composition, W&B logging) and what only the loop calls (a resume's RNG states and
# reading of old model nodes, the header of every results.json, whole-line log appends).
HARNESS_LIBRARIES = ("hydra", "wandb")
HARNESS_NAMES = {"rng_state", "set_rng_state", "upgrade_node", "results_header", "append_line"}
DOTTED_TARGET = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):[A-Za-z_]\w*$")


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    where: str  # file:line


def source_files(root: Path) -> dict[str, Path]:
    """Module name -> file, for every .py of a floor package and every root script.
    A root script gets the name `<stem>.py` so train.py is not taken for the train package."""
    mods = {}
    for path in sorted(root.glob("*.py")):
        mods[path.name] = path
    for top in sorted(p for p in root.iterdir() if p.is_dir() and p.name in FLOORS):
        for path in sorted(top.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            mods[".".join(parts)] = path
    return mods


def unfloored_packages(root: Path) -> list[str]:
    """Top-level folders holding Python code that FLOORS does not place."""
    out = []
    for p in sorted(root.iterdir()):
        if (p.is_dir() and not p.name.startswith((".", "_")) and p.name not in FLOORS
                and p.name not in NOT_CODE and any(p.rglob("*.py"))):
            out.append(p.name)
    return out


def floor_of(module: str) -> int:
    if module.endswith(".py"):
        return ROOT_SCRIPTS
    parts = module.split(".")
    return next(FLOORS[p] for p in (".".join(parts[:n]) for n in range(len(parts), 0, -1)) if p in FLOORS)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in modules:
            return cand
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path], root: Path) -> list[Edge]:
    """Edges from `module` to our modules: import statements anywhere in the file, and
    "pkg.mod:Name" strings."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    rel = path.relative_to(root)
    edges = []

    def add(target: str | None, node):
        if target is not None and target != module:
            edges.append(Edge(module, target, f"{rel}:{node.lineno}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_resolve(alias.name, modules), node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{base_name}.{alias.name}" if base_name else alias.name
                add(sub if sub in modules else _resolve(base_name, modules), node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = DOTTED_TARGET.match(node.value)
            if m:
                add(_resolve(m[1], modules), node)
    return edges


def import_graph(root: Path) -> tuple[dict[str, Path], list[Edge]]:
    modules = source_files(root)
    edges = [e for mod, path in modules.items() for e in imports_of(mod, path, modules, root)]
    return modules, edges


def upward_imports(edges: list[Edge]) -> list[str]:
    out = []
    for e in edges:
        f, g = floor_of(e.src), floor_of(e.dst)
        if g > f:
            out.append(f"{e.where}: {e.src} ({FLOOR_NAMES[f]}) imports {e.dst} ({FLOOR_NAMES[g]})")
    return out


def cycles(modules: dict[str, Path], edges: list[Edge]) -> list[str]:
    """Every strongly connected group of modules (Tarjan): its shortest cycle through its first
    module, with the file:line of each import on the way, and the group's other modules."""
    out_edges: dict[str, dict[str, Edge]] = {m: {} for m in modules}
    for e in edges:
        out_edges[e.src].setdefault(e.dst, e)
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):  # iterative Tarjan: deep import chains must not hit the recursion limit
        work = [(v, iter(sorted(out_edges[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(out_edges[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.add(w)
                    if w == node:
                        break
                if len(group) > 1:
                    groups.append(group)

    for m in sorted(modules):
        if m not in index:
            visit(m)
    report = []
    for group in groups:
        start = min(group)
        # The shortest way round through `start` (breadth first inside the group) names one cycle.
        prev, frontier = {start: None}, [start]
        while not any(start in out_edges[f] for f in frontier):
            nxt = []
            for f in frontier:
                for d in sorted(out_edges[f]):
                    if d in group and d not in prev:
                        prev[d] = f
                        nxt.append(d)
            frontier = nxt
        node = next(f for f in frontier if start in out_edges[f])
        path = [start]
        while node is not None:
            path.append(node)
            node = prev[node]
        path = path[::-1]  # start, ..., node, start
        hops = [f"{out_edges[a][b].where} ({a} -> {b})" for a, b in zip(path, path[1:])]
        others = sorted(group - set(path))
        also = f" (the same knot also holds {', '.join(others)})" if others else ""
        report.append(f"{' -> '.join(path)}: " + "; ".join(hops) + also)
    return report


def long_files(root: Path, limit: int = MAX_LINES) -> list[str]:
    """Our .py files (the floors, the root scripts, the tests) over `limit` lines."""
    ours = list(source_files(root).values()) + sorted((root / "tests").rglob("*.py"))
    out = []
    for path in ours:
        n = len(path.read_text().splitlines())
        if n > limit:
            out.append(f"{path.relative_to(root)}: {n} lines")
    return out


# ----------------------------------------------------------------------------- the checks
def test_every_code_folder_has_a_floor():
    missing = unfloored_packages(ROOT)
    assert not missing, (f"top-level folders with Python code but no floor: {missing}; add each to FLOORS in "
                         f"tests/test_architecture.py (library 0, data 1, loop 2, consumers 3, tools 4)")


def test_floors_only_look_down():
    _, edges = import_graph(ROOT)
    up = upward_imports(edges)
    assert not up, "imports from a lower floor to a higher one:\n" + "\n".join(up)


def test_no_import_cycle():
    modules, edges = import_graph(ROOT)
    found = cycles(modules, edges)
    assert not found, "import cycles among our modules:\n" + "\n".join(found)


def test_the_graph_sees_lazy_and_relative_imports_and_class_paths(tmp_path):
    """The checks themselves: a lazy import, a relative one and a registry string are edges."""
    (tmp_path / "laplace").mkdir()
    (tmp_path / "train").mkdir()
    (tmp_path / "laplace" / "__init__.py").write_text("")
    (tmp_path / "laplace" / "a.py").write_text("def f():\n    from . import b\n")
    (tmp_path / "laplace" / "b.py").write_text("from laplace.a import f\nX = 'train.loop:Trainer'\n")
    (tmp_path / "laplace" / "data").mkdir()
    (tmp_path / "laplace" / "data" / "__init__.py").write_text("from laplace import a\n")  # down: allowed
    (tmp_path / "laplace" / "c.py").write_text("from laplace.data import x\n")
    (tmp_path / "train" / "__init__.py").write_text("")
    (tmp_path / "train" / "loop.py").write_text("import laplace.a\n")
    modules, edges = import_graph(tmp_path)
    assert upward_imports(edges) == ["laplace/b.py:2: laplace.b (library) imports train.loop (loop)",
                                     "laplace/c.py:1: laplace.c (library) imports laplace.data (data)"]
    (cyc,) = cycles(modules, edges)
    assert cyc.startswith("laplace.a -> laplace.b -> laplace.a: laplace/a.py:2") and "laplace/b.py:1" in cyc


def test_the_library_holds_no_run_harness():
    found = []
    for path in sorted((ROOT / "laplace").rglob("*.py")):
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [f"{where}:{node.lineno} imports {a.name}" for a in node.names
                          if a.name.split(".")[0] in HARNESS_LIBRARIES]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] in HARNESS_LIBRARIES:
                found.append(f"{where}:{node.lineno} imports {node.module}")
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in HARNESS_NAMES:
                found.append(f"{where}:{node.lineno} defines {node.name}, the loop's (train/)")
    assert not found, "laplace/ is the library users import; the run harness lives in train/:\n" + "\n".join(found)


def test_no_file_over_450_lines():
    long = long_files(ROOT)
    assert not long, f"files over {MAX_LINES} lines (split them by concept):\n" + "\n".join(long)


def test_no_private_name_crosses_a_module_and_no_hasattr_probe():
    """Issue 52's rules: a name another module imports is public (no leading underscore); a type is
    asked with isinstance, not guessed from an attribute (hasattr on a model or module)."""
    found = []
    for path in source_files(ROOT).values():
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or node.module.split(".")[0] in FLOORS):
                found += [f"{where}:{node.lineno} imports {a.name} from {node.module or '.'}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "hasattr"
                  and getattr(node.args[0], "id", None) in ("model", "module", "m", "net")):
                found.append(f"{where}:{node.lineno} hasattr({node.args[0].id}, ...)")
    assert not found, "\n".join(found)
