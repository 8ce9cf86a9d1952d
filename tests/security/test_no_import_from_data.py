"""No module is imported, and no code compiled, from a string an artifact could supply.

The test walks flatpack's source (ast, so comments and strings do not count) for every
dynamic import or code evaluation — ``importlib.import_module``, ``__import__``,
``spec_from_file_location``, ``exec``, ``eval``, ``compile`` of source — and checks each
against the list below, which says why that one reads no artifact data. A new call site
fails this test until it is reviewed and listed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import flatpack

ROOT = Path(flatpack.__file__).parent
DYNAMIC = {"import_module", "__import__", "spec_from_file_location", "exec", "eval"}

ALLOWED = {
    # the MODEL and --data arguments of the command line (path/to/file.py:name or
    # package.module:name): the user's own code, named by the user, never read from an artifact
    # or a run record (`flatpack resume` must name a --data factory again:
    # data.source_from_json never imports one a run.json names)
    ("factories.py", "import_factory"): "the user's MODEL and --data arguments",
    # the registries' built-in names map to constant "module:attribute" strings in flatpack's code
    ("registry.py", "factory"): "a constant table in registry users",
    # the package's public names that load on first use (start-up time): the constant _LAZY table
    ("__init__.py", "__getattr__"): "the constant _LAZY table",
    # the dp solver picks its algorithm module from the constant ALGORITHMS table by cost model
    ("partitioner/solvers/dp.py", "_algorithm"): "the constant ALGORITHMS table",
    # at compile time, the module of a function the traced graph calls (a live object in the
    # compiling process), and only below torch, math, operator or builtins
    ("codegen/emit.py", "_import_callable"): "a live callable's module, allowlisted roots, at compile time",
    # the one place a stage's generated source runs: build_module, whose callers pass an
    # artifact that was verified against its index (and digest) first (test_tampering.py,
    # test_worker.py)
    ("stage/artifact.py", "build_module"): "verified stage source",
    # a schedule class defined outside flatpack, named by the user in FLATPACK_SCHEDULES: the
    # environment the user gives the invoker and its functions, never a run record or an artifact
    ("schedules.py", "register_plugins"): "the user's FLATPACK_SCHEDULES environment variable",
    # the fork server imports, before any function runs, one program and its modules from the
    # constant PROGRAMS table (flatpack's own; any other name is refused), nothing a request names
    ("runtime/forkserver.py", "preload"): "the constant PROGRAMS table",
}


class _Calls(ast.NodeVisitor):
    """(file, enclosing function) of every dynamic import or evaluation in one module."""

    def __init__(self, relative: str) -> None:
        self.relative, self.function, self.found = relative, "<module>", set()

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._visit_function(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._visit_function(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        # x.eval() is nn.Module.eval, not the builtin
        if name in DYNAMIC and not (name == "eval" and isinstance(node.func, ast.Attribute)):
            self.found.add((self.relative, self.function))
        self.generic_visit(node)


def dynamic_calls() -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for path in sorted(ROOT.rglob("*.py")):
        calls = _Calls(path.relative_to(ROOT).as_posix())
        calls.visit(ast.parse(path.read_text(), str(path)))
        found |= calls.found
    return found


def test_every_dynamic_import_or_exec_is_reviewed():
    unexpected = dynamic_calls() - set(ALLOWED)
    assert not unexpected, f"dynamic imports/exec not on the reviewed list (they must read no artifact data): " \
                           f"{unexpected}"


def test_the_reviewed_list_has_no_stale_entries():
    assert set(ALLOWED) <= dynamic_calls()


def test_output_structures_import_nothing_by_name():
    source = (ROOT / "ir" / "structure.py").read_text()
    assert "importlib" not in source and "__import__" not in source


def test_nothing_unpickles():
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
                assert not any(name.split(".")[0] in ("pickle", "dill", "cloudpickle") for name in names), path
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                    and getattr(node.func.value, "id", None) == "torch":
                weights_only = [kw for kw in node.keywords if kw.arg == "weights_only"]
                assert weights_only and getattr(weights_only[0].value, "value", None) is True, \
                    f"{path}: torch.load without weights_only=True"
