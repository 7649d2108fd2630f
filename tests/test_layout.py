"""The layout is the architecture: core <- studies <- front <- cli, no cycles, no hidden imports.

    .venv/bin/python -m pytest tests/test_layout.py -q        # a second

Read from the source (ast), not from what happens to be imported: every `import workbench...`
at a module's top level is an edge of the graph. The graph must be acyclic; a lower layer never
imports a higher one (core knows no study; a study knows no other study and nothing of front);
and no function imports a workbench module (an import inside a function is how a cycle hides).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "workbench"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The module a dotted import name refers to (a name imported from a package is its module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path, module: str = "workbench.probe") -> tuple[set[str], list[str]]:
    """(workbench modules imported outside functions, workbench imports inside functions).

    Outside functions means anywhere in the module's own code: inside `try:`, `if TYPE_CHECKING:` or a
    class body too (such an import is an edge all the same); relative imports are resolved from
    `module`'s package. Only `tree.body`'s plain statements had been read, so an import in a `try:`
    or `if` block was no edge at all and a relative one no import."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top, nested = set(), []

    def names(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            return [f"{base}.{a.name}" for a in node.names]
        return []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for n in names(child):
                if not n.startswith("workbench"):
                    continue
                if inside:
                    nested.append(f"{path.name}:{child.lineno} {n}")
                elif _resolve(n):
                    top.add(_resolve(n))
            visit(child, inside)

    visit(tree, False)
    return top, nested


GRAPH = {m: _imports(p, m)[0] - {m} for m, p in MODULES.items()}


def _layer(module: str) -> tuple[int, str]:
    if module == "workbench":  # the root package: only __version__
        return 0, "core"
    parts = module.split(".")
    if len(parts) > 1 and parts[1] == "core":
        return 0, "core"
    if len(parts) > 2 and parts[1] == "studies":
        return 1, parts[2]
    if len(parts) > 1 and parts[1] == "front":
        return 2, "front"
    return 3, module  # workbench, workbench.cli, workbench.__main__, workbench.studies


def test_the_layout_has_the_three_layers_and_each_study_the_same_shape():
    assert {"workbench.core.config", "workbench.core.results", "workbench.core.memory.predict",
            "workbench.front.notebooks", "workbench.front.report", "workbench.front.sweep"} <= set(MODULES)
    for study in ("strategies", "ladder", "split"):
        for part in ("config", "runner", "figures"):
            assert f"workbench.studies.{study}.{part}" in MODULES, (study, part)


def test_no_module_imports_a_workbench_module_inside_a_function():
    nested = [hit for m, p in MODULES.items() for hit in _imports(p, m)[1]]
    assert nested == []


def test_imports_go_down_the_layers_only():
    wrong = []
    for module, deps in GRAPH.items():
        level, group = _layer(module)
        for dep in deps:
            dlevel, dgroup = _layer(dep)
            if dlevel > level or (level == dlevel == 1 and dgroup != group):
                wrong.append(f"{module} -> {dep}")
    assert wrong == []


def test_the_import_graph_has_no_cycle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str):
        state[m] = 1
        stack.append(m)
        for d in sorted(GRAPH.get(m, ())):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_checker_finds_a_cycle_and_a_nested_import(tmp_path):
    """The checks above can fail: a module that imports inside a function is found, and so is a cycle."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from workbench.core import config\n")
    assert _imports(bad)[1] and "workbench.core.config" not in _imports(bad)[0]
    # imports in a try or TYPE_CHECKING block, in a class body, or relative, are edges too
    hidden = tmp_path / "hidden.py"
    hidden.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from workbench.front import sweep\n"
                      "try:\n    import workbench.front.live\nexcept ImportError:\n    pass\n"
                      "class A:\n    from ..front import panel\n"
                      "from . import results\n")
    assert _imports(hidden, "workbench.core.probe") == (
        {"workbench.front.sweep", "workbench.front.live", "workbench.front.panel", "workbench.core.results"}, [])
    GRAPH["workbench.core.config"].add("workbench.core.results")
    GRAPH["workbench.core.results"].add("workbench.core.config")
    try:
        with pytest.raises(pytest.fail.Exception, match="import cycle"):
            test_the_import_graph_has_no_cycle()
    finally:
        GRAPH["workbench.core.config"].discard("workbench.core.results")
        GRAPH["workbench.core.results"].discard("workbench.core.config")


def test_python_m_workbench_works_like_the_command():
    out = subprocess.run([sys.executable, "-m", "workbench", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "reproduce" in out.stdout and "strategies" in out.stdout


def test_no_module_is_over_400_lines_without_a_reason_in_its_docstring():
    long = []
    for module, path in MODULES.items():
        n = len(path.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if n > 400 and "over 400 lines" not in doc:
            long.append(f"{module}: {n} lines")
    assert long == []


def test_every_file_beside_the_modules_is_named_for_a_wheel():
    """A built wheel carries a package's .py files and only the others pyproject names: study 3's
    GPU profiles had been left out of one, as the dashboard's Voila template would be."""
    import tomllib

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["workbench"]
    named = {p for pattern in patterns for p in PACKAGE.glob(pattern) if p.is_file()}
    others = {p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".py"}
    assert sorted(str(p.relative_to(PACKAGE)) for p in others - named) == []
