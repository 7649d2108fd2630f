"""Study 2: will my fine-tune fit on my card, and what is the cheapest change that makes it fit?

    from workbench.studies.ladder.runner import LadderConfig, run_ladder
    df = run_ladder(LadderConfig(tiny=True, steps=3))       # seconds, on the CPU
    df.attrs["published"], df.attrs["baselines"], df.attrs["autofit"]
    df = run_ladder(cfg, sinks=[LiveChart(run_keys=("rung", "stage"))])   # live, per training step

For every rung of the ladder (workbench.studies.ladder.rungs) and two models - the model at hand (the
embedded base by default) and a reference config (Qwen2-0.5B) - the study predicts the
steady-state device peak (fake tensors, no GPU), and for the model at hand it measures every
rung that can run on this machine: peak live bytes, step time, tokens/s and the loss after a
fixed number of steps. A rung that cannot run here is a row whose `reason` says why.
It then asks auto-fit for the fastest rung predicted to fit the budget and runs it with the
budget enforced, stepping down the ladder on a real out-of-memory error.

Results: results/ladder/<run_id>/{config.json, ladder.csv, baselines.csv, autofit.csv,
summary.json} and results/ladder/runs.csv. Columns say which figures are `measured`,
`predicted` or `estimated`; sizes are bytes (`_bytes`) or MiB (`_mib`).

Sinks receive the training rows of every measured rung (`stage` "ladder") and of every auto-fit
attempt (`stage` "auto-fit"), labelled with `rung` and the `budget_mib` to fit, plus one event
row per rung or attempt that did not train to the end (skipped, oom). `app(cfg)` is the
notebook's control panel; `report_section()` is study 2's part of results/index.html.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd
import torch

from workbench.core.config import Config, ConfigError, param
from workbench.studies.ladder.rungs import RUNGS
from workbench.core.common import PROJECT_ROOT

MiB = 2**20
ROOT = PROJECT_ROOT


@dataclass(frozen=True)
class LadderConfig(Config):
    model: str = param("embedded", "model at hand: 'embedded', a model directory, or a config.json (random init)")
    tiny: bool = param(False, "use the tiny embedded base (tests; builds in ~10 s)")
    rungs: tuple[str, ...] = param(tuple(RUNGS), "rungs to predict and measure, top of the ladder first",
                                   choices=tuple(RUNGS))
    batch: int = param(8, "sequences per optimizer step for the model at hand")
    seq_len: int = param(128, "tokens per sequence for the model at hand")
    steps: int = param(6, "optimizer steps measured per rung (the first is warm-up, left out of timings)")
    lr: float = param(1e-4, "learning rate of the measured runs")
    budget_mib: float = param(24.0, "device budget to fit (MiB); the CPU enforces it by counting live bytes")
    measure: bool = param(True, "measure the rungs that can run on this machine")
    autofit: bool = param(True, "run auto-fit for the model at hand with the budget enforced")
    reference_model: str = param("data/configs/qwen2-0.5b.json", "reference config predicted for every rung ('' = none)")
    reference_batch: int = param(1, "batch of the reference prediction")
    reference_seq: int = param(512, "sequence length of the reference prediction")
    reference_budget_mib: float = param(6144.0, "budget the reference model is checked against (MiB)")
    reference_device: str = param("cpu", "device the reference is predicted for: cpu (exact) or cuda (CUDA's "
                                  "choices simulated, allocator modelled; the budget then caps reserved memory)",
                                  choices=("cpu", "cuda"))
    breakdown_rung: str = param("bf16_ckpt", "rung whose per-category breakdown the notebook shows")
    threads: int = param(0, "torch threads (0 = leave as set)")
    seed: int = param(0, "seed of the measured runs")

    def __post_init__(self):
        unknown = [r for r in self.rungs if r not in RUNGS]
        if unknown:
            raise ConfigError(f"unknown rung{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                              f"known rungs: {', '.join(RUNGS)}")
        if not self.rungs:
            raise ConfigError("rungs must name at least one rung")
        if self.reference_device not in ("cpu", "cuda"):
            raise ConfigError(f"reference_device must be cpu or cuda, got {self.reference_device!r}")
        if self.breakdown_rung not in self.rungs:
            raise ConfigError(f"breakdown_rung {self.breakdown_rung!r} is not among rungs: {', '.join(self.rungs)}")
        for name in ("batch", "seq_len", "reference_batch", "reference_seq"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.steps < 2:
            raise ConfigError(f"steps must be at least 2 (the first is warm-up), got {self.steps}")
        for name in ("budget_mib", "reference_budget_mib"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be a positive number of MiB, got {getattr(self, name)}")

    def spec(self):
        from workbench.core.models import TINY_SPEC, EmbeddedSpec

        return TINY_SPEC if self.tiny else EmbeddedSpec()

    def run_id(self) -> str:
        return f"ladder-{self.hash()}"


def _resolve(path: str) -> str:
    """A project-relative config path works from any working directory (notebooks run in notebooks/)."""
    p = Path(path)
    return str(ROOT / p) if path and not p.is_absolute() and not p.exists() and (ROOT / p).exists() else path


def _model_at_hand(cfg: LadderConfig):
    """(config, load() -> fresh model, train blocks) for the model at hand."""
    from workbench.core.models import load_model
    from workbench.core.memory.predict import model_config

    name = _resolve(cfg.model)
    if name.endswith(".json"):
        from transformers import AutoModelForCausalLM

        config = model_config(name)
        gen = torch.Generator().manual_seed(cfg.seed)
        blocks = torch.randint(0, config.vocab_size, (max(64, 4 * cfg.batch), cfg.seq_len), generator=gen)

        def load():
            torch.manual_seed(cfg.seed)
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)

        return config, load, blocks, "random init from the config, random tokens"
    from workbench.core.data import corpus_blocks, target_corpus

    model, tok = load_model(name, spec=cfg.spec())
    blocks, _ = corpus_blocks(tok, target_corpus(), cfg.seq_len)
    if len(blocks) == 0:
        raise ConfigError(f"seq_len {cfg.seq_len} leaves no training block in the target corpus")
    return model.config, (lambda: load_model(name, spec=cfg.spec())[0]), blocks, "target corpus"


def published_table() -> pd.DataFrame:
    """The published memory table (study2_memory_table of data/published_claims.json), with its source."""
    claims = json.loads((ROOT / "data" / "published_claims.json").read_text())["study2_memory_table"]
    df = pd.DataFrame(claims["rows"])
    df["published_mib"] = df["memory_gb"] * 1e9 / MiB
    df["source"] = claims["source"]
    # Which rung each published row describes (fp16 rows map onto our half-precision rungs).
    df["rung"] = df["strategy"].map({
        "FP32 full model": "fp32", "FP16 full model": "fp16", "FP16 + gradient checkpointing": "bf16_ckpt",
        "FP16 + adapter (6%)": "lora", "CPU offload": "zero_offload", "CPU only": "cpu",
    })
    return df


Sink = Callable[[dict[str, Any]], None]


def _labelled(sinks: list[Sink], **labels: Any) -> tuple[Sink, ...]:
    """One sink that adds `labels` to each row and passes it on to every sink (none: nothing)."""
    if not sinks:
        return ()

    def feed(row: dict[str, Any]) -> None:
        row = {**row, **labels}
        for sink in sinks:
            sink(row)

    return (feed,)


def _event(sinks: list[Sink], **row: Any) -> None:
    for sink in sinks:
        sink({"event": "attempt", **row})


def run_ladder(cfg: LadderConfig, sinks: Iterable[Sink] = ()) -> pd.DataFrame:
    """Predict (and where possible measure) every rung; returns one row per (model, rung).

    `sinks` get every measured training step as a plain row (see the module docstring)."""
    from workbench.studies.ladder.baselines import baseline_table
    from workbench.studies.ladder.rungs import auto_fit, measure, run_with_fallback
    from workbench.core.memory.predict import model_config, predict
    from workbench.core.results import RunDir, atomic_write_csv, locked, results_root, write_runs_table

    sinks = list(sinks)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run = RunDir("ladder", cfg.run_id())
    run.write_config(cfg.to_dict())
    config, load, blocks, data_note = _model_at_hand(cfg)
    budget = int(cfg.budget_mib * MiB)
    rows: list[dict[str, Any]] = []
    steps_sink = run.steps_sink()
    preds = {}
    for name in cfg.rungs:
        plan = RUNGS[name]
        p = predict(config, name, batch=cfg.batch, seq=cfg.seq_len, n_blocks=len(blocks))
        preds[name] = p
        row = {**p.row(), "model_label": p.model, "model": cfg.model, "role": "at hand",
               "tier": plan.tier, "help": plan.help, "budget_mib": cfg.budget_mib,
               "fits_predicted": p.fit_bytes <= budget, "data": data_note}
        if cfg.measure:
            torch.manual_seed(cfg.seed)
            m = measure(name, load, blocks, batch=cfg.batch, steps=cfg.steps, lr=cfg.lr,
                        sinks=(steps_sink, *_labelled(sinks, stage="ladder", budget_mib=cfg.budget_mib)))
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
    steps_sink.close()

    ref_rows = []
    if cfg.reference_model:
        ref = model_config(_resolve(cfg.reference_model))
        ref_budget = int(cfg.reference_budget_mib * MiB)
        for name in cfg.rungs:
            p = predict(ref, name, batch=cfg.reference_batch, seq=cfg.reference_seq, device=cfg.reference_device)
            ref_rows.append({**p.row(), "model": cfg.reference_model, "role": "reference",
                             "tier": RUNGS[name].tier, "help": RUNGS[name].help,
                             "budget_mib": cfg.reference_budget_mib, "fits_predicted": p.fit_bytes <= ref_budget,
                             "status": "skipped", "reason": "reference model: predicted only (no weights here)"})
    df = pd.DataFrame(rows + ref_rows)
    df["predicted_peak_mib"] = df["predicted_peak_bytes"] / MiB
    if "measured_peak_bytes" in df:
        df["measured_peak_mib"] = df["measured_peak_bytes"] / MiB

    # Auto-fit for the model at hand, with the budget enforced: step down on a real OOM.
    fit_rows: list[dict[str, Any]] = []
    if cfg.autofit:
        choice = auto_fit(config, batch=cfg.batch, seq=cfg.seq_len, budget_mib=cfg.budget_mib,
                          rungs=cfg.rungs, predictions=preds, device="cpu")

        def attempt(name):
            m = measure(name, load, blocks, batch=cfg.batch, steps=2, lr=cfg.lr, budget_mib=cfg.budget_mib,
                        sinks=_labelled(sinks, stage="auto-fit", budget_mib=cfg.budget_mib))
            _event(sinks, rung=name, attempt=f"auto-fit {name}", result=m["status"])
            if m["status"] == "oom":
                raise torch.OutOfMemoryError(m["reason"])
            if m["status"] != "ok":
                raise RuntimeError(f"{name}: {m['status']}: {m['reason']}")
            return m

        try:
            chosen, _, tries = run_with_fallback(choice, attempt, log=lambda s: None)
        except torch.OutOfMemoryError as e:
            chosen, tries = None, [{"rung": None, "status": "oom", "error": str(e)}]
        except RuntimeError as e:  # the chosen rung cannot run here (e.g. needs CUDA)
            chosen, tries = None, [{"rung": choice.rung, "status": "skipped", "error": str(e)}]
        fit_rows = [{**t, "predicted_choice": choice.rung, "ran": chosen, "budget_mib": cfg.budget_mib} for t in tries]

    # Side tables for the notebook: what others claim / estimate, beside our prediction.
    published = published_table()
    baselines = pd.DataFrame()
    if cfg.reference_model:
        baselines = pd.DataFrame(baseline_table(ref))
        ours = {r["rung"]: r["predicted_peak_bytes"] for r in ref_rows}
        baselines["workbench_predicted_bytes"] = baselines["compares_to"].map(ours)
        ours_ref = {r["rung"]: r["predicted_peak_mib"] for r in ref_rows}
        published["workbench_predicted_mib"] = published["rung"].map(ours_ref)
        host = {r["rung"]: r["host_bytes"] / MiB for r in ref_rows}
        published.loc[published["rung"] == "cpu", "workbench_predicted_mib"] = host.get("cpu")
    df.attrs.update(published=published, baselines=baselines, autofit=pd.DataFrame(fit_rows),
                    run_dir=str(run.path))

    atomic_write_csv(run.path / "ladder.csv", df)
    atomic_write_csv(run.path / "baselines.csv", baselines)
    atomic_write_csv(run.path / "published.csv", published)
    atomic_write_csv(run.path / "autofit.csv", pd.DataFrame(fit_rows))
    statuses = set(df["status"])
    run.write_summary({"status": "error" if statuses == {"error"} else "ok", "rungs": len(cfg.rungs),
                       "measured_ok": int((df["status"] == "ok").sum()),
                       "autofit_ran": fit_rows[-1]["ran"] if fit_rows else None})
    # runs.csv: one row per run; a run with the same settings replaces its earlier row.
    runs_csv = results_root() / "ladder" / "runs.csv"
    this = {**{k: json.dumps(v) if isinstance(v, list) else v for k, v in cfg.to_dict().items()},
            "run_id": cfg.run_id(), "status": "ok", "measured_ok": int((df["status"] == "ok").sum()),
            "autofit_ran": fit_rows[-1]["ran"] if fit_rows else None}
    with locked(runs_csv):  # read-modify-write: another run may finish at the same time
        old = pd.read_csv(runs_csv).to_dict("records") if runs_csv.exists() else []
        keep = [{k: v for k, v in r.items() if not k.startswith("env_")} for r in old
                if r.get("run_id") != this["run_id"]]
        write_runs_table(results_root() / "ladder", keep + [this])
    return df


# ------------------------------------------------------------------------------------------------
# the panel and the report

# What "fits the budget" means on each kind of device (issue 11 item 6).
BUDGET_NOTE = ("On a GPU the budget caps the CUDA caching allocator's reserved memory "
               "(set_per_process_memory_fraction: fragmentation and cached blocks count); on the CPU the "
               "played budget counts live tensor bytes, so a played budget is a little more generous than "
               "a card of the same size.")

LADDER_COLUMNS = ["rung", "method", "predicted_peak_mib", "measured_peak_mib", "status", "reason", "step_ms",
                  "tokens_per_s", "loss_after", "fits_predicted", "fits_measured"]


def ladder_figure(df: pd.DataFrame, budget_mib: float, title: str = ""):
    """Predicted, estimated and measured peaks per rung of the model at hand, with the budget.

    Each bar trace says where its figures come from: `predicted` (the training step run over
    fake tensors), `estimated` (a formula, for rungs the simulation cannot run) or `measured`
    here (live tensor bytes of a real run); a rung that did not run here has no measured bar.
    """
    import plotly.graph_objects as go

    hand = df[df["role"] == "at hand"]
    fig = go.Figure()
    for method in ("predicted", "estimated"):
        part = hand[hand["method"] == method]
        if len(part):
            fig.add_trace(go.Bar(x=part["rung"], y=part["predicted_peak_mib"], name=f"{method} (not measured)",
                                 marker_pattern_shape="/" if method == "estimated" else "",
                                 hovertext=part["note"].fillna("") if "note" in part else None))
    if "measured_peak_mib" in hand:
        ok = hand[hand["status"] == "ok"]
        fig.add_trace(go.Bar(x=ok["rung"], y=ok["measured_peak_mib"], name="measured on this machine"))
    fig.add_hline(y=budget_mib, line_dash="dash", line_color="red", annotation_text=f"budget {budget_mib:g} MiB")
    fig.update_layout(barmode="group", height=420, yaxis_title="peak device memory (MiB)",
                      xaxis=dict(categoryorder="array", categoryarray=list(hand["rung"])),
                      title=title or "Memory ladder: peak device memory per rung")
    return fig


def app(cfg: LadderConfig):
    """Study 2's control panel: a knob per parameter; Run shows live training charts, then the ladder."""
    from IPython.display import display

    from workbench.front.live import LiveChart
    from workbench.front.panel import knobs

    def run(c: LadderConfig) -> pd.DataFrame:
        live = LiveChart(title="Study 2: each measured rung (loss, memory against the budget, speed)",
                         run_keys=("rung", "stage"))
        df = run_ladder(c, sinks=[live])
        live.close()
        hand = df[df["role"] == "at hand"]
        display(hand[[col for col in LADDER_COLUMNS if col in hand]])
        ladder_figure(df, c.budget_mib, title=f"memory ladder: {c.model}, batch {c.batch} x seq {c.seq_len}").show()
        display(df.attrs["autofit"])
        return df

    return knobs(LadderConfig, cfg, run, title="Study 2: change the settings and press Run")


def _read_csv(path: Path) -> pd.DataFrame:
    """A results table; an empty file (a table with no rows, e.g. auto-fit switched off) is empty."""
    try:
        return pd.read_csv(path)
    except (FileNotFoundError, pd.errors.EmptyDataError):
        return pd.DataFrame()


def report_section() -> list[tuple[str, str, Any]]:
    """The report's parts for study 2, from the latest run in results/ladder/ ([] if none)."""
    import plotly.graph_objects as go

    from workbench.studies.strategies import figures as plots
    from workbench.core.results import read_steps, results_root

    root = results_root() / "ladder"
    runs = _read_csv(root / "runs.csv")
    if runs.empty:
        return []
    last = runs.iloc[-1]  # run_ladder puts the run it just wrote last
    run_dir = root / str(last["run_id"])
    df = _read_csv(run_dir / "ladder.csv")
    if df.empty:
        return []
    budget = float(last["budget_mib"])
    hand = df[df["role"] == "at hand"]
    ref = df[df["role"] == "reference"]
    measured = hand[hand["status"] == "ok"]
    where = ", ".join(sorted(set(measured["device"].astype(str)))) if "device" in measured else ""
    cpu_note = " (the CPU plays the device: live tensor bytes are counted, as a GPU's allocator would)" \
        if where == "cpu" else ""
    tags = (
        f'<span class="tag measured">measured</span> on this machine ({where or "nothing measured"}){cpu_note}: '
        f"peak, step time, tokens/s and loss of {len(measured)} rung(s) of {last['model']} "
        f"(batch {last['batch']} x seq {last['seq_len']}), and the auto-fit attempts.<br>"
        '<span class="tag modelled">predicted</span> every peak in the "predicted" columns: the real training '
        "step run over fake tensors (no weights, no GPU)"
        + (f"; the reference model ({ref['model'].iloc[0]}) is predicted only" if len(ref) else "") + ".<br>"
        '<span class="tag modelled">estimated</span> rungs whose method is "estimated" (a formula, see note).<br>'
        "The published memory table was not measured by its authors either; it is shown as published.<br>"
        f"{BUDGET_NOTE}"
    )
    parts: list[tuple[str, str, Any]] = [
        ("text", "", tags),
        ("table", f"The ladder for the model at hand (budget {budget:g} MiB: reserved memory on a GPU, "
                  f"live tensor bytes on the CPU)",
         hand[[c for c in LADDER_COLUMNS if c in hand]]),
        ("figure", "", ladder_figure(df, budget)),
    ]
    steps_path = run_dir / "steps.jsonl"
    if steps_path.exists() and steps_path.stat().st_size:
        steps = read_steps(steps_path)
        if "event" in steps:
            steps = steps[steps["event"].isna()]
        if {"rung", "step", "loss"} <= set(steps.columns):
            steps = steps.drop_duplicates(["rung", "step"], keep="last")  # a rerun appends its steps
            parts.append(("figure", "", plots.loss_curves(steps, color="rung",
                                                          title="Training loss per rung (measured on this machine)")))
    fit = _read_csv(run_dir / "autofit.csv")
    if not fit.empty:
        parts.append(("table", "Auto-fit: the rung predicted fastest to fit, run here with the budget enforced "
                               "(measured where its status is ok or oom)", fit))
    if len(ref):
        parts.append(("table", f"Reference model {ref['model'].iloc[0]}: predicted peaks (not measured)",
                      ref[[c for c in ("rung", "method", "predicted_peak_mib", "budget_mib", "fits_predicted", "note")
                           if c in ref]]))
    pub = _read_csv(run_dir / "published.csv")
    if not pub.empty and "workbench_predicted_mib" in pub and len(ref):
        fig = go.Figure([go.Bar(name="published (not measured)", x=pub["strategy"], y=pub["published_mib"]),
                         go.Bar(name="workbench prediction (not measured)", x=pub["strategy"],
                                y=pub["workbench_predicted_mib"])])
        fig.update_layout(barmode="group", yaxis_title="MiB", height=400,
                          title=f"Published memory table beside the prediction for {ref['model'].iloc[0]}")
        parts.append(("figure", "", fig))
    base = _read_csv(run_dir / "baselines.csv")
    if not base.empty:
        parts.append(("table", "Library estimators beside the workbench prediction (none measured)", base))
    return parts
