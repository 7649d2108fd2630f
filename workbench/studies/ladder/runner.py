"""Study 2: will my fine-tune fit on my card, and what is the cheapest change that makes it fit?

    from workbench.studies.ladder.runner import LadderConfig, run_ladder
    result = run_ladder(LadderConfig(base_size="tiny", steps=3))   # minutes on the CPU (15 rungs, the
    # reference model's predictions, auto-fit); seconds with rungs=("fp32", "bf16_ckpt"), reference_model=""
    result.runs                                   # one row per (model, rung)
    result.tables["autofit"], result.tables["baselines"], result.tables["published"]
    with LiveChart(run_keys=("rung", "stage")) as live:     # live, per training step; the final
        run_ladder(cfg, sinks=[live])                         # figure stays when the block ends

For every rung of the ladder (workbench.studies.ladder.rungs) and two models - the model at hand (the
embedded base by default) and a reference config (Qwen2-0.5B) - the study predicts the
steady-state device peak (fake tensors, no GPU), and for the model at hand it measures every
rung that can run on this machine: peak live bytes, step time, tokens/s and the loss after a
fixed number of steps. A rung that cannot run here is a row whose `reason` says why.
It then asks auto-fit (workbench.studies.ladder.autofit) for the fastest setup predicted to fit
the budget, searching from the ladder's top rung with the batch per step kept (micro-batch with
accumulation, checkpointing, precision, optimizer), and runs it with the budget enforced, stepping
down to the next setup on a real out-of-memory error and to the CPU last (`device`: on a card under a
real CUDA budget, where there is one; else on the CPU with the budget played: studies/ladder/fit_run.py).

Results: results/ladder/<run_id>/{config.json, ladder.csv, baselines.csv, autofit.csv,
autofit_search.csv, summary.json} and results/ladder/runs.csv. Columns say which figures are
`measured`, `predicted` or `estimated`; sizes are bytes (`_bytes`) or MiB (`_mib`). Each rung's
row is also appended to rungs.jsonl as the rung finishes, so a run that is killed keeps the rungs
it finished, and the same settings run again go on from there (rows are reused only with the
same model weights and workbench version; $WORKBENCH_RERUN=1 measures every rung again). A
rung read back has `reused` set in the result's rows, and the findings say which.

Sinks receive the training rows of every measured rung (`stage` "ladder") and of every auto-fit
attempt (`stage` "auto-fit"), labelled with `rung` and the `budget_mib` to fit, plus an event
row per auto-fit try (ok too) and per rung that did not train to the end (skipped, oom). Charts and the report section:
workbench.studies.ladder.figures; the widget app: workbench.front.apps.
"""

from __future__ import annotations

import copy
import gc
import json
import sys
import time
from typing import Any, Callable, Iterable

import pandas as pd
import torch
from tqdm import tqdm

from workbench import __version__
from workbench.core.common import MiB, Sink, past_free_memory
from workbench.core.config import ConfigError
from workbench.core.data import corpus_blocks, target_corpus
from workbench.core.memory.baselines import baseline_table
from workbench.core.memory.meta import model_config
from workbench.core.memory.plan import RUNGS
from workbench.core.memory.predict import predict
from workbench.core.models import EMBEDDED, load_model, model_fingerprint, resolve_model_path
from workbench.core.trainable import StrategyNotApplicable
from workbench.core.results import (JsonlSink, ResultsWriter, RunDir, StudyResult, atomic_write_text, code_fingerprint,
                                    library_versions, read_steps, read_table, results_root, reuse_finished_runs)
from workbench.studies.ladder.config import ROOT, STUDY, LadderConfig, _resolve
from workbench.studies.ladder.fit_run import past_free, run_choice, search_here
from workbench.studies.ladder.rungs import measure


def model_at_hand(cfg: LadderConfig, *, keep: bool = False):
    """(config, load() -> fresh model, train blocks) for the model at hand.

    keep (a config's random init only; see `kept`): made once, each load() a deep copy. For gpu-check,
    which loads its model some 35 times: a random init of Qwen2-0.5B took 11.3 s here, a copy 1.15 s."""

    name = _resolve(cfg.model)
    if name.endswith(".json"):
        from transformers import AutoModelForCausalLM

        config = model_config(name)
        gen = torch.Generator().manual_seed(cfg.seed)
        blocks = torch.randint(0, config.vocab_size, (max(64, 4 * cfg.micro_batch), cfg.seq_len), generator=gen)

        def load():
            torch.manual_seed(cfg.seed)
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)

        return config, kept(load, cfg.seed) if keep else load, blocks, "random init from the config, random tokens"

    model, tok = load_model(name, spec=cfg.spec())
    blocks, _ = corpus_blocks(tok, target_corpus(), cfg.seq_len)
    if len(blocks) == 0:
        raise ConfigError(f"seq_len {cfg.seq_len} leaves no training block in the target corpus")
    return model.config, (lambda: load_model(name, spec=cfg.spec())[0]), blocks, "target corpus"


def kept(init: Callable[[], torch.nn.Module], seed: int) -> Callable[[], torch.nn.Module]:
    """init() (it seeds torch with `seed`, then draws the weights) made once: each call returns a deep copy
    (ties kept, a config of its own) and leaves torch's random state as init() leaves it. Kept in host
    memory (4 bytes a parameter) only with room for a copy and as much again (else each call makes it
    afresh); `load.drop()` gives it back for good (`past_free_memory(..., drop=load.drop)`: a run whose
    host memory it would stand in the way of); `load.timings`: what the making and the copies took."""
    made: dict[str, Any] = {}
    timings: dict[str, Any] = {"made_s": None, "copies": 0, "copy_s": 0.0, "kept": None}

    def load() -> torch.nn.Module:
        if "cpu_rng" not in made:  # the first call
            t = time.perf_counter()
            model = init()
            made["cpu_rng"] = torch.get_rng_state()
            timings["made_s"] = round(time.perf_counter() - t, 2)
            size = sum(x.nbytes for x in {id(x): x for x in [*model.parameters(), *model.buffers()]}.values())
            timings["kept"] = not past_free_memory(2 * size / MiB)
            if not timings["kept"]:
                return model
            made["model"] = model
        if "model" not in made:  # none kept, or given back
            return init()
        t = time.perf_counter()
        model = copy.deepcopy(made["model"])
        torch.manual_seed(seed)  # the CUDA generators, as init() seeds them
        torch.set_rng_state(made["cpu_rng"])
        timings["copies"] += 1
        timings["copy_s"] = round(timings["copy_s"] + time.perf_counter() - t, 2)
        return model

    def drop() -> bool:
        """Give the kept model back (each load from now on makes the model afresh); True where one was kept."""
        if had := made.pop("model", None) is not None:
            timings["kept"] = "dropped"
            gc.collect()
        return had

    load.timings = timings  # (s) made_s: the one init(); copy_s: the copies in all; kept: False where no room
    load.drop = drop
    return load


def published_table() -> pd.DataFrame:
    """The published memory table (study2_memory_table of data/published_claims.json), with its source."""
    claims = json.loads((ROOT / "data" / "published_claims.json").read_text())["study2_memory_table"]
    df = pd.DataFrame(claims["rows"])
    df["published_mib"] = df["memory_gb"] * 1e9 / MiB
    df["source"] = claims["source"]
    # Which setup each published row describes. "FP16 full model" at half of FP32's memory describes
    # pure 16-bit weights, gradients and optimizer state (bf16_true): autocast (the fp16/bf16 rungs)
    # keeps fp32 weights and AdamW state and cannot halve a step's memory (see `precision_verdict`).
    # The FP16 rows after it add checkpointing or an adapter to that same pure 16-bit step (mapped to
    # autocast's rungs, checkpointing had read as costing FP16 3.6 GB on Qwen2-0.5B).
    df["rung"] = df["strategy"].map({
        "FP32 full model": "fp32", "FP16 full model": "bf16_true", "FP16 + gradient checkpointing": PURE_CKPT.name,
        "FP16 + adapter (6%)": "bf16_true_lora", "CPU offload": "zero_offload", "CPU only": "cpu",
    })
    return df


# the published "FP16 + gradient checkpointing": pure 16-bit with checkpointing, which no rung is
PURE_CKPT = RUNGS["bf16_true"].compose("bf16_true_ckpt", "pure bf16 + gradient checkpointing",
                                       grad_checkpointing=True)


def _labelled(sinks: list[Sink], **labels: Any) -> tuple[Sink, ...]:
    """One sink that adds `labels` to each row and passes it on to every sink (none: nothing)."""
    if not sinks:
        return ()

    def feed(row: dict[str, Any]) -> None:
        row = {**row, **labels}
        for sink in sinks:
            sink(row)

    return (feed,)


def _chart(sinks: list[Sink], name: str, budget_mib: float | None) -> tuple[Sink, ...]:
    """The sinks of a rung's measured steps: labelled with its stage and the budget; the cpu rung's
    without a memory figure (its device holds nothing, as its row says: the live bytes the count
    gives for it are the host's, and were drawn as device memory over the budget's line)."""
    host = name in RUNGS and RUNGS[name].placement == "cpu"
    return _labelled(sinks, stage="ladder", budget_mib=budget_mib, **({"mem_mib": None} if host else {}))


def _event(sinks: list[Sink], **row: Any) -> None:
    for sink in sinks:
        sink({"event": "attempt", **row})


def run_ladder(cfg: LadderConfig, sinks: Iterable[Sink] = (), *, progress: bool = True) -> StudyResult:
    """Predict (and where possible measure) every rung: `runs` has one row per (model, rung).

    `sinks` get every measured training step as a plain row (see the module docstring). `progress`:
    bars on standard error, over the rungs (each predicted, then measured: the default ladder said
    nothing for minutes) and over auto-fit's setups (a large micro_batch has many divisors to try)."""

    threads = torch.get_num_threads()  # given back after: the next study in a notebook's kernel has its own
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        device = cfg.resolved_device() if cfg.autofit else None  # where auto-fit runs: a missing card says so first
        # a missing model or reference config is said before the run's folder is made (it was left holding
        # config.partial.json and a lock alone), and before the model at hand (the embedded base: minutes)
        ref = model_config(_resolve(cfg.reference_model)) if cfg.reference_model else None
        if cfg.model != EMBEDDED:
            resolve_model_path(_resolve(cfg.model))
        with RunDir(STUDY, cfg.run_id()).training():  # the same ladder started elsewhere at once waits, then reads back
            return _run_ladder(cfg, list(sinks), progress, device, ref)
    finally:
        torch.set_num_threads(threads)


def _run_ladder(cfg: LadderConfig, sinks: list[Sink], progress: bool, device, ref) -> StudyResult:
    run = RunDir(STUDY, cfg.run_id())
    run.write_config(cfg.to_dict())
    config, load, blocks, data_note = model_at_hand(cfg)
    budget = int(cfg.budget_mib * MiB)
    rows: list[dict[str, Any]] = []
    inputs = {"model_fingerprint": model_fingerprint(_resolve(cfg.model), cfg.spec()), "workbench_version": __version__,
              "workbench_code": code_fingerprint(), "libraries": library_versions()}
    finished = _finished_rungs(run, inputs) if reuse_finished_runs() else {}
    # the rungs reused, on disk whole before the call goes on (emptied first and then written back, a kill in
    # between lost them); each rung this call finishes is appended
    atomic_write_text(run.path / "rungs.jsonl", "".join(json.dumps({"rung": row["rung"], "inputs": inputs, "row": row},
                                                                   default=float) + "\n" for row in finished.values()))
    steps_sink, rungs_sink = _resumed_steps(run, finished, sinks), JsonlSink(run.path / "rungs.jsonl")
    for name in tqdm(cfg.rungs, desc="ladder", unit="rung", disable=not progress, file=sys.stderr):
        if name in finished:
            rows.append({**finished[name], "reused": True})  # read back, not measured by this call
            continue
        # the step as the study's own live-bytes count (a dispatch mode) runs it: the figure it is held to
        try:
            p = predict(config, name, batch=cfg.micro_batch, seq=cfg.seq_len, n_blocks=len(blocks), instrumented=True)
        except StrategyNotApplicable as e:  # QLoRA without bitsandbytes: the rung's row says so, the others run
            rows.append({**_head(name, cfg.model, "at hand", cfg.budget_mib), "method": "not predicted",
                         "status": "skipped", "reason": str(e), "data": data_note})
            continue
        row = {**p.row(), "model_label": p.model, **_head(name, cfg.model, "at hand", cfg.budget_mib),
               "fits_predicted": p.fit_bytes <= budget, "data": data_note}
        if cfg.measure:
            torch.manual_seed(cfg.seed)
            # the rungs are measured on this CPU (device or host), with no budget enforced: one
            # past the free memory would have the OOM killer take the study with it
            too_big = past_free(p)
            if too_big:
                m = {"status": "skipped", "reason": too_big}
            else:
                m = measure(name, load, blocks, batch=cfg.micro_batch, steps=cfg.steps, lr=cfg.lr,
                            sinks=(steps_sink, *_chart(sinks, name, cfg.budget_mib)))
            if m["status"] != "ok":
                _event(sinks, rung=name, attempt=name, result=m["status"])
            row.update({k: v for k, v in m.items() if k not in row or k in ("status", "reason")})
            if m["status"] == "ok":
                row["fits_measured"] = m["measured_peak_bytes"] <= budget
                row["predicted_vs_measured"] = (p.peak_bytes / m["measured_peak_bytes"]
                                                if m["measured_peak_bytes"] else float("nan"))
        else:
            row.update(status="skipped", reason="measure=False")
        rows.append(row)
        rungs_sink({"rung": name, "inputs": inputs, "row": row})  # flushed: a killed run keeps it
    steps_sink.close()
    rungs_sink.close()

    ref_rows = []
    if cfg.reference_model:
        ref_budget = int(cfg.reference_budget_mib * MiB)
        for name in tqdm(cfg.rungs, desc="reference predictions", unit="rung", disable=not progress, file=sys.stderr):
            try:
                p = predict(ref, name, batch=cfg.reference_micro_batch, seq=cfg.reference_seq_len,
                            device=cfg.reference_device)
            except StrategyNotApplicable as e:
                ref_rows.append({**_head(name, cfg.reference_model, "reference", cfg.reference_budget_mib),
                                 "method": "not predicted", "status": "skipped", "reason": str(e)})
                continue
            ref_rows.append({**p.row(), **_head(name, cfg.reference_model, "reference", cfg.reference_budget_mib),
                             "fits_predicted": p.fit_bytes <= ref_budget,
                             "status": "skipped", "reason": "reference model: predicted only (no weights here)"})
    df = pd.DataFrame(rows + ref_rows)
    # (every rung skipped before its prediction, QLoRA alone without bitsandbytes: no column to divide)
    df["predicted_peak_mib"] = df.get("predicted_peak_bytes", pd.Series(float("nan"), index=df.index)) / MiB
    if "measured_peak_bytes" in df:
        df["measured_peak_mib"] = df["measured_peak_bytes"] / MiB

    # Auto-fit for the model at hand, with the budget enforced: the joint search from the ladder's
    # top rung (the setup the user would train) keeps the batch per step; step down on a real OOM.
    # On a card (device auto or cuda) under a real CUDA budget, else the budget played on the CPU.
    fit_rows: list[dict[str, Any]] = []
    search_table = pd.DataFrame()
    if device is not None:
        choice = search_here(config, RUNGS[cfg.rungs[0]], device=device, batch=cfg.micro_batch, seq=cfg.seq_len,
                             budget_mib=cfg.budget_mib, progress=progress)
        search_table = pd.DataFrame(choice.table)
        chosen, tries = run_choice(choice, config, load, blocks, device=device, batch=cfg.micro_batch,
                                   budget_mib=cfg.budget_mib, lr=cfg.lr,
                                   sinks=_labelled(sinks, stage="auto-fit", budget_mib=cfg.budget_mib),
                                   on_event=lambda **row: _event(sinks, **row))
        fit_rows = [{**t, "predicted_choice": choice.plan.name if choice.plan else None, "ran": chosen,
                     "why": choice.why, "budget_mib": cfg.budget_mib} for t in tries]

    # Side tables for the notebook: what others claim / estimate, beside our prediction.
    published = published_table()
    baselines = pd.DataFrame()
    if cfg.reference_model:
        baselines = pd.DataFrame(baseline_table(ref))
        predicted = [r for r in ref_rows if "predicted_peak_bytes" in r]  # not a skipped rung's
        ours = {r["rung"]: r["predicted_peak_bytes"] for r in predicted}
        baselines["workbench_predicted_bytes"] = baselines["compares_to"].map(ours)
        ours_ref = {r["rung"]: r["predicted_peak_mib"] for r in predicted}
        if "bf16_true" in cfg.rungs:  # the published table's pure 16-bit step with checkpointing
            ours_ref[PURE_CKPT.name] = predict(ref, PURE_CKPT, batch=cfg.reference_micro_batch,
                                               seq=cfg.reference_seq_len, device=cfg.reference_device).peak_bytes / MiB
        published["workbench_predicted_mib"] = published["rung"].map(ours_ref)
        host = {r["rung"]: r["host_bytes"] / MiB for r in predicted}
        published.loc[published["rung"] == "cpu", "workbench_predicted_mib"] = host.get("cpu")
    tables = {"ladder": df, "baselines": baselines, "published": published, "autofit": pd.DataFrame(fit_rows),
              "autofit_search": search_table}
    writer = ResultsWriter(STUDY)
    paths = {name: str(writer.table(name, table, run=cfg.run_id())) for name, table in tables.items()}
    statuses = set(df["status"])
    measured_ok = int((df["status"] == "ok").sum())
    autofit_ran = fit_rows[-1]["ran"] if fit_rows else None
    # where auto-fit's run trained (study 1's `device` is where its run finished): the setting where none did
    ran_on = fit_rows[-1].get("device") if autofit_ran else cfg.device
    status = "error" if statuses == {"error"} else "ok"  # runs.csv's too (it had said ok whatever summary.json said)
    run.write_summary({"status": status, "rungs": len(cfg.rungs),
                       "measured_ok": measured_ok, "autofit_ran": autofit_ran,
                       "autofit_device": device})
    # runs.csv: one row per ladder run, with its figures (a sweep stacks these rows, one per point);
    # a run with the same settings replaces its earlier row. Its `device` is where auto-fit's run trained.
    writer.update_runs([{**{k: json.dumps(v) if isinstance(v, list) else v for k, v in cfg.to_dict().items()},
                         "device": ran_on, "run_id": cfg.run_id(), "status": status, "measured_ok": measured_ok,
                         "autofit_ran": autofit_ran, **_figures_of(df)}])
    steps = read_steps(run.path / "steps.jsonl") if (run.path / "steps.jsonl").exists() else pd.DataFrame()
    return StudyResult(STUDY, runs=df, steps=steps, tables={k: v for k, v in tables.items() if k != "ladder"},
                       paths={**paths, "run_dir": str(run.path)})


def _head(rung: str, model: str, role: str, budget_mib: float) -> dict[str, Any]:
    """What every row of a rung says of it, predicted or not."""
    return {"rung": rung, "model": model, "role": role, "tier": RUNGS[rung].tier, "help": RUNGS[rung].help,
            "budget_mib": budget_mib}


def _figures_of(df: pd.DataFrame) -> dict[str, float]:
    """Each rung's peaks for the model at hand, as runs.csv columns: `<rung>_predicted_mib` and, where
    it ran, `<rung>_measured_mib`; and the largest prediction error over the measured rungs (%)."""
    out: dict[str, float] = {}
    hand = df[df["role"] == "at hand"]
    for _, r in hand.iterrows():
        out[f"{r['rung']}_predicted_mib"] = round(float(r["predicted_peak_mib"]), 3)
        if r.get("status") == "ok" and pd.notna(r.get("measured_peak_mib")):
            out[f"{r['rung']}_measured_mib"] = round(float(r["measured_peak_mib"]), 3)
    if "predicted_vs_measured" in hand and hand["predicted_vs_measured"].notna().any():
        out["max_prediction_error_pct"] = round(float((hand["predicted_vs_measured"] - 1).abs().max() * 100), 3)
    return out


def _finished_rungs(run: RunDir, inputs: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The rows of rungs an earlier run with these settings measured (rungs.jsonl), where the weights, the
    workbench version and its code are the same; a line cut short by a kill is left out, and so is a rung that
    measured nothing (skipped, out of memory, an error: it runs again, as the machine is now)."""
    path = run.path / "rungs.jsonl"
    done = {}
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("inputs") == inputs and rec.get("rung") in RUNGS and rec.get("row", {}).get("status") == "ok":
            done[rec["rung"]] = rec["row"]
    return done


def _resumed_steps(run: RunDir, finished: dict[str, dict], sinks: list[Sink]) -> JsonlSink:
    """This call's steps (steps.partial.jsonl, which its summary puts in place as steps.jsonl) started afresh
    with the steps of the rungs reused (their charts are sent to the sinks again), read from a killed call's
    partial file, else the finished call's; a rung cut short left steps that are dropped, and it runs again.
    The finished call's steps.jsonl stays beside its ladder.csv until this call finishes: a call killed
    part-way (re-measuring, WORKBENCH_RERUN=1) had left its few steps beside the earlier call's table."""
    partial = run.partial("steps.jsonl")
    path = partial if partial.exists() else run.path / "steps.jsonl"
    kept = read_steps(path) if finished and path.exists() and path.stat().st_size else pd.DataFrame()
    rows = kept[kept["rung"].isin(list(finished))].to_dict("records") if "rung" in kept else []
    # on disk whole before the charts get them: a kill while they redraw loses none of them
    atomic_write_text(partial, "".join(json.dumps(row, default=float) + "\n" for row in rows))
    for row in rows:
        for s in _chart(sinks, row["rung"], finished[row["rung"]].get("budget_mib")):
            s(row)
    return JsonlSink(partial)


def load_result() -> StudyResult | None:
    """The latest ladder run, read back from results/ladder/ (None if it never ran)."""
    root = results_root() / STUDY
    runs = read_table(root / "runs.csv")
    if runs.empty:
        return None
    last = runs.sort_values("recorded").iloc[-1] if "recorded" in runs else runs.iloc[-1]
    run_dir = root / str(last["run_id"])
    ladder = read_table(run_dir / "ladder.csv")
    if ladder.empty:
        return None
    steps_path = run_dir / "steps.jsonl"
    steps = read_steps(steps_path) if steps_path.exists() and steps_path.stat().st_size else pd.DataFrame()
    tables = {name: read_table(run_dir / f"{name}.csv") for name in ("baselines", "published", "autofit", "autofit_search")}
    return StudyResult(STUDY, runs=ladder, steps=steps, tables=tables, paths={"run_dir": str(run_dir)})
