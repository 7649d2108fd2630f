"""Study 2's notebook runs headless through papermill on tiny parameters and writes results.

    .venv/bin/python -m pytest tests/test_ladder_notebook.py -q        # about 60 s
"""

from __future__ import annotations

import html
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from conftest import executed_plots

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "02_ladder.ipynb"
PLOTLY, WIDGET = "application/vnd.plotly.v1+json", "application/vnd.jupyter.widget-view+json"
# Few rungs and a short reference sequence: each Qwen2-0.5B prediction still costs ~2-3 s here.
TINY = {"base_size": "tiny", "rungs": ["fp32", "bf16_ckpt", "zero_offload", "cpu"], "micro_batch": 4, "seq_len": 64,
        "steps": 2, "budget_mib": 3.0, "reference_seq_len": 32, "breakdown_rung": "bf16_ckpt", "threads": 1}


@pytest.mark.slow
def test_notebook_runs_on_tiny_parameters(tiny_base, tmp_path, monkeypatch):
    import papermill as pm

    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path / "results"))
    out = tmp_path / "02_ladder.ipynb"
    pm.execute_notebook(str(NOTEBOOK), str(out), parameters=TINY, cwd=str(ROOT), progress_bar=False)
    assert out.stat().st_size < 3 * 2**20  # plotly JSON per chart, no plotly.js bundle
    live_outputs, others = executed_plots(out)
    assert len(others) == 5  # ladder, loss per rung, breakdown, published table, estimators
    assert len(live_outputs) == 1  # redrawn in place, not appended
    # the live chart's final state: every step of every measured rung, and the budget line
    live = live_outputs[-1]
    loss = {t["name"]: t["y"] for t in live["data"] if t.get("xaxis", "x") == "x" and t.get("y")}
    # auto-fit runs the setup its joint search chose (pure bf16, 1 x 4 accumulation at this budget)
    fitted = [n for n in loss if n.endswith(" auto-fit")]
    assert set(loss) - set(fitted) == {"fp32 ladder", "bf16_ckpt ladder", "cpu ladder"}
    assert fitted == ["bf16-true, adamw_fused, full, micro-batch 1 x 4 auto-fit"]  # --optimizer's name
    assert all(len(y) == TINY["steps"] for y in loss.values())
    assert any(s.get("y0") == TINY["budget_mib"] for s in live["layout"]["shapes"])
    last = nbformat.read(out, as_version=4).cells[-1]
    assert any(WIDGET in o.get("data", {}) for o in last.get("outputs", []))  # the app(cfg) panel
    (run_dir,) = (tmp_path / "results" / "ladder").glob("ladder-*")
    df = pd.read_csv(run_dir / "ladder.csv")
    hand = df[df["role"] == "at hand"].set_index("rung")
    assert hand.loc["zero_offload", "status"] == "skipped" and hand.loc["zero_offload", "method"] == "predicted"
    # the tables show every text whole (pandas' display cut the reason at 50 characters)
    shown = "".join(o["data"].get("text/html", "") for c in nbformat.read(out, as_version=4).cells
                    for o in c.get("outputs", []) if "data" in o)
    reason = hand.loc["zero_offload", "reason"]
    assert len(reason) > 50 and html.escape(reason) in shown
    ok = hand[(hand["status"] == "ok") & (hand.index != "cpu")]
    assert len(ok) == 2
    assert ((ok["predicted_peak_bytes"] / ok["measured_peak_bytes"] - 1).abs() < 0.01).all()
    ref = df[df["role"] == "reference"]
    assert len(ref) == len(TINY["rungs"]) and (ref["predicted_peak_bytes"] > 0).sum() == 3  # cpu: 0 on the device
    assert len(pd.read_csv(run_dir / "baselines.csv")) >= 4
