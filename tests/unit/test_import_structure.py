"""How the three packages import each other, read from their source (every ``import``, at
module level or inside a function, but not under ``if TYPE_CHECKING``):

- no module imports itself in a cycle;
- ``pdwire`` holds the protocol without IO: none of its modules imports a socket, a thread, an
  event loop, ZMQ, a subprocess or the clock.

Each check has a twin showing that it can fail."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[2]
PACKAGES: Final = ("pdwire", "conformance", "reference_connector")
#: Modules that do IO or read the clock, which ``pdwire`` must not import.
IO: Final = frozenset(
    {"socket", "selectors", "threading", "_thread", "asyncio", "multiprocessing", "concurrent",
     "subprocess", "zmq", "time", "datetime", "httpx", "anyio", "uvicorn"}
)  # fmt: skip


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Each module's dotted name and file."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                yield from _imports(child)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _imports(node)


def imported(name: str, path: Path) -> set[str]:
    """The dotted names the module ``name`` at ``path`` imports (``from M import x``: ``M.x``,
    which is module ``M`` when ``x`` is no module of it)."""
    names: set[str] = set()
    for node in _imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
            continue
        base = node.module or ""
        if node.level:
            here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            here = here[: len(here) - node.level + 1]
            base = ".".join([*here, *([node.module] if node.module else [])])
        names |= {f"{base}.{a.name}" for a in node.names}
    return names


def graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of the other modules of ``mods``."""
    edges = {}
    for name, path in mods.items():
        targets = set()
        for dotted in imported(name, path):
            while dotted and dotted not in mods and "." in dotted:
                dotted = dotted.rsplit(".", 1)[0]
            if dotted in mods and dotted != name:
                targets.add(dotted)
        edges[name] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.add(frozenset(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_new_import_cycle() -> None:
    found = cycles(graph(modules(ROOT, PACKAGES)))
    assert not found, sorted(sorted(c) for c in found)


def test_the_cycle_check_finds_a_cycle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from .a import x\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from .a import y\n")  # fmt: skip
    found = cycles(graph(modules(tmp_path, ("pkg",))))
    assert found == {frozenset({"pkg.a", "pkg.b"})}


def _io_imports(package: str) -> dict[str, set[str]]:
    mods = modules(ROOT, (package,))
    found = {n: {d.split(".")[0] for d in imported(n, p)} & IO for n, p in mods.items()}
    return {n: io for n, io in found.items() if io}


def test_pdwire_does_no_io() -> None:
    assert _io_imports("pdwire") == {}


def test_the_io_check_finds_io_where_there_is() -> None:
    found = _io_imports("reference_connector")
    assert {"asyncio", "zmq", "time"} <= set().union(*found.values()), found
