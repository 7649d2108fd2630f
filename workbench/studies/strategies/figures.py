"""Plotly figures of the studies' DataFrames: the notebooks and the report call these.

Figures are built from results tables only (nothing is scraped from logs). The default
renderer is set to `plotly_mimetype`, so an executed notebook stores each chart as JSON data
(rendered by JupyterLab and Voila) instead of embedding the 5 MB plotly.js bundle per chart;
the HTML report includes plotly.js once.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

pio.renderers.default = "plotly_mimetype"
pio.templates.default = "plotly_white"


def loss_curves(steps: pd.DataFrame, *, color: str = "strategy", title: str = "Training loss") -> go.Figure:
    """Loss against tokens seen, one line per (color, seed) run."""
    fig = go.Figure()
    if steps.empty:
        return fig.update_layout(title=f"{title} (no steps recorded)")
    group_cols = [c for c in (color, "seed", "device") if c in steps]
    for key, g in steps.groupby(group_cols, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        label = " ".join(f"{v}" if c == color else f"{c}={v}" for c, v in zip(group_cols, key))
        fig.add_trace(go.Scatter(x=g["tokens"], y=g["loss"], mode="lines", name=label,
                                 legendgroup=str(key[0])))
    return fig.update_layout(title=title, xaxis_title="tokens seen", yaxis_title="loss (nats/token)")


def perplexity_spread(df: pd.DataFrame, *, title: str = "Held-out perplexity after fine-tuning") -> go.Figure:
    """Per-seed held-out perplexity as points, the mean as a bar, the base model as a dashed line."""
    ok = df[df["status"].isin(["ok", "fallback"])]
    fig = go.Figure()
    if ok.empty:
        return fig.update_layout(title=f"{title} (no run finished)")
    order = list(dict.fromkeys(ok["strategy"]))
    mean = ok.groupby("strategy")["ppl_after"].mean().reindex(order)
    std = ok.groupby("strategy")["ppl_after"].std().reindex(order).fillna(0)
    fig.add_trace(go.Bar(x=order, y=mean, error_y=dict(type="data", array=std), name="mean ± std over seeds",
                         opacity=0.6))
    fig.add_trace(go.Scatter(x=ok["strategy"], y=ok["ppl_after"], mode="markers", name="one seed",
                             marker=dict(color="black", size=7)))
    base = ok["ppl_before"].median()
    fig.add_hline(y=base, line_dash="dash", annotation_text=f"base model {base:.1f}")
    return fig.update_layout(title=title, yaxis_title="perplexity (lower is better)")


def device_timeline(df: pd.DataFrame, *, title: str = "Where each run ended up") -> go.Figure:
    """One bar per run coloured by its final status, hover showing the device history."""
    colors = {"ok": "#2ca02c", "fallback": "#ff7f0e", "oom": "#d62728", "skipped": "#7f7f7f", "error": "black"}
    fig = go.Figure()
    for status, g in df.groupby("status"):
        fig.add_trace(go.Bar(
            x=g["strategy"] + " s" + g["seed"].astype(str), y=[1] * len(g), name=status,
            marker_color=colors.get(status, "blue"), hovertext=g["device_history"], hoverinfo="text+name",
        ))
    return fig.update_layout(title=title, barmode="stack", yaxis=dict(visible=False), height=300)
