"""Study 1's tables: runs.csv rebuilt from the runs' folders, the summary and claims, the loss curves,
and the latest call's result read back (split from runner.py, which trains).
"""

from __future__ import annotations

import json
import warnings
from typing import Callable

import pandas as pd

from workbench.core.claims import study1_comparison
from workbench.core.fallback import Attempt
from workbench.core.results import ResultsWriter, RunDir, StudyResult, read_steps, read_table, results_root
from workbench.studies.strategies.config import STUDY


def rebuild_runs_table() -> pd.DataFrame:
    """Put every run's summary.json into results/strategies/runs.csv (so it never disagrees with them,
    even after a run finished by a process that was killed before it wrote the table)."""
    rows = []
    for p in sorted((results_root() / STUDY).glob("*/summary.json")):
        s = json.loads(p.read_text())
        # each run's environment as its config.json recorded it (not this process's, stamped on every row)
        env = (RunDir(STUDY, p.parent.name).config() or {}).get("env") or {}
        rows.append({"run_id": p.parent.name, **{f"env_{k}": v for k, v in env.items()}, **s.get("row", {}),
                     "status": s["status"], "finished": s.get("finished")})
    return ResultsWriter(STUDY).update_runs(rows, key="run_id")


def record_interrupted(runs: list[RunDir], overlap: Callable[[], dict]) -> None:
    """A call's finished runs as the latest result, marked, where it stopped part-way (^C, a kill, an
    error): a call killed after 4 of its 10 runs had no latest.json, and the report read its 4 runs (the
    newest settings' rows) as the study's result, unmarked. A finished call's latest.json stays the
    latest. Called while the call's exception is handled: a failure here is a warning, not in its place."""
    try:
        latest = results_root() / STUDY / "latest.json"
        if latest.exists() and "interrupted" not in json.loads(latest.read_text()):
            return
        ids = [r.run_id for r in runs if (s := r.summary()) is not None and s.get("status") in ("ok", "fallback")]
        if ids:
            ResultsWriter(STUDY).json("latest", {"run_ids": ids, "corpus_overlap": overlap(),
                                                 "interrupted": {"finished": len(ids), "asked": len(runs)}})
    except Exception as e:  # a full disk, say: what stopped the call is what the caller must hear
        warnings.warn(f"the stopped call's finished runs were not recorded as the latest result ({e})")


def peak_is(device) -> str:
    """What the peak of a run that finished on `device` ('cpu@160:cuda', as runs.csv holds it) counts: a played
    card's modelled allocator is not the live bytes the CPU counts; '' where no attempt finished."""
    return Attempt.parse(device).peak_is() if isinstance(device, str) and device else ""


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Mean and spread over seeds, one row per strategy, in the order the strategies were run."""
    order = list(dict.fromkeys(df["strategy"]))
    measured = ("trainable_params", "total_params", "trainable_share", "trainable_set", "ppl_before", "ppl_after",
                "improvement_pct", "tokens_per_s", "train_seconds", "peak_mem_mib")
    # a study where every run ran out of memory has no measured columns: they are empty, not missing
    df = df.assign(**{c: float("nan") for c in measured if c not in df})
    ok = df[df["status"].isin(["ok", "fallback"])]
    agg = ok.groupby("strategy").agg(
        trainable_params=("trainable_params", "first"),
        total_params=("total_params", "first"),  # the share's denominator: the model trained, LoRA's adapters in
        trainable_share=("trainable_share", "first"),
        trainable_set=("trainable_set", "first"),
        ppl_before=("ppl_before", "mean"),
        ppl_after_mean=("ppl_after", "mean"),
        ppl_after_std=("ppl_after", "std"),
        improvement_mean_pct=("improvement_pct", "mean"),
        improvement_std_pct=("improvement_pct", "std"),
        tokens_per_s=("tokens_per_s", "mean"),
        train_seconds=("train_seconds", "mean"),
        peak_mem_mib=("peak_mem_mib", "max"),
        seeds=("seed", "count"),
    )
    # what the peak counts: each kind the seeds' runs finished on (a played card's, the CPU's live bytes)
    agg["peak_is"] = ok.groupby("strategy")["device"].agg(lambda d: "; ".join(sorted({peak_is(x) for x in d})))
    status = df.groupby("strategy").agg(
        statuses=("status", lambda s: ", ".join(sorted(set(s)))),
        devices=("device", lambda s: ", ".join(sorted({str(x) for x in s}))),
        device_history=("device_history", "first"),
    )
    return status.join(agg, how="left").reindex(order).reset_index()


def claims_table(df: pd.DataFrame) -> pd.DataFrame:
    """The published study's four rows beside what the workbench measured, with the reasons they differ."""
    return study1_comparison(summarize(df))


def steps_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Every run's per-step rows (loss curves), read from steps.jsonl."""
    frames = []
    for run_id, device in zip(df["run_id"], df["device"]):
        p = results_root() / STUDY / run_id / "steps.jsonl"
        if p.exists() and p.stat().st_size and isinstance(device, str):
            steps = read_steps(p)
            frames.append(steps[steps["device"] == device])  # the attempt that finished, not the ones that ran out
    if not frames:
        return pd.DataFrame(columns=["strategy", "seed", "step", "loss", "tokens"])
    return pd.concat(frames, ignore_index=True)


def load_result() -> StudyResult | None:
    """The latest settings' result, read back from results/strategies/ (None if it never ran)."""
    root = results_root() / STUDY
    runs = read_table(root / "runs.csv")
    if runs.empty:
        return None
    chosen = (json.loads(latest.read_text()).get("run_ids") or []) if (latest := root / "latest.json").exists() else []
    if chosen and set(chosen) <= set(runs["run_id"]):  # the last call's runs, in its order
        runs = runs.set_index("run_id").loc[chosen].reset_index()
    elif "config_hash" in runs and runs["config_hash"].notna().any():  # results written before latest.json
        last = runs.sort_values("finished")["config_hash"].dropna().iloc[-1]
        runs = runs[runs["config_hash"] == last]
    # made from the chosen runs, and the overlap from latest.json, as the runs are chosen: the files beside
    # it are written before it, so a call killed between them showed one call's runs with another's summary
    overlap = json.loads(latest.read_text()).get("corpus_overlap") if latest.exists() else None
    tables = {"summary": summarize(runs), "claims": claims_table(runs),
              "corpus_overlap": pd.DataFrame(**overlap) if overlap else read_table(root / "corpus_overlap.csv")}
    config = RunDir(STUDY, str(runs["run_id"].iloc[-1])).config() or {}  # the settings' budget, for the findings
    facts = {"token_budget": config.get("token_budget")}
    if latest.exists() and (cut := json.loads(latest.read_text()).get("interrupted")):
        facts["interrupted"] = cut  # {"finished": n, "asked": m}: the findings say so first
    return StudyResult(STUDY, runs=runs.reset_index(drop=True), steps=steps_frame(runs), tables=tables, facts=facts)
