"""Study 2's charts, tables and report section: used alike by notebook 02, the widget app and the report.

Every function takes the study's result (`run_ladder(cfg)`, or `load_result()` for the report).
Each figure says where its numbers come from: `predicted` (the training step over fake tensors),
`estimated` (a formula, for rungs the simulation cannot run) or `measured` here.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.core.charts import loss_curves, palette, rounded
from workbench.core.claims import published
from workbench.core.common import MiB
from workbench.core.results import StudyResult

BUDGET_NOTE = ("On a GPU the budget caps the CUDA caching allocator's reserved memory "
               "(set_per_process_memory_fraction: fragmentation and cached blocks count); on the CPU the "
               "played budget counts live tensor bytes, so a played budget is a little more generous than "
               "a card of the same size.")

LADDER_COLUMNS = ["rung", "method", "predicted_peak_mib", "measured_peak_mib", "status", "reason", "step_ms",
                  "tokens_per_s", "loss_after", "fits_predicted", "fits_measured", "note"]
CATEGORIES = ["weights", "gradients", "optimizer_state", "activations", "temporaries"]
LITTLE_SAVING = 0.05  # checkpointing saving less of the peak than this, its published row is said to show little
LOG_SPREAD = 20  # the ladder chart's memory axis is logarithmic where its highest bar is this many times the median


def _hand(result: StudyResult) -> pd.DataFrame:
    return result.runs[result.runs["role"] == "at hand"]


def _reference(result: StudyResult) -> pd.DataFrame:
    return result.runs[result.runs["role"] == "reference"]


def budget_mib(result: StudyResult) -> float:
    hand = _hand(result)
    return float(hand["budget_mib"].iloc[0]) if len(hand) else float("nan")


def ladder_table(result: StudyResult) -> pd.DataFrame:
    """The ladder for the model at hand, per rung: predicted and measured peak, speed, loss, fit; `method` shown as
    `how_predicted` ("method: predicted" beside a measured peak read as if that were predicted too)."""
    hand = _hand(result)
    return _how_predicted(rounded(hand[[c for c in LADDER_COLUMNS if c in hand]]))


def _how_predicted(table: pd.DataFrame) -> pd.DataFrame:
    """`method` shown as `how_predicted`: simulated (over fake tensors) or estimated."""
    if "method" in table:
        table["method"] = table["method"].replace({"predicted": "simulated"})
    return table.rename(columns={"method": "how_predicted"})


def ladder_figure(result: StudyResult, title: str = "") -> go.Figure:
    """Peak device memory per rung (predicted, hatched where estimated, and measured) against the
    budget, beside the measured step time (rungs that cannot run here have none: their row says why)."""
    hand = _hand(result)
    budget = budget_mib(result)
    peaks = pd.concat([hand[c] for c in ("predicted_peak_mib", "measured_peak_mib") if c in hand]).dropna()
    # one rung far above the rest (on a tiny model, ZeRO's 500M-element reduce bucket: 954 MiB beside a few)
    # squashed every other bar and the budget's line into the panel's bottom: a log axis shows them all
    log = len(peaks[peaks > 0]) > 1 and peaks.max() > LOG_SPREAD * peaks[peaks > 0].median()
    fig = make_subplots(rows=1, cols=2, column_widths=[0.62, 0.38], subplot_titles=(
        f"peak device memory (MiB{', log scale' if log else ''})", "measured step time (ms)"))
    for method in ("predicted", "estimated"):
        part = hand[hand["method"] == method]
        if len(part):
            shown = "simulated" if method == "predicted" else method  # as the table's how_predicted says
            fig.add_trace(go.Bar(x=part["rung"], y=part["predicted_peak_mib"], name=f"predicted, {shown} (not measured)",
                                 marker_pattern_shape="/" if method == "estimated" else "",
                                 hovertext=part["note"].astype("string").fillna("") if "note" in part else None), row=1, col=1)
    if "measured_peak_mib" in hand:
        ok = hand[hand["status"] == "ok"]
        fig.add_trace(go.Bar(x=ok["rung"], y=ok["measured_peak_mib"], name="measured on this machine"), row=1, col=1)
        if "step_ms" in ok:
            fig.add_trace(go.Bar(x=ok["rung"], y=ok["step_ms"], name="step time (measured on this machine)"),
                          row=1, col=2)
    fig.add_hline(y=budget, line_dash="dash", line_color="red", row=1, col=1)
    # its label apart: on a log axis an annotation's y is log10 of the value, a line's the value (plotly.py#2580)
    fig.add_annotation(text=f"budget {budget:g} MiB", x=1, xref="x domain", y=math.log10(budget) if log else budget,
                       yref="y", showarrow=False, xanchor="right", yanchor="bottom", font_color="red")
    fig.update_yaxes(type="log" if log else "linear", row=1, col=1)
    order = dict(categoryorder="array", categoryarray=list(hand["rung"]))
    fig.update_xaxes(**order)
    return fig.update_layout(barmode="group", height=450, title=title or "Memory ladder: peak device memory per rung")


# the table `workbench ladder` prints
runs_table = ladder_table


def autofit_table(result: StudyResult) -> pd.DataFrame:
    """Auto-fit's attempts: of the setups predicted to fit, the one expected fastest, run under the budget; why."""
    return rounded(result.tables.get("autofit", pd.DataFrame()))


def autofit_search_table(result: StudyResult) -> pd.DataFrame:
    """Every setup the joint search tried, in its order (`not_predicted`: why an earlier prediction ruled it out,
    `ruled_out_by`: which); the margin in %, as the CLI and the choice's why say it (a bare 0.058 beside them)."""
    return rounded(result.tables.get("autofit_search", pd.DataFrame()).rename(columns={"margin": "margin_share"}))


def breakdown_figure(result: StudyResult, rung: str) -> go.Figure:
    """Bytes per category at one rung's steady-state peak: predicted (and measured) for the model at hand, predicted
    for the reference, each in its own panel (on one axis the tiny model's few MiB were invisible beside it)."""
    sel = result.runs[result.runs["rung"] == rung]
    # the cpu rung's step is all host memory, and so is what measured it: its prediction's host side beside it
    # (its device side is zeros, which had stood beside the measured host bytes as a total miss)
    none = pd.Series(0.0, index=sel.index)
    device, host_bytes = (sel.get(c, none).fillna(0) for c in ("predicted_peak_bytes", "host_bytes"))
    host = len(sel) > 0 and bool(((device == 0) & (host_bytes > 0)).all())
    panels: dict[str, list[tuple[str, list[float]]]] = {}
    wheres: dict[str, str] = {}
    for _, r in sel.iterrows():
        bars = panels.setdefault(r["role"], [])
        bars.append(("predicted", [(r.get(f"host_{c}_bytes" if host else f"{c}_bytes", 0) or 0) / MiB
                                   for c in CATEGORIES]))
        if r["role"] == "at hand" and r.get("status") == "ok" and f"measured_{CATEGORIES[0]}_bytes" in r:
            bars.append(("measured", [r[f"measured_{c}_bytes"] / MiB for c in CATEGORIES]))
        model = r.get("model", "")
        peak = f"<br><sup>peak: {r['where']}</sup>" if isinstance(r.get("where"), str) and r["where"] else ""
        wheres[r["role"]] = f"{r['role']}: {model}{peak}"
    if not panels:
        return go.Figure().update_layout(title=f"{rung}: no prediction for this rung (it is not in the ladder)")
    roles = list(panels)
    fig = make_subplots(rows=1, cols=len(roles), subplot_titles=[wheres[role] for role in roles])
    for col, role in enumerate(roles, start=1):
        for i, c in enumerate(CATEGORIES):
            fig.add_trace(go.Bar(name=c, x=[b[0] for b in panels[role]], y=[b[1][i] for b in panels[role]],
                                 marker_color=palette()[i], legendgroup=c, showlegend=col == 1), row=1, col=col)
        fig.update_yaxes(title_text="MiB at the peak" if col == 1 else None, row=1, col=col)
    return fig.update_layout(barmode="stack", height=460, margin={"t": 110},
                             title=f"{rung}: {'host ' if host else ''}bytes per category at the steady-state peak, "
                                   "per model")


def reference_table(result: StudyResult) -> pd.DataFrame:
    """The reference model's predicted peak per rung (no weights here: predicted only)."""
    ref = _reference(result)
    return _how_predicted(rounded(ref[[c for c in ("rung", "method", "predicted_peak_mib", "budget_mib",
                                                   "fits_predicted", "note") if c in ref]]))


def published_figure(result: StudyResult) -> go.Figure:
    """The published memory table (never measured) beside the prediction for the reference model."""
    pub = result.tables.get("published", pd.DataFrame())
    ref = _reference(result)
    model = ref["model"].iloc[0] if len(ref) else "no reference model"
    fig = go.Figure()
    if len(pub):
        fig.add_trace(go.Bar(name="published (not measured)", x=pub["strategy"], y=pub["published_mib"]))
        if pub.get("workbench_predicted_mib", pd.Series(dtype=float)).notna().any():  # no empty trace
            fig.add_trace(go.Bar(name="workbench prediction (not measured)", x=pub["strategy"],
                                 y=pub["workbench_predicted_mib"]))
        elif "workbench_predicted_mib" in pub:  # a reference model, but none of the rungs the rows build on
            model = f"{model}: none predicted (no rung of this ladder is one the rows build on)"
    return fig.update_layout(barmode="group", yaxis_title="MiB", height=420,
                             title=f"Published memory table beside the prediction for {model}")


def published_table(result: StudyResult) -> pd.DataFrame:
    pub = result.tables.get("published", pd.DataFrame())
    return rounded(pub[[c for c in ("strategy", "rung", "published_mib", "workbench_predicted_mib", "note", "source")
                        if c in pub]])


def baselines_figure(result: StudyResult) -> go.Figure:
    """accelerate's and DeepSpeed's estimators beside the workbench prediction of the same rung."""
    base = result.tables.get("baselines", pd.DataFrame())
    fig = go.Figure()
    if len(base):
        fig.add_trace(go.Bar(name="library estimate", x=base["estimator"], y=base["estimated_bytes"] / MiB,
                             hovertext=base.get("why_it_differs")))
        if base.get("workbench_predicted_bytes", pd.Series(dtype=float)).notna().any():  # no empty trace
            fig.add_trace(go.Bar(name="workbench (same rung)", x=base["estimator"],
                                 y=base["workbench_predicted_bytes"] / MiB))
    return fig.update_layout(barmode="group", yaxis_title="MiB", height=450,
                             title="Library estimators beside the workbench prediction (none measured)")


def baselines_table(result: StudyResult) -> pd.DataFrame:
    """The estimators' rows; an empty workbench cell says why (the rung compared to was not run)."""
    base = result.tables.get("baselines", pd.DataFrame()).copy()
    if (gap := base.get("workbench_predicted_bytes", pd.Series(dtype=float)).isna()).any():
        base.loc[gap, "why_it_differs"] += "; no workbench figure: " + base.loc[gap, "compares_to"] + " was not run"
    return rounded(base)


def loss_figure(result: StudyResult) -> go.Figure:
    """Training loss per measured rung."""
    steps = result.steps
    if len(steps) and "event" in steps:
        steps = steps[steps["event"].isna()]
    if not {"rung", "step", "loss"} <= set(steps.columns):
        return go.Figure().update_layout(title="Training loss per rung (no rung measured)")
    steps = steps.drop_duplicates(["rung", "step"], keep="last")
    return loss_curves(steps, color="rung", title="Training loss per rung (measured on this machine)")


def precision_verdict(result: StudyResult) -> str:
    """Does 16-bit precision halve a step's memory? Autocast (mixed) against pure 16-bit, from the
    predicted peaks of the same model ('' when the rungs were not all predicted)."""
    for role in ("reference", "at hand"):
        rows = result.runs[result.runs["role"] == role].set_index("rung")
        if {"fp32", "bf16", "bf16_true"} <= set(rows.index):
            fp32, mixed, pure = (float(rows.loc[r, "predicted_peak_bytes"]) for r in ("fp32", "bf16", "bf16_true"))
            if fp32 > 0:
                return (f"{_setting(rows)}: bf16 autocast (mixed precision) needs {mixed / fp32:.0%} of fp32's "
                        f"peak, because its weights, gradients and AdamW state stay fp32; pure bf16 weights, "
                        f"gradients and state (bf16-true) need {pure / fp32:.0%}. Only the pure 16-bit step comes "
                        "near halving memory; the claim describes that mechanism, not autocast (predicted).")
    return ""


def _setting(rows: pd.DataFrame) -> str:
    """'MODEL at B x S': what a prediction's shares depend on (activations grow with the tokens, the rest not)."""
    r = rows.iloc[0]
    return f"{r['model']} at {r.get('batch', '?')} x {r.get('seq', '?')}" if "batch" in rows else str(r["model"])


def _little_to_save(pub: pd.DataFrame, ref: pd.DataFrame) -> str:
    """Where checkpointing saves little of the reference's pure 16-bit peak (quick settings: 1 x 32), that its
    row shows little (fp32's activations at fp32's peak, after backward, had read "0.0%" at 1 x 512)."""
    mib = pub.dropna(subset=["workbench_predicted_mib"]).set_index("strategy")["workbench_predicted_mib"]
    full, ckpt = mib.get("FP16 full model"), mib.get("FP16 + gradient checkpointing")
    if not full or ckpt is None:
        return ""
    saved = 1 - float(ckpt) / float(full)
    return "" if saved >= LITTLE_SAVING else (
        f"At {_setting(ref)} checkpointing lowers pure bf16's predicted peak by {saved:.1%} ({full:,.0f} to "
        f"{ckpt:,.0f} MiB): the activations it saves are a small part of that step's peak, so this row says "
        "little of what it saves at a longer sequence (reference_seq_len).")


def _fp16_claim() -> str:
    """The seed's "FP16 halves memory", its figures as published_claims.json gives them."""
    table = published()["study2_memory_table"]
    gb = {r["strategy"]: r["memory_gb"] for r in table["rows"]}
    mixed = next(c["claim"] for c in table["other_claims"] if c["claim"].startswith("mixed precision"))
    return (f"FP16 halves memory: FP16 full model {gb['FP16 full model']:.1f} GB against FP32 "
            f"{gb['FP32 full model']:.1f} GB; '{mixed}'")


def findings(result: StudyResult) -> list[tuple[str, str]]:
    """What we found, each beside the published claim it answers."""
    hand = _hand(result)
    out = []
    verdict = precision_verdict(result)
    if verdict:
        out.append((verdict, _fp16_claim()))
    measured = hand[hand["status"] == "ok"] if "status" in hand else hand.iloc[0:0]
    # the rungs compared: the cpu rung has no device peak to compare (its figures are host memory)
    compared = measured[measured["predicted_vs_measured"].notna()] if "predicted_vs_measured" in measured else []
    if len(compared):
        err = (compared["predicted_vs_measured"] - 1).abs().max() * 100
        out.append((f"Predicted peaks of {len(compared)} rung(s) measured here are within {err:.1f}% of the "
                    "measured live bytes (the prediction runs the same training step over fake tensors).",
                    "the published memory table was estimated, never measured"))
    again = hand[hand["reused"].fillna(False).astype(bool)] if "reused" in hand else hand.iloc[0:0]
    if len(again):
        out.append((f"{len(again)} of {len(hand)} rungs ({', '.join(again['rung'])}) were read back from an earlier "
                    "run with the same settings, model weights and code, not measured again "
                    "(WORKBENCH_RERUN=1 measures them again).", ""))
    fit = result.tables.get("autofit", pd.DataFrame())
    if len(fit):
        last = fit.iloc[-1]
        where = _fit_where(fit)
        # (an empty cell read back from autofit.csv is NaN, not None: it read "Auto-fit chose nan")
        said = {k: last.get(k) if pd.notna(last.get(k)) and last.get(k) != "" else None
                for k in ("predicted_choice", "ran", "why")}
        out.append((f"Auto-fit chose {said['predicted_choice'] or 'nothing on the device'} for a "
                    f"{budget_mib(result):g} MiB budget and ran {said['ran'] or 'nothing'}{where}, the batch per step "
                    f"kept. Why: {said['why'] or ''}", ""))
    pub = result.tables.get("published", pd.DataFrame())
    ref = _reference(result)
    if len(pub) and "workbench_predicted_mib" in pub and len(ref):
        setting = _setting(ref)  # the published table states none
        for r in pub.dropna(subset=["workbench_predicted_mib"]).itertuples():
            out.append((f"{r.strategy}: predicted {r.workbench_predicted_mib:,.0f} MiB for {setting}.",
                        f"{r.published_mib:,.0f} MiB"))
        out += [(little, "")] if (little := _little_to_save(pub, ref)) else []
    if not out and len(hand):  # e.g. one rung, predicted, and skipped as bigger than this machine
        out.append((f"No finding to state from {len(hand)} rung(s) predicted and {len(measured)} measured here "
                    "(the table has each rung).", ""))
    return out or [("Nothing was predicted or measured.", "")]


def _fit_where(fit: pd.DataFrame) -> str:
    """Where auto-fit's tries ran, the last one's place last, and what the budget capped there (the ladder's
    last resort, the cpu rung, runs with none: it had read "with the budget enforced on the CPU")."""
    devices = fit["device"].dropna().astype(str).tolist() if "device" in fit else []
    last_resort = "ran" in fit and len(fit) and fit["ran"].iloc[-1] == "cpu"
    card = (" with the budget enforced on the card (its allocator's reserved memory capped at the budget: a real "
            "out-of-memory error)")
    if devices and devices[-1].startswith("cuda"):
        return card
    if any(d.startswith("cuda") for d in devices):  # stepped down past the card to the ladder's last resort
        return card + ", then on the CPU (the cpu rung: no budget)"
    if last_resort:
        return (" on the CPU with no budget (the cpu rung, the last resort" + (
            "; the tries before it under the budget played: live tensor bytes counted)" if len(devices) > 1 else ")"))
    return " with the budget enforced on the CPU (the budget played: live tensor bytes counted)" if devices else ""


def report_section(result: StudyResult | None) -> list[tuple[str, str, Any]]:
    """Study 2's part of the report: the same tables and charts as notebook 02."""
    if result is None or result.runs.empty:
        return []
    hand, ref = _hand(result), _reference(result)
    measured = hand[hand["status"] == "ok"]
    where = ", ".join(sorted(set(measured["device"].astype(str)))) if "device" in measured else ""
    cpu_note = (" (the CPU plays the device: live tensor bytes are counted; a card's allocator rounds them to "
                "blocks and reserves more)") if where == "cpu" else ""
    model = hand["model"].iloc[0] if len(hand) else ""
    fitted = len(result.tables.get("autofit", pd.DataFrame())) > 0  # autofit=False: no attempts, no tables
    tags = (
        f'<span class="tag measured">measured</span> on this machine ({where or "nothing measured"}){cpu_note}: '
        f"peak, step time, tokens/s and loss of {len(measured)} rung(s) of {model}"
        f"{', and the auto-fit attempts' if fitted else ''}.<br>"
        '<span class="tag modelled">predicted</span> every peak in the "predicted" columns: the real training '
        "step run over fake tensors (no weights, no GPU)"
        + (f"; the reference model ({ref['model'].iloc[0]}) is predicted only" if len(ref) else "") + ".<br>"
        '<span class="tag modelled">estimated</span> rungs whose method is "estimated" (a formula, see note).<br>'
        "The published memory table was not measured by its authors either; it is shown as published.<br>"
        f"{BUDGET_NOTE}"
    )
    parts: list[tuple[str, str, Any]] = [
        ("text", "", tags),
        ("table", f"The ladder for the model at hand (budget {budget_mib(result):g} MiB: reserved memory on a GPU, "
                  "live tensor bytes on the CPU)", ladder_table(result)),
        ("figure", "", ladder_figure(result)),
        ("figure", "", loss_figure(result)),
    ]
    if fitted:
        parts += [("table", "Auto-fit: of the setups predicted to fit, the one a GPU's prior cost expects fastest, "
                            "run here with the budget enforced (on a "
                            "card under a real CUDA budget where there is one, else on the CPU playing it; its "
                            "`device` column says which; measured where its status is ok or oom)",
                   autofit_table(result)),
                  ("table", "Auto-fit's search: each setup tried, cheapest first (not predicted: ruled out by a "
                            "prediction above)", autofit_search_table(result))]
    if len(ref):
        parts += [("table", f"Reference model {ref['model'].iloc[0]}: predicted peaks (not measured)",
                   reference_table(result)),
                  ("figure", "", published_figure(result)),
                  ("table", "Library estimators beside the workbench prediction (none measured)",
                   baselines_table(result))]
    return parts


NOTEBOOK_INTRO = """# Study 2: will my fine-tune fit on my card, and what is the cheapest change that makes it fit?

The memory ladder: each rung changes one thing about the training step (precision, activation
checkpointing, micro-batch, optimizer, what trains, where tensors live). For every rung the
workbench **predicts** the steady-state peak device memory by running the real training step on
fake tensors (no GPU, no weights), **measures** the rungs that can run on this machine (peak
live bytes, step time, tokens/s, loss after a fixed number of steps), and marks figures it had to
**estimate** another way. Auto-fit then searches the setups in the order a prior cost of each
mechanism on a GPU expects fastest (`prior_cost` in its search table: an expectation, not this
machine's measured speed, so on a CPU its choice can be slower than rungs measured here), picks the
first predicted to fit the budget, and steps down on a real out-of-memory error."""

NOTEBOOK_RUN_TITLE = "Study 2: each measured rung (loss, memory against the budget, speed)"
NOTEBOOK_RUN_KEYS = ("rung", "stage")

NOTEBOOK = [
    ("## The ladder for the model at hand", "table(figures.ladder_table(result))"),
    ("Bars: the predicted peak (hatched where the figure is *estimated*, not simulated) and the measured peak; "
     "the dashed line is the budget. Right: the measured step time.", "figures.ladder_figure(result).show()"),
    ("", "figures.loss_figure(result).show()"),
    ("## Auto-fit\n\nFrom the ladder's top rung, the fastest setup predicted to fit the budget with the batch per "
     "step kept (micro-batch with accumulation, checkpointing, precision, optimizer), run with the budget "
     "enforced; on a real out-of-memory error it steps down to the next setup, and to the CPU last. With `device` "
     "auto or cuda on a machine with a card it searches the card's step and runs each setup there, the "
     "allocator capped at the budget; else the CPU plays the card.",
     "table(figures.autofit_table(result))"),
    ("The setups auto-fit predicted, cheapest first by their prior cost, until enough fitted.",
     "table(figures.autofit_search_table(result))"),
    ("## Where the bytes go at the peak (one rung)\n\nWeights, gradients, optimizer state, activations (saved "
     "for backward) and temporaries at the steady-state peak.",
     "figures.breakdown_figure(result, cfg.breakdown_rung).show()"),
    ("## The reference model, predicted", "table(figures.reference_table(result))"),
    ("## The published memory table beside the prediction\n\nThe published figures "
     "(`data/published_claims.json`, study2_memory_table) were never measured.",
     "figures.published_figure(result).show()"),
    ("", "table(figures.published_table(result))"),
    ("## What the usual estimators say, and why they differ\n\naccelerate's `estimate-memory` reports the largest "
     "of its entries: in fp32 as many bytes as weights, gradients and two moments; in mixed precision the two "
     "moments alone. DeepSpeed's estimators count model states only. Neither counts activations, "
     "the vocabulary-sized logits and their gradient, or optimizer temporaries.",
     "figures.baselines_figure(result).show()"),
    ("", "table(figures.baselines_table(result))"),
]
