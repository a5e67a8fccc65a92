"""The shape of the code (docs/architecture.md, "The cache and the server as parts").

- no module of `kvtier` imports another in a cycle (imports under `if TYPE_CHECKING:` name
  types only and do not count, nor does a package's `__init__` importing its own modules);
- no file of `kvtier` has more than 600 lines;
- code reaches into another object's private attribute in few places, each marked.

The import graph is read from the source with `ast`; the checks are shown to fail on a planted
cycle and a planted reach.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 600
MAX_PRIVATE_REACHES = 20


def _modules(root: Path) -> dict[str, Path]:
    mods = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of the same root package it imports at runtime."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        is_pkg = path.name == "__init__.py"
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != mod and not (is_pkg and t.startswith(mod + ".")):
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def private_reaches(paths: Iterable[Path], root: Path = REPO) -> list[str]:
    """`x._name` where x is not self or cls: another object's private attribute."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_import_cycle_in_kvtier() -> None:
    found = cycles(import_graph(REPO / "kvtier"))
    assert not found, f"import cycles: {found}"


def test_the_cycle_check_finds_a_planted_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import a\n")  # re-export: no arrow
    (pkg / "sub" / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nfrom . import c\n")
    (pkg / "c.py").write_text("import pkg.sub.a\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.b\n"
    )
    assert cycles(import_graph(pkg)) == [["pkg.b", "pkg.c", "pkg.sub.a"]]


def test_no_file_of_kvtier_over_the_line_limit() -> None:
    long = {
        str(p.relative_to(REPO)): n
        for p in (REPO / "kvtier").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_few_reaches_into_private_attributes() -> None:
    found = private_reaches(sorted((REPO / "kvtier").rglob("*.py")))
    assert len(found) <= MAX_PRIVATE_REACHES, "\n".join(found)


def test_the_reach_check_finds_a_planted_reach(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "def f(cache, other):\n    return cache._lock, other._x, other.__class__\n\n"
        "class A:\n    def g(self):\n        return self._y\n"
    )
    found = [r.split(" ", 1)[1] for r in private_reaches([src], tmp_path)]
    assert sorted(found) == ["cache._lock", "other._x"], found


# ---- the HTTP routes see the server through `RoutePort` only ----------------------------------

# (module, function) whose parameter `port`/`state` is the routes' face of the server
ROUTE_FUNCTIONS = [
    ("kvtier/server/http/app.py", "_routes"),
    ("kvtier/server/http/app.py", "_install_errors"),
    ("kvtier/server/http/admin.py", "install_admin_routes"),
    ("kvtier/server/http/devices_admin.py", "install_device_routes"),
    ("kvtier/server/http/completions.py", "respond"),
]


def _port_members() -> set[str]:
    tree = ast.parse((REPO / "kvtier/server/http/state.py").read_text())
    port = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "RoutePort")
    names = {n.name for n in port.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {n.target.id for n in port.body if isinstance(n, ast.AnnAssign)}  # type: ignore[union-attr]
    return names


def _used_on(source: str, function: str) -> set[str]:
    """The attributes read or written on the function's `port` or `state` parameter."""
    tree = ast.parse(source)
    fn = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function
    )
    params = {a.arg for a in fn.args.args} & {"port", "state"}
    assert params, f"{function} takes no port"
    return {
        n.attr
        for n in ast.walk(fn)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in params
    }


def test_the_routes_use_the_route_port_alone() -> None:
    members = _port_members()
    assert {"ready_engine", "readiness", "config"} <= members
    for path, function in ROUTE_FUNCTIONS:
        used = _used_on((REPO / path).read_text(), function)
        assert used, f"{path}:{function} uses nothing of its port"
        assert used <= members, f"{path}:{function} reaches past RoutePort: {used - members}"


def test_a_route_reaching_into_the_state_is_caught() -> None:
    planted = "def _routes(app, port):\n    engine = port.engine\n    port.warming = True\n"
    assert _used_on(planted, "_routes") - _port_members() == {"engine", "warming"}
