"""Study 3's notebook runs headless through papermill on tiny parameters and writes results; no
study notebook's cell leaves a name that a second Run All refuses; study 3's texts and charts say
whose figures they show and label their axes.

    .venv/bin/python -m pytest tests/test_split_notebook.py -q
"""

from __future__ import annotations

import ast
import re
import symtable
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from conftest import executed_plots

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "03_split.ipynb"
PLOTLY, WIDGET = "application/vnd.plotly.v1+json", "application/vnd.jupyter.widget-view+json"
TINY = {"base_size": "tiny", "micro_batch": 2, "seq_len": 16, "steps": 4, "untimed_steps": 1,
        "k_sweep": [0.0, 1.0], "modelled_k_points": 3, "host_share": 0.8, "eval_blocks": 4}


@pytest.mark.slow
def test_notebook_runs_on_tiny_parameters(tmp_path, monkeypatch, tiny_base):
    import papermill as pm

    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path / "results"))
    out = tmp_path / "03_split.ipynb"
    pm.execute_notebook(str(NOTEBOOK), str(out), parameters=TINY, cwd=str(ROOT), progress_bar=False)
    assert out.stat().st_size < 3 * 2**20  # plotly JSON per chart, no plotly.js bundle
    live_outputs, others = executed_plots(out)
    assert len(others) >= 7
    assert len(live_outputs) == 1  # redrawn in place, not appended
    # the live chart's final state: every iteration of every measured run
    live = live_outputs[-1]
    loss = {t["name"]: t["y"] for t in live["data"] if t.get("xaxis", "x") == "x" and t.get("y")}
    assert set(loss) == {"k=0", "k=1", "adaptive"}  # the engine's runs
    assert all(len(y) == TINY["steps"] for y in loss.values())
    last = nbformat.read(out, as_version=4).cells[-1]
    assert any(WIDGET in o.get("data", {}) for o in last.get("outputs", []))  # the app(cfg) panel
    runs = pd.read_csv(tmp_path / "results" / "split" / "runs.csv")
    assert set(runs["source"]) == {"measured", "modelled", "published"}
    assert (runs.loc[runs["source"] == "measured", "status"] == "ok").all()


# ------------------------------------------------------------------------------------------------
# a second Run All in the same kernel: the config cell reads every global the first run left


def _bound(source: str) -> set[str]:
    """The module-level names a cell's source binds (assignments, for and with targets, imports,
    a walrus anywhere); a comprehension's or generator's own variables are not among them."""
    top = symtable.symtable(source, "<cell>", "exec")
    return {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}


def _imports(source: str) -> str:
    return "\n".join(ast.unparse(n) for n in ast.parse(source).body if isinstance(n, (ast.Import, ast.ImportFrom)))


@pytest.mark.parametrize("name", ["01_strategies", "02_ladder", "03_split"])
def test_no_cell_leaves_a_name_a_second_run_all_refuses(name):
    """The namespace the config cell sees on a second Run All (the parameters cell's defaults, and
    whatever the first run's later cells bound) must make a config: cell 6 of notebook 03 left its
    loop's `caption` and `runs`, and SplitConfig.from_namespace refused them ("unknown parameters
    for SplitConfig: caption, runs"). No later cell may bind a parameter's name either (it would
    replace the parameter on the second run without a word)."""
    from workbench.core.results import StudyResult
    from workbench.front.live import LiveChart
    from workbench.front.notebooks import STUDIES, notebook

    study = STUDIES[name]
    cells = [c for c in notebook(study).cells if c.cell_type == "code"]
    params = next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", []))
    namespace: dict = {}
    exec(cells[params].source, namespace)  # the defaults
    later = [c.source for i, c in enumerate(cells) if i != params]
    bound = set().union(*map(_bound, later))
    assert not bound & set(study.config.fields()), "a cell binds a parameter's name"
    for source in later:
        exec(_imports(source), namespace)  # what the imports bind: modules, classes, functions
    # what the cells make from the config: workbench objects, which from_namespace leaves out
    made = {"cfg": study.config, "live": LiveChart, "result": StudyResult}
    for n in bound - set(namespace):
        namespace[n] = made[n].__new__(made[n]) if n in made else "a value the cell left"
    study.config.from_namespace(namespace)  # raises ConfigError on a name the first run left


def test_the_run_tables_cell_shows_one_table_per_source():
    """The cell that replaced the loop (one expression, nothing left behind) still shows each
    source's table under its caption."""
    from workbench.core.results import StudyResult
    from workbench.studies.split import figures

    source = next(code for _, code in figures.NOTEBOOK if "run_tables" in code)
    runs = pd.DataFrame({"source": ["measured", "modelled"], "run": ["k=0", "A100: adaptive"],
                         "status": ["ok", "oom"], "tokens_per_s": [10.0, float("nan")]})
    shown: list = []
    namespace = {"figures": figures, "result": StudyResult("split", runs), "table": lambda df, caption: (caption, df),
                 "display": lambda *objs: shown.extend(objs)}
    before = set(namespace)
    exec(source, namespace)
    assert set(namespace) - before <= {"__builtins__"}  # no name left behind
    assert [c for c, _ in shown] == [figures.RUN_TABLES["measured"], figures.RUN_TABLES["modelled"]]
    assert list(shown[0][1]["run"]) == ["k=0"] and list(shown[1][1]["run"]) == ["A100: adaptive"]
    # each table keeps only the columns its rows fill: the modelled run has no throughput
    assert "tok/s" in shown[0][1] and "tok/s" not in shown[1][1]


# ------------------------------------------------------------------------------------------------
# study 3's texts and charts


def test_the_intro_speaks_of_the_development_machine_not_the_readers():
    """"this CPU" was the author's machine, not the reader's; a record the text cites exists."""
    from workbench.studies.split import figures

    intro = " ".join(figures.NOTEBOOK_INTRO.split())
    assert "this CPU" not in intro
    assert "on the development machine's CPU" in intro
    cited = re.findall(r"`(data/measured/[^`]+)`", intro)
    assert cited and all((ROOT / c).is_dir() for c in cited)


def _panel_texts(fig) -> list[str]:
    return [a.text for a in fig.layout.annotations]


def test_timeline_rows_say_measured_or_modelled_without_plotlys_prefix():
    from workbench.core.results import StudyResult
    from workbench.studies.split import figures

    rows = [("measured", "k=0"), ("measured", "adaptive"), ("modelled", "H100-PCIe: adaptive")]
    timeline = pd.DataFrame([{"source": s, "run": r, "lane": lane, "activity": lane, "what": lane,
                              "start_ms": 0.0, "duration_ms": 5.0} for s, r in rows for lane in ("accelerator", "host")])
    fig = figures.timeline_figure(StudyResult("split", pd.DataFrame(), tables={"timeline": timeline}))
    texts = _panel_texts(fig)
    assert sorted(texts) == sorted(f"{s}: {r}" for s, r in rows)  # not "run=modelled: H100-PCIe: adaptive"


def test_loss_and_k_axes_say_what_they_show_with_units():
    from workbench.core.results import StudyResult
    from workbench.studies.split import figures

    steps = pd.DataFrame({"iteration": [0, 1, 0, 1], "run": ["k=0", "k=0", "adaptive", "adaptive"],
                          "loss": [4.0, 3.9, 4.0, 3.9], "k_actual": [0.0, 0.0, 0.5, 0.4]})
    result = StudyResult("split", pd.DataFrame(), steps=steps)
    assert figures.loss_figure(result).layout.yaxis.title.text == "loss (nats/token)"  # as studies 1 and 2
    assert figures.k_figure(result).layout.yaxis.title.text == "k (share of parameters updated on the accelerator)"


def test_the_verdict_names_the_host_of_each_modelled_alpha(monkeypatch):
    """"Modelled alpha: 0.106, 0.238" did not say which host each was; now each follows its host."""
    from workbench.core.common import figure_text
    from workbench.studies.split import perf_model

    monkeypatch.setattr(perf_model, "FINE_SEQ", (128, 512))  # the band's grid: two points are enough here
    verdict = perf_model.seed_verdict({"bandwidth_share": 0.5, "per_core_bytes_per_s": 10e9})
    alphas = {v["host"]: figure_text(v["alpha_modelled"]) for v in verdict["verdicts"]}  # as the tables show it
    assert len(alphas) >= 2 and len(set(alphas.values())) == len(alphas)  # hosts told apart by their alpha
    said = re.search(r"Modelled alpha, per host: (.*) against the seed's", verdict["text"]).group(1)
    assert said == ", ".join(f"{host} {alpha}" for host, alpha in alphas.items())


def test_the_validation_table_keeps_each_rows_own_digits():
    """Its rows mix seconds and TFLOP/s: 40 TFLOP/s read "40.00", its decimals those of 0.25 s."""
    from workbench.core.results import StudyResult
    from workbench.studies.split.figures import validation_table

    v = pd.DataFrame({"source": ["a", "b"], "metric": ["offload time (s)", "TFLOP/s"], "published": [0.25, 40.0],
                      "modelled": [0.4312, 53.61], "error_pct": [72.5, 34.0]})
    t = validation_table(StudyResult("split", runs=pd.DataFrame(), tables={"validation": v}))
    assert t["published"].tolist() == ["0.25", "40"] and t["modelled"].tolist() == ["0.431", "53.6"]
