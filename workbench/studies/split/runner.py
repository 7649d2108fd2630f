"""Study 3: when the optimizer must live on the host, how much speed does an adaptive
accelerator/host split of the Adam update win back?

    df = run_split_study(SplitConfig())            # one row per run, measured and modelled
    df.attrs["steps"]       # one row per iteration of every measured run (loss, k, overlap)
    df.attrs["timeline"]    # backward, transfers and updates of one iteration, per side
    df.attrs["host"]        # this machine's host Adam rate and memory bandwidth
    df.attrs["published"]   # the seed's operating point, computed from the model's own inputs
    df.attrs["sensitivity"] # k of the seed's setting against sequence length, host and MFU
    df.attrs["verdict"]     # for which settings the seed's k band holds (one row per host, MFU)
    df.attrs["validation"]  # the model against published offload measurements, error per point
    df.attrs["inputs"]      # every input of the performance model with its source

Two halves. Measured: the engine fine-tunes the embedded base (the tiny one in tests) on the
real target corpus here for k = 0 (host-only update), a static sweep of k, adaptive k and plain
torch AdamW (optionally DeepSpeed ZeRO-Offload), on the same blocks from the same weights, with
held-out perplexity before and after each run; on a CPU-only machine the accelerator is the CPU,
so these runs show that training is unchanged and how the work overlaps, not GPU speed.
Modelled: the performance model runs the same sweep for a real model on named GPUs, with the
host's rate from a bandwidth model of the named host (see perf_model). Every row says which it
is in `source` (measured / modelled / published).

`app(cfg)` is the notebook's control panel (knobs + live chart); `report_section()` is study
3's part of results/index.html, read from results/split/.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Callable, Iterable

import pandas as pd
import torch

from workbench.studies.split import perf_model as pm
from workbench.studies.split.adam import AdamHP, backend_status
from workbench.studies.split.balance import balance_k
from workbench.studies.split.config import SplitConfig
from workbench.studies.split.engine import SplitEngine
from workbench.studies.split.hostbench import measure_host

STUDY = "split"
Sink = Callable[[dict], None]


class _RunSink:
    """Collects each iteration's row of one run and hands them to the study's sinks as training rows.

    It adds the run's labels, `step` (iteration + 1), cumulative `tokens` (the engine's row counts
    one iteration's: kept as `iteration_tokens`) and, on CUDA, the allocator's `mem_mib` then.
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
            out["mem_mib"] = torch.cuda.memory_allocated(self.device) / 2**20
        self.rows.append(out)

    def flush(self) -> None:
        for row in self.rows:
            for sink in self.sinks:
                sink(row)
        self.rows = []


# ---------------------------------------------------------------- model and data
def load_base(cfg: SplitConfig):
    """(model, tokenizer) of the run's base: the embedded base (built once, cached) or a real one."""
    from workbench.core.models import load_model

    return load_model(cfg.model, spec=cfg.spec())


def text_batches(cfg: SplitConfig, tokenizer) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(training batches, held-out blocks) from the target corpus: `iterations` batches of
    `batch_size` consecutive training blocks (from a seeded starting block, wrapping around), the
    same for every run; the first `eval_blocks` held-out blocks for perplexity."""
    from workbench.core.data import corpus_blocks, target_corpus

    train, held = corpus_blocks(tokenizer, target_corpus(cfg.corpus), cfg.seq_len)
    start = int(torch.randint(0, len(train), (1,), generator=torch.Generator().manual_seed(cfg.seed)))
    batches = []
    for i in range(cfg.iterations):
        idx = (start + i * cfg.batch_size + torch.arange(cfg.batch_size)) % len(train)
        batches.append(train[idx])
    return batches, held[: cfg.eval_blocks]


def heldout_ppl(model, held: torch.Tensor) -> float:
    from workbench.core.training import evaluate_perplexity

    return evaluate_perplexity(model, held, batch_size=8)


# ---------------------------------------------------------------- measured runs
def _plain_adamw(model, batches, hp: AdamHP, max_grad_norm: float = 0.0) -> list[dict]:
    """torch.optim.AdamW (fused), everything on the accelerator: the reference. k and the idle
    share are measured as for the engine: k from where the optimizer state lives after each step,
    idle from the accelerator's busy spans (forward, backward, step) within the iteration's period
    (from its start to the next one's)."""
    from workbench.studies.split._cuda import Clock

    device = next(model.parameters()).device
    clock = Clock(device)
    opt = torch.optim.AdamW(model.parameters(), lr=hp.lr, betas=hp.betas, eps=hp.eps,
                            weight_decay=hp.weight_decay, fused=True)
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    marks = []
    for b in batches:
        m = {"start": clock.mark()}
        loss = model(input_ids=b, labels=b).loss
        m["forward_end"] = clock.mark()
        loss.backward()
        m["backward_end"] = clock.mark()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        m["step_end"] = clock.mark()
        opt.zero_grad(set_to_none=True)
        m["loss"] = loss.item()
        on_accel = sum(p.numel() for p in params if opt.state[p]["exp_avg"].device == device)
        m["k"] = on_accel / total
        marks.append(m)
    end = clock.mark()
    rows = []
    for i, m in enumerate(marks):
        ms = {k: clock.ms(v) for k, v in m.items() if k not in ("loss", "k")}
        nxt = clock.ms(marks[i + 1]["start"]) if i + 1 < len(marks) else clock.ms(end)
        period = nxt - ms["start"]
        busy = ms["step_end"] - ms["start"]  # forward + backward + step: the accelerator's own work
        rows.append({"iteration": i, "loss": m["loss"], "iteration_ms": period, "tokens": batches[i].numel(),
                     "tokens_per_s": batches[i].numel() / (period / 1e3), "k_actual": m["k"],
                     "forward_ms": ms["forward_end"] - ms["start"], "backward_ms": ms["backward_end"] - ms["forward_end"],
                     "accel_update_ms": ms["step_end"] - ms["backward_end"],
                     "accel_idle_share": max(0.0, 1.0 - busy / period)})
    return rows


def _runs(cfg: SplitConfig) -> list[dict]:
    """(name, mode, engine kwargs) of every measured run."""
    runs = [{"name": f"k={k:g}", "mode": "host only (k=0)" if k == 0 else "static",
             "kw": dict(k=k, adaptive=False)} for k in cfg.k_sweep]
    if cfg.adaptive:
        runs.append({"name": "adaptive", "mode": "adaptive",
                     "kw": dict(k=cfg.k_start, adaptive=True, k_every=cfg.k_every)})
    return runs


def _summary(rows: list[dict], warmup: int) -> dict:
    """Means over the iterations after warm-up (they are left out and flagged in steps)."""
    df = pd.DataFrame(rows)
    keep = df[df["iteration"] >= warmup] if len(df) > warmup else df
    out = {"iterations": len(df), "warmup": warmup, "first_loss": float(df["loss"].iloc[0]),
           "final_loss": float(df["loss"].iloc[-1])}
    for col in ("tokens_per_s", "iteration_ms", "accel_idle_share", "host_done_before_bwd_end_share",
                "k_actual", "alpha", "forward_wait_ms", "host_tail_ms"):
        if col in keep:
            out[col] = float(keep[col].mean())
    out["tokens_per_s"] = float(keep["tokens"].sum() / (keep["iteration_ms"].sum() / 1e3))
    return out


def measured_runs(cfg: SplitConfig, sinks: Iterable[Sink] = (),
                  run_dir: Callable[[str], object] | None = None):
    """Fine-tune the base under every measured setting; (run rows, step rows, timeline rows).

    `sinks` get each iteration's row of every engine run (the reference and ZeRO-Offload runs send
    none), as each run ends (_RunSink: labelled with `run` and `mode`)."""
    sinks = list(sinks)
    device = torch.device(cfg.resolved_device())
    base, tokenizer = load_base(cfg)
    shape = pm.shape_from_model(base, cfg.model, cfg.seq_len)
    flops_tok = shape.flops_per_token()
    batches, held = text_batches(cfg, tokenizer)
    batches, held = [b.to(device) for b in batches], held.to(device)
    ppl_before = heldout_ppl(base.to(device), held)
    hp = AdamHP(lr=cfg.lr, weight_decay=cfg.weight_decay)
    runs, steps, events = [], [], []
    name = f"{cfg.model} ({cfg.base_size})" if cfg.model == "embedded" else cfg.model
    common = {"source": "measured", "hardware": f"this machine ({device.type})", "model": name,
              "corpus": cfg.corpus, "n_params": shape.n_params, "precision": cfg.precision, "backend": cfg.backend,
              "heldout_blocks": len(held), "ppl_before": ppl_before}

    ref_w = None
    if cfg.reference:
        model = copy.deepcopy(base).to(device)
        rows = _plain_adamw(model, batches, hp, cfg.max_grad_norm)
        ref_w = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
        for r in rows:
            steps.append({**r, "run": "plain AdamW", "mode": "plain AdamW", "source": "measured"})
        runs.append({**common, "run": "plain AdamW", "mode": "plain AdamW", "k_target": 1.0, "status": "ok",
                     **_summary(rows, cfg.warmup), "ppl_after": heldout_ppl(model, held)})

    status = backend_status(cfg.backend)
    for spec in _runs(cfg):
        name = spec["name"]
        head = {**common, "run": name, "mode": spec["mode"], "k_target": spec["kw"]["k"]}
        if status != "ok":
            runs.append({**head, "status": "skipped", "reason": status})
            continue
        rd = run_dir(name) if run_dir else None
        jsonl = rd.steps_sink() if rd else None
        tag = {"run": name, "mode": spec["mode"], "source": "measured"}
        live = _RunSink(sinks, tag, device)
        run_sinks = ([live] if sinks else []) + ([jsonl] if jsonl else [])
        model = copy.deepcopy(base).to(device)
        try:
            eng = SplitEngine(model, hp=hp, precision=cfg.precision, backend=cfg.backend,
                              host_workers=cfg.host_workers, include_transfer=cfg.include_transfer,
                              sinks=run_sinks, max_grad_norm=cfg.max_grad_norm, **spec["kw"])
            for b in batches:
                eng.step(b)
            eng.close()
        except Exception as e:  # a failed run is a row, never a gap
            runs.append({**head, "status": "error", "reason": f"{type(e).__name__}: {e}"})
            if rd:
                rd.write_summary({"status": "error", "reason": str(e)})
            continue
        finally:
            if jsonl:
                jsonl.close()
            live.flush()  # the rows it made, also those of a run that failed
        summary = {**head, "status": "ok", **_summary(eng.rows, cfg.warmup), "ppl_after": heldout_ppl(model, held),
                   "pinned_bytes": eng.pinned_bytes, "staging_bytes": eng.staging_bytes}
        if ref_w is not None:
            masters = eng.master_weights()
            summary["max_abs_diff_vs_adamw"] = max(float((masters[n] - w).abs().max()) for n, w in ref_w.items())
        runs.append(summary)
        if rd:
            rd.write_summary(summary)
        steps += [{**r, **tag, "warmup": r["iteration"] < cfg.warmup} for r in eng.rows]
        last = max(e["iteration"] for e in eng.events)
        events += [{**e, **tag} for e in eng.events if e["iteration"] == last]

    if cfg.zero_offload:
        from workbench.studies.split.zero_baseline import run_zero_offload

        rows, reason = run_zero_offload(copy.deepcopy(base).to(device), batches, cfg.lr, cfg.weight_decay,
                                        cfg.precision)
        head = {**common, "run": "DeepSpeed ZeRO-Offload", "mode": "ZeRO-Offload", "k_target": 0.0,
                "backend": "deepspeed"}
        if reason:
            runs.append({**head, "status": "skipped", "reason": reason})
        else:
            runs.append({**head, "status": "ok", **_summary(rows, cfg.warmup)})  # its weights stay in DeepSpeed
            steps += [{**r, "run": head["run"], "mode": "ZeRO-Offload", "source": "measured"} for r in rows]

    for r in runs:
        if "tokens_per_s" in r:
            r["tflops"] = r["tokens_per_s"] * flops_tok / 1e12
    return runs, steps, events


# ---------------------------------------------------------------- modelled runs
def modelled_runs(cfg: SplitConfig, host: dict):
    """The performance model's sweep on each GPU profile; (run rows, timeline rows)."""
    shape = pm.model_shape(cfg.modelled_model, cfg.modelled_seq)
    rows, events = [], []
    for gpu in cfg.profiles:
        m = pm.machine(gpu, cfg.host, host_meas=host, host_share=cfg.host_share, alpha=cfg.alpha)
        r = pm.rates(shape, m, cfg.modelled_batch)
        # the balance asks for k; the card's memory caps it (master + Adam state of k live there)
        k_mem = pm.k_max_for_memory(shape, cfg.modelled_batch, m.memory_bytes)
        k_adapt = min(balance_k(r, cfg.include_transfer), k_mem)
        hw = f"{gpu} + {cfg.host}"
        specs = [(f"k={k:.2f}", "static" if k else "host only (k=0)", k, "split")
                 for k in (i / (cfg.modelled_k_points - 1) for i in range(cfg.modelled_k_points))]
        specs += [("adaptive", "adaptive", k_adapt, "split"),
                  ("seed formula", "seed formula (no transfers)", min(balance_k(r, False), k_mem), "split"),
                  ("ZeRO-Offload", "ZeRO-Offload", 0.0, "zero-offload"),
                  ("all on accelerator", "all on accelerator", 1.0, "all-accelerator")]
        for name, mode, k, sim_mode in specs:
            sim = pm.simulate(shape, m, k, cfg.modelled_batch, sim_mode)
            ev = sim.pop("events")
            row = {**sim, "source": "modelled", "hardware": hw, "run": f"{gpu}: {name}", "mode": mode,
                   "model": shape.name, "n_params": shape.n_params, "precision": "bf16",
                   "backend": "modelled", "alpha": m.alpha, "mfu": m.notes["mfu"], "t_backward_s": r.t_backward_s,
                   "t_update_host_s": r.t_update_host_s, "t_transfer_s": r.t_transfer_s,
                   "k_balance": balance_k(r, cfg.include_transfer), "k_max_memory": k_mem,
                   "host_rate_from": m.notes["host update"], "compute_from": m.notes["forward/backward"],
                   "host_share_from": "config" if cfg.host_share else "measured here",
                   "status": "ok" if sim["fits"] else "oom"}
            if not sim["fits"]:  # an OOM is a result: keep the row, do not show a speed
                row["reason"] = f"needs {sim['accel_memory_gib']:.0f} GiB of {m.memory_bytes / 2**30:.0f}"
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
             "k_band": f"{lo}-{hi}", "status": "ok"}
    shape = pm.model_shape(op["model"], op["seq_len"])
    m = pm.machine(op["gpu"], op["host"], host_meas=host)
    sim = pm.simulate(shape, m, op["k_seed_formula"], op["batch"])
    sim.pop("events")
    model_row = {**sim, "source": "modelled", "hardware": f"{op['gpu']} + {op['host']} (published setting)",
                 "run": f"published setting, seq {op['seq_len']}: seed formula", "model": op["model"],
                 "n_params": op["n_params"], "alpha": op["alpha_modelled"], "mfu": op["mfu"],
                 "t_backward_s": op["t_backward_s"], "t_update_host_s": op["t_update_host_s"],
                 "t_transfer_s": op["t_transfer_s"], "k_balance": op["k_seed_formula"], "k_band": f"{lo}-{hi}",
                 "host_rate_from": op["host_rate_from"], "compute_from": op["compute_from"],
                 "mode": "adaptive", "status": "ok" if sim["fits"] else "oom"}
    return [claim, model_row], op


# ---------------------------------------------------------------- the entry point
def run_split_study(cfg: SplitConfig, sinks: Iterable[Sink] = ()) -> pd.DataFrame:
    """Run study 3 (measured + modelled); one row per run, step/timeline tables in attrs.

    `sinks` get every iteration of the engine's runs as a plain row (loss, cumulative tokens,
    tokens_per_s, k, labelled with `run` and `mode`; `mem_mib` on CUDA), run by run as each run
    ends (see _RunSink). The modelled half sends nothing: it is not a run."""
    from workbench.core.results import RunDir, atomic_write_csv, atomic_write_json, results_root, write_runs_table

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        key = cfg.hash()
        run_dir = None
        if cfg.write_results:
            def run_dir(name: str):
                rd = RunDir(STUDY, f"{key}-{name.replace('=', '').replace(' ', '_')}")
                rd.write_config({**cfg.to_dict(), "run": name})
                return rd

        runs, steps, events = measured_runs(cfg, sinks, run_dir)
        # The host Adam's share of the Adam-pattern bandwidth and one core's bandwidth: a per-core
        # figure that the host model scales to the named host's cores (on a shared machine a
        # multi-threaded measurement mostly measures the other processes: a 2-thread step was
        # seen 50x slower under load, a 1-thread one unchanged). Out of cache, about a second.
        torch.set_num_threads(1)
        host = measure_host(numel=16_000_000, backend="torch_fused", reps=5)
        mod_rows, mod_events = modelled_runs(cfg, host)
        pub_rows, op = published_rows(host)
        verdict = pm.seed_verdict(host)
        validation = pd.DataFrame(pm.validate(host))
        inputs = pd.DataFrame(pm.model_inputs(host))
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
    sensitivity = pd.DataFrame(verdict["rows"])
    sensitivity["source"] = "modelled"
    verdicts = pd.DataFrame(verdict["verdicts"])
    op = {**op, "verdict": verdict["text"]}
    df.attrs.update(steps=steps_df, timeline=timeline, host=host, published=op, sensitivity=sensitivity,
                    verdict=verdicts, validation=validation, inputs=inputs)
    if cfg.write_results:
        study_dir = results_root() / STUDY
        write_runs_table(study_dir, df.to_dict("records"))
        atomic_write_csv(study_dir / "steps.csv", steps_df)
        atomic_write_csv(study_dir / "timeline.csv", timeline)
        atomic_write_json(study_dir / "host_and_published.json", {"host": host, "published": op})
        atomic_write_csv(study_dir / "sensitivity.csv", sensitivity)
        atomic_write_csv(study_dir / "verdict.csv", verdicts)
        atomic_write_csv(study_dir / "validation.csv", validation)
        atomic_write_csv(study_dir / "model_inputs.csv", inputs)
    return df


# ---------------------------------------------------------------- the panel and the report
RUN_COLUMNS = ["hardware", "run", "mode", "k_actual", "tokens_per_s", "tflops", "accel_idle_share",
               "host_done_before_bwd_end_share", "first_loss", "final_loss", "ppl_before", "ppl_after",
               "max_abs_diff_vs_adamw", "accel_memory_gib", "status", "reason"]
# SplitConfig fields without a knob: optional floats (None = measured here / from the profiles)
# have no widget that can say None; the panel keeps the value it was given.
_NO_KNOB = ("host_share", "alpha")


def throughput_figure(df: pd.DataFrame):
    """Tokens/s against k, one panel per machine; each panel's title says measured or modelled."""
    import plotly.express as px

    speed = df[df["source"] != "published"].dropna(subset=["tokens_per_s"])
    fig = px.scatter(speed, x="k_actual", y="tokens_per_s", color="mode", symbol="mode", facet_col="panel",
                     facet_col_wrap=2, hover_data=["run", "status"],
                     labels={"k_actual": "k (share of parameters updated on the accelerator)",
                             "tokens_per_s": "tokens/s"},
                     title="Tokens/s against k (panels: measured on this machine, or modelled for a GPU profile)")
    fig.update_traces(marker_size=10)
    fig.update_yaxes(matches=None, showticklabels=True)
    return fig


def loss_figure(steps: pd.DataFrame):
    """The measured runs' loss per iteration (the same text blocks from the same weights)."""
    import plotly.express as px

    return px.line(steps, x="iteration", y="loss", color="run", markers=True,
                   title="Training loss per iteration on the target corpus (measured on this machine)")


def app(cfg: SplitConfig):
    """Study 3's control panel: a knob per parameter; Run shows live training charts, then the runs."""
    from IPython.display import display

    from workbench.front.live import LiveChart
    from workbench.front.panel import knobs

    def run(c: SplitConfig) -> pd.DataFrame:
        live = LiveChart(title="Study 3: the engine's measured runs (loss, speed; device memory on CUDA)",
                         run_keys=("run",))
        df = run_split_study(c, sinks=[live])
        live.close()
        display(df[[col for col in ["source", *RUN_COLUMNS] if col in df]].round(4))
        throughput_figure(df).show()
        return df

    fields = [n for n in SplitConfig.fields() if n not in _NO_KNOB]
    return knobs(SplitConfig, cfg, run, fields=fields, title="Study 3: change the settings and press Run")


def report_section() -> list[tuple[str, str, object]]:
    """The report's parts for study 3, from results/split/ ([] when it has not run)."""
    import json

    import plotly.express as px

    from workbench.core.results import results_root

    root = results_root() / STUDY
    if not (root / "runs.csv").exists():
        return []
    df = pd.read_csv(root / "runs.csv")
    if df.empty or "source" not in df:
        return []
    measured = df[df["source"] == "measured"]
    modelled = df[df["source"] == "modelled"]
    published = df[df["source"] == "published"]
    host = {}
    if (root / "host_and_published.json").exists():
        host = json.loads((root / "host_and_published.json").read_text()).get("host", {})
    where = ", ".join(sorted(set(measured["hardware"].astype(str)))) or "nothing measured"
    cpu_note = (" On a machine without a GPU the accelerator is the CPU too: these runs show that training"
                " is unchanged and how the work overlaps, not GPU speed." if "(cpu)" in where else "")
    gpus = ", ".join(sorted(set(modelled["hardware"].astype(str))))
    tags = (
        f'<span class="tag measured">measured</span> {len(measured)} run(s) of the split engine on {where}: '
        f"the embedded base fine-tuned on the target corpus: tokens/s, idle share, loss, held-out perplexity "
        f"before and after, parity with AdamW; and the host Adam rate.{cpu_note}<br>"
        f'<span class="tag modelled">modelled</span> {len(modelled)} run(s) of the performance model for '
        f"{gpus or 'no GPU profile'} (data-sheet peaks x a published MFU; the host from a bandwidth model of the "
        "named CPU, scaled per core from one core measured here): no figure in these rows was measured on that "
        "hardware. Every input and its source is listed below; none of them is a figure the model is compared "
        "with.<br>Published: the seed's own claims (data/published_claims.json), shown as published, and the "
        "published offload measurements the model is validated against."
    )
    def cols(d: pd.DataFrame) -> pd.DataFrame:
        return d[[c for c in RUN_COLUMNS if c in d]]

    parts: list[tuple[str, str, object]] = [
        ("text", "", tags),
        ("table", "Measured runs (this machine)", cols(measured)),
        ("figure", "", throughput_figure(df)),
        ("table", "Modelled runs (performance model; oom: the modelled card's memory does not fit)", cols(modelled)),
    ]
    key = df[df["mode"].isin(["host only (k=0)", "adaptive", "ZeRO-Offload", "all on accelerator", "plain AdamW"])
             | (df["source"] == "published")].dropna(subset=["tflops"])
    if len(key):
        fig = px.bar(key, x="run", y="tflops", color="source", facet_col="source", hover_data=["status", "k_actual"],
                     title="Achieved TFLOP/s of the key runs, by source (measured / modelled / published)",
                     labels={"tflops": "TFLOP/s", "run": ""})
        fig.update_xaxes(matches=None)
        fig.update_yaxes(matches=None, showticklabels=True)
        parts.append(("figure", "", fig))
    if (root / "steps.csv").exists():
        try:
            steps = pd.read_csv(root / "steps.csv")
        except pd.errors.EmptyDataError:
            steps = pd.DataFrame()
        if {"iteration", "loss", "run"} <= set(steps.columns):
            parts.append(("figure", "", loss_figure(steps)))
    if len(published):
        parts.append(("table", "Published claims (the seed's own figures, not measured here)",
                      published.dropna(axis=1, how="all")))
    extra = [("verdict.csv", "Verdict on the seed's k band 0.1-0.2 (modelled): for which sequence lengths it holds, "
                              "per host and MFU"),
             ("validation.csv", "The performance model against published offload measurements (modelled vs "
                                "published, error per point)"),
             ("model_inputs.csv", "Every input of the performance model, with its source")]
    for name, title in extra:
        if (root / name).exists():
            parts.append(("table", title, pd.read_csv(root / name)))
    pub = {}
    if (root / "host_and_published.json").exists():
        pub = json.loads((root / "host_and_published.json").read_text()).get("published", {})
    if pub.get("verdict"):
        parts.append(("text", "", pub["verdict"]))
    if host:
        parts.append(("table", "Host Adam rate and Adam-pattern bandwidth (measured on this machine, one thread)",
                      pd.DataFrame([host])))
    return parts
