"""flatpack's own source files and the imports between them, read with ``ast`` (nothing is
imported): what an image ships for a stage worker (the files its entry modules import,
function-level imports included), what ``benchmarks/import_layers.py`` draws, and the imports
that run inside a function with the comment that says why (:func:`function_level_imports`).

An import under ``if TYPE_CHECKING:`` is not followed (it never runs), and neither is a
module named in a string (``Registry`` entries): a module a worker reaches only that way
would be missing from its image, which the image tests catch by running the shipped files.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

PACKAGE = "flatpack"
ROOT = Path(__file__).resolve().parent


def module_name(path: Path, root: Path = ROOT) -> str:
    """``<root>/runtime/worker.py`` -> ``flatpack.runtime.worker``; a package's ``__init__.py`` is the package."""
    parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_path(name: str, root: Path = ROOT) -> Path:
    """Where module ``name`` of flatpack lives under ``root`` (its ``__init__.py`` for a package)."""
    relative = Path(*name.split(".")[1:])
    package = root / relative / "__init__.py"
    return package if package.is_file() else root / relative.with_suffix(".py")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, known: set[str], root: Path = ROOT) -> Counter[str]:
    """The flatpack modules the file at ``path`` imports, counted per import statement,
    anywhere except under ``if TYPE_CHECKING:``; ``from pkg import name`` counts as importing
    ``pkg.name`` when that is a module, else ``pkg``."""
    this = module_name(path, root)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: Counter[str] = Counter()
    for base, names in _import_statements(path.read_text(), str(path), package):
        if base is None:        # ``import a.b, c``: the names themselves
            found.update(names)
        else:                   # ``from base import names``
            found.update(f"{base}.{name}" if f"{base}.{name}" in known else base for name in names)
    del found[this]
    return Counter({name: count for name, count in found.items() if name in known})


@functools.lru_cache(maxsize=1024)
def _import_statements(source: str, filename: str, package: str) -> tuple[tuple[str | None, tuple[str, ...]], ...]:
    """The flatpack import statements of ``source`` (a module of ``package``), outside ``if
    TYPE_CHECKING:``: ``(None, names)`` for ``import names``, ``(base, names)`` for ``from
    base import names``, a relative base made absolute. Keyed by the source text itself, so an edited
    file is parsed again: every image build reads the import graph of flatpack's ~190 files,
    and parsing them was 1-2 s of each ``flatpack deploy`` to a container platform (issue 42)."""
    statements: list[tuple[str | None, tuple[str, ...]]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            statements.append((None, tuple(alias.name for alias in node.names
                                           if alias.name.split(".")[0] == PACKAGE)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] == PACKAGE:
                statements.append((base, tuple(alias.name for alias in node.names)))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source, filename))
    return tuple(statements)


def import_graph(root: Path = ROOT) -> dict[str, Counter[str]]:
    """Every flatpack module -> the flatpack modules it imports (with how many statements)."""
    paths = sorted(path for path in root.rglob("*.py") if "__pycache__" not in path.parts)
    known = {module_name(path, root) for path in paths}
    return {module_name(path, root): imports_of(path, known, root) for path in paths}


def closure(entries: Iterable[str], graph: dict[str, Counter[str]] | None = None) -> set[str]:
    """The modules ``entries`` import, directly or not, with themselves and every package
    above each (Python runs a package's ``__init__`` before any module in it)."""
    graph = import_graph() if graph is None else graph
    seen: set[str] = set()
    pending = list(entries)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        if name not in graph:
            raise KeyError(f"{name} is not a flatpack module")
        seen.add(name)
        parts = name.split(".")
        pending += [".".join(parts[:end]) for end in range(1, len(parts))]
        pending += graph[name]
    return seen


def source_files(entries: Iterable[str], root: Path = ROOT) -> dict[str, bytes]:
    """The source of the modules ``entries`` need (:func:`closure`), by ``flatpack/...`` path."""
    return {f"{PACKAGE}/{module_path(name, root).relative_to(root).as_posix()}": module_path(name, root).read_bytes()
            for name in sorted(closure(entries, import_graph(root)))}


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one member (Tarjan): each is a set of
    modules (or packages) that import one another, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def subpackage(module: str) -> str:
    """``flatpack.ir.passes.coarsen`` -> ``ir``; a top-level module is its own node, the package's
    ``__init__`` is ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def package_graph(files: Mapping[str, Counter[str]]) -> dict[str, Counter[str]]:
    """The import graph between sub-packages (and top-level modules), with import counts."""
    graph: dict[str, Counter[str]] = {}
    for source, targets in files.items():
        edges = graph.setdefault(subpackage(source), Counter())
        for target, count in targets.items():
            if subpackage(target) != subpackage(source):
                edges[subpackage(target)] += count
    return graph


@dataclass(frozen=True)
class FunctionLevelImport:
    """An import that runs when a function does, not when its module is imported."""

    module: str      # the flatpack module it is in
    line: int
    statement: str   # its first source line
    reason: str      # the comment that says why it is in a function; "" when there is none


_LINTER_DIRECTIVE = re.compile(r"^(noqa|type: ?ignore|pyright: ?ignore)\b[^-]*(- |$)", re.I)


def _comments(source: str) -> dict[int, str]:
    """The comment on each line that has one, without ``#`` and a leading linter directive."""
    comments = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = _LINTER_DIRECTIVE.sub("", token.string.lstrip("#").strip()).strip()
    return comments


def _grouping_lines(tree: ast.AST) -> set[int]:
    """The lines imports share a comment across: every line of an import statement and the
    ``try:``/``except ...:`` lines of a ``try`` whose body starts with an import."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        elif isinstance(node, ast.Try) and node.body and isinstance(node.body[0], (ast.Import, ast.ImportFrom)):
            lines.add(node.lineno)
            lines.update(handler.lineno for handler in node.handlers)
    return lines


def _reason(node: ast.Import | ast.ImportFrom, comments: dict[int, str], grouping: set[int],
            lines: list[str]) -> str:
    """The comment on the import's own lines, else the comment just above it or above the
    imports and ``try``/``except`` lines it is grouped with; a blank line or code between ends
    the search."""
    own = [comments[number] for number in range(node.lineno, (node.end_lineno or node.lineno) + 1)
           if comments.get(number)]
    if own:
        return own[0]
    number = node.lineno - 1
    while number >= 1:
        if lines[number - 1].strip().startswith("#"):   # the comment block's lines, first to last
            block = []
            while number >= 1 and lines[number - 1].strip().startswith("#"):
                block.insert(0, comments.get(number, ""))
                number -= 1
            return " ".join(line for line in block if line)
        if number not in grouping:
            return ""
        if comments.get(number):
            return comments[number]
        number -= 1
    return ""


def function_level_imports(root: Path = ROOT) -> list[FunctionLevelImport]:
    """Every import statement in flatpack that sits in a function body (not under
    ``if TYPE_CHECKING:``), with the comment that says why it is not at module level."""
    found = []
    for path in sorted(path for path in root.rglob("*.py") if "__pycache__" not in path.parts):
        source = path.read_text()
        tree = ast.parse(source, str(path))
        lines, comments, grouping = source.splitlines(), _comments(source), _grouping_lines(tree)

        def visit(node: ast.AST, in_function: bool) -> None:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                for child in node.orelse:
                    visit(child, in_function)
                return
            if in_function and isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(FunctionLevelImport(module_name(path, root), node.lineno, lines[node.lineno - 1].strip(),
                                                 _reason(node, comments, grouping, lines)))
            for child in ast.iter_child_nodes(node):
                visit(child, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))

        visit(tree, False)
    return found
