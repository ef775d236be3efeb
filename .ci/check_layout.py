"""Checks the source tree's layout: no source file over 800 lines, no import circle.

- Line count: every ``.rs`` and ``.py`` file outside the test trees (``tests/``
  directories and Rust ``tests.rs`` unit-test modules) has at most 800 lines.
- Python: the imports among ``python/pagedkv`` modules (deferred imports inside
  functions included, those under ``if TYPE_CHECKING`` left out) form no cycle.
- Rust: within each crate, the top-level modules' code references
  (``crate::x``, comments left out) form no cycle.

Usage: python .ci/check_layout.py   (exits 1 and names each violation)
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

MAX_LINES = 800
ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("python", "rust", "benches", "examples", "fuzz")
SKIP_PARTS = {"tests", "target", ".venv", "__pycache__", "node_modules"}


def source_files() -> list[Path]:
    files: list[Path] = []
    for top in SOURCE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT)
            if path.suffix not in {".rs", ".py"} or not path.is_file():
                continue
            if SKIP_PARTS & set(rel.parts) or path.name == "tests.rs":
                continue
            files.append(path)
    return files


def long_files() -> list[str]:
    out = []
    for path in source_files():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            out.append(f"{path.relative_to(ROOT)}: {n} lines (at most {MAX_LINES})")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at module level or inside functions (a deferred
    import is still a circle), except under ``if TYPE_CHECKING``."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            out += _imports(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    stmts = [c for c in children if isinstance(c, ast.stmt)]
                    for c in children:
                        if isinstance(c, (ast.ExceptHandler, ast.match_case)):
                            stmts += c.body
                    out += _imports(stmts)
    return out


def python_graph(package: Path) -> dict[str, set[str]]:
    modules: dict[str, Path] = {}
    # Extension modules (``_core``) count as modules through their stubs.
    for path in [*package.rglob("*.py"), *package.rglob("*.pyi")]:
        rel = path.relative_to(package.parent).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        modules[".".join(parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        if path.suffix == ".pyi":
            continue
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in _imports(tree.body):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base_parts = name.split(".") if is_pkg else name.split(".")[:-1]
                if node.level:
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # ``from x import y``: the submodule ``x.y`` when there is
                # one, else the module ``x`` (y is a name defined there).
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            for t in targets:
                # The deepest module the name resolves to.
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


_COMMENT = re.compile(r"//[^\n]*")
_CFG_TEST = re.compile(r"#\[cfg\(test\)\]\s*mod \w+\s*(\{.*|;)", re.S)


def rust_graph(src: Path) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in src.rglob("*.rs"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "mod":
            parts = parts[:-1]
        if parts in (["lib"], ["main"]) or not parts or path.name == "tests.rs":
            continue
        text = _COMMENT.sub("", path.read_text(encoding="utf-8"))
        text = _CFG_TEST.sub("", text)
        refs = set(re.findall(r"\bcrate::(\w+)", text))
        for group in re.findall(r"\bcrate::\{([^}]*)\}", text, flags=re.S):
            refs |= set(re.findall(r"(?:^|,)\s*(\w+)", group))
        graph.setdefault(parts[0], set()).update(refs - {parts[0]})
    return {k: {r for r in v if r in graph} for k, v in graph.items()}


def main() -> int:
    problems = long_files()
    for comp in cycles(python_graph(ROOT / "python" / "pagedkv")):
        problems.append("python import circle: " + " <-> ".join(comp))
    for crate in sorted((ROOT / "rust").iterdir()):
        if (crate / "src").is_dir():
            for comp in cycles(rust_graph(crate / "src")):
                problems.append(f"{crate.name} module circle: " + " <-> ".join(comp))
    for p in problems:
        print(p)
    print(f"layout: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
