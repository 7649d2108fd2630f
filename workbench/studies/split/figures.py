"""Study 3's charts, tables and report section: used alike by notebook 03, the widget app and the report.

Every function takes the study's result (`run_split_study(cfg)`, or `load_result()` for the report).
Rows and panels say whether their figures were measured on this machine, modelled for a named GPU
or published.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from workbench.core.charts import rounded
from workbench.core.claims import published
from workbench.core.common import figure_text
from workbench.core.results import StudyResult

# k_actual and tokens_per_s: the whole run after warm-up (an adaptive run's mix its search's ks); settled_*:
# after its last move of k
RUN_COLUMNS = ["hardware", "run", "mode", "recompute", "status", "k_actual", "tokens_per_s", "settled_k",
               "settled_tokens_per_s", "tflops", "accel_idle_share", "host_done_before_bwd_end_share", "first_loss",
               "final_loss", "ppl_before", "ppl_after", "max_abs_diff_vs_adamw", "accel_memory_gib", "reason"]
RUN_TABLES = {"measured": "Measured runs (this machine; k_actual: the share of parameters updated on the accelerator, "
                          "in whole layers, so near a static run's k, not at it)",
              "modelled": "Modelled runs (performance model; oom: the modelled card's memory does not fit)",
              "published": "Published claims (the seed's own figures, not measured here)"}
KEY_MODES = ["host only (k=0)", "adaptive", "ZeRO-Offload", "all on accelerator", "plain AdamW"]


def _facts(result: StudyResult) -> dict[str, Any]:
    return result.facts.get("host_and_published", {})


def runs_table(result: StudyResult, source: str | None = None) -> pd.DataFrame:
    """One row per run (`source`: measured, modelled or published; None: all)."""
    df = result.runs if source is None else result.runs[result.runs["source"] == source]
    return rounded(df[[c for c in ["source", *RUN_COLUMNS] if c in df]].dropna(axis=1, how="all"))


def run_tables(result: StudyResult) -> list[tuple[str, pd.DataFrame]]:
    """(caption, table) per source of the runs, as the report shows them: each table keeps only the
    columns its rows fill (one table of every run was 17 columns wide, its status off the screen)."""
    return [(caption, runs_table(result, source)) for source, caption in RUN_TABLES.items()
            if (result.runs["source"] == source).any()]


def _panels(fig: go.Figure, n: int, cols: int) -> go.Figure:
    """A faceted figure that stays readable: each row of panels 300 px tall, every panel with its own
    tick labels, and panel titles without plotly express's "panel=" prefix."""
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
    fig.update_xaxes(showticklabels=True)
    fig.update_yaxes(matches=None, showticklabels=True)
    return fig.update_layout(height=160 + 300 * max(1, -(-n // cols)))


def _adaptive_at(df: pd.DataFrame, settled: bool) -> pd.DataFrame:
    """A measured adaptive run's point on a chart against k: where it settled (`settled`: its k and
    tokens/s after its last move), else at its whole run's mean k, a k it may never have used, labelled so."""
    df = df.copy()
    adaptive = df["mode"].eq("adaptive") & df["source"].eq("measured")  # a modelled one runs at one k
    there = adaptive & df["settled_k"].notna() if settled and "settled_k" in df else adaptive & False
    if there.any():
        df.loc[there, "k_actual"] = df.loc[there, "settled_k"]
        df.loc[there, "tokens_per_s"] = df.loc[there, "settled_tokens_per_s"]
    df.loc[there, "mode"] = "adaptive (where it settled)"
    df.loc[adaptive & ~there, "mode"] = "adaptive (its run's mean k: a mix of the ks it tried)"
    return df


def throughput_figure(result: StudyResult) -> go.Figure:
    """Tokens/s against k, one panel per machine; each panel's title says measured or modelled."""
    df = _adaptive_at(result.runs, settled=True)
    speed = df[df["source"] != "published"].dropna(subset=["tokens_per_s"])
    fig = px.scatter(speed, x="k_actual", y="tokens_per_s", color="mode", symbol="mode", facet_col="panel",
                     facet_col_wrap=2, facet_row_spacing=0.14, hover_data=["run", "status"],
                     labels={"k_actual": "k (share of parameters updated on the accelerator)",
                             "tokens_per_s": "tokens/s"},
                     title="Tokens/s against k (panels: measured on this machine, or modelled for a GPU profile)")
    fig.update_traces(marker_size=10)
    return _panels(fig, speed["panel"].nunique(), 2)


def tflops_figure(result: StudyResult) -> go.Figure:
    """TFLOP/s of the key runs (measured, modelled) beside the seed's published figure (oom rows have none)."""
    df = result.runs
    # the seed's claim and the model's run at its setting: a column of their own (the hardware text's
    # suffix had been matched)
    published = df["published_setting"].eq(True) if "published_setting" in df else df["source"] == "published"
    rows = df.dropna(subset=["tflops"])
    key = rows[rows["mode"].isin(KEY_MODES) | published.reindex(rows.index)]
    # a source none of whose runs is of a key mode (a sweep of static k only) shows the runs it has
    key = pd.concat([key, rows[~rows["source"].isin(key["source"])]])
    fig = px.bar(key, x="run", y="tflops", color="source", facet_col="source", hover_data=["status", "k_actual"],
                 title="TFLOP/s of the key runs: measured here, modelled for a GPU profile, or published (the seed's)",
                 labels={"tflops": "TFLOP/s", "run": ""})
    fig.update_xaxes(matches=None)
    return _panels(fig, 1, 1)


def idle_figure(result: StudyResult) -> go.Figure:
    """The share of an iteration the accelerator waits for the host, against k."""
    df = _adaptive_at(result.runs, settled=False)  # its idle share is its whole run's
    idle = df[df["source"] != "published"].dropna(subset=["accel_idle_share"])
    idle = idle.assign(accel_idle_pct=100 * idle["accel_idle_share"])  # in %, as the runs table shows it
    fig = px.scatter(idle, x="k_actual", y="accel_idle_pct", color="mode", symbol="status", facet_col="panel",
                     facet_col_wrap=2, facet_row_spacing=0.14,
                     labels={"k_actual": "k", "accel_idle_pct": "accelerator idle (%)"},
                     title="Accelerator idle share against k (oom rows: modelled memory does not fit)")
    return _panels(fig.update_traces(marker_size=10), idle["panel"].nunique(), 2)


def timeline_figure(result: StudyResult) -> go.Figure:
    """Backward, transfers and updates of one iteration on each side (measured and modelled)."""
    timeline = result.tables.get("timeline", pd.DataFrame())
    if timeline.empty:
        return go.Figure().update_layout(title="Timeline of one iteration (nothing recorded)")
    tl = timeline[timeline["run"].isin(["k=0", "adaptive"]) | (timeline["source"] == "modelled")]
    # each row's facet says its source: a modelled run's name ("A100-80GB-PCIe: adaptive") read as a measurement
    tl = tl.assign(run=tl["source"] + ": " + tl["run"])
    fig = px.bar(tl, x="duration_ms", y="lane", base="start_ms", color="activity", orientation="h",
                 facet_row="run", hover_data=["what", "source"],
                 labels={"duration_ms": "ms", "lane": ""}, title="Timeline of one iteration (each row: measured or modelled)")
    fig.update_xaxes(matches=None)
    return _panels(fig, tl["run"].nunique(), 1)  # row labels "measured: k=0", not "run=measured: k=0"


def loss_figure(result: StudyResult) -> go.Figure:
    """The measured runs' loss per iteration (the same text blocks from the same weights)."""
    steps = result.steps
    if not {"iteration", "loss", "run"} <= set(steps.columns):
        return go.Figure().update_layout(title="Training loss (no measured run)")
    return px.line(steps, x="iteration", y="loss", color="run", markers=True,
                   labels={"loss": "loss (nats/token)"},  # as studies 1 and 2 label it
                   title="Training loss per iteration on the target corpus (measured on this machine)")


def host_done_figure(result: StudyResult) -> go.Figure:
    """Per iteration, the share of the host's update finished before the accelerator's backward ended."""
    col = "host_done_before_bwd_end_share"
    steps = result.steps.dropna(subset=[col]) if col in result.steps else pd.DataFrame(columns=["iteration", col, "run"])
    steps = steps.assign(pct=100 * steps[col].astype(float))  # in %, as the runs table shows it
    fig = px.line(steps, x="iteration", y="pct", color="run", markers=True,
                  labels={"pct": "host update done before backward ended (%)"},
                  title="Host update finished before backward ended (measured, per iteration)")
    return fig.update_yaxes(range=[0, 105])


def k_figure(result: StudyResult) -> go.Figure:
    """The k each iteration ran with (adaptive runs recompute it from measured times)."""
    steps = result.steps.dropna(subset=["k_actual"]) if "k_actual" in result.steps else result.steps
    if steps.empty:
        return go.Figure().update_layout(title="k per iteration (no measured run)")
    return px.line(steps, x="iteration", y="k_actual", color="run", markers=True,
                   labels={"k_actual": "k (share of parameters updated on the accelerator)"},
                   title="k used per iteration (measured; adaptive runs recompute it from measured times)")


def verdict_text(result: StudyResult) -> str:
    return _facts(result).get("published", {}).get("verdict", "")


def verdict_table(result: StudyResult) -> pd.DataFrame:
    """For which settings the seed's k band holds (modelled), per host and MFU."""
    return rounded(result.tables.get("verdict", pd.DataFrame()))


def sensitivity_figure(result: StudyResult) -> go.Figure:
    """k of the seed's setting against sequence length, one panel with and one without activation
    recompute: solid, the k the card lets the engine run (the seed's formula capped by the card's
    memory; no point where even k = 0 does not fit); dotted, the formula alone. Shaded: the seed's band."""
    sens = result.tables.get("sensitivity", pd.DataFrame())
    band = _facts(result).get("published", {}).get("k_band", [0.1, 0.2])
    if sens.empty:
        return go.Figure().update_layout(title="k against sequence length (not modelled)")
    sens = sens.assign(setting=sens["host"] + ", MFU " + sens["mfu"].astype(str))
    if "recompute" in sens:
        sens["recompute"] = sens["recompute"].map({True: "with activation recompute", False: "without recompute"})
    ks = {"k_on_card": "on the card (capped by its memory)", "k_seed_formula": "the formula alone"}
    long = sens.melt(id_vars=[c for c in ("seq_len", "setting", "recompute") if c in sens],
                     value_vars=[c for c in ks if c in sens], var_name="k", value_name="modelled k")
    long["k"] = long["k"].map(ks)
    fig = px.line(long, x="seq_len", y="modelled k", color="setting", line_dash="k", markers=True, log_x=True,
                  facet_col="recompute" if "recompute" in long else None,
                  line_dash_map={ks["k_on_card"]: "solid", ks["k_seed_formula"]: "dot"},
                  title="Modelled k at the seed's setting (its formula, modelled alpha) against sequence length; "
                        "shaded: the seed's published band")
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))  # "recompute=with ...": the value
    return fig.add_hrect(y0=band[0], y1=band[1], opacity=0.15, line_width=0)


def validation_table(result: StudyResult) -> pd.DataFrame:
    """The performance model against published offload measurements: error per point."""
    v = result.tables.get("validation", pd.DataFrame())
    cols = ["source", "hardware", "model", "setup", "metric", "published", "modelled", "error_pct"]
    out = rounded(v[[c for c in cols if c in v]])
    for c in ("published", "modelled"):  # each row its own metric (s, TFLOP/s): three significant digits per row,
        if c in out:  # not the column's (40 TFLOP/s had read "40.00", its decimals those of 0.25 s)
            out[c] = out[c].map(lambda x: f"{x:.3g}" if isinstance(x, (int, float)) and pd.notna(x) else x)
    return out


def inputs_table(result: StudyResult) -> pd.DataFrame:
    """Every input of the performance model, with its source."""
    return result.tables.get("model_inputs", pd.DataFrame())


def host_table(result: StudyResult) -> pd.DataFrame:
    """The host Adam rate and Adam-pattern bandwidth measured here (one thread), with units."""
    host = _facts(result).get("host", {})
    rows = [{"measure": label, "this machine": fmt(host[key]), "field": key}
            for key, (label, fmt) in _HOST_FIELDS.items() if host.get(key) is not None]
    rows += [{"measure": key, "this machine": str(v), "field": key} for key, v in host.items() if key not in _HOST_FIELDS]
    return pd.DataFrame(rows, columns=["measure", "this machine", "field"])


_gbs = lambda v: f"{v / 1e9:,.1f} GB/s"  # noqa: E731
_HOST_FIELDS = {  # host_and_published.json's "host": what each field is, and its figure with a unit
    "backend": ("CPU Adam implementation", str),
    "threads": ("threads", lambda v: f"{int(v)}"),
    "numel": ("parameters per timed step", lambda v: f"{int(v):,}"),
    "adam_step_s": ("one Adam step over them", lambda v: f"{v * 1e3:,.1f} ms"),
    "adam_s_per_param": ("time per parameter", lambda v: f"{v * 1e9:.2f} ns"),
    "adam_bytes_per_s": ("Adam's bytes moved per second", _gbs),
    "memory_bytes_per_s": ("Adam-pattern probe (4 reads, 3 writes per element)", _gbs),
    "per_core_bytes_per_s": ("probe per core", _gbs),
    "bandwidth_share": ("Adam's share of the probe (at most 1)", lambda v: f"{v:.2f}"),
    "bandwidth_share_raw": ("the same before clipping", lambda v: f"{v:.2f}"),
    "probe": ("probe", str),
    "probe_block": ("probe block", lambda v: f"{int(v):,} elements"),
    "load_average_1min": ("load average (1 min) while measuring", lambda v: f"{v:.2f}"),
}


_OP_UNITS = (("_gb_per_s", "GB/s"), ("_gib", "GiB"), ("_s", "s"), ("tflops", "TFLOP/s"))


def _seed_band(with_setup: bool = False) -> str:
    """The seed's k band as published_claims.json gives it ("k band 0.1-0.2"; with its alpha and setting)."""
    seed = published()["study3_split"]
    (lo, hi), c = seed["claims"]["k_range"], seed["claims"]
    if not with_setup:
        return f"k band {lo:g}-{hi:g}"
    return f"k between {lo:g} and {hi:g} (alpha {c['alpha']:g}, {seed['setup']['model']}, {seed['setup']['gpu']})"


def operating_point_table(op: dict) -> pd.DataFrame:
    """The seed's setting as modelled (`perf_model.published_operating_point`), one quantity a row:
    counts thousands-separated, other numbers to three significant digits with the unit their name
    gives (t_backward_s: s; tflops: TFLOP/s), text as it is."""
    rows = []
    for name, v in op.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            text = "-".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
        else:
            unit = next((u for key, u in _OP_UNITS if name.endswith(key) or key in name.split("_")), "")
            number = f"{v:,}" if isinstance(v, int) else figure_text(v)
            text = number + (f" {unit}" if unit else "")
        rows.append({"quantity": name, "value": text})
    return pd.DataFrame(rows, columns=["quantity", "value"])


def findings(result: StudyResult) -> list[tuple[str, str]]:
    """What we found, each beside the published claim it answers."""
    df = result.runs
    out = []
    measured = df[df["source"] == "measured"]
    if "max_abs_diff_vs_adamw" in measured and measured["max_abs_diff_vs_adamw"].notna().any():
        worst = measured["max_abs_diff_vs_adamw"].max()
        where = ", ".join(sorted(set(measured["hardware"].astype(str))))
        precision = str(measured["precision"].iloc[0]) if "precision" in measured else "fp32"
        if precision == "fp32":
            out.append((f"The engine trains the same weights as AdamW at every k (largest difference {worst:.2g}), "
                        f"measured on {where}.", ""))
        else:  # the reference is mixed precision: fp32 weights under autocast, the engine a 16-bit copy
            out.append((f"In {precision}, the engine's weights differ from plain AdamW's ({precision} autocast over "
                        f"fp32 weights) by at most {worst:.2g} at every k, measured on {where}. The engine trains a "
                        f"{precision} copy of its fp32 masters (its gradients {precision} too), so this is not a "
                        "parity check; precision=fp32 is.", ""))
    verdict = verdict_text(result)
    if verdict:
        out.append((verdict, _seed_band(with_setup=True)))
    v = result.tables.get("validation", pd.DataFrame())
    if len(v) and "error_pct" in v:
        out.append((f"The performance model's error against {len(v)} published offload measurements: "
                    + ", ".join(f"{e:+.0f}%" for e in v["error_pct"].dropna()) + ".", ""))
    return out or [("Nothing was measured or modelled.", "")]


def report_section(result: StudyResult | None) -> list[tuple[str, str, Any]]:
    """Study 3's part of the report: the same tables and charts as notebook 03."""
    if result is None or result.runs.empty or "source" not in result.runs:
        return []
    df = result.runs
    measured, modelled = df[df["source"] == "measured"], df[df["source"] == "modelled"]
    where = ", ".join(sorted(set(measured["hardware"].astype(str)))) or "nothing measured"
    cpu_note = (" On a machine without a GPU the accelerator is the CPU too: these runs show that training"
                " is unchanged and how the work overlaps, not GPU speed." if "(cpu)" in where else "")
    gpus = ", ".join(sorted(set(modelled["hardware"].astype(str))))
    given = set(modelled.get("host_share_from", pd.Series(dtype=str)).astype(str))  # a what-if setting: not measured
    host = ("the host's update time from the alpha given" if "not used (alpha given)" in given else
            "the host from a bandwidth model of the named CPU, its Adam share given" if "config" in given else
            "the host from a bandwidth model of the named CPU, scaled per core from one core measured here")
    if given & {"config", "not used (alpha given)"}:  # a what-if is not an input of the published comparison
        host += ("; the published setting's row, the verdict and the validation do not take it: their host is "
                 "modelled from one core measured here")
    tags = (
        f'<span class="tag measured">measured</span> {len(measured)} run(s) of the split engine on {where}: '
        f"the embedded base fine-tuned on the target corpus: tokens/s, idle share, loss, held-out perplexity "
        f"before and after, parity with AdamW; and the host Adam rate.{cpu_note}<br>"
        f'<span class="tag modelled">modelled</span> {len(modelled)} run(s) of the performance model for '
        f"{gpus or 'no GPU profile'} (data-sheet peaks x a published MFU; {host}): no figure in these rows was "
        "measured on that hardware. Every input and its source is listed below; none of them is a figure the model "
        "is compared with.<br>Published: the seed's own claims (data/published_claims.json), shown as published, "
        "and the published offload measurements the model is validated against."
    )
    return [
        ("text", "", tags),
        ("table", RUN_TABLES["measured"], runs_table(result, "measured")),
        ("figure", "", throughput_figure(result)),
        ("table", RUN_TABLES["modelled"], runs_table(result, "modelled")),
        ("figure", "", tflops_figure(result)),
        ("figure", "", loss_figure(result)),
        ("table", RUN_TABLES["published"], runs_table(result, "published")),
        ("text", "", verdict_text(result)),
        ("table", f"Verdict on the seed's {_seed_band()} (modelled): for which sequence lengths it holds, per host, "
                  "MFU and activation recompute", verdict_table(result)),
        ("table", "The performance model against published offload measurements (modelled vs published, error "
                  "per point)", validation_table(result)),
        ("table", "Every input of the performance model, with its source", inputs_table(result)),
        ("table", "Host Adam rate and Adam-pattern bandwidth (measured on this machine, one thread)",
         host_table(result)),
    ]


NOTEBOOK_INTRO = """# Study 3: the adaptive GPU/CPU update split

**Question.** When the optimizer has to live on the host (fp32 master weights and Adam state in CPU
memory), how much training speed does it win back to update a share *k* of the layers on the GPU
instead, with *k* computed at run time so that the two sides finish together?

The engine (`workbench.studies.split.engine.SplitEngine`) streams each parameter's gradient to the
host as soon as backward finalises it and runs a CPU Adam there while backward goes on; the layers
whose gradients arrive last (the ones the next forward needs first) are updated on the accelerator.
The balance also measures how much the host's work slows backward itself (backward against *k* over
the last iterations; the adaptive run moves *k* once to see a second point): on an H200 (the record
`data/measured/h200-2026-11-22/`) and on the development machine's CPU, backward took far longer with
every update on the host, and leaving that out made the adaptive run pick the slowest *k*.

Two kinds of figures, never mixed: **measured** rows come from the engine on this machine,
fine-tuning the embedded base on the real target corpus with held-out perplexity before and after
each run (on a machine without a GPU the "accelerator" is the CPU too, so they show that training
is unchanged and how the work overlaps, not GPU speed); **modelled** rows come from the performance
model (`workbench.studies.split.perf_model`): a named GPU's data-sheet peak times a published
model-FLOPs utilisation, and the host from a bandwidth model of the named CPU. The seed's claims and
published offload measurements are what the model is *compared* with, never inputs."""

NOTEBOOK_RUN_TITLE = ("Study 3: the engine's measured runs, each drawn when it ends (loss: one line where every k "
                      "trains the same weights; speed; memory on CUDA)")
NOTEBOOK_RUN_KEYS = ("run",)

NOTEBOOK = [
    ("## The runs\n\nOne row per run, one table per source: measured on this machine, modelled, published. "
     "`status` is `oom` where the modelled GPU memory exceeds the card. `max_abs_diff_vs_adamw` compares each "
     "measured run's final weights with plain AdamW.",
     # one expression: a for loop's `caption` and `runs` stayed behind as globals, and a second Run All
     # refused them in the config cell (SplitConfig.from_namespace: unknown parameters)
     "display(*(table(runs, caption) for caption, runs in figures.run_tables(result)))"),
    ("## Throughput against k\n\nPanels are per machine; modelled panels say so in their title.",
     "figures.throughput_figure(result).show()"),
    ("", "figures.tflops_figure(result).show()"),
    ("## Accelerator idle share\n\nThe share of an iteration the accelerator waits for the host's updates. "
     "Balancing k is meant to drive it towards zero.", "figures.idle_figure(result).show()"),
    ("## One iteration, per side", "figures.timeline_figure(result).show()"),
    ("## Loss curves\n\nIn fp32 the engine's update is the same kernel as `torch.optim.AdamW(fused=True)`, so "
     "the curves lie on top of each other whatever k is.", "figures.loss_figure(result).show()"),
    ("## How much of the host's update is done when backward ends", "figures.host_done_figure(result).show()"),
    ("", "figures.k_figure(result).show()"),
    ("## The seed's k band: a verdict, not a reproduction\n\nThe seed reports alpha = 0.083 and k between 0.1 "
     "and 0.2 (LLaMA2-10B, batch 8, A100 80 GB) without its sequence length, its CPU or whether it recomputes "
     "activations. The model computes k for that setting from its own inputs only, and caps it at what the "
     "card's memory holds.", "table(figures.verdict_table(result), caption=figures.verdict_text(result))"),
    ("", "figures.sensitivity_figure(result).show()"),
    ("## The model against published offload measurements", "table(figures.validation_table(result))"),
    ("## Every input of the performance model, and the host measured here", "table(figures.inputs_table(result))"),
    ("", "table(figures.host_table(result))"),
]
