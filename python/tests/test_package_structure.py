"""The package's structure, read from its source with ast: no module reaches into
another's private names (a leading underscore is private to the module that defines
it), the modules import each other without cycles, function-level imports
included (a cycle hidden inside a function is still a cycle), and no module keeps
state in a module-level container keyed by ``id()`` (per-connection state belongs
on the Store; an id is reused once its object is gone)."""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Set, Tuple

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cudaipc")


def _modules(pkg: str = PKG) -> Dict[str, ast.Module]:
    return {f[:-3]: ast.parse(open(os.path.join(pkg, f)).read(), f)
            for f in sorted(os.listdir(pkg)) if f.endswith(".py")}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _owned(tree: ast.Module) -> Set[str]:
    """The names a module defines: functions, classes, module and class variables,
    attributes it sets on self or cls, and __slots__ entries."""
    own: Set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            own.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and \
                isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
            own.add(n.attr)
        elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets):
            own.update(c.value for c in ast.walk(n.value) if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return own


def _imports(node: ast.AST, mods: Set[str]) -> List[Tuple[str, List[str]]]:
    """The package modules an import statement imports, each with the names it takes
    from it ([] for the module itself)."""
    out: List[Tuple[str, List[str]]] = []
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level == 0:
            if base != "cudaipc" and not base.startswith("cudaipc."):
                return []
            base = base[len("cudaipc"):].lstrip(".")
        elif node.level > 1:
            return []
        if base:
            out.append((base.split(".")[0], [a.name for a in node.names]))
        else:
            out.extend((a.name, []) for a in node.names)
    elif isinstance(node, ast.Import):
        out.extend((a.name.split(".")[1], []) for a in node.names if a.name.startswith("cudaipc."))
    return [(m, names) for m, names in out if m in mods]


def _reach_ins(mods: Dict[str, ast.Module]) -> List[str]:
    owned = {m: _owned(t) for m, t in mods.items()}
    elsewhere: Dict[str, Set[str]] = {}
    for m, names in owned.items():
        for n in names:
            elsewhere.setdefault(n, set()).add(m)
    found = []
    for m, tree in mods.items():
        for n in ast.walk(tree):
            for src, names in _imports(n, set(mods)):
                for name in names:
                    if _private(name) and name not in mods:
                        found.append("%s.py:%d imports %s.%s" % (m, n.lineno, src, name))
            if isinstance(n, ast.Attribute) and _private(n.attr):
                if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                    continue
                if n.attr not in owned[m] and elsewhere.get(n.attr, set()) - {m}:
                    found.append("%s.py:%d uses %s.%s (private to %s)" % (
                        m, n.lineno, ast.unparse(n.value), n.attr, ", ".join(sorted(elsewhere[n.attr]))))
    return found


def _cycles(mods: Dict[str, ast.Module]) -> Set[str]:
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for m, tree in mods.items():
        for n in ast.walk(tree):
            for dep, _ in _imports(n, set(mods)):
                if dep != m and m != "__init__":
                    graph[m].add(dep)
    cycles = set()
    for start in graph:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    i = path.index(min(path))
                    cycles.add(" -> ".join(path[i:] + path[:i] + [min(path)]))
                elif nxt not in path:
                    stack.append((nxt, path + [nxt]))
    return cycles


def _calls_id(node: ast.AST, keys: Set[str] = set()) -> bool:
    """Whether node calls id(), or names a variable in keys (one assigned such a value)."""
    return any((isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "id")
               or (isinstance(c, ast.Name) and c.id in keys) for c in ast.walk(node))


def _keyed_by_id(mods: Dict[str, ast.Module]) -> List[str]:
    """Where a module indexes one of its module-level names with a key made with
    ``id()``: ``g[id(x)]``, ``g.get((id(x), n))`` (any method taking such a key) or
    ``id(x) in g``, the key written there or in a variable assigned it."""
    found = []
    for m, tree in mods.items():
        glob: Set[str] = set()
        for n in tree.body:
            if isinstance(n, ast.Assign):
                glob.update(t.id for t in n.targets if isinstance(t, ast.Name))
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                glob.add(n.target.id)
        keys = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and _calls_id(n.value)
                for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(tree):
            name = None
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and _calls_id(n.slice, keys):
                name = n.value.id
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) \
                    and any(_calls_id(a, keys) for a in n.args):
                name = n.func.value.id
            elif isinstance(n, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in n.ops) \
                    and _calls_id(n.left, keys):
                name = next((c.id for c in n.comparators if isinstance(c, ast.Name) and c.id in glob), None)
            if name in glob:
                found.append("%s.py:%d keys the module-level %s with id()" % (m, n.lineno, name))
    return found


def test_no_module_reaches_into_another_modules_private_names() -> None:
    found = _reach_ins(_modules())
    assert not found, "cross-module private access:\n" + "\n".join(found)


def test_no_import_cycles() -> None:
    cycles = _cycles(_modules())
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))


def test_no_module_level_state_keyed_by_id() -> None:
    found = _keyed_by_id(_modules())
    assert not found, "module-level containers keyed by id():\n" + "\n".join(found)


def test_the_checks_find_what_they_look_for(tmp_path) -> None:
    """The checks on a made-up package: an imported private name, a private
    attribute of another module's object and a cycle hidden in a function are
    found; a module's own private names and third-party ones are not."""
    (tmp_path / "a.py").write_text("from .b import _hidden\n\n\ndef f(s, torch):\n"
                                   "    from . import b\n    return s._conn, torch._C, s._mine\n\n\n_mine = 1\n")
    (tmp_path / "b.py").write_text("from . import a\n\n_hidden = 1\n\n\nclass S:\n"
                                   "    def __init__(self):\n        self._conn = a\n")
    mods = _modules(str(tmp_path))
    found = _reach_ins(mods)
    assert len(found) == 2 and "imports b._hidden" in found[0] and "s._conn (private to b)" in found[1], found
    assert _cycles(mods) == {"a -> b -> a"}
    (tmp_path / "c.py").write_text("_by_conn: dict = {}\n_names = {}\n\n\nclass C:\n"
                                   "    def f(self, conn, n, x):\n        _by_conn[id(conn)] = 1\n"
                                   "        _names.get((id(conn), n))\n        if id(conn) in _by_conn:\n"
                                   "            pass\n        seen = {}\n        seen[id(x)] = x\n"
                                   "        self._m[id(x)] = x\n        k = (id(conn), n)\n"
                                   "        _names.pop(k)\n        return _names[n]\n")
    found = _keyed_by_id(_modules(str(tmp_path)))
    assert sorted(f.split(" ", 1)[0] for f in found) == ["c.py:15", "c.py:7", "c.py:8", "c.py:9"], found
