"""Study 2: will my fine-tune fit on my card, and what is the cheapest change that makes it fit?

    from workbench.memory.study import LadderConfig, run_ladder
    df = run_ladder(LadderConfig(tiny=True, steps=3))       # seconds, on the CPU
    df.attrs["published"], df.attrs["baselines"], df.attrs["autofit"]

For every rung of the ladder (workbench.memory.ladder) and two models - the model at hand (the
embedded base by default) and a reference config (Qwen2-0.5B) - the study predicts the
steady-state device peak (fake tensors, no GPU), and for the model at hand it measures every
rung that can run on this machine: peak live bytes, step time, tokens/s and the loss after a
fixed number of steps. A rung that cannot run here is a row whose `reason` says why.
It then asks auto-fit for the fastest rung predicted to fit the budget and runs it with the
budget enforced, stepping down the ladder on a real out-of-memory error.

Results: results/ladder/<run_id>/{config.json, ladder.csv, baselines.csv, autofit.csv,
summary.json} and results/ladder/runs.csv. Columns say which figures are `measured`,
`predicted` or `estimated`; sizes are bytes (`_bytes`) or MiB (`_mib`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from workbench.config import Config, ConfigError, param
from workbench.memory.ladder import RUNGS

MiB = 2**20
ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass(frozen=True)
class LadderConfig(Config):
    model: str = param("embedded", "model at hand: 'embedded', a model directory, or a config.json (random init)")
    tiny: bool = param(False, "use the tiny embedded base (tests; builds in ~10 s)")
    rungs: tuple[str, ...] = param(tuple(RUNGS), "rungs to predict and measure, top of the ladder first")
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
        from workbench.models import TINY_SPEC, EmbeddedSpec

        return TINY_SPEC if self.tiny else EmbeddedSpec()

    def run_id(self) -> str:
        return f"ladder-{self.hash()}"


def _resolve(path: str) -> str:
    """A project-relative config path works from any working directory (notebooks run in notebooks/)."""
    p = Path(path)
    return str(ROOT / p) if path and not p.is_absolute() and not p.exists() and (ROOT / p).exists() else path


def _model_at_hand(cfg: LadderConfig):
    """(config, load() -> fresh model, train blocks) for the model at hand."""
    from workbench.models import load_model
    from workbench.memory.predict import model_config

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
    from workbench.data import corpus_blocks, target_corpus

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


def run_ladder(cfg: LadderConfig) -> pd.DataFrame:
    """Predict (and where possible measure) every rung; returns one row per (model, rung)."""
    from workbench.memory.baselines import baseline_table
    from workbench.memory.ladder import auto_fit, measure, run_with_fallback
    from workbench.memory.predict import model_config, predict
    from workbench.results import RunDir, atomic_write_csv, results_root, write_runs_table

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
            m = measure(name, load, blocks, batch=cfg.batch, steps=cfg.steps, lr=cfg.lr, sinks=(steps_sink,))
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
            p = predict(ref, name, batch=cfg.reference_batch, seq=cfg.reference_seq)
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
            m = measure(name, load, blocks, batch=cfg.batch, steps=2, lr=cfg.lr, budget_mib=cfg.budget_mib)
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
    old = pd.read_csv(runs_csv).to_dict("records") if runs_csv.exists() else []
    this = {**{k: json.dumps(v) if isinstance(v, list) else v for k, v in cfg.to_dict().items()},
            "run_id": cfg.run_id(), "status": "ok", "measured_ok": int((df["status"] == "ok").sum()),
            "autofit_ran": fit_rows[-1]["ran"] if fit_rows else None}
    keep = [{k: v for k, v in r.items() if not k.startswith("env_")} for r in old if r.get("run_id") != this["run_id"]]
    write_runs_table(results_root() / "ladder", keep + [this])
    return df
