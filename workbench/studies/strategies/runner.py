"""Study 1: which transfer strategy gives the best model for a small target domain on my card?

    from workbench.studies.strategies.runner import StrategiesConfig, run_strategies
    df = run_strategies(StrategiesConfig(token_budget=20_000, seeds=(0,)))   # CPU-sized

Every (strategy, seed) run starts from a fresh copy of the base model, trains on the target
domain's training text for the same token budget, and is scored by held-out perplexity before
and after. Each run goes through the device-fallback ladder (workbench.core.fallback): by default, on a
machine without a GPU, the CPU playing a GPU of `budget_mib`, then the CPU without a budget.
Results: results/strategies/<run_id>/{config.json, steps.jsonl, summary.json} and
results/strategies/runs.csv (every run ever made here); a finished run is not trained again.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal

import pandas as pd
import torch

from workbench import __version__
from workbench.core.config import Config, ConfigError, param
from workbench.core.data import corpus_blocks, target_corpus
from workbench.core.fallback import Attempt, Outcome, default_attempts, run_with_fallback
from workbench.core.models import (EMBEDDED, TINY_SPEC, EmbeddedSpec, check_seq_len, embedded_metrics, load_config,
                              load_model, model_fingerprint, resolve_model_path)
from workbench.core.results import (RunDir, atomic_write_csv, locked, results_root, reuse_finished_runs,
                               write_runs_table)
from workbench.core.trainable import PAPER_STRATEGIES, STRATEGIES, StrategyNotApplicable, apply_strategy
from workbench.core.training import TrainSettings, evaluate_perplexity, train

STUDY = "strategies"
Sink = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class StrategiesConfig(Config):
    model: str = param(EMBEDDED, "'embedded', a Hugging Face model id, or a local model directory")
    base_size: Literal["default", "tiny"] = param("default", "embedded base: 'default' or 'tiny' (tests)")
    corpus: str = param("embedded", "target domain: 'embedded' (Python's language reference) or a text file/folder")
    strategies: tuple[str, ...] = param(PAPER_STRATEGIES + ("lora", "bitfit", "qlora"), "strategies to compare",
                                        choices=tuple(STRATEGIES))
    seeds: tuple[int, ...] = param((0, 1, 2), "one run per seed and strategy")
    token_budget: int = param(150_000, "training tokens per run (equal for every strategy)")
    seq_len: int = param(128, "tokens per sequence")
    micro_batch: int = param(8, "sequences per forward/backward pass")
    grad_accum: int = param(1, "micro-batches per optimizer step")
    lr: float = param(1e-3, "peak learning rate (warm-up then cosine decay)")
    qlora_lr: float = param(3e-4, "peak learning rate of the QLoRA row (on a 4-bit base the shared rate diverged)")
    lora_rank: int = param(8, "rank of the LoRA and QLoRA adapters")
    precision: Literal["fp32", "bf16", "fp16"] = param("fp32", "autocast precision (fp16 needs CUDA)")
    budget_mib: float = param(160.0, "device-memory budget of the first attempt (the GPU, or the CPU playing one); 0 = none")
    devices: tuple[str, ...] = param((), "attempts in order, e.g. ['cuda', 'cpu'] or ['cpu@64', 'cpu'] ('cpu@64:cuda' also models a card's caching allocator); empty = default")
    preflight: bool = param(True, "skip an attempt whose predicted peak exceeds its budget")
    eval_blocks: int = param(64, "held-out blocks used for perplexity")
    trust_remote_code: bool = param(False, "let transformers run model code from the hub (off: safer)")

    def __post_init__(self):
        for name in ("token_budget", "seq_len", "micro_batch", "grad_accum", "eval_blocks", "lora_rank"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.lr <= 0 or self.qlora_lr <= 0:
            raise ConfigError(f"lr and qlora_lr must be positive, got {self.lr} and {self.qlora_lr}")
        if self.budget_mib < 0:
            raise ConfigError(f"budget_mib must be >= 0 (0 = no budget), got {self.budget_mib}")
        if not self.strategies:
            raise ConfigError("strategies is empty")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ConfigError(f"unknown strategy {', '.join(unknown)}; known: {', '.join(STRATEGIES)}")
        if len(set(self.strategies)) != len(self.strategies) or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError("strategies and seeds must not repeat")
        if not self.seeds:
            raise ConfigError("seeds is empty")
        for d in self.devices:
            Attempt.parse(d)
        if self.precision == "fp16" and not any(d.startswith("cuda") for d in self.attempts_as_text()):
            raise ConfigError("fp16 needs a CUDA device; use bf16 or fp32")

    # derived values are methods, not stored fields
    def spec(self) -> EmbeddedSpec:
        return TINY_SPEC if self.base_size == "tiny" else EmbeddedSpec()

    def attempts(self) -> tuple[Attempt, ...]:
        if self.devices:
            return tuple(Attempt.parse(d) for d in self.devices)
        return default_attempts(self.budget_mib or None)

    def attempts_as_text(self) -> list[str]:
        return [str(a) for a in self.attempts()]

    def steps(self) -> int:
        return max(1, self.token_budget // (self.micro_batch * self.grad_accum * self.seq_len))

    def train_settings(self, seed: int, strategy: str = "") -> TrainSettings:
        steps = self.steps()
        lr = self.qlora_lr if strategy == "qlora" else self.lr
        return TrainSettings(steps=steps, micro_batch=self.micro_batch, grad_accum=self.grad_accum,
                             lr=lr, warmup_steps=max(1, steps // 10), precision=self.precision, seed=seed)

    def run_id(self, strategy: str, seed: int, inputs: str = "") -> str:
        """The run's folder name: strategy, seed and a key of everything that changes its result:
        the settings, and `inputs` (see `run_inputs`: corpus content, base weights, version)."""
        run_fields = {k: v for k, v in self.to_dict().items() if k not in ("strategies", "seeds")}
        blob = json.dumps({"settings": type(self).from_dict(run_fields).hash(), "inputs": inputs}, sort_keys=True)
        return f"{strategy}-s{seed}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def corpus_overlap(cfg: StrategiesConfig, corpus=None) -> pd.DataFrame:
    """How much held-out text occurs verbatim in training text, for every corpus a study 1 run
    uses: the target domain it fine-tunes and evaluates on, and (for the embedded base) the source
    domain the base was pretrained and scored on. Measured on 50-character windows."""
    from workbench.core.data import MAX_OVERLAP, WINDOW

    corpus = corpus or target_corpus(cfg.corpus)
    rows = []
    ov = corpus.overlap
    rows.append({"corpus": corpus.name, "role": "target (fine-tuning, held-out perplexity)",
                 "train_chars": sum(map(len, corpus.train)), "heldout_chars": sum(map(len, corpus.heldout)),
                 "overlap_split_by_name_pct": 100 * ov.share_by_name, "overlap_pct": 100 * ov.share,
                 "heldout_paragraphs_left_out": ov.dropped_paragraphs, "docs_that_lost_text": ", ".join(ov.files)})
    if cfg.model == EMBEDDED:
        m = embedded_metrics(cfg.spec())
        if "source_overlap_share" in m:
            rows.append({"corpus": m["source_corpus"], "role": "source (pretraining the embedded base)",
                         "train_chars": m["source_train_chars"], "heldout_chars": m["source_heldout_chars"],
                         "overlap_split_by_name_pct": 100 * m["source_overlap_share_by_name"],
                         "overlap_pct": 100 * m["source_overlap_share"],
                         "heldout_paragraphs_left_out": m["source_heldout_paragraphs_left_out"],
                         "docs_that_lost_text": ""})
    df = pd.DataFrame(rows)
    df["window_chars"] = WINDOW
    df["limit_pct"] = 100 * MAX_OVERLAP
    df["within_limit"] = df["overlap_pct"] <= 100 * MAX_OVERLAP
    return df


def run_inputs(cfg: StrategiesConfig, corpus) -> dict[str, str]:
    """What a run's result depends on beyond its settings: a finished run is reused only when all match."""
    return {"corpus_fingerprint": corpus.fingerprint(),
            "model_fingerprint": model_fingerprint(cfg.model, cfg.spec()),
            "workbench_version": __version__}


# ------------------------------------------------------------------------------------------------
# one run


_PREDICTIONS: dict[tuple, tuple[float, str] | None] = {}


def predicted_peak_mib(cfg: StrategiesConfig, strategy: str, n_blocks: int) -> tuple[float, str] | None:
    """The predicted steady-state peak of one training step of `strategy`, in MiB (no weights read).

    It runs the real training loop on fake tensors (workbench.core.memory.predict), so it counts
    activations and temporaries too, not just weights + gradients + Adam state. Cached per setting.
    """
    from workbench.studies.ladder.rungs import Plan
    from workbench.core.memory.predict import simulate

    key = (cfg.model, cfg.base_size, strategy, cfg.precision, cfg.micro_batch, cfg.grad_accum, cfg.seq_len,
           cfg.lora_rank, n_blocks)
    if key not in _PREDICTIONS:
        config = load_config(cfg.model, spec=cfg.spec(), trust_remote_code=cfg.trust_remote_code)
        plan = Plan(f"study1-{strategy}", 0, "", precision=cfg.precision, trainable=strategy,
                    accum=cfg.grad_accum, lora_rank=cfg.lora_rank)
        try:
            report = simulate(config, plan, batch=cfg.micro_batch * cfg.grad_accum, seq=cfg.seq_len, n_blocks=n_blocks)
            _PREDICTIONS[key] = (report.steady_peak_bytes / 2**20, "fake-tensor prediction of the training step")
        except StrategyNotApplicable:
            _PREDICTIONS[key] = None
    return _PREDICTIONS[key]


def _load_for(cfg: StrategiesConfig, strategy: str, device: str):
    if strategy == "qlora":
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            raise StrategyNotApplicable("QLoRA needs bitsandbytes, which is not installed") from e
        from peft import prepare_model_for_kbit_training

        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_compute_dtype=torch.bfloat16 if cfg.precision == "bf16" else torch.float32)
        path = resolve_model_path(cfg.model, cfg.spec())
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=q, device_map={"": device},
                                                     use_safetensors=True, trust_remote_code=cfg.trust_remote_code)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        return model
    model, _ = load_model(cfg.model, device=device, spec=cfg.spec(), trust_remote_code=cfg.trust_remote_code)
    return model


def _run_strategy(cfg: StrategiesConfig, strategy: str, seed: int, train_blocks, held_blocks,
                  sinks: list[Sink], run: RunDir) -> dict[str, Any]:
    settings = cfg.train_settings(seed, strategy)
    steps_sink = run.steps_sink()
    predicted: list = []

    def preflight(attempt: Attempt):
        predicted.append(predicted_peak_mib(cfg, strategy, len(train_blocks)))
        return predicted[-1]

    def job(attempt: Attempt, budget, phase):
        phase("load")
        torch.manual_seed(seed)
        model = _load_for(cfg, strategy, attempt.device)
        budget.track_module(model)
        model, sel = apply_strategy(model, strategy, lora_rank=cfg.lora_rank)
        phase("eval_before")
        ppl_before = evaluate_perplexity(model, held_blocks, device=attempt.device, precision=cfg.precision,
                                         max_blocks=cfg.eval_blocks, batch_size=cfg.micro_batch)
        phase("train")
        extra = {"strategy": strategy, "seed": seed, "device": str(attempt), "budget_mib": attempt.budget_mib}
        t0 = time.perf_counter()
        result = train(model, train_blocks, settings, device=attempt.device, sinks=[steps_sink, *sinks],
                       memory_probe=lambda: budget.current_mib, extra=extra)
        wall = time.perf_counter() - t0
        phase("eval_after")
        ppl_after = evaluate_perplexity(model, held_blocks, device=attempt.device, precision=cfg.precision,
                                        max_blocks=cfg.eval_blocks, batch_size=cfg.micro_batch)
        return {**sel.as_row(), "ppl_before": ppl_before, "ppl_after": ppl_after, "train_seconds": wall,
                "tokens_per_s": result.tokens / result.seconds, "tokens": result.tokens,
                "final_loss": result.final_loss}

    def announce(event):
        for sink in sinks:
            sink({"event": "attempt", "strategy": strategy, "seed": seed, **event})

    try:
        outcome = run_with_fallback(cfg.attempts(), job, preflight=preflight if cfg.preflight else None,
                                    on_event=announce)
    except StrategyNotApplicable as e:
        outcome = Outcome("skipped", None, {"notes": str(e)}, [{"attempt": "-", "result": "skipped", "reason": str(e)}])
    finally:
        steps_sink.close()
    row: dict[str, Any] = {"strategy": strategy, "seed": seed, "run_id": run.run_id, "status": outcome.status,
                           "device": str(outcome.attempt) if outcome.attempt else None,
                           "device_history": outcome.history_text(), "peak_mem_mib": outcome.peak_mib,
                           "history": json.dumps(outcome.history)}
    # Every row has the same columns: a run that did not finish has no perplexity (None), not a gap.
    row.update({"ppl_before": None, "ppl_after": None, "improvement_pct": None})
    if outcome.value:
        row.update(outcome.value)
    if row["ppl_after"] is not None:
        row["improvement_pct"] = 100.0 * (1 - row["ppl_after"] / row["ppl_before"])
    row["predicted_peak_mib"] = predicted[-1][0] if predicted and predicted[-1] else None
    return row


# ------------------------------------------------------------------------------------------------
# the study


def run_strategies(cfg: StrategiesConfig, sinks: Iterable[Sink] = (), *, progress: bool = True) -> pd.DataFrame:
    """Run every (strategy, seed) of `cfg`; one row per run. Finished runs are read back, not redone."""
    from tqdm.auto import tqdm

    sinks = list(sinks)
    check_seq_len(load_config(cfg.model, spec=cfg.spec(), trust_remote_code=cfg.trust_remote_code),
                  cfg.seq_len, repr(cfg.model))
    tokenizer = _tokenizer(cfg)
    corpus = target_corpus(cfg.corpus)
    train_blocks, held_blocks = corpus_blocks(tokenizer, corpus, cfg.seq_len)
    inputs = run_inputs(cfg, corpus)
    inputs_key = json.dumps(inputs, sort_keys=True)
    reuse = reuse_finished_runs()
    rows = []
    jobs = [(s, seed) for seed in cfg.seeds for s in cfg.strategies]
    bar = tqdm(jobs, desc="strategies", unit="run", disable=not progress)
    for strategy, seed in bar:
        bar.set_postfix(strategy=strategy, seed=seed)
        run = RunDir(STUDY, cfg.run_id(strategy, seed, inputs_key))
        done = run.summary() if reuse else None
        if done is not None and done.get("status") in ("ok", "fallback", "oom", "skipped"):
            rows.append(done["row"])
            continue
        run.write_config({**cfg.to_dict(), "strategy": strategy, "seed": seed,
                          "train_blocks": len(train_blocks), "heldout_blocks": len(held_blocks),
                          **corpus.describe(), **inputs})
        try:
            row = _run_strategy(cfg, strategy, seed, train_blocks, held_blocks, sinks, run)
        except Exception as e:
            run.write_summary({"status": "error", "row": {"strategy": strategy, "seed": seed, "status": "error",
                                                          "error": f"{type(e).__name__}: {e}"}})
            raise
        row["config_hash"] = cfg.hash()
        row.update(inputs)
        row["heldout_overlap_share"] = corpus.overlap.share if corpus.overlap else None
        run.write_summary({"status": row["status"], "row": row})
        rows.append(row)
    bar.close()
    rebuild_runs_table()
    atomic_write_csv(results_root() / STUDY / "corpus_overlap.csv", corpus_overlap(cfg, corpus))
    df = pd.DataFrame(rows)
    return df


def _tokenizer(cfg: StrategiesConfig):
    from transformers import AutoTokenizer

    from workbench.core.models import ModelNotFoundError, _not_found_message

    try:
        tok = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model, cfg.spec()),
                                            trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(_not_found_message(cfg.model, e)) from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def rebuild_runs_table() -> pd.DataFrame:
    """results/strategies/runs.csv from every run's summary.json (so it never disagrees with them).

    Under the study's lock: two processes finishing runs at once each write a complete table."""
    root = results_root() / STUDY
    with locked(root / "runs.csv"):
        rows = []
        for p in sorted(root.glob("*/summary.json")):
            s = json.loads(p.read_text())
            rows.append({**s.get("row", {}), "status": s["status"], "finished": s.get("finished")})
        return write_runs_table(root, rows)


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Mean and spread over seeds, one row per strategy, in the order the strategies were run."""
    order = list(dict.fromkeys(df["strategy"]))
    ok = df[df["status"].isin(["ok", "fallback"])]
    agg = ok.groupby("strategy").agg(
        trainable_params=("trainable_params", "first"),
        trainable_share=("trainable_share", "first"),
        ppl_before=("ppl_before", "mean"),
        ppl_after_mean=("ppl_after", "mean"),
        ppl_after_std=("ppl_after", "std"),
        improvement_pct_mean=("improvement_pct", "mean"),
        improvement_pct_std=("improvement_pct", "std"),
        tokens_per_s=("tokens_per_s", "mean"),
        train_seconds=("train_seconds", "mean"),
        peak_mem_mib=("peak_mem_mib", "max"),
        seeds=("seed", "count"),
    )
    status = df.groupby("strategy").agg(
        statuses=("status", lambda s: ", ".join(sorted(set(s)))),
        devices=("device", lambda s: ", ".join(sorted({str(x) for x in s}))),
        device_history=("device_history", "first"),
    )
    out = status.join(agg, how="left").reindex(order).reset_index()
    return out


def claims_table(df: pd.DataFrame) -> pd.DataFrame:
    """The published study's four rows beside what the workbench measured, with the reasons they differ."""
    from workbench.core.claims import study1_comparison

    return study1_comparison(summarize(df))


def write_tables(df: pd.DataFrame) -> dict[str, str]:
    """Write the summary and claims tables beside runs.csv; returns their paths."""
    root = results_root() / STUDY
    paths = {"summary": root / "summary.csv", "claims": root / "claims.csv"}
    atomic_write_csv(paths["summary"], summarize(df))
    atomic_write_csv(paths["claims"], claims_table(df))
    return {k: str(v) for k, v in paths.items()}


def steps_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Every run's per-step rows (loss curves), read from steps.jsonl."""
    from workbench.core.results import read_steps

    frames = []
    for run_id, device in zip(df["run_id"], df["device"]):
        p = results_root() / STUDY / run_id / "steps.jsonl"
        if p.exists() and p.stat().st_size and isinstance(device, str):
            steps = read_steps(p)
            frames.append(steps[steps["device"] == device])  # the attempt that finished, not the ones that ran out
    if not frames:
        return pd.DataFrame(columns=["strategy", "seed", "step", "loss", "tokens"])
    return pd.concat(frames, ignore_index=True)


def app(cfg: StrategiesConfig):
    """The study's control panel: a knob per parameter; Run shows live charts, then the summary."""
    from IPython.display import display

    from workbench.studies.strategies import figures as plots
    from workbench.front.live import LiveChart
    from workbench.front.panel import knobs

    def run(c: StrategiesConfig) -> pd.DataFrame:
        import ipywidgets

        chart = ipywidgets.Output()
        display(chart)
        live = LiveChart(title="Study 1: transfer strategies", output=chart)
        df = run_strategies(c, sinks=[live], progress=False)
        live.close()
        display(summarize(df))
        plots.perplexity_spread(df).show()
        return df

    return knobs(StrategiesConfig, cfg, run, title="Study 1: change the settings and press Run")


def report_section() -> list[tuple[str, str, Any]]:
    """The report's parts for study 1, from results/strategies/ (the latest configuration run)."""
    from workbench.studies.strategies import figures as plots
    from workbench.core.claims import study1_general_problems

    root_dir = results_root() / STUDY
    runs = root_dir / "runs.csv"
    if not runs.exists():
        return []
    df = pd.read_csv(runs)
    if "config_hash" in df and df["config_hash"].notna().any():
        latest = df.sort_values("finished")["config_hash"].dropna().iloc[-1]
        df = df[df["config_hash"] == latest]
    where = "GPU" if df["device"].astype(str).str.startswith("cuda").any() else "CPU"
    tag = (f'<span class="tag measured">measured</span> on this machine ({where}); budgets on the CPU are played, not a real GPU. '
           "A CUDA budget caps the allocator's reserved memory (fragmentation included); the CPU budget counts live tensor bytes")
    problems = "".join(f"<li>{p}</li>" for p in study1_general_problems())
    overlap = root_dir / "corpus_overlap.csv"
    overlap_parts = []
    if overlap.exists():
        ov = pd.read_csv(overlap)
        overlap_parts = [
            ("text", "Held-out text is unseen in content",
             "Share of each corpus's held-out 50-character windows that occur verbatim in its training "
             "text: split by document name alone, and as the workbench splits it (repeated paragraphs "
             "kept once, held-out paragraphs that share a window with training text left out)."),
            ("table", "", ov[["corpus", "role", "train_chars", "heldout_chars", "overlap_split_by_name_pct",
                              "overlap_pct", "limit_pct", "heldout_paragraphs_left_out", "docs_that_lost_text"]]),
        ]
    return [
        ("text", "", tag),
        *overlap_parts,
        ("table", "Summary over seeds", summarize(df)),
        ("figure", "", plots.perplexity_spread(df)),
        ("figure", "", plots.loss_curves(steps_frame(df))),
        ("table", "Every run and its device history",
         df[["strategy", "seed", "status", "device_history", "peak_mem_mib", "ppl_before", "ppl_after"]]),
        ("text", "Why the published figures differ", f"<ul>{problems}</ul>"),
        ("table", "Published claims beside this measurement", claims_table(df)),
    ]
