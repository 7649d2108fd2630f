"""Study 3: when the optimizer must live on the host, how much speed does an adaptive
accelerator/host split of the Adam update win back?

    result = run_split_study(SplitConfig())     # a StudyResult (workbench.core.results)
    result.runs                          # one row per run, measured, modelled and published
    result.steps                         # one row per iteration of every measured run (loss, k, overlap)
    result.tables["timeline"]            # backward, transfers and updates of one iteration, per side
    result.tables["sensitivity"]         # k of the seed's setting against sequence length, host and MFU
    result.tables["verdict"]             # for which settings the seed's k band holds (one row per host, MFU)
    result.tables["validation"]          # the model against published offload measurements, error per point
    result.tables["model_inputs"]        # every input of the performance model with its source
    result.facts["host_and_published"]   # this machine's host rates; the seed's operating point

Written to results/split/: runs.csv (earlier settings' rows kept) and, in the settings' folder
(results/split/<study_key>/), steps.csv, a CSV per side table and host_and_published.json.

Two halves. Measured: the engine fine-tunes the embedded base (the tiny one in tests) on the real target
corpus here for k = 0 (host-only update), a static sweep of k, adaptive k and plain torch AdamW (optionally
DeepSpeed ZeRO-Offload), on the same blocks from the same weights, with held-out perplexity before and after
each run; on a CPU-only machine the accelerator is the CPU, so these runs show that training is unchanged
and how the work overlaps, not GPU speed. Modelled: the performance model runs the same sweep for a real
model on named GPUs, with the host's rate from a bandwidth model of the named host (see perf_model). Every
row says which it is in `source` (measured / modelled / published). Charts and the report section:
workbench.studies.split.figures; the widget app: workbench.front.apps.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import sys
from typing import Callable, Iterable

import pandas as pd
import torch
from tqdm import tqdm

from workbench.core.common import Sink
from workbench.core.fallback import freed_on_interrupt, release
from workbench.core.models import check_seq_len, load_model
from workbench.core.results import ResultsWriter, RunDir, StudyResult, latest, locked, read_table, results_root
from workbench.core.training import check_loss
from workbench.studies.split import perf_model as pm
from workbench.studies.split.adam import AdamHP, backend_status
from workbench.studies.split.balance import balance_k, settled
from workbench.studies.split.batches import base_perplexity, heldout_ppl, text_batches
from workbench.studies.split.config import STUDY, SplitConfig
from workbench.studies.split.engine import SplitEngine, first_decision
from workbench.studies.split.preflight import MemoryHold, failure
from workbench.studies.split.reference import plain_adamw
from workbench.studies.split.zero_baseline import run_zero_offload


class _RunSink:
    """Collects each iteration's row of one run and hands them to the study's sinks as training rows.

    It adds the run's labels, `step` (iteration + 1), cumulative `tokens` (the engine's row counts
    one iteration's: kept as `iteration_tokens`) and, on CUDA, `mem_mib`: the iteration's `accel_peak_mib`.
    The rows are passed on by `flush()` when the run ends, not as they come: the engine emits a row
    between an iteration's forward and backward, so a chart redraw there (~20 ms here) would be
    timed as backward and move the adaptive k. A run of the tiny model takes seconds.
    """

    def __init__(self, sinks: list[Sink], labels: dict, device: torch.device):
        self.sinks, self.labels, self.device = sinks, labels, device
        self.tokens = 0
        self.rows: list[dict] = []

    def __call__(self, row: dict) -> None:
        self.tokens += row["tokens"]
        out = {**row, **self.labels, "step": row["iteration"] + 1, "iteration_tokens": row["tokens"],
               "tokens": self.tokens}
        if self.device.type == "cuda":
            out["mem_mib"] = row.get("accel_peak_mib")
        self.rows.append(out)

    def flush(self) -> None:
        for row in self.rows:
            for sink in self.sinks:
                sink(row)
        self.rows = []


# ---------------------------------------------------------------- measured runs
def _runs(cfg: SplitConfig) -> list[dict]:
    """(name, mode, engine kwargs; `short`: why a run too short to adapt is not run) of every measured run."""
    runs = [{"name": f"k={k:g}", "mode": "host only (k=0)" if k == 0 else "static",
             "kw": dict(k=k, adaptive=False)} for k in cfg.k_sweep]
    if cfg.adaptive:  # a run too short for k to move would be k=k_start under another name
        first = first_decision(cfg.k_every)
        runs.append({"name": "adaptive", "mode": "adaptive",
                     "kw": dict(k=cfg.k_start, adaptive=True, k_every=cfg.k_every),
                     "short": first >= cfg.steps and f"k is first recomputed at iteration {first} (k_every="
                     f"{cfg.k_every}), past the run's {cfg.steps} steps: not run (raise steps to {first + 1})"})
    return runs


def _finite(rows: list[dict], lr: float) -> list[dict]:
    """`rows`, where every iteration's loss is finite; else LossDiverged (the run is an error row:
    its speed was measured on NaNs, its parity and perplexity mean nothing)."""
    for r in rows:
        check_loss(r["loss"], r["iteration"] + 1, lr)
    return rows


def _summary(rows: list[dict], warmup: int) -> dict:
    """After warm-up: tokens/s total over total, the shares weighted by time / host parameters, means;
    and the k the run settled on with its tokens/s (an adaptive run's whole-run figures mix its ks)."""
    df = pd.DataFrame(rows)
    keep = df[df["iteration"] >= warmup] if len(df) > warmup else df
    out = {"iterations": len(df), "warmup": warmup, "first_loss": float(df["loss"].iloc[0]),
           "final_loss": float(df["loss"].iloc[-1]), **settled(rows, warmup)}
    for col in ("iteration_ms", "k_actual", "alpha", "forward_wait_ms", "host_tail_ms"):
        if col in keep:
            out[col] = float(keep[col].mean())
    for col, weight in (("accel_idle_share", "iteration_ms"), ("host_done_before_bwd_end_share", "host_params")):
        if col in keep and weight in keep:
            w = keep[weight].where(keep[col].notna(), 0.0)
            out[col] = float((keep[col].fillna(0.0) * w).sum() / w.sum()) if w.sum() > 0 else float("nan")
    out["tokens_per_s"] = float(keep["tokens"].sum() / (keep["iteration_ms"].sum() / 1e3))
    if out["settled_k"] is None and "k_actual" in df and df["k_actual"].nunique() > 1:  # why no settled figures
        last = df["k_actual"].iloc[-1]
        n = int(((df["k_actual"] == last) & (df["iteration"] >= warmup)).iloc[::-1].cummin().sum())
        out["reason"] = (f"k still moving at the end: its last k, {last:.2f}, ran {n} measured iteration(s), and "
                         "settled figures need 2 (raise steps); k_actual and tokens/s mix the ks it tried")
    return out


def measured_runs(cfg: SplitConfig, sinks: Iterable[Sink] = (),
                  run_dir: Callable[[str], object] | None = None, progress: bool = True):
    """Fine-tune the base under every measured setting; (run rows, step rows, timeline rows).

    `sinks` get each iteration's row of every engine run (the reference and ZeRO-Offload runs send
    none), as each run ends (_RunSink: labelled with `run` and `mode`)."""
    sinks = list(sinks)
    device = torch.device(cfg.resolved_device())
    base, tokenizer = load_model(cfg.model, spec=cfg.spec())  # the embedded base (built once, cached) or a real one
    check_seq_len(base.config, cfg.seq_len, repr(cfg.model))  # past learned positions: one line, not an IndexError
    shape = pm.shape_from_model(base, cfg.model, cfg.seq_len)
    flops_tok = shape.flops_per_token()
    batches, held = text_batches(cfg, tokenizer)
    batches, held = [b.to(device) for b in batches], held.to(device)
    ppl_before = base_perplexity(base, held, device)
    hp = AdamHP(lr=cfg.lr, weight_decay=cfg.weight_decay)
    runs, steps, events = [], [], []
    name = f"{cfg.model} ({cfg.base_size})" if cfg.model == "embedded" else cfg.model
    common = {"source": "measured", "hardware": f"this machine ({device.type})", "model": name,
              "corpus": cfg.corpus, "n_params": shape.n_params, "precision": cfg.precision, "backend": cfg.backend,
              "heldout_blocks": len(held), "ppl_before": ppl_before}

    # past the host's free memory a run is killed, not an OutOfMemoryError: held to a prediction (CPU) or floor (card)
    hold = MemoryHold(cfg, base.config, device, shape.n_params)
    ref_w = None
    # torch's fused AdamW whatever the engine's backend, at the study's precision (mixed: fp32 weights)
    ref_head = {**common, "run": "plain AdamW", "mode": "plain AdamW", "k_target": 1.0, "backend": "torch"}
    if cfg.reference and (why := hold.reason("reference")):
        runs.append({**ref_head, "status": "skipped", "reason": why})
    elif cfg.reference:
        try:  # on a card too small for the plain step (study 3's case): out of memory, a row
            model = copy.deepcopy(base).to(device)
            rows = _finite(plain_adamw(model, batches, hp, cfg.max_grad_norm, cfg.precision), cfg.lr)
        except Exception as e:
            runs.append({**ref_head, **failure(e)})
        else:
            ref_w = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
            for r in rows:
                steps.append({**r, "run": "plain AdamW", "mode": "plain AdamW", "source": "measured"})
            runs.append({**ref_head, "status": "ok", **_summary(rows, cfg.untimed_steps),
                         "ppl_after": heldout_ppl(model, held)})
        model = None  # the card's memory for the runs after it
        release(device)

    status = backend_status(cfg.backend)
    for spec in tqdm(_runs(cfg), desc="split", unit="run", file=sys.stderr, disable=not progress):  # (~30 s silent)
        name = spec["name"]
        head = {**common, "run": name, "mode": spec["mode"], "k_target": spec["kw"]["k"]}
        why = status if status != "ok" else hold.reason("engine", spec["kw"]["k"], compared=ref_w is not None)
        why = why or spec.get("short")
        if why:
            runs.append({**head, "status": "skipped", "reason": why})
            continue
        rd = run_dir(name) if run_dir else None
        jsonl = rd.steps_sink() if rd else None
        tag = {"run": name, "mode": spec["mode"], "source": "measured"}
        live = _RunSink(sinks, tag, device)
        run_sinks = ([live] if sinks else []) + ([jsonl] if jsonl else [])
        eng = row = None
        try:
            model = copy.deepcopy(base)  # on the host: the engine moves only its training copy to the device
            eng = SplitEngine(model, hp=hp, precision=cfg.precision, backend=cfg.backend,
                              host_workers=cfg.host_workers, include_transfer=cfg.include_transfer,
                              sinks=run_sinks, max_grad_norm=cfg.max_grad_norm, device=device, **spec["kw"])
            for b in batches:
                eng.step(b)
            eng.close()
            _finite(eng.rows, cfg.lr)
        except Exception as e:  # a failed run is a row, never a gap (on a card: out of memory too)
            row = failure(e)
        finally:
            if jsonl:
                jsonl.close()
            live.flush()  # the rows it made, also those of a run that failed
            if eng is not None:  # its hooks keep it and the model alive after a failure or ^C (closed: nothing left)
                eng.abort()
        if row:
            model = eng = None
            release(device)
            runs.append({**head, **row})
            if rd:
                rd.write_summary(row)
            continue
        summary = {**head, "status": "ok", **_summary(eng.rows, cfg.untimed_steps), "ppl_after": heldout_ppl(model, held),
                   "pinned_bytes": eng.pinned_bytes, "staging_bytes": eng.staging_bytes}
        if ref_w is not None:
            masters = eng.master_weights()
            summary["max_abs_diff_vs_adamw"] = max(float((masters[n] - w).abs().max()) for n, w in ref_w.items())
        runs.append(summary)
        if rd:
            rd.write_summary(summary)
        steps += [{**r, **tag, "warmup": r["iteration"] < cfg.untimed_steps} for r in eng.rows]
        last = max(e["iteration"] for e in eng.events)
        events += [{**e, **tag} for e in eng.events if e["iteration"] == last]
        model = eng = None  # before the next run's copy is made (its right-hand side comes first)
        release(device)

    if cfg.zero_offload:
        reason = hold.reason("zero")  # on a CPU held as an engine run; on a card to DeepSpeed's host state
        head = {**common, "run": "DeepSpeed ZeRO-Offload", "mode": "ZeRO-Offload", "k_target": 0.0,
                "backend": "deepspeed"}
        row = None
        if not reason:
            try:
                rows, reason = run_zero_offload(copy.deepcopy(base).to(device), batches, cfg.lr, cfg.weight_decay,
                                                cfg.precision, cfg.max_grad_norm)
                _finite(rows, cfg.lr)
            except Exception as e:  # out of memory on a card: a row
                row = failure(e)
        if row:
            release(device)
            runs.append({**head, **row})
        elif reason:
            runs.append({**head, "status": "skipped", "reason": reason})
        else:
            runs.append({**head, "status": "ok", **_summary(rows, cfg.untimed_steps)})  # its weights stay in DeepSpeed
            steps += [{**r, "run": head["run"], "mode": "ZeRO-Offload", "source": "measured"} for r in rows]

    for r in runs:
        if "tokens_per_s" in r:
            r["tflops"] = r["tokens_per_s"] * flops_tok / 1e12
    return runs, steps, events


# ---------------------------------------------------------------- modelled runs
def modelled_runs(cfg: SplitConfig, host: dict):
    """The performance model's sweep on each GPU profile; (run rows, timeline rows)."""
    shape = pm.model_shape(cfg.modelled_model, cfg.modelled_seq_len)
    rows, events = [], []
    for gpu in cfg.profiles:
        m = pm.machine(gpu, cfg.host, host_meas=host, host_share=cfg.host_share, alpha=cfg.alpha)
        r = pm.rates(shape, m, cfg.modelled_micro_batch, cfg.modelled_recompute)
        # the balance asks for k; the card's memory caps it (master + Adam state of k live there)
        k_mem = pm.k_max_for_memory(shape, cfg.modelled_micro_batch, m.memory_bytes, cfg.modelled_recompute)
        k_adapt = min(balance_k(r, cfg.include_transfer), k_mem)
        hw = f"{gpu} + {cfg.host}"
        specs = [(f"k={k:.2f}", "static" if k else "host only (k=0)", k, "split")
                 for k in (i / (cfg.modelled_k_points - 1) for i in range(cfg.modelled_k_points))]
        specs += [("adaptive", "adaptive", k_adapt, "split"),
                  ("seed formula", "seed formula (no transfers)", min(balance_k(r, False), k_mem), "split"),
                  ("ZeRO-Offload", "ZeRO-Offload", 0.0, "zero-offload"),
                  ("all on accelerator", "all on accelerator", 1.0, "all-accelerator")]
        for name, mode, k, sim_mode in specs:
            sim = pm.simulate(shape, m, k, cfg.modelled_micro_batch, sim_mode, cfg.modelled_recompute)
            ev = sim.pop("events")
            row = {**sim, "source": "modelled", "hardware": hw, "run": f"{gpu}: {name}", "mode": mode,
                   "model": shape.name, "n_params": shape.n_params, "precision": "bf16", "recompute": cfg.modelled_recompute,
                   "backend": "modelled", "alpha": m.alpha, "mfu": m.notes["mfu"], "t_backward_s": r.t_backward_s,
                   "t_update_host_s": r.t_update_host_s, "t_transfer_s": r.t_transfer_s,
                   "k_balance": balance_k(r, cfg.include_transfer), "k_max_memory": k_mem,
                   "host_rate_from": m.notes["host update"], "compute_from": m.notes["forward/backward"],
                   "host_share_from": m.notes["host share"],  # as machine() took it
                   "status": "ok" if sim["fits"] else "oom",  # an OOM is a result: a row, without a speed
                   **({} if sim["fits"] else {"reason": _oom_reason(sim, m)})}
            rows.append(row)
            if name == "adaptive":
                events += [{**e, "source": "modelled", "run": row["run"], "iteration": 0} for e in ev]
    return rows, events


def published_rows(host: dict) -> tuple[list[dict], dict]:
    """The seed's claim beside what the model computes for its setting from its own inputs
    (none of them the seed's figures), at profiles.json's sequence length and first host."""
    claims = pm.published_claims()
    op = pm.published_operating_point(host_meas=host)
    lo, hi = op["k_band"]
    claim = {"source": "published", "hardware": f"{claims['setup']['gpu']} + {claims['setup']['cpu']}",
             "run": "seed (HyTrainDNN)", "mode": "adaptive", "model": claims["setup"]["model"],
             "tflops": claims["claims"]["throughput_tflops"], "alpha": claims["claims"]["alpha"],
             "k_band": f"{lo}-{hi}", "status": "ok", "published_setting": True}
    shape, m = pm.model_shape(op["model"], op["seq_len"]), pm.machine(op["gpu"], op["host"], host_meas=host)
    sim = pm.simulate(shape, m, min(op["k_seed_formula"], op["k_max_memory"]), op["batch"], recompute=op["recompute"])
    sim.pop("events")  # at the seed's formula capped by what the card holds: uncapped, the card runs out
    recompute = "with" if op["recompute"] else "without"
    model_row = {**sim, "source": "modelled", "hardware": f"{op['gpu']} + {op['host']} (published setting)",
                 "run": f"published setting, seq {op['seq_len']}, {recompute} recompute: seed formula, memory-capped",
                 "model": op["model"], "k_max_memory": op["k_max_memory"], "n_params": op["n_params"],
                 "alpha": op["alpha_modelled"], "mfu": op["mfu"], "recompute": op["recompute"],
                 "t_backward_s": op["t_backward_s"], "t_update_host_s": op["t_update_host_s"],
                 "t_transfer_s": op["t_transfer_s"], "k_balance": op["k_seed_formula"], "k_band": f"{lo}-{hi}",
                 "host_rate_from": op["host_rate_from"], "compute_from": op["compute_from"],
                 "host_share_from": m.notes["host share"],  # measured here: never the what-if settings' share
                 "mode": "seed formula (no transfers)", "status": "ok" if sim["fits"] else "oom", "published_setting": True,
                 **({} if sim["fits"] else {"reason": _oom_reason(sim, m)})}
    return [claim, model_row], op


def _oom_reason(sim: dict, m) -> str:  # what a modelled run that does not fit needs, of what there is
    return f"needs {sim['accel_memory_gib']:,.2f} GiB of {m.memory_bytes / 2**30:,.2f} GiB"  # as accel_memory shows it


# ---------------------------------------------------------------- the entry point
def run_split_study(cfg: SplitConfig, sinks: Iterable[Sink] = (), *, progress: bool = True) -> StudyResult:
    """Run study 3 (measured + modelled): one row per run, the iterations, and the side tables.

    `sinks` get every iteration of the engine's runs as a plain row (loss, cumulative tokens,
    tokens_per_s, k, labelled with `run` and `mode`; `mem_mib` on CUDA), run by run as each run
    ends (see _RunSink). The modelled half sends nothing: it is not a run."""
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        key = cfg.hash()
        run_dir = None
        if cfg.write_results:
            def run_dir(name: str):
                rd = RunDir(STUDY, f"{key}-{name.replace('=', '').replace(' ', '_')}")
                rd.write_config({**cfg.to_dict(), "run": name})
                return rd

        # the same settings started elsewhere at once wait: both had written each run's one steps.jsonl
        # (and timed their runs on shared cores); study 3 reuses nothing, so the second measures after the first
        hold = locked(results_root() / STUDY / f"{key}-measuring", waiting=f"split: study 3 with these settings "
                      f"({key}) is being measured by another process; waiting for it to finish") \
            if cfg.write_results else contextlib.nullcontext()
        with hold, freed_on_interrupt(cfg.resolved_device()):  # ^C: the runs' model is not kept on the card
            runs, steps, events = measured_runs(cfg, sinks, run_dir, progress)
            # The host Adam's share of the Adam-pattern bandwidth and one core's bandwidth, per core, measured on
            # one thread (the host model scales it to the named host's cores; on a shared machine a multi-threaded
            # measurement mostly measures the other processes: 2 threads seen 50x slower under load, 1 unchanged).
            # The modelled half after it runs on one thread too, as it did until ffa30aa (after which a CI run's
            # study 3 notebook cell, under load, went 15 minutes without a word past its measured runs)
            torch.set_num_threads(1)
            host = pm.measure_here()  # `split --published`'s own
        mod_rows, mod_events = modelled_runs(cfg, host)
        pub_rows, op = published_rows(host)
        verdict = pm.seed_verdict(host)
        validation = pd.DataFrame(pm.validate(host))
        inputs = pd.DataFrame(pm.model_inputs(host, cfg.host_share, cfg.alpha))
    finally:
        torch.set_num_threads(threads)

    df = pd.DataFrame(runs + mod_rows + pub_rows)
    df.insert(0, "study_key", key)
    df.insert(1, "panel", df["source"] + ": " + df["hardware"])  # one chart panel per machine
    for col in ("tokens_per_s", "tflops"):  # an OOM row has no speed
        df.loc[df["status"] == "oom", col] = math.nan
    steps_df = pd.DataFrame(steps)
    timeline = pd.DataFrame(events + mod_events)
    if len(timeline):
        timeline["duration_ms"] = timeline["end_ms"] - timeline["start_ms"]
    sensitivity = pd.DataFrame(verdict["rows"]).assign(source="modelled")
    verdicts = pd.DataFrame(verdict["verdicts"])
    op = {**op, "verdict": verdict["text"]}
    result = StudyResult(STUDY, runs=df, steps=steps_df,
                         tables={"timeline": timeline, "sensitivity": sensitivity, "verdict": verdicts,
                                 "validation": validation, "model_inputs": inputs},
                         facts={"host_and_published": {"host": host, "published": op}})
    if cfg.write_results:  # the steps and side tables in the settings' folder, runs.csv last
        ResultsWriter(STUDY).write(result, run=key, runs_key="study_key")
    return result


def load_result() -> StudyResult | None:
    """The latest settings' result, read back from results/split/: runs.csv's rows of the latest call and
    the steps and side tables of their settings' folder (None if it never ran). The tables were beside
    runs.csv, one set for every setting: a call of other settings killed before its runs.csv showed its
    own loss curves, timeline and inputs under the earlier call's runs."""
    root = results_root() / STUDY
    runs = latest(read_table(root / "runs.csv", ["study_key"]), "study_key")
    if runs.empty:
        return None
    folder = root / str(runs["study_key"].iloc[0])
    folder = folder if (folder / "steps.csv").exists() else root  # written before the settings' folders
    tables = {name: read_table(folder / f"{name}.csv")
              for name in ("timeline", "sensitivity", "verdict", "validation", "model_inputs")}
    facts_path = folder / "host_and_published.json"
    facts = {"host_and_published": json.loads(facts_path.read_text())} if facts_path.exists() else {}
    return StudyResult(STUDY, runs=runs.reset_index(drop=True), steps=read_table(folder / "steps.csv"),
                       tables=tables, facts=facts)
