"""The study notebooks are generated from their study's config and committed as generated.

    .venv/bin/python -m pytest tests/test_notebooks.py -q        # seconds

Moved here from the per-study notebook tests (their shape assertions are kept): each notebook's
parameters cell is 1:1 with its config, every parameter has a help comment, the defaults make a
valid config, code cells hold no logic and no outputs. New: the committed notebooks are exactly
what `workbench.front.notebooks` generates (so they cannot drift from the configs), and papermill
parses every parameters line (no "Unable to parse line" warnings).
"""

from __future__ import annotations

import ast
import logging

import nbformat
import pytest
from papermill.translators import PythonTranslator

from workbench.core.config import Config, param
from workbench.front.notebooks import STUDIES, notebook_text, parameters_cell

NAMES = list(STUDIES)


def _params_cell(nb):
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1
    return cells[0]


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_is_the_generated_one(name):
    study = STUDIES[name]
    assert study.path.read_text() == notebook_text(study), \
        f"{study.path.name} differs from its config: run `python -m workbench.front.notebooks`"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_shape(name):
    study = STUDIES[name]
    nb = nbformat.read(study.path, as_version=4)
    params = _params_cell(nb)
    body = ast.parse(params.source).body
    names = [t.id for node in body for t in node.targets]
    assert names == list(study.config.fields())  # 1:1 with the config, in its order
    for line in params.source.splitlines()[1:]:
        assert "  # " in line, f"parameter without a help comment: {line}"
    study.config.from_dict({node.targets[0].id: ast.literal_eval(node.value) for node in body})  # valid defaults
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None  # committed clean
            tree = ast.parse(cell.source)
            assert not [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Lambda))]
    assert nb.cells[-1].source == "app(cfg)"
    live = next(c for c in nb.cells if "LiveChart(" in c.source)
    assert "with LiveChart(" in live.source  # the cell's only output is the live chart, closed on leaving
    assert not [c for c in nb.cells if c.cell_type == "markdown" and "\\n" in c.source]  # no escaped newlines shown


@pytest.mark.parametrize("name", NAMES)
def test_papermill_parses_every_parameter_line(name, caplog):
    nb = nbformat.read(STUDIES[name].path, as_version=4)
    with caplog.at_level(logging.WARNING, logger="papermill"):
        params = PythonTranslator.inspect(_params_cell(nb))
    assert not [r for r in caplog.records if "Unable to parse" in r.getMessage()]
    assert [p.name for p in params] == list(STUDIES[name].config.fields())


def test_an_equals_sign_in_a_help_text_is_what_papermill_cannot_parse(caplog):
    text = parameters_cell(STUDIES["03_split"].config)
    assert "max_grad_norm = 0.0  # " in text and "(0: off)" in text
    cell = nbformat.v4.new_code_cell(text.replace("(0: off)", "(0 = off)"))
    with caplog.at_level(logging.WARNING, logger="papermill"):
        PythonTranslator.inspect(cell)
    assert any("Unable to parse" in r.getMessage() for r in caplog.records)  # the fault the writer avoids


def test_the_generator_rewrites_an_equals_sign_in_a_help_text(caplog):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Demo(Config):
        clip: float = param(0.0, "clipping (0 = off)")

    text = parameters_cell(Demo)
    assert "clip = 0.0  # clipping (0 is off)" in text
    with caplog.at_level(logging.WARNING, logger="papermill"):
        assert [p.name for p in PythonTranslator.inspect(nbformat.v4.new_code_cell(text))] == ["clip"]
    assert not caplog.records
