"""The package's folders are layers: read from the source with ``ast`` (every import, also the
ones inside functions, relative ones resolved), not by importing it.

* The sub-package graph has no cycle: ``lsgd_hpc/comm/...`` is the node ``lsgd_hpc.comm``,
  a top-level module such as ``lsgd_hpc/session.py`` a node of its own, and
  ``lsgd_hpc/__init__.py`` the node ``lsgd_hpc`` (its names are imported lazily by name, so
  it has no edges of its own).
* Nothing outside ``lsgd_hpc/cli`` imports ``lsgd_hpc.cli``, but the ``python -m`` entry
  points that only forward to it.
* The offline analysis loads neither torch nor mpi4py.
* Nothing under ``lsgd_hpc/``, ``benchmarks/`` or ``results/`` puts ``tests/`` on sys.path.
* Inside one folder, the modules import each other without a cycle (the module graph: every
  import, also inside functions and ``if TYPE_CHECKING``).
* No module but an ``__init__.py`` only re-exports names (a body of imports, ``__all__`` and
  a docstring): code imports each name from the module that defines it, and the package
  faces (``lsgd_hpc``, ``lsgd_hpc.runtime``, ...) are the only re-exporters.
* No function or method under ``lsgd_hpc/`` is longer than 80 lines (from its ``def`` line,
  decorators left out, to its last line).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "lsgd_hpc"

#: (importing file, imported module) pairs that the layer rules let pass, for now (none: the
#: last one, planning/plan.py -> cli/config.py, went with the spec work).
KNOWN_EXCEPTIONS: Set[Tuple[str, str]] = set()

#: ``python -m lsgd_hpc.X`` entry points that forward to lsgd_hpc/cli/X.py (their only
#: lsgd_hpc import; they define nothing). plan, netprobe, summary and aggregate forward to
#: planning/ and analysis/ instead, so they need no exception.
CLI_SHIMS = ("lsgd_hpc/train.py", "lsgd_hpc/doctor.py")


# -- reading the imports ---------------------------------------------------------------------
def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules(pkg: Path = PKG) -> Dict[str, Path]:
    """Every module and package of ``pkg``, by dotted name."""
    return {module_name(p, pkg.parent): p for p in sorted(pkg.rglob("*.py"))}


def imports_of(path: Path, modules: Iterable[str], root: Path = REPO) -> List[Tuple[str, int]]:
    """``(imported module, line)`` for every import statement of the file, wherever it is
    (module level, functions, ``if TYPE_CHECKING``). ``from X import name`` imports the
    module ``X.name`` when there is one, else ``X``."""
    modules = set(modules)
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = {f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod
                       for a in node.names}
            out += [(t, node.lineno) for t in sorted(targets)]
    return out


def layer(module: str) -> str:
    """The graph node of a module: its sub-package (``lsgd_hpc.comm``), or the top-level
    module itself (``lsgd_hpc.session``), or the package ``lsgd_hpc``."""
    return ".".join(module.split(".")[:2])


Edge = Tuple[str, str]


def package_edges(pkg: Path = PKG) -> Dict[Edge, List[str]]:
    """(importing node, imported node) -> 'file:line -> module' of each import behind it,
    known exceptions left out."""
    modules = all_modules(pkg)
    edges: Dict[Edge, List[str]] = defaultdict(list)
    for name, path in modules.items():
        rel = str(path.relative_to(pkg.parent))
        for target, line in imports_of(path, modules, pkg.parent):
            if target.split(".")[0] != pkg.name or (rel, target) in KNOWN_EXCEPTIONS:
                continue
            a, b = layer(name), layer(target)
            if a != b:
                edges[(a, b)].append(f"{rel}:{line} -> {target}")
    return edges


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """A cycle of ``graph`` (node -> successors) as ``[a, b, ..., a]``, or None."""
    white, grey, black = 0, 1, 2
    colour = defaultdict(int)
    stack: List[str] = []

    def visit(u: str) -> Optional[List[str]]:
        colour[u] = grey
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if colour[v] == grey:
                return stack[stack.index(v):] + [v]
            if colour[v] == white:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        colour[u] = black
        return None

    for node in sorted(graph):
        if colour[node] == white:
            found = visit(node)
            if found:
                return found
    return None


def describe_cycle(cycle: List[str], edges: Dict[Edge, List[str]]) -> str:
    lines = [" -> ".join(cycle)]
    for a, b in zip(cycle, cycle[1:]):
        lines.append(f"  {a} -> {b}:")
        lines += [f"    {where}" for where in edges[(a, b)]]
    return "\n".join(lines)


# -- inside one folder ---------------------------------------------------------------------
def folder_edges(pkg: Path = PKG) -> Dict[Edge, List[str]]:
    """(importing module, imported module) -> 'file:line' of each import, for the pairs of
    modules in the same folder (a package's ``__init__.py`` is in its folder)."""
    modules = all_modules(pkg)
    edges: Dict[Edge, List[str]] = defaultdict(list)
    for name, path in modules.items():
        rel = str(path.relative_to(pkg.parent))
        for target, line in imports_of(path, modules, pkg.parent):
            if target in modules and target != name and modules[target].parent == path.parent:
                edges[(name, target)].append(f"{rel}:{line}")
    return edges


def folder_cycle(pkg: Path = PKG) -> Optional[str]:
    """A cycle of modules of one folder that import each other, described, or None."""
    edges = folder_edges(pkg)
    graph: Dict[str, Set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    cycle = find_cycle(graph)
    return None if cycle is None else describe_cycle(cycle, edges)


# -- re-export shims -------------------------------------------------------------------------
def _only_reexports(tree: ast.Module) -> bool:
    """Whether a module's body is imports (one at least), ``__all__`` and a docstring alone."""
    imports = 0
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports += 1
        elif i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            continue
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if not all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                return False
        else:
            return False
    return imports > 0


def reexport_modules(pkg: Path = PKG) -> List[str]:
    """The modules of ``pkg``, ``__init__.py`` files left out, that only re-export names."""
    return [str(path.relative_to(pkg.parent)) for path in sorted(pkg.rglob("*.py"))
            if path.name != "__init__.py"
            and _only_reexports(ast.parse(path.read_text(), str(path)))]


# -- function length -------------------------------------------------------------------------
MAX_FUNCTION_LINES = 80


def function_lengths(tree: ast.AST) -> List[Tuple[str, int]]:
    """``(qualified name, lines)`` of every function and method of a module, nested ones too
    (``Class.method``, ``outer.inner``): from the ``def`` line (decorators left out) to the
    last line, both counted."""
    out: List[Tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                out.append((name, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def long_functions(pkg: Path = PKG, limit: int = MAX_FUNCTION_LINES) -> List[str]:
    """'file:function:lines' of each function of ``pkg`` longer than ``limit`` lines."""
    bad = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg.parent)
        bad += [f"{rel}:{name}:{lines}"
                for name, lines in function_lengths(ast.parse(path.read_text(), str(path)))
                if lines > limit]
    return bad


# -- sys.path ----------------------------------------------------------------------------------
def _names_bound(tree: ast.AST) -> Dict[str, List[ast.AST]]:
    """name -> the expressions assigned to it, or iterated over into it, in the file."""
    bound: Dict[str, List[ast.AST]] = defaultdict(list)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    bound[t.id].append(node.value)
        elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            bound[node.target.id].append(node.iter)
    return bound


def _mentions_tests(expr: ast.AST, bound: Dict[str, List[ast.AST]], depth: int = 4) -> bool:
    """Whether a path built by ``expr`` has a component 'tests' (names followed ``depth``
    assignments back)."""
    for node in ast.walk(expr):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if "tests" in node.value.replace("\\", "/").split("/"):
                return True
        if isinstance(node, ast.Name) and depth > 0:
            if any(_mentions_tests(e, bound, depth - 1) for e in bound.get(node.id, ())):
                return True
    return False


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


def lines_adding_tests_to_path(source: str, filename: str = "<source>") -> List[int]:
    """Lines of ``source`` that put a tests/ folder on sys.path (insert, append, extend,
    assignment to a slice, +=)."""
    tree = ast.parse(source, filename)
    bound = _names_bound(tree)
    lines = []
    for node in ast.walk(tree):
        args: List[ast.AST] = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and _is_sys_path(node.func.value) \
                and node.func.attr in ("insert", "append", "extend"):
            args = list(node.args)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Subscript) and _is_sys_path(t.value) for t in node.targets):
            args = [node.value]
        elif isinstance(node, ast.AugAssign) and _is_sys_path(node.target):
            args = [node.value]
        if any(_mentions_tests(a, bound) for a in args):
            lines.append(node.lineno)
    return sorted(lines)


# -- the rules -------------------------------------------------------------------------------
def test_sub_packages_import_each_other_without_a_cycle():
    edges = package_edges()
    graph: Dict[str, Set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    cycle = find_cycle(graph)
    assert cycle is None, "sub-packages import each other in a loop:\n" + \
        describe_cycle(cycle, edges)


def test_known_exceptions_are_still_needed():
    """An exception whose import is gone must go too (then delete it from KNOWN_EXCEPTIONS)."""
    modules = all_modules()
    for rel, target in KNOWN_EXCEPTIONS:
        path = REPO / rel
        assert path.exists() and target in {t for t, _ in imports_of(path, modules)}, \
            f"{rel} no longer imports {target}: remove it from KNOWN_EXCEPTIONS"


def test_only_cli_imports_cli():
    modules = all_modules()
    bad = []
    for name, path in modules.items():
        rel = str(path.relative_to(REPO))
        if name == "lsgd_hpc.cli" or name.startswith("lsgd_hpc.cli.") or rel in CLI_SHIMS:
            continue
        bad += [f"{rel}:{line} -> {t}" for t, line in imports_of(path, modules)
                if (t == "lsgd_hpc.cli" or t.startswith("lsgd_hpc.cli."))
                and (rel, t) not in KNOWN_EXCEPTIONS]
    assert not bad, "imports of lsgd_hpc.cli outside cli/:\n" + "\n".join(bad)


@pytest.mark.parametrize("rel", CLI_SHIMS)
def test_cli_shims_only_forward(rel):
    path = REPO / rel
    own = f"lsgd_hpc.cli.{path.stem}"
    ours = {t for t, _ in imports_of(path, all_modules()) if t.split(".")[0] == "lsgd_hpc"}
    assert ours == {own}, f"{rel} imports {sorted(ours)}; a shim imports {own} alone"
    tree = ast.parse(path.read_text())
    assert not [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))], \
        f"{rel} defines functions or classes; it should only forward to {own}"


ANALYSIS = sorted(n for n in all_modules() if n == "lsgd_hpc.analysis"
                  or n.startswith("lsgd_hpc.analysis.")) + ["lsgd_hpc.aggregate",
                                                            "lsgd_hpc.summary"]


@pytest.mark.parametrize("module", ANALYSIS)
def test_analysis_loads_neither_torch_nor_mpi4py(module):
    code = (f"import sys, {module}; "
            "print(sorted(m for m in ('torch', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"import {module} loads {out.stdout.strip()}"


def test_nothing_puts_tests_on_sys_path():
    bad = []
    for folder in ("lsgd_hpc", "benchmarks", "results"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO)
            bad += [f"{rel}:{line}"
                    for line in lines_adding_tests_to_path(path.read_text(), str(rel))]
    assert not bad, "tests/ put on sys.path (use lsgd_hpc.testing instead):\n" + "\n".join(bad)


def test_modules_of_a_folder_import_each_other_without_a_cycle():
    cycle = folder_cycle()
    assert cycle is None, "modules of one folder import each other in a loop (move the " \
        "shared piece down into a module both import):\n" + cycle


def test_no_module_only_reexports():
    shims = reexport_modules()
    assert not shims, "modules that only re-export names (import each name from the module " \
        "that defines it; only a package's __init__.py re-exports):\n" + "\n".join(shims)


def test_no_function_is_longer_than_80_lines():
    bad = long_functions()
    assert not bad, f"functions longer than {MAX_FUNCTION_LINES} lines (file:function:lines; " \
        "split them into steps with names of their own):\n" + "\n".join(bad)


# -- the checks can fail -----------------------------------------------------------------------
def test_find_cycle_on_a_made_up_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert set(cycle) == {"a", "b", "c"} and len(cycle) == 4
    for u, v in zip(cycle, cycle[1:]):
        assert v in graph[u]
    text = describe_cycle(cycle, defaultdict(list, {("a", "b"): ["a.py:3 -> b"]}))
    assert "a.py:3 -> b" in text
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_package_edges_on_a_made_up_package(tmp_path):
    """Two sub-packages that import each other, one of them from inside a function and by
    a relative import: the loop is found, and named by file and line."""
    pkg = tmp_path / "lsgd_hpc"
    for sub in ("one", "two"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "one" / "a.py").write_text("from lsgd_hpc.two import b\n")
    (pkg / "two" / "b.py").write_text("def f():\n    from ..one import a\n")
    edges = package_edges(pkg)
    assert edges[("lsgd_hpc.one", "lsgd_hpc.two")] == ["lsgd_hpc/one/a.py:1 -> lsgd_hpc.two.b"]
    assert edges[("lsgd_hpc.two", "lsgd_hpc.one")] == ["lsgd_hpc/two/b.py:2 -> lsgd_hpc.one.a"]
    graph: Dict[str, Set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    assert find_cycle(graph) is not None


def test_tests_on_sys_path_finds_the_usual_forms():
    src = '''
import sys
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
for p in (str(REPO), str(REPO / "tests")):
    sys.path.insert(0, p)
sys.path.append("../tests")
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path[:0] = [str(REPO / "tests")]
'''
    assert lines_adding_tests_to_path(src) == [5, 7, 8, 10]


def test_folder_cycle_on_a_made_up_package(tmp_path):
    """Three modules of one folder in a loop, one edge inside a function, one relative and one
    under ``if TYPE_CHECKING``: found, and named by file and line; imports across folders and
    of the package's own ``__init__`` by a sibling are no loop by themselves."""
    pkg = tmp_path / "lsgd_hpc"
    (pkg / "data").mkdir(parents=True)
    (pkg / "other").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("")
    (pkg / "other" / "__init__.py").write_text("")
    (pkg / "data" / "loaders.py").write_text("import os\nfrom lsgd_hpc.data import splits\n")
    (pkg / "data" / "splits.py").write_text("def f():\n    from .sampler import g\n")
    (pkg / "data" / "sampler.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from lsgd_hpc.data.loaders import Dataset\n")
    (pkg / "other" / "x.py").write_text("from lsgd_hpc.data import loaders\n")
    (pkg / "data" / "y.py").write_text("from lsgd_hpc.other import x\n")
    found = folder_cycle(pkg)
    assert found is not None
    loop = found.splitlines()[0].split(" -> ")
    assert set(loop) == {"lsgd_hpc.data.loaders", "lsgd_hpc.data.splits",
                         "lsgd_hpc.data.sampler"} and len(loop) == 4, found
    for where in ("lsgd_hpc/data/loaders.py:2", "lsgd_hpc/data/splits.py:2",
                  "lsgd_hpc/data/sampler.py:3"):
        assert where in found, found
    # the loop broken: the shared piece moved down
    (pkg / "data" / "sampler.py").write_text("from lsgd_hpc.data import base\n")
    (pkg / "data" / "base.py").write_text("class Dataset:\n    pass\n")
    assert folder_cycle(pkg) is None


def test_reexport_modules_on_a_made_up_package(tmp_path):
    """A module of imports, ``__all__`` and a docstring is a shim (also one that re-exports
    private names, or extends ``__all__``); an ``__init__.py``, an entry point that runs
    ``main`` and a module that defines anything are not."""
    pkg = tmp_path / "lsgd_hpc"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from lsgd_hpc.runtime.real import f\n__all__ = ['f']\n")
    (pkg / "runtime" / "__init__.py").write_text('"""Face."""\nfrom .real import f\n')
    (pkg / "runtime" / "real.py").write_text("import os\n\n\ndef f():\n    return os\n")
    (pkg / "runtime" / "blocks.py").write_text(
        '"""For older callers."""\n\nfrom lsgd_hpc.runtime.real import f\n'
        'from lsgd_hpc.runtime.real import os as _os\n\n__all__ = ["f"]\n__all__ += ["_os"]\n')
    (pkg / "runtime" / "bare.py").write_text("from lsgd_hpc.runtime.real import f  # noqa\n")
    (pkg / "entry.py").write_text(
        '"""python -m lsgd_hpc.entry"""\nimport sys\n\nfrom lsgd_hpc.runtime.real import f\n'
        '__all__ = ["f"]\n\nif __name__ == "__main__":\n    sys.exit(f())\n')
    (pkg / "consts.py").write_text('"""Constants."""\nimport os\n\nSEP = os.sep\n')
    (pkg / "empty.py").write_text('"""Nothing yet."""\n')
    assert reexport_modules(pkg) == ["lsgd_hpc/runtime/bare.py", "lsgd_hpc/runtime/blocks.py"]


def test_long_functions_on_a_made_up_package(tmp_path):
    """Functions, methods, nested and async ones are measured from the ``def`` line to the
    last, decorators left out: 81 lines is too long, 80 is not."""
    pkg = tmp_path / "lsgd_hpc"
    (pkg / "comm").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")

    def body(lines: int, indent: str = "    ") -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(lines - 1))

    (pkg / "comm" / "__init__.py").write_text(
        "def ok():\n" + body(80)
        + "\n\ndef too_long():\n" + body(81))
    (pkg / "comm" / "base.py").write_text(
        "import functools\n\n\nclass Comm:\n"
        + "".join("    @functools.lru_cache()\n" for _ in range(5))
        + "    def decorated(self):\n" + body(80, "        ")
        + "\n    async def method(self):\n" + body(82, "        ")
        + "\n\ndef outer():\n    def inner():\n" + body(81, "        ") + "    return inner\n")
    assert long_functions(pkg) == [
        "lsgd_hpc/comm/__init__.py:too_long:81",
        "lsgd_hpc/comm/base.py:Comm.method:82",
        "lsgd_hpc/comm/base.py:outer:83",
        "lsgd_hpc/comm/base.py:outer.inner:81",
    ]
    assert long_functions(pkg, limit=83) == []
