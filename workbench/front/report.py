"""results/index.html: every study's tables and charts in one page that opens offline.

Each study contributes a section built from its results files (never from notebook outputs or
logs). plotly.js is inlined once, with the first chart, so the charts work without a network.
Every section says where its figures come from: measured on this machine's CPU or GPU, or modelled.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import pandas as pd

from workbench.core.charts import table_html
from workbench.core.results import atomic_write_text, environment, now, results_root
from workbench.front.notebooks import STUDIES

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:12px;margin:0.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}
th{background:#f3f3f3}
.tag{display:inline-block;padding:1px 6px;border-radius:4px;font-size:12px;color:white}
.measured{background:#2ca02c}.modelled{background:#ff7f0e}.missing{background:#999}
pre{background:#f7f7f7;padding:0.5em;overflow-x:auto}
.findings td,.findings th{text-align:left;font-size:14px;max-width:600px}
.wide{overflow-x:auto;max-width:100%}
"""


def findings_html() -> tuple[str, dict[str, Any]]:
    """The report's opening: what we found per study, each beside the published claim; and the
    results each study's section is built from (loaded once)."""
    results = {nb.study: nb.load() for nb in STUDIES.values()}
    rows = []
    for nb in STUDIES.values():
        result = results[nb.study]
        found = nb.figures.findings(result) if result is not None else [("not run yet: run its notebook", "")]
        for i, (what, claim) in enumerate(found):
            study = html.escape(nb.title) if i == 0 else ""
            rows.append(f"<tr><td>{study}</td><td>{html.escape(what)}</td><td>{html.escape(claim)}</td></tr>")
    table = ('<table class="findings"><tr><th>study</th><th>what we found</th><th>the published claim</th></tr>'
             + "".join(rows) + "</table>")
    return table, results


def write_report(path: str | Path | None = None) -> Path:
    path = Path(path or results_root() / "index.html")
    env = environment()
    body: list[str] = []
    first_fig = True
    found, results = findings_html()
    for nb in STUDIES.values():
        parts = nb.figures.report_section(results[nb.study])
        body.append(f"<h2>{html.escape(nb.title)}</h2>")
        if not parts:
            body.append('<p><span class="tag missing">not run</span> no results yet: run its notebook.</p>')
            continue
        for kind, sub, obj in parts:
            if sub:
                body.append(f"<h3>{html.escape(sub)}</h3>")
            if kind == "table":
                body.append(table_html(obj))
            elif kind == "figure":
                body.append(obj.to_html(full_html=False, include_plotlyjs=first_fig, default_width="100%"))
                first_fig = False
            else:
                body.append(f"<div>{obj}</div>")
    reproduce = results_root() / "reproduce.json"
    runs = json.loads(reproduce.read_text()).get("notebooks", []) if reproduce.exists() else []
    runs = pd.DataFrame(runs)  # each notebook's latest run (an earlier call's where this one ran others)
    # quick: a run on the tiny parameters (--quick), whose study's section is that run's (a call of some
    # notebooks keeps the others' rows: a quick one's study read as the full one's)
    runs_html = table_html(runs[[c for c in ("name", "status", "quick", "started", "seconds", "output") if c in runs]]) \
        if len(runs) else ""
    gpu = "no GPU" if env.get("gpu") in (None, "none") else f"GPU {html.escape(str(env['gpu']))}"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>Workbench report</title>
<style>{_CSS}</style></head><body>
<h1>Memory-constrained training workbench: report</h1>
<h2>What we found</h2>{found}
<p>Written {now()} on this machine ({gpu}; CPU {html.escape(str(env.get('cpu')))} with
{env.get('cpu_count')} cores). Figures tagged <span class="tag measured">measured</span> were measured
where their study ran: each run's machine is in its row of <code>results/&lt;study&gt;/runs.csv</code>
(<code>env_gpu</code>, <code>env_cpu</code>), which is this one unless the results were brought from
another; <span class="tag modelled">modelled</span> figures come from a performance model and were not
measured on the hardware they describe.</p>
<h3>Environment</h3><pre>{html.escape(json.dumps(env, indent=1))}</pre>
{('<h3>Notebooks executed</h3>' + runs_html) if runs_html else ''}
{''.join(body)}
</body></html>"""
    return atomic_write_text(path, page)
