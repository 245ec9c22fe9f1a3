"""The package's layers, checked by parsing it (docs/design.md, "Layers").

- No import cycle between the package's modules, counting imports inside
  functions (those hide cycles), nor counting `if TYPE_CHECKING:` imports:
  a type imported from above is a call back up in disguise (a callback, or
  an object of the upper layer handed down).  Name what is needed below
  (a Protocol) or pass it in.  TYPE_ONLY_CIRCLES lists the edges still to go.
- No Python module of the package over 900 lines, no C file over 1,000
  (OVERSIZE lists those still to be split).
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


def _walk_runtime(tree: ast.AST, type_only: bool = False):
    """Every node of `tree` except those under `if TYPE_CHECKING:` (with `type_only`, those too)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_only:
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


def _imports(module: str, tree: ast.Module, type_only: bool = False) -> list[tuple[str, list[str]]]:
    """(imported module of the package, names imported from it) for every runtime import in `tree` (with
    `type_only`, the `if TYPE_CHECKING:` ones too)."""
    out = []
    for node in _walk_runtime(tree, type_only):
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


def _graph(type_only: bool = False) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, tree in MODULES.items():
        for target, _ in _imports(m, tree, type_only):
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


# Type-only imports that still close a circle, each with why it is left: the coordinator empties this list at
# merge.  Each entry must still be an edge of such a circle (the test below says when one is gone).
TYPE_ONLY_CIRCLES: dict[tuple[str, str], str] = {}


def _type_only_circles() -> list[list[str]]:
    g = _graph(type_only=True)
    for a, b in TYPE_ONLY_CIRCLES:
        g[a].discard(b)
    return _cycles(g)


def test_no_import_cycles_even_through_type_only_imports():
    assert _type_only_circles() == []


def test_every_allowed_type_only_circle_is_still_one():
    """An edge of TYPE_ONLY_CIRCLES that no longer closes a circle (its import gone, or made a runtime one that
    the test above would catch) comes off the list."""
    runtime, full = _graph(), _graph(type_only=True)
    for a, b in TYPE_ONLY_CIRCLES:
        assert b in full[a] and b not in runtime[a], f"{a} -> {b} is no type-only import: take it off the list"
        assert a in _reachable(full, {b}), f"{a} -> {b} closes no circle now: take it off the list"


# ---------------------------------------------------------------- sizes

MAX_PY_LINES, MAX_C_LINES = 900, 1000
# Files of the package over those sizes, each with why: the coordinator empties this list at merge, and an
# entry whose file is no longer over fails the test (so that it comes off).
OVERSIZE: dict[str, str] = {}


def _oversize() -> dict[str, int]:
    """Files of the package over their size: {path from the repository: lines}."""
    out = {}
    for path in sorted(ROOT.rglob("*")):
        limit = MAX_PY_LINES if path.suffix == ".py" else MAX_C_LINES if path.suffix in (".c", ".h") else None
        if limit is None:
            continue
        n = len(path.read_text().splitlines())
        if n > limit:
            out[str(path.relative_to(REPO))] = n
    return out


def test_no_module_over_900_lines_nor_c_file_over_1000():
    over = _oversize()
    assert {f: n for f, n in over.items() if f not in OVERSIZE} == {}
    assert [f for f in OVERSIZE if f not in over] == [], "no longer over: take it off OVERSIZE"


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
C_HALVES = {f"{PACKAGE}._fastpath": f"{PACKAGE}.core_fast"}


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
    hidden = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .pool import Pool\n")
    assert _imports(f"{PACKAGE}.a", hidden) == []
    assert _imports(f"{PACKAGE}.a", hidden, type_only=True) == [(f"{PACKAGE}.pool", ["Pool"])]
    made_up = {f"{PACKAGE}.a": ast.parse("class A:\n    def __init__(self):\n        self._mine = 1\n"
                                         "def f(a, pool):\n    return a._mine, pool._secret\n")}
    assert _private_uses(made_up) == [f"{PACKAGE}.a:5 uses ._secret, which it does not define"]


# ---------------------------------------------------------------- the tiers below memory

# The tier layer: the contract of a tier (lower), the one entry point to them (tiers), the table of the tiers a
# pool is created with (tier_table), and the tiers with what only they use.  Above it nothing names a tier: a
# tier is a module of its own and a line in tier_table (docs/design.md, "One tier contract").
TIER_MODULES = {f"{PACKAGE}.{m}" for m in ("disktier", "diskindex", "disklog", "remote", "snaptier")}
TIER_LAYER = TIER_MODULES | {f"{PACKAGE}.{m}" for m in ("lower", "tiers", "tier_table")}
# Operator tools that work on a tier's own files and servers by design, not through a pool's tiers:
# `delete --force --disk-path` removes the files of a deleted pool's disk tier (admin), `doctor` checks the
# tiers' directories and servers.
OPERATOR_TOOLS = {f"{PACKAGE}.admin", f"{PACKAGE}.doctor"}


def _reachable(g: dict[str, set[str]], start: set[str]) -> set[str]:
    seen: set[str] = set()
    stack = list(start)
    while stack:
        for w in g[stack.pop()]:
            if w not in seen:
                seen.add(w)
                stack.append(w)
    return seen


def _tier_vocabulary() -> tuple[set[str], set[str], set[str]]:
    """(tier names, the classes the tier modules define, the header fields that configure a tier)."""
    from cortex_cache.snaptier import SnapshotBelow
    from cortex_cache.tier_table import TIERS

    names = {k.name for k in TIERS} | {SnapshotBelow.name}
    classes = {n.name for m in TIER_MODULES for n in MODULES[m].body if isinstance(n, ast.ClassDef)}
    fields = {f for k in TIERS for f in k.HEADER_FIELDS}
    return names, classes, fields


def _names_of_tiers(modules: dict[str, ast.Module], checked: set[str]) -> list[str]:
    """Where a module in `checked` names a tier: imports a tier's module, uses a tier's class, asks a Tiers
    for a tier by attribute (`tiers.disk`, `pool.tiers.remote`), or handles a header field that configures
    a tier ("disk_flags")."""
    names, classes, fields = _tier_vocabulary()
    problems = []
    for m in sorted(checked):
        tree = modules[m]
        for target, _ in _imports(m, tree):
            if target in TIER_MODULES:
                problems.append(f"{m} imports {target}")
        found = []  # (line, column, what)
        for node in ast.walk(tree):
            where = (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
            if isinstance(node, ast.Name) and node.id in classes:
                found.append((*where, f"uses {node.id}"))
            elif isinstance(node, ast.Attribute):
                v = node.value
                on_tiers = (isinstance(v, ast.Name) and v.id == "tiers") or (
                    isinstance(v, ast.Attribute) and v.attr == "tiers")
                if node.attr in classes:
                    found.append((*where, f"uses .{node.attr}"))
                elif on_tiers and node.attr in names:
                    found.append((*where, f"uses tiers.{node.attr}"))
            elif isinstance(node, ast.Constant) and node.value in fields:
                found.append((*where, f"handles the header field {node.value!r}"))
        problems += [f"{m}:{line} {what}" for line, _, what in sorted(found)]
    return problems


def _above_the_tiers() -> set[str]:
    """Every module but the tier layer, what it is built on (what it imports, all the way down) and
    OPERATOR_TOOLS.  The snapshot tier reads snapshots: snapshot.py, and the configuration a snapshot
    carries, are below it but above the rest of the layer, so its imports do not count as the layer's base."""
    g = _graph()
    base = {m: (set() if m == f"{PACKAGE}.snaptier" else targets) for m, targets in g.items()}
    below = _reachable(base, TIER_LAYER) - TIER_LAYER
    return set(MODULES) - TIER_LAYER - below - OPERATOR_TOOLS - {PACKAGE}


def test_nothing_above_the_tiers_names_a_tier():
    above = _above_the_tiers()
    assert {f"{PACKAGE}.{m}" for m in ("pool", "batch", "lookups", "restore", "config", "persist", "kv", "gpu",
                                        "cli", "cli_render", "integrations.lmcache")} <= above
    assert _names_of_tiers(MODULES, above) == []


def test_the_tier_check_sees_each_way_of_naming_a_tier():
    """The check itself, on made-up modules: each way of naming a tier is caught, and names that only look
    alike (a `disk` that is no Tiers' attribute, a tier's name in a string) are not."""
    made_up = {
        f"{PACKAGE}.a": ast.parse("from .disktier import check_disk_path\n"),
        f"{PACKAGE}.b": ast.parse("def f(pool, tiers):\n    return pool.tiers.remote, tiers.disk\n"),
        f"{PACKAGE}.c": ast.parse("def f(h, cls):\n    h['remote_url'] = 1\n    return cls.DiskTier\n"),
        f"{PACKAGE}.d": ast.parse("def f(st, args):\n    return st['disk'], args.disk, 'remote', args.remote\n"),
    }
    assert _names_of_tiers(made_up, set(made_up)) == [
        f"{PACKAGE}.a imports {PACKAGE}.disktier",
        f"{PACKAGE}.b:2 uses tiers.remote",
        f"{PACKAGE}.b:2 uses tiers.disk",
        f"{PACKAGE}.c:2 handles the header field 'remote_url'",
        f"{PACKAGE}.c:3 uses .DiskTier",
    ]
