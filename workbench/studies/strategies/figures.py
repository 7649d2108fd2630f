"""Study 1's charts and its report section: used alike by notebook 01, the widget app and the report.

Figures are built from results tables only (nothing is scraped from logs).
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go

from workbench.core import charts
from workbench.core.charts import rounded
from workbench.core.claims import better, study1_general_problems
from workbench.core.results import StudyResult
from workbench.studies.strategies.tables import peak_is


def loss_curves(steps: pd.DataFrame) -> go.Figure:
    return charts.loss_curves(steps, title="Training loss per strategy (measured on this machine)")


def perplexity_spread(df: pd.DataFrame, *,
                      title: str = "Held-out perplexity after fine-tuning (measured on this machine)") -> go.Figure:
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


def device_timeline(df: pd.DataFrame, *, title: str = "Where each run ended up (colour: its status; in the bar: "
                                                      "the device it finished on; hover: every attempt)") -> go.Figure:
    """One bar per run coloured by its final status, naming the device it finished on (its bars, all of one
    height, said nothing else but on hover), hover showing the device history."""
    colors = {"ok": "#2ca02c", "fallback": "#ff7f0e", "oom": "#d62728", "skipped": "#7f7f7f", "error": "black"}
    fig = go.Figure()
    for status, g in df.groupby("status"):
        on = g["device"].astype("string").fillna("nowhere") if "device" in g else pd.Series("", index=g.index)
        fig.add_trace(go.Bar(
            x=g["strategy"] + " s" + g["seed"].astype(str), y=[1] * len(g), name=status, text=on,
            textposition="inside", marker_color=colors.get(status, "blue"),
            hovertext=g["device_history"], hoverinfo="text+name",
        ))
    return fig.update_layout(title=title, barmode="stack", yaxis=dict(visible=False), height=300)


def overlap_table(result: StudyResult) -> pd.DataFrame:
    """Is the held-out text unseen? Each corpus's overlap split by name and as the workbench splits."""
    ov = result.tables.get("corpus_overlap", pd.DataFrame())
    cols = ["corpus", "role", "train_chars", "heldout_chars", "overlap_split_by_name_pct", "overlap_pct",
            "limit_pct", "heldout_paragraphs_left_out", "seen_by_model_paragraphs", "docs_that_lost_text",
            "pretraining_text"]
    return rounded(ov[[c for c in cols if c in ov]])


# devices: where each seed's run finished (the means below mix them where they differ; device_history is
# the first seed's path there)
SUMMARY_COLUMNS = ["strategy", "statuses", "devices", "device_history", "trainable_params", "total_params",
                   "trainable_share", "ppl_before", "ppl_after_mean", "ppl_after_std", "improvement_mean_pct", "improvement_std_pct",
                   "train_seconds", "tokens_per_s", "peak_mem_mib", "peak_is", "seeds"]


def summary_table(result: StudyResult) -> pd.DataFrame:
    """What each strategy achieved: mean and spread over seeds."""
    s = result.tables.get("summary", pd.DataFrame())
    return rounded(s[[c for c in SUMMARY_COLUMNS if c in s]])


def runs_table(result: StudyResult) -> pd.DataFrame:
    """Where each run went: every attempt in `device_history`, the measured and the predicted peak."""
    cols = ["strategy", "seed", "status", "device", "device_history", "peak_mem_mib", "peak_is", "predicted_peak_mib",
            "ppl_before", "ppl_after", "notes"]
    runs = result.runs
    if "device" in runs:  # what a peak counts, where there is one (a run that diverged has none)
        had = runs["peak_mem_mib"].notna() if "peak_mem_mib" in runs else True
        runs = runs.assign(peak_is=runs["device"].map(peak_is).where(had, ""))
    return rounded(runs[[c for c in cols if c in runs]])


def claims_table(result: StudyResult) -> pd.DataFrame:
    """The published study's rows beside what this run measured, with why they differ."""
    return rounded(result.tables.get("claims", pd.DataFrame()))


def findings(result: StudyResult) -> list[tuple[str, str]]:
    """What we found, each beside the published claim it answers."""
    summary = result.tables.get("summary", pd.DataFrame())
    claims = result.tables.get("claims", pd.DataFrame())
    runs = result.runs
    stopped = runs[runs["status"] == "error"] if "status" in runs else runs.iloc[0:0]  # a loss that diverged
    diverged = [(f"{len(stopped)} run(s) stopped when their loss diverged, so they have no perplexity: "
                 + "; ".join(f"{r.strategy} seed {r.seed}: {r.notes}" for r in stopped.itertuples()), "")] \
        if len(stopped) and "notes" in stopped else []
    cut = result.facts.get("interrupted")
    interrupted = [(f"The last call stopped part-way: {cut['finished']} of the {cut['asked']} runs asked for "
                    "finished; what follows is of those alone.", "")] if cut else []
    if summary.empty or summary["ppl_after_mean"].isna().all():
        return [*interrupted, ("No strategy finished a run.", ""), *diverged]
    done = summary.dropna(subset=["ppl_after_mean"]).sort_values("ppl_after_mean")
    best = done.iloc[0]
    order = " < ".join(f"{r.strategy} {r.ppl_after_mean:.1f}" for r in done.itertuples())
    out = interrupted + [(f"Best held-out perplexity: {best['strategy']}, {best['ppl_before']:.1f} -> {best['ppl_after_mean']:.1f} "
            f"({better(best['improvement_mean_pct'])}; "
            + (f"mean of {int(best['seeds'])} seeds" if best["seeds"] != 1 else "1 seed") + f"). Order: {order}.",
            "; ".join(f"{r.strategy} {r.published_improvement_pct:.1f}%" for r in claims.itertuples()
                      if pd.notna(r.published_improvement_pct)) + " better (published, on random weights)")]
    trained = result.runs["tokens"].dropna().unique() if "tokens" in result.runs else ()
    if len(trained) == 1:  # a budget that is not a whole number of optimizer steps is rounded down
        budget = result.facts.get("token_budget")
        short = f" (the token budget of {budget:,}, rounded down to whole optimizer steps)" \
            if budget and budget != trained[0] else ""
        best_row = len(interrupted)
        out[best_row] = (out[best_row][0] + f" Each run trained {int(trained[0]):,} tokens{short}.", out[best_row][1])
    for _, same in done.groupby("trainable_set", sort=False) if "trainable_set" in done else ():
        if len(same) > 1:  # on a model with 4 decoder layers, the last 2 are the upper half
            out.append((f"{' and '.join(same['strategy'])} train the same {int(same['trainable_params'].iloc[0]):,} "
                        f"parameters on this model: one experiment under {len(same)} names, not {len(same)} results.",
                        ""))
    fell = result.runs[result.runs["status"] == "fallback"] if "status" in result.runs else pd.DataFrame()
    if len(fell):
        history = fell["device_history"].astype(str) if "device_history" in fell else pd.Series("", index=fell.index)
        how = []  # a run the pre-flight prediction kept off the device never ran out of memory there
        oom = history.str.contains(": oom")
        for rows, what in ((fell[oom], "ran out of memory"), (fell[~oom], "kept off it by the pre-flight prediction")):
            if len(rows):
                verb = "" if what.startswith("ran") else "was " if len(rows) == 1 else "were "
                how.append(f"{len(rows)} {verb}{what} ({', '.join(sorted(set(rows['strategy'])))})")
        published = claims.get("published_device", pd.Series(dtype=str)).astype(str)
        fell_there = sorted(claims.loc[published.str.contains("fallback", case=False), "strategy"]) \
            if len(claims) else []
        out.append((f"{len(fell)} run(s) did not fit the device budget and finished on the next device: "
                    f"{'; '.join(how)}.", f"the published {', '.join(fell_there)} runs fell back from GPU to CPU"
                    if fell_there else ""))
    out += diverged
    if "reused" in result.runs and result.runs["reused"].any():
        n, total = int(result.runs["reused"].sum()), len(result.runs)
        out.append((f"{n} of {total} runs were read back, not trained again: they "
                    "finished before with the same settings, base weights, corpus and code "
                    "(WORKBENCH_RERUN=1 trains them again).", ""))
    return out


def peaks_tag(runs: pd.DataFrame) -> str:
    """Where the runs' figures come from, and what each finishing attempt's peak counts (`peak_is`): a played
    card's (cpu@N:cuda) is its modelled allocator's, not the live tensor bytes a plain CPU budget counts."""
    devices = runs["device"].dropna().astype(str) if "device" in runs else pd.Series(dtype=str)
    where = "GPU" if devices.str.startswith("cuda").any() else "CPU"
    tag = (f'<span class="tag measured">measured</span> on this machine ({where}); budgets on the CPU are played, '
           "not a real GPU. A CUDA budget caps the allocator's reserved memory (fragmentation included); a CPU budget "
           "counts live tensor bytes, a played card's (cpu@N:cuda) its modelled allocator's reserved bytes. A CPU run's "
           "speed is taken with that count running (how its peak is measured: 1.31x the time of the loop without it "
           "on this project's 2-core machine on 2026-11-22, benchmarks/loop_overhead.py's live_bytes_hook_overhead); "
           "tokens/s leaves out each run's first step, its warm-up")
    said = []
    for device in sorted(set(devices)):
        kind, _, what = peak_is(device).partition(": ")
        said.append(f'{device}: <span class="tag {kind}">{kind}</span> {what}')
    return tag + (". The peak of a run that finished on " + "; on ".join(said) if said else "")


def report_section(result: StudyResult | None) -> list[tuple[str, str, Any]]:
    """Study 1's part of the report: the same tables and charts as notebook 01."""
    if result is None or result.runs.empty:
        return []
    df = result.runs
    tag = peaks_tag(df)
    problems = "".join(f"<li>{p}</li>" for p in study1_general_problems())
    return [
        ("text", "", tag),
        ("text", "Held-out text is unseen in content",
         "Share of each corpus's held-out 50-character windows that occur in its training text, whitespace collapsed "
         "on both sides (a re-wrapped or re-indented copy counts): split by document name alone, and as the workbench "
         "splits it (repeated paragraphs kept once, held-out paragraphs that share a window with training text, "
         "verbatim or whitespace collapsed, left out)."),
        ("table", "", overlap_table(result)),
        ("table", "Summary over seeds", summary_table(result)),
        ("figure", "", perplexity_spread(df)),
        ("figure", "", loss_curves(result.steps)),
        ("table", "Every run and its device history", runs_table(result)),
        ("text", "Why the published figures differ", f"<ul>{problems}</ul>"),
        ("table", "Published claims beside this measurement", claims_table(result)),
    ]


# Notebook 01 after its parameters cell: (markdown, code) pairs; `result`, `cfg` and this module
# (`figures`) are in scope. Generated into notebooks/01_strategies.ipynb by workbench.front.notebooks.
NOTEBOOK_INTRO = """# Study 1: which transfer strategy gives the best model for a small target domain on my card?

Up to seven ways to fine-tune the same base on the same target text for the same token budget (the
`strategies` parameter picks them): four from the published comparison (adapter layers as it defines
them, the last decoder layers and the head retrained, no adapter modules added; freeze lower layers;
freeze embeddings; full fine-tuning) and three it left out (LoRA, BitFit, QLoRA). Each (strategy,
seed) run starts from a fresh copy of the base and is scored by **held-out** perplexity before and after.

Every run goes through the device-fallback ladder: on a machine without a GPU, first the CPU
*playing* a GPU of `budget_mib` (allocations are counted, and torch's OutOfMemoryError is raised past
the budget, as CUDA raises it), then the CPU without a budget. A strategy that runs out of memory
is freed and restarted from scratch on the next device; `device_history` says what happened."""

NOTEBOOK_RUN_TITLE = "Study 1: loss, device memory against the budget, speed (live)"

NOTEBOOK = [
    ("## Is the held-out text really unseen?\n\nShare of held-out 50-character windows that occur in the training "
     "text, whitespace collapsed on both sides (a re-wrapped copy counts): split by document name alone, and as the "
     "workbench splits. The limit is 0.5%.",
     "table(figures.overlap_table(result))"),
    ("## What each strategy achieved (mean and spread over seeds)", "table(figures.summary_table(result))"),
    ("", "figures.perplexity_spread(result.runs).show()"),
    ("", "figures.loss_curves(result.steps).show()"),
    ("## Where each run went\n\n`device_history` lists every attempt: `skipped` (the pre-flight estimate said it "
     "would not fit), `oom` with the phase it ran out in, then `ok` on the device that finished it.",
     "table(figures.runs_table(result))"),
    ("", "figures.device_timeline(result.runs).show()"),
    ("## The published claims beside this measurement\n\nThe published comparison (Qwen2-0.5B, Rust/Candle) "
     "reported trainable *tensor* counts, selected layers by substring, started from random weights, and scored "
     "perplexity on training text.", "table(figures.claims_table(result))"),
]
