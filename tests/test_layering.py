"""The package's layers, checked by parsing it (docs/design.md, "Layers").

- No import cycle between the package's modules, counting imports inside
  functions (those hide cycles; `if TYPE_CHECKING:` imports are left out,
  since they never run).
- No module touches another module's private (`_name`) members: an access
  `obj._name` is allowed on `self`/`cls`, or when `_name` is defined in the
  accessing module itself (its own classes' attributes); `from .m import _x`
  and `m._x` on a module of the package are never allowed.

Both rules are what lets a newcomer trust the picture in docs/design.md: a
module may only use what the modules below it publish.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

PACKAGE = "cortex_cache"
ROOT = REPO / PACKAGE


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = ast.parse(path.read_text(), str(path))
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _walk_runtime(tree: ast.AST):
    """Every node of `tree` except those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative ones against `module`)."""
    if not node.level:
        return node.module or ""
    is_pkg = (ROOT / Path(*module.split(".")[1:]) / "__init__.py").exists() if module != PACKAGE else True
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(imported module of the package, names imported from it) for every runtime import in `tree`."""
    out = []
    for node in _walk_runtime(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            if target.split(".")[0] != PACKAGE:
                continue
            names = [a.name for a in node.names]
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            if subs:  # `from . import segment`: the submodules themselves
                out += [(s, []) for s in subs]
            else:
                out.append((target, names))
    return out


def _graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, tree in MODULES.items():
        for target, _ in _imports(m, tree):
            if target in MODULES and target != m and target != PACKAGE:
                g[m].add(target)
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_even_through_imports_inside_functions():
    assert _cycles(_graph()) == []


def _defined_private_names(tree: ast.Module) -> set[str]:
    """`_names` a module defines: functions, classes, assignments, attributes it sets, parameters."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# Compiled extensions that are the C half of one module, which alone imports them.
C_HALVES = {f"{PACKAGE}._fastpath": f"{PACKAGE}.core"}


# Standard-library names that are public despite their underscore: os._exit is the documented way out of a
# forked child (restore's detached filler), which must not run the parent's cleanup.
STDLIB_PUBLIC = {"os._exit"}


def _private_uses(modules: dict[str, ast.Module]) -> list[str]:
    problems = []
    for m, tree in modules.items():
        own = _defined_private_names(tree)
        modules_here: set[str] = set()  # local names bound to modules of the package
        for target, names in _imports(m, tree):
            for n in names:
                if _private(n) and C_HALVES.get(f"{target}.{n}") != m:
                    problems.append(f"{m} imports {n} from {target}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                for a in node.names:
                    if f"{_resolve(m, node)}.{a.name}" in MODULES:
                        modules_here.add(a.asname or a.name)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            v = node.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Name) and f"{v.id}.{node.attr}" in STDLIB_PUBLIC:
                continue
            if isinstance(v, ast.Name) and v.id in modules_here:
                problems.append(f"{m}:{node.lineno} uses {v.id}.{node.attr}")
            elif node.attr not in own:
                problems.append(f"{m}:{node.lineno} uses .{node.attr}, which it does not define")
    return problems


def test_no_module_touches_another_modules_private_members():
    assert _private_uses(MODULES) == []


def test_the_check_sees_a_cycle_and_a_private_use():
    """The checks themselves: a made-up cycle and a made-up private access are caught."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    made_up = {f"{PACKAGE}.a": ast.parse("class A:\n    def __init__(self):\n        self._mine = 1\n"
                                         "def f(a, pool):\n    return a._mine, pool._secret\n")}
    assert _private_uses(made_up) == [f"{PACKAGE}.a:5 uses ._secret, which it does not define"]
