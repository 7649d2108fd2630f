"""Study 3's notebook runs headless through papermill on tiny parameters and writes results.

    .venv/bin/python -m pytest tests/test_split_notebook.py -q
"""

from __future__ import annotations

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
