"""The package's shape, read from its source with `ast` (nothing is imported): functions stay short
enough to read at once (the benchmarks' too), and no two modules of one folder import each other,
directly or round a longer loop, at module level or inside a function (a lazy import that dodges a
cycle is still a cycle of design)."""

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lmcache_cartridge"
MAX_LINES = 80
# Argument parsers read as one table of options, in the package and in the benchmarks alike.
LONG_ALLOWED = {"build_parser"}
BENCHMARKS = ROOT / "benchmarks"


def _modules(package: Path) -> dict[str, Path]:
    """Dotted name -> file for every module of `package` (a package is its `__init__`)."""
    out = {}
    for p in sorted(package.rglob("*.py")):
        parts = p.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def long_functions(tree: ast.AST, limit: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """(name, def line, length) of each function in `tree` longer than `limit` lines, from its
    `def` line to its last line."""
    return [(n.name, n.lineno, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def imported(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The package modules `module` imports anywhere in `tree` (at module level, in a function, or
    under TYPE_CHECKING): `import a.b`, `from a import b` (b a module, else a's `__init__`), and
    relative forms."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            src = ".".join([*(base[:len(base) - n.level + 1] if n.level else []), *([n.module] if n.module else [])])
            for a in n.names:
                out.add(f"{src}.{a.name}" if f"{src}.{a.name}" in known else src)
    return {m for m in out if m in known and m != module}


def folder_cycles(package: Path) -> list[list[str]]:
    """One import cycle of `package` (as a list of modules, first == last) for each folder that
    has one."""
    mods = _modules(package)
    graphs: dict[Path, dict[str, set[str]]] = {}
    for name, path in mods.items():
        folder = path.parent
        deps = imported(ast.parse(path.read_text()), name, path.name == "__init__.py", set(mods))
        graphs.setdefault(folder, {})[name] = {d for d in deps if mods[d].parent == folder}
    out = []
    for graph in graphs.values():
        try:
            graphlib.TopologicalSorter(graph).prepare()
        except graphlib.CycleError as e:
            out.append(list(reversed(e.args[1])))
    return out


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")) + sorted(BENCHMARKS.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_functions_fit_on_a_screen(path):
    found = [f for f in long_functions(ast.parse(path.read_text())) if f[0] not in LONG_ALLOWED]
    assert not found, "\n".join(f"{path.relative_to(ROOT)}:{line}: {name} is {n} lines (at most {MAX_LINES}): "
                                "split it by phase into named functions" for name, line, n in found)


def test_no_import_cycle_inside_a_folder():
    cycles = folder_cycles(PACKAGE)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles) + (
        "\nmove the piece both need to the module it belongs to (a lazy import keeps the cycle)")


def test_the_checks_see_what_they_are_for(tmp_path):
    """A long function and import cycles in made-up sources are found (the checks look)."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    assert long_functions(ast.parse(f"def f():\n{body}\n")) == [("f", 1, MAX_LINES + 1)]
    assert not long_functions(ast.parse(f"def f():\n{body[:body.rindex(chr(10))]}\n"))
    known = {"p", "p.a", "p.b"}
    assert imported(ast.parse("def g():\n    from p.b import x\n"), "p.a", False, known) == {"p.b"}
    assert imported(ast.parse("from . import a\nfrom .a import y\n"), "p.b", False, known) == {"p.a"}
    assert imported(ast.parse("from .b import z\n"), "p", True, known) == {"p.b"}
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    for name, text in {"__init__.py": "", "a.py": "from p.sub import c\n", "b.py": "import p.a\n",
                       "sub/__init__.py": "", "sub/c.py": "def f():\n    from . import d\n",
                       "sub/d.py": "from .c import f\n"}.items():
        (pkg / name).write_text(text)
    assert folder_cycles(pkg) == [["p.sub.c", "p.sub.d", "p.sub.c"]] or \
        folder_cycles(pkg) == [["p.sub.d", "p.sub.c", "p.sub.d"]]
    (pkg / "sub" / "d.py").write_text("x = 1\n")
    assert folder_cycles(pkg) == []
