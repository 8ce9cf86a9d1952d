"""The layering (docs/architecture.md): the sub-package import graph has no cycle, the stage
kernel imports nothing but the standard library, torch and safetensors, a worker starts
without the compiler, and an image ships exactly the files its entry points import.

`lint-imports` (.ci/run) checks the order of the layers; these tests check what it cannot:
third-party imports, what a process really loads, and that the shipped files suffice.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import grimp
import pytest

import flatpack
from flatpack.backends.images import FUNCTION_ENTRIES, runtime_sources
from flatpack.backends.gpu_container import RANK_ENTRIES
from flatpack.sources import (ROOT, closure, cycles, function_level_imports, import_graph, module_name, module_path,
                              package_graph)

# what the stage kernel may import besides the standard library
KERNEL_THIRD_PARTY = {"torch", "safetensors"}
# ... and inside a function, for a feature a worker never uses
KERNEL_OPTIONAL = {"cryptography"}   # Ed25519 signatures of an artifact's index (verify_key)
KERNEL_FLATPACK = {"flatpack.errors", "flatpack.version", "flatpack.safeio"}
# what a worker process must not load: the compiler and everything only it needs
COMPILER_SIDE = ("flatpack.compiler", "flatpack.ir", "flatpack.partitioner", "flatpack.codegen", "flatpack.platform",
                 "flatpack.profiler", "flatpack.backends", "flatpack.cli", "flatpack.job")


def _run(code: str, pythonpath: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=pythonpath,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_sub_package_import_graph_has_no_cycle():
    files = import_graph()
    assert cycles(package_graph(files)) == []
    assert cycles(files) == []


# Edges left out of the graph: none (the last type-only cycles, protocol -> functions.TrainResult
# and gpu_container -> the package root, are gone); keep it empty.
KNOWN_TYPE_ONLY_EDGES: set[tuple[str, str]] = set()


def _grimp_graph(exclude_type_checking: bool) -> dict[str, set[str]]:
    """Every import between flatpack's modules, function-level ones included, as grimp (which
    import-linter runs on) reads them; with ``exclude_type_checking=False`` those under
    ``if TYPE_CHECKING:`` too."""
    graph = grimp.build_graph("flatpack", include_external_packages=False,
                              exclude_type_checking_imports=exclude_type_checking, cache_dir=None)
    return {module: set(graph.find_modules_directly_imported_by(module)) for module in graph.modules}


def _without(graph: dict[str, set[str]], edges: set[tuple[str, str]]) -> dict[str, set[str]]:
    return {module: {target for target in targets if (module, target) not in edges}
            for module, targets in graph.items()}


def test_no_import_cycle_of_any_kind_type_only_included():
    """No two flatpack modules import each other, directly or not, counting the imports under
    ``if TYPE_CHECKING:`` (a type-only cycle still says two modules depend on each other),
    nor do two sub-packages (the package root, the facade over all of them, is a node of its own)."""
    graph = _grimp_graph(exclude_type_checking=False)
    modules = _without(graph, KNOWN_TYPE_ONLY_EDGES)
    assert cycles(modules) == []
    assert cycles(package_graph({module: Counter(targets) for module, targets in modules.items()})) == []


def test_the_cycle_check_sees_type_checking_imports():
    """The check above is not blind to type-only imports: the root package's ``if
    TYPE_CHECKING:`` import of ``flatpack.api`` is in its graph and not in the runtime one."""
    assert "flatpack.api" in _grimp_graph(exclude_type_checking=False)["flatpack"]
    assert "flatpack.api" not in _grimp_graph(exclude_type_checking=True)["flatpack"]


def test_cycles_are_found_where_they_are():
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert cycles({"a": ["b"], "b": []}) == []


def test_function_level_imports_count_and_type_checking_ones_do_not(tmp_path):
    package = tmp_path / "flatpack"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("from typing import TYPE_CHECKING\n"
                                    "if TYPE_CHECKING:\n    from flatpack import high\n")
    (package / "high.py").write_text("def f():\n    from flatpack.low import x\n    return x\n")
    graph = import_graph(package)
    assert set(graph["flatpack.high"]) == {"flatpack.low"}
    assert set(graph["flatpack.low"]) == set()


def test_the_import_graph_follows_an_edited_file(tmp_path):
    """The parse is cached by the source text (images read the graph on every build), so a
    file edited between two reads is read as it is now, however often it was read before."""
    package = tmp_path / "flatpack"
    package.mkdir()
    for name in ("__init__", "a", "b", "c"):
        (package / f"{name}.py").write_text("")
    (package / "a.py").write_text("from flatpack import b\n")
    assert set(import_graph(package)["flatpack.a"]) == {"flatpack.b"}
    assert set(import_graph(package)["flatpack.a"]) == {"flatpack.b"}    # the cached parse
    (package / "a.py").write_text("from . import c\nimport flatpack.b\n")
    assert set(import_graph(package)["flatpack.a"]) == {"flatpack.b", "flatpack.c"}
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flatpack import b\n")
    assert set(import_graph(package)["flatpack.a"]) == set()


# how the comment of an import inside a function begins: why it is not at module level
LAZY_REASONS = ("optional dependency", "start-up time")


def test_function_level_imports_are_found_with_the_comment_above_them_or_on_their_line(tmp_path):
    package = tmp_path / "flatpack"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "lazy.py").write_text(
        "import json\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from flatpack import other\n"
        "def grouped():\n"
        "    # start-up time: two lines of\n    # reasons\n"
        "    import csv\n    from decimal import (Decimal,\n                         Context)\n"
        "    try:\n        import tomllib\n    except ImportError:\n        import tomli as tomllib\n"
        "def inline():\n    import csv  # noqa: F401 - optional dependency: on its line\n"
        "def bare():\n    x = 1\n    import csv\n"
        "def directive_only():\n    import csv  # noqa: F401\n"
        "def separated():\n    # optional dependency: but a blank line follows\n\n    import csv\n")
    found = [(item.line, item.statement.split()[1], item.reason) for item in function_level_imports(package)]
    grouped = "start-up time: two lines of reasons"
    assert found == [(8, "csv", grouped), (9, "decimal", grouped), (12, "tomllib", grouped), (14, "tomli", grouped),
                     (16, "csv", "optional dependency: on its line"), (19, "csv", ""), (21, "csv", ""), (25, "csv", "")]


def test_every_function_level_import_says_why_it_is_not_at_module_level():
    """A lazy import is for an optional dependency or a measured start-up time, and its comment
    says which (`benchmarks/import_layers.py` lists them); one that dodges the layering would be
    a cycle, which the tests above and lint-imports refuse."""
    unexplained = [f"{item.module}:{item.line}: {item.statement}" for item in function_level_imports()
                   if not item.reason.startswith(LAZY_REASONS)]
    assert not unexplained, "imports inside a function whose comment does not start with " \
                            f"{' or '.join(LAZY_REASONS)} (move each to module level, or say why):\n" + \
                            "\n".join(unexplained)


def _imports(tree: ast.AST, inside_function: bool = False):
    """(imported module, whether the import runs inside a function) of every import in ``tree``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, inside_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.module, inside_function
        yield from _imports(node, inside_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


def test_the_stage_kernel_imports_only_the_standard_library_torch_and_safetensors():
    stage = ROOT / "stage"
    for path in sorted(stage.glob("*.py")):
        for name, inside_function in _imports(ast.parse(path.read_text(), str(path))):
            root = name.split(".")[0]
            if root == "flatpack":
                assert name.startswith("flatpack.stage") or name in KERNEL_FLATPACK, \
                    f"{module_name(path)} imports {name}, outside the kernel"
            else:
                allowed = KERNEL_THIRD_PARTY | (KERNEL_OPTIONAL if inside_function else set())
                assert root in sys.stdlib_module_names or root in allowed, \
                    f"{module_name(path)} imports {name}: the stage kernel runs on torch and safetensors alone"


def test_a_worker_starts_without_the_compiler():
    loaded = _run("import sys, flatpack.runtime.worker, flatpack.runtime.handler, flatpack.runtime.distributed\n"
                  "print(' '.join(sorted(m for m in sys.modules if m.startswith('flatpack'))))",
                  ROOT.parent).split()
    assert "flatpack.stage.artifact" in loaded and "flatpack.runtime.worker" in loaded
    assert not [name for name in loaded if name.startswith(COMPILER_SIDE)]


def test_the_public_names_load_on_first_use():
    assert "flatpack.compiler" not in _run("import sys, flatpack\nprint(' '.join(sys.modules))", ROOT.parent).split()
    from flatpack import api, compiler, weights
    from flatpack.partitioner.plan import Plan

    # flatpack.compile: the backends' capability check (api, above the backends), then the compiler's
    assert flatpack.compile is api.compile and flatpack.compile.__doc__ == compiler.compile.__doc__
    assert flatpack.load is compiler.load
    assert flatpack.Plan is Plan and flatpack.save_state_dict is weights.save_state_dict
    assert set(flatpack.__all__) <= set(dir(flatpack))
    with pytest.raises(AttributeError, match="no attribute 'compiel'"):
        flatpack.compiel  # noqa: B018


def _locked_distributions(lock: str) -> set[str]:
    text = (ROOT / "backends" / "locks" / lock).read_text()
    return {re.sub(r"[-_.]+", "-", name).lower() for name in re.findall(r"^([A-Za-z0-9_.-]+)==", text, re.M)}


def _module_level_imports(tree: ast.AST):
    """The modules a file imports when it is imported: its top level, and the bodies of
    top-level ``if``/``try`` blocks except ``if TYPE_CHECKING:``."""
    for node in getattr(tree, "body", ()):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.module
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            yield from _module_level_imports(ast.Module(body=node.body + node.orelse, type_ignores=[]))
        elif isinstance(node, ast.Try):
            yield from _module_level_imports(ast.Module(body=node.body, type_ignores=[]))


# what each image's processes import: the function's every role, the gpu-container rank
FUNCTION_ROLES = (*FUNCTION_ENTRIES, "flatpack.runtime.training", "flatpack.runtime.forkjoin",
                  "flatpack.runtime.profile_function", "flatpack.runtime.calibrate_function")


@pytest.mark.parametrize("modules, lock", [(FUNCTION_ROLES, "function.txt"), (RANK_ENTRIES, "gpu.txt")])
def test_what_an_image_imports_at_load_is_installed_in_it(modules, lock):
    """An image installs only its lock (torch, numpy, safetensors, boto3 for a function): the
    flatpack modules its roles load may import anything else (scipy, tqdm, ortools) only
    inside a function those roles never call."""
    installed = _locked_distributions(lock)
    providers = importlib.metadata.packages_distributions()
    loaded = _run(f"import sys, {', '.join(modules)}\n"
                  "print(' '.join(name for name in sys.modules if name.startswith('flatpack')))", ROOT.parent).split()
    for name in sorted(loaded):
        for imported in _module_level_imports(ast.parse(module_path(name).read_text())):
            root = imported.split(".")[0]
            if root == "flatpack" or root in sys.stdlib_module_names:
                continue
            distributions = {re.sub(r"[-_.]+", "-", dist).lower() for dist in providers.get(root, [root])}
            assert distributions & installed, f"{name} imports {imported} when loaded, but the {lock} image " \
                                              f"does not install {sorted(distributions)}"


def test_an_image_ships_what_its_entry_points_import_and_nothing_else(tmp_path):
    files = runtime_sources()
    shipped = set(files)
    assert "flatpack/runtime/handler.py" in shipped and "flatpack/stage/artifact.py" in shipped
    # the compiler, the solvers (ortools, optuna: not installed in an image) and the backends stay out
    assert not {"flatpack/compiler.py", "flatpack/cli.py", "flatpack/partitioner/solvers/miqp.py",
                "flatpack/backends/local.py"} & shipped
    assert len(shipped) == len(closure(FUNCTION_ENTRIES))
    for path, data in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
    # the shipped files alone import every role a function has (the profile role's imports included):
    # a module missing from them would load from the installed flatpack, outside the image
    out = _run("import sys, flatpack.runtime.handler, flatpack.runtime.fc_server, flatpack.runtime.training, "
               "flatpack.runtime.forkjoin, flatpack.runtime.profile_function, flatpack.runtime.calibrate_function\n"
               "print(' '.join(sorted(m.__file__ for n, m in sys.modules.items() if n.startswith('flatpack'))))",
               tmp_path)
    loaded = out.split()
    assert str(tmp_path / "flatpack" / "runtime" / "profile_function.py") in loaded
    outside = [path for path in loaded if not path.startswith(str(tmp_path))]
    assert not outside, f"modules missing from the image, loaded from the install: {outside}"
