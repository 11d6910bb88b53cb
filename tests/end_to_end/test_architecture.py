"""The package's modules import one another without a circle.

A circle hidden by an import inside a function (or under `TYPE_CHECKING`)
still ties two modules together: neither can be read, tested or moved
without the other, and the import order decides whether one of them sees
the other half-initialised. This test reads every module of
`keras_nanguard` with `ast` (no backend, nothing imported), takes every
import it makes of the package's own modules, at module level, inside
functions and under `TYPE_CHECKING` alike, and fails with the circle when
there is one.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.backend_free

PACKAGE = "keras_nanguard"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def _module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str | None:
    """The absolute name `from ... import` reads from (relative ones too)."""
    if not node.level:
        return node.module
    base = module.split(".")
    if path.name != "__init__.py":
        base.pop()  # a module's `.` is its package
    if node.level > 1:
        base = base[: -(node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _names(module: str, path: Path, node: ast.AST) -> list[str]:
    """What one statement imports, as dotted names: `from a import b` gives
    `a.b` (`b` may be a module of `a` or a name defined in it)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        source = _resolve(module, path, node)
        return [f"{source}.{alias.name}" for alias in node.names] if source else []
    return []


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `module` imports, anywhere in its source."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        for name in _names(module, path, node):
            # The deepest module of ours on the name: `from keras_nanguard.ops
            # import all_finite` imports `ops`, `from keras_nanguard import
            # snapshots` imports `snapshots`, `import keras_nanguard.a.b`
            # imports `a.b`.
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph, as the modules along it (first = last), or
    `None`. The package's `__init__` is a node like the others: it imports
    the modules whose names it exports, so a module that imports
    `keras_nanguard` itself (not in a doctest) closes a circle through it."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle through an edge, removed once found: how many there are."""
    graph = {k: set(v) for k, v in graph.items()}
    cycles = []
    while (cycle := find_cycle(graph)) is not None:
        cycles.append(cycle)
        graph[cycle[-2]].discard(cycle[-1])
    return cycles


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    # module level, `from keras_nanguard import module`
    assert "keras_nanguard.snapshots" in graph["keras_nanguard.nan_guard.callback"]
    # module level, `from keras_nanguard.module import name`
    assert "keras_nanguard.ops" in graph["keras_nanguard.snapshots"]
    # the package's exports
    assert "keras_nanguard.nan_guard" in graph["keras_nanguard"]
    assert len(graph) >= 30


def test_imports_inside_functions_and_dotted_ones_count(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from keras_nanguard.a import A\n"
        "def f():\n"
        "    import keras_nanguard.b\n"
        "    from keras_nanguard import c\n"
        "    from . import d\n"
        "    from .e import g\n"
        "    import keras_nanguard as ng\n"
        "    return '>>> from keras_nanguard import f'\n"
    )
    known = {PACKAGE, *(f"{PACKAGE}.{m}" for m in "abcdefm")}
    assert imports_of(f"{PACKAGE}.m", source, known) == {
        PACKAGE,
        *(f"{PACKAGE}.{m}" for m in "abcde"),
    }


def test_no_import_circle():
    graph = import_graph()
    cycles = all_cycles(graph)
    assert not cycles, "import circles among keras_nanguard's modules:\n" + "\n".join(
        "  " + " -> ".join(c) for c in cycles
    )


def test_a_circle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# ------------------------------------------------------------ backend seam
FRAMEWORKS = ("tensorflow", "jax", "jaxlib", "torch", "optree")
SEAM = f"{PACKAGE}._backend"


def backend_code(path: Path) -> list[str]:
    """Where a module outside the backend seam knows the backend: an import of
    a framework (anywhere in it) or a call of `keras.backend.backend()`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            names = []
        for name in names:
            if name.split(".")[0] in FRAMEWORKS:
                found.append(f"line {node.lineno}: import {name}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "backend"
            and ast.unparse(node.func.value) == "keras.backend"
        ):
            found.append(f"line {node.lineno}: keras.backend.backend()")
    return sorted(found, key=lambda where: int(where.split()[1].rstrip(":")))


def test_backend_code_only_in_the_seam():
    outside = {
        name: found
        for name, path in package_modules().items()
        if not (name == SEAM or name.startswith(SEAM + "."))
        and (found := backend_code(path))
    }
    assert not outside, "backend code outside keras_nanguard._backend:\n" + "\n".join(
        f"  {name}: {', '.join(found)}" for name, found in sorted(outside.items())
    )


def test_the_seam_check_sees_imports_and_calls(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import keras\n"
        "def f():\n"
        "    import torch.nn\n"
        "    from jax import numpy\n"
        "    return keras.backend.backend() == 'jax'\n"
    )
    assert backend_code(source) == [
        "line 3: import torch.nn",
        "line 4: import jax",
        "line 5: keras.backend.backend()",
    ]


OUTSIDE_TESTS = ("benchmarks", "notebooks", "examples")


def imports_of_tests(path: Path) -> list[str]:
    """The lines of `path` (a script or a notebook) that import `tests`."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        source = "\n".join(
            "".join(c["source"]) for c in cells if c["cell_type"] == "code"
        )
    else:
        source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(n == "tests" or n.startswith("tests.") for n in names):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_benchmarks_notebooks_and_examples_do_not_import_the_tests():
    # DESIGN: they run on their own; what they share with the tests lives with
    # them (notebooks/report_models.py, notebooks/run_corpus.py,
    # benchmarks/_launch.py) and the tests import it from there.
    top = ROOT.parent
    found = {
        str(path.relative_to(top)): lines
        for folder in OUTSIDE_TESTS
        for path in sorted((top / folder).rglob("*"))
        if path.suffix in (".py", ".ipynb") and (lines := imports_of_tests(path))
    }
    assert not found, f"imports of tests/: {found}"


def test_the_tests_import_check_sees_notebooks_and_late_imports(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import os\ndef f():\n    from tests import corpus\n")
    notebook = tmp_path / "n.ipynb"
    cells = [
        {"cell_type": "markdown", "source": ["import tests\n"]},
        {"cell_type": "code", "source": ["x = 1\n", "import tests.launch as t\n"]},
    ]
    notebook.write_text(json.dumps({"cells": cells}))
    assert imports_of_tests(script) == ["line 3: from tests import corpus"]
    assert imports_of_tests(notebook) == ["line 2: import tests.launch as t"]
