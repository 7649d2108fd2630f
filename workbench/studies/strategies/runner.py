"""Study 1: which transfer strategy gives the best model for a small target domain on my card?

    from workbench.studies.strategies.runner import StrategiesConfig, run_strategies
    result = run_strategies(StrategiesConfig(token_budget=20_000, seeds=(0,)))   # CPU-sized
    result.runs                                   # one row per (strategy, seed); a StudyResult

Every (strategy, seed) run starts from a fresh copy of the base model, trains on the target
domain's training text for the same token budget, and is scored by held-out perplexity before
and after. Each run goes through the device-fallback ladder (workbench.core.fallback): by default, on a
machine without a GPU, the CPU playing a GPU of `budget_mib`, then the CPU without a budget.
Results: results/strategies/<run_id>/{config.json, steps.jsonl, summary.json} and
results/strategies/runs.csv (every run ever made here); a finished run is not trained again.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Iterable

import pandas as pd
import torch

from workbench import __version__
from workbench.core.common import Sink
from workbench.core.data import MAX_OVERLAP, WINDOW, corpus_blocks
from workbench.core.fallback import Attempt, Outcome, run_with_fallback
from workbench.core.hub import LOAD_ERRORS, hub_options, not_found_message, with_vocabulary
from workbench.core.memory import cuda_model
from workbench.core.memory.plan import Plan, bnb_4bit_config
from workbench.core.memory.played import played_card_peaks
from workbench.core.memory.predict import predict, simulate
from workbench.core.models import (
    EMBEDDED,
    ModelNotFoundError,
    check_seq_len,
    corpus_for,
    embedded_metrics,
    load_config,
    load_model,
    model_fingerprint,
    resolve_model_path,
)
from workbench.core.parallel import run_many
from workbench.core.results import (
    ResultsWriter,
    RunDir,
    StudyResult,
    code_fingerprint,
    library_versions,
    read_steps,
    reuse_finished_runs,
)
from workbench.core.trainable import StrategyNotApplicable, apply_strategy, check_lora_rank
from workbench.core.training import LossDiverged, evaluate_perplexity, train
from workbench.studies.strategies.config import STUDY, StrategiesConfig
from workbench.studies.strategies.tables import (  # noqa: F401 (load_result, summarize: this module's API too)
    claims_table, load_result, rebuild_runs_table, record_interrupted, steps_frame, summarize)


def corpus_overlap(cfg: StrategiesConfig, corpus=None) -> pd.DataFrame:
    """How much held-out text occurs in training text (whitespace collapsed), for every corpus a study 1 run
    uses: the target domain it fine-tunes and evaluates on, and (for the embedded base) the source
    domain the base was pretrained and scored on. Measured on 50-character windows."""
    corpus = corpus or corpus_for(cfg.model, cfg.corpus, cfg.spec())
    rows = []
    ov = corpus.overlap
    rows.append({"corpus": corpus.name, "role": "target (fine-tuning, held-out perplexity)",
                 "train_chars": sum(map(len, corpus.train)), "heldout_chars": sum(map(len, corpus.heldout)),
                 "overlap_split_by_name_pct": 100 * ov.share_by_name, "overlap_pct": 100 * ov.share,
                 "heldout_paragraphs_left_out": ov.dropped_paragraphs,
                 # of those, left out for sharing a window with the embedded base's pretraining text (a hub
                 # model's is not at hand: none)
                 "seen_by_model_paragraphs": ov.seen_by_model_paragraphs if cfg.model == EMBEDDED else None,
                 "docs_that_lost_text": ", ".join(ov.files)})
    if cfg.model == EMBEDDED:
        m = embedded_metrics(cfg.spec())
        if "source_overlap_share" in m:
            rows.append({"corpus": m["source_corpus"], "role": "source (pretraining the embedded base)",
                         "train_chars": m["source_train_chars"], "heldout_chars": m["source_heldout_chars"],
                         "overlap_split_by_name_pct": 100 * m["source_overlap_share_by_name"],
                         "overlap_pct": 100 * m["source_overlap_share"],
                         "heldout_paragraphs_left_out": m["source_heldout_paragraphs_left_out"],
                         # its training text is the base's pretraining text: each paragraph left out had been seen
                         "seen_by_model_paragraphs": m["source_heldout_paragraphs_left_out"],
                         "docs_that_lost_text": ""})
    df = pd.DataFrame(rows)
    # unseen by the model too? The embedded base's pretraining text is ours; a hub model's (or a user's) is not
    df["pretraining_text"] = ("checked: held-out paragraphs that share a window with it are left out" if
                              cfg.model == EMBEDDED else f"not known: {cfg.model} may have seen the held-out "
                              "text in pretraining (its pretraining text is not at hand to check)")
    df["window_chars"] = WINDOW
    df["limit_pct"] = 100 * MAX_OVERLAP
    df["within_limit"] = df["overlap_pct"] <= 100 * MAX_OVERLAP
    return df


def run_inputs(cfg: StrategiesConfig, corpus) -> dict[str, str]:
    """What a run's result depends on beyond its settings: a finished run is reused only when all match.
    `attempts`: the devices as resolved here. Empty `devices` means the GPU under the budget on a GPU
    machine and the CPU playing it elsewhere, so the key of a run made on the CPU had matched on a
    GPU machine, which then read the CPU's run back instead of training on the card."""
    return {"attempts": " ".join(cfg.attempts_as_text()), "corpus_fingerprint": corpus.fingerprint(),
            "model_fingerprint": model_fingerprint(cfg.model, cfg.spec()),
            "workbench_version": __version__, "workbench_code": code_fingerprint(), "libraries": library_versions()}


# ------------------------------------------------------------------------------------------------
# one run


_PREDICTIONS: dict[tuple, tuple[float, str, float] | None] = {}


def predicted_peak_mib(cfg: StrategiesConfig, strategy: str, n_blocks: int,
                       device: str = "cpu", allocator: str = "live") -> tuple[float, str] | None:
    """What the run of `strategy` on `device` needs of a budget there, in MiB, predicted on fake tensors
    (workbench.core.memory.predict; activations counted, no weights read): on the CPU its steady-state
    step's peak live bytes, which a CPU budget counts; on a card the reserved memory it needs (CUDA's
    kernels and caching allocator modelled), which a card's budget caps; on a played card (the CPU with
    `allocator="cuda"`, 'cpu@N:cuda') the CPU step's allocations replayed through the same allocator model
    the budget runs, under caps: the least reserved memory it runs in. Cached per setting."""
    got = _predicted(cfg, strategy, n_blocks, device, allocator)
    return got[:2] if got else None


def _predicted(cfg: StrategiesConfig, strategy: str, n_blocks: int, device: str,
               allocator: str) -> tuple[float, str, float] | None:
    """(what the budget is held to, how it was predicted, the peak of the kind the run reports), in MiB."""
    cuda = torch.device(device).type == "cuda"
    played = not cuda and allocator == "cuda"
    key = (cfg.model, cfg.base_size, strategy, cfg.precision, cfg.micro_batch, cfg.grad_accum, cfg.seq_len,
           cfg.lora_rank, n_blocks, cfg.steps() if played else cfg.steps() >= 2, device if cuda else "cpu", played)
    if key not in _PREDICTIONS:
        config = load_config(cfg.model, spec=cfg.spec(), trust_remote_code=cfg.trust_remote_code)
        plan = Plan(f"study1-{strategy}", 0, "", precision=cfg.precision, trainable=strategy,
                    accum=cfg.grad_accum, lora_rank=cfg.lora_rank)
        batch = cfg.micro_batch * cfg.grad_accum
        try:
            if cuda:  # the card at hand's compute capability picks the attention kernel
                card = cuda_model.card_at_hand(device) if torch.cuda.is_available() else None
                p = predict(config, plan, batch=batch, seq=cfg.seq_len, n_blocks=n_blocks, device="cuda", card=card)
                _PREDICTIONS[key] = (p.fit_bytes / 2**20, "CUDA-modelled prediction of the reserved memory at its peak",
                                     p.allocated_peak_bytes / 2**20)
            elif played:  # the CPU's kernels, the card's allocator: as PlayedCudaAllocator runs the step
                allocated, needed = played_card_peaks(config, plan, batch=batch, seq=cfg.seq_len, n_blocks=n_blocks,
                                                      steps=cfg.steps())
                _PREDICTIONS[key] = (needed / 2**20, "fake-tensor prediction of the training step, its allocations "
                                     "replayed through the modelled caching allocator: the least reserved memory it "
                                     "runs in", allocated / 2**20)
            else:  # as the played budget's live-bytes count (a dispatch mode) runs the step
                report = simulate(config, plan, batch=batch, seq=cfg.seq_len, n_blocks=n_blocks, instrumented=True)
                peak = report.run_peak_bytes(cfg.steps()) / 2**20
                _PREDICTIONS[key] = (peak, "fake-tensor prediction of the training step", peak)
        except StrategyNotApplicable:
            _PREDICTIONS[key] = None
    return _PREDICTIONS[key]


def _load_for(cfg: StrategiesConfig, strategy: str, device: str):
    if strategy == "qlora":
        from transformers import AutoModelForCausalLM

        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            raise StrategyNotApplicable("QLoRA needs bitsandbytes, which is not installed") from e
        from peft import prepare_model_for_kbit_training

        # as the pre-flight prediction quantizes (NF4 with double quantization, QLoRA's recipe)
        q = bnb_4bit_config(torch.bfloat16 if cfg.precision == "bf16" else torch.float32)
        path = resolve_model_path(cfg.model, cfg.spec())
        try:  # as load_model says a folder without *.safetensors: one line, not a traceback
            model = AutoModelForCausalLM.from_pretrained(path, quantization_config=q, device_map={"": device},
                                                         use_safetensors=True, trust_remote_code=cfg.trust_remote_code,
                                                         **hub_options(path, model=True))
        except LOAD_ERRORS as e:
            raise ModelNotFoundError(not_found_message(cfg.model, e)) from e
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        return model
    model, _ = load_model(cfg.model, device=device, spec=cfg.spec(), trust_remote_code=cfg.trust_remote_code)
    return model


def _run_strategy(cfg: StrategiesConfig, strategy: str, seed: int, train_blocks, held_blocks,
                  sinks: list[Sink], run: RunDir) -> dict[str, Any]:
    settings = cfg.train_settings(seed, strategy)
    steps_sink = run.steps_sink()
    predicted: dict[str, tuple[float, str, float] | None] = {}  # by attempt: _predicted

    def preflight(attempt: Attempt):
        got = _predicted(cfg, strategy, len(train_blocks), attempt.device, attempt.allocator)
        predicted[str(attempt)] = got
        return got[:2] if got else None

    history: list[dict] = []  # the attempts' events as the fallback chain records them, and the one running

    def job(attempt: Attempt, budget, phase):
        history.append({"attempt": str(attempt), "result": "diverged", "phase": "train"})  # unless it returns
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
                       memory_probe=budget.step_memory, extra=extra)
        wall = time.perf_counter() - t0
        phase("eval_after")
        ppl_after = evaluate_perplexity(model, held_blocks, device=attempt.device, precision=cfg.precision,
                                        max_blocks=cfg.eval_blocks, batch_size=cfg.micro_batch)
        return {**sel.as_row(), "ppl_before": ppl_before, "ppl_after": ppl_after, "train_seconds": wall,
                "tokens_per_s": result.tokens_per_s, "tokens": result.tokens,
                "final_loss": result.final_loss}

    def announce(event):
        if event["result"] in ("ok", "oom"):  # an attempt the job ran: its record replaces the one it began with
            history.pop()
        history.append(event)
        for sink in sinks:
            sink({"event": "attempt", "strategy": strategy, "seed": seed, **event})

    try:
        outcome = run_with_fallback(cfg.attempts(), job, preflight=preflight if cfg.preflight else None,
                                    on_event=announce)
    except StrategyNotApplicable as e:
        outcome = Outcome("skipped", None, {"notes": str(e)}, [{"attempt": "-", "result": "skipped", "reason": str(e)}])
    except LossDiverged as e:  # at a learning rate others take, a finding: its row; the comparison goes on
        outcome = Outcome("error", Attempt.parse(history[-1]["attempt"]), {"notes": str(e)}, history)
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
    # beside the measured peak, a prediction of the same kind: the finishing attempt's allocated peak (live
    # bytes on a CPU; a played card's allocated blocks; a card's CUDA-modelled max_memory_allocated); none
    # finished: what the last CPU one's budget was held to (why it was skipped)
    if outcome.attempt is not None:
        mine = predicted.get(str(outcome.attempt))
        row["predicted_peak_mib"] = mine[2] if mine else None
    else:
        mine = next((v for k, v in reversed(predicted.items()) if not k.startswith("cuda") and v), None)
        row["predicted_peak_mib"] = mine[0] if mine else None
    return row


# ------------------------------------------------------------------------------------------------
# the study


@dataclass(frozen=True)
class Job:
    """One (strategy, seed) run with everything it needs: picklable, so it can run in another process."""

    cfg: StrategiesConfig
    strategy: str
    seed: int
    inputs: dict
    corpus_info: dict
    overlap_share: float | None
    train_blocks: torch.Tensor
    held_blocks: torch.Tensor

    def run_dir(self) -> RunDir:
        return RunDir(STUDY, self.cfg.run_id(self.strategy, self.seed, json.dumps(self.inputs, sort_keys=True)))


def finished_row(run: RunDir) -> dict | None:
    """A run's row if it trained (ok, or fell back), else None: a run skipped or out of memory runs again."""
    summary = run.summary() if reuse_finished_runs() else None
    return summary["row"] if summary is not None and summary.get("status") in ("ok", "fallback") else None


def run_job(job: Job, sinks: Iterable[Sink] = ()) -> dict:
    """Train one run and write its folder (its config and steps as partial files, put in place with
    summary.json, last: workbench.core.results.RunDir); returns its row.
    The run is held while it trains: the same run started elsewhere at once waits, then reads it back."""
    run = job.run_dir()
    with run.training():
        if (row := finished_row(run)) is not None:  # another process trained it while this one waited
            _replay(job, list(sinks))
            return {**row, "reused": True}
        return _train_job(job, run, sinks)


def _train_job(job: Job, run: RunDir, sinks: Iterable[Sink]) -> dict:
    run.write_config({**job.cfg.to_dict(), "strategy": job.strategy, "seed": job.seed,
                      "train_blocks": len(job.train_blocks), "heldout_blocks": len(job.held_blocks),
                      **job.corpus_info, **job.inputs})
    try:
        row = _run_strategy(job.cfg, job.strategy, job.seed, job.train_blocks, job.held_blocks, list(sinks), run)
    except Exception as e:
        run.write_summary({"status": "error", "row": {"strategy": job.strategy, "seed": job.seed, "status": "error",
                                                      "error": f"{type(e).__name__}: {e}"}})
        raise
    row["config_hash"] = job.cfg.science().hash()
    row.update(job.inputs)
    row["heldout_overlap_share"] = job.overlap_share
    run.write_summary({"status": row["status"], "row": row})
    return row


def run_strategies(cfg: StrategiesConfig, sinks: Iterable[Sink] = (), *, progress: bool = True) -> StudyResult:
    """Run every (strategy, seed) of `cfg`: one row per run, their steps, the summary, claims and
    overlap tables (all written to results/strategies/). Finished runs are read back, not redone.

    With `cfg.workers` > 1 (or `cfg.scheduler`) the runs go to a Dask cluster (workbench.core.parallel):
    each in its own process with its share of the cores, the same settings and seeds, so the same
    results; the sinks then get each run's step rows when the runs are done (read from steps.jsonl)."""
    sinks = list(sinks)
    config = load_config(cfg.model, spec=cfg.spec(), trust_remote_code=cfg.trust_remote_code)
    check_seq_len(config, cfg.seq_len, repr(cfg.model))
    if {"lora", "qlora"} & set(cfg.strategies):  # before any run: the first LoRA run said it after others trained
        check_lora_rank(config, cfg.lora_rank, trust_remote_code=cfg.trust_remote_code)
    tokenizer = _tokenizer(cfg)
    corpus = corpus_for(cfg.model, cfg.corpus, cfg.spec())
    train_blocks, held_blocks = corpus_blocks(tokenizer, corpus, cfg.seq_len, cfg.eval_blocks)
    inputs = run_inputs(cfg, corpus)
    jobs = [Job(cfg, s, seed, inputs, corpus.describe(), corpus.overlap.share if corpus.overlap else None,
                train_blocks, held_blocks) for seed in cfg.seeds for s in cfg.strategies]
    done: dict[int, dict] = {}
    for i, job in enumerate(jobs):
        if (row := finished_row(job.run_dir())) is not None:
            done[i] = row
    pending = [i for i in range(len(jobs)) if i not in done]
    for i in sorted(done):  # runs read back: the live chart shows what they did (it stayed empty)
        _replay(jobs[i], sinks)
    try:
        if cfg.workers > 1 or cfg.scheduler:
            rows = run_many(run_job, [jobs[i] for i in pending], workers=cfg.workers,
                            scheduler=cfg.scheduler or None, desc="strategies", progress=progress, done=len(done))
            for i in pending:  # the live chart, after the fact
                _replay(jobs[i], sinks)
        else:
            rows = run_many(lambda i: run_job(jobs[i], sinks), pending, desc="strategies", progress=progress,
                            done=len(done))
    except BaseException:  # ^C, SIGTERM: runs.csv lists the runs finished so far (it was written at the end alone)
        rebuild_runs_table()
        record_interrupted([job.run_dir() for job in jobs], lambda: _as_json(corpus_overlap(cfg, corpus)))
        raise
    reused = set(done) | {i for i, row in zip(pending, rows) if row.get("reused")}  # one another process trained
    done.update(zip(pending, rows))
    df = pd.DataFrame([done[i] for i in range(len(jobs))])
    df["reused"] = [i in reused for i in range(len(jobs))]  # read back, not trained by this call
    result = StudyResult(STUDY, runs=df, steps=steps_frame(df),
                         tables={"summary": summarize(df), "claims": claims_table(df),
                                 "corpus_overlap": corpus_overlap(cfg, corpus)},
                         facts={"token_budget": cfg.token_budget})
    rebuild_runs_table()
    writer = ResultsWriter(STUDY)
    result.paths = {name: str(writer.table(name, table)) for name, table in result.tables.items()}
    # which runs this call's tables are of (load_result reads them back): a reused run keeps its old
    # `finished`, so the latest finished run can belong to an earlier call of other settings
    result.paths["latest"] = str(writer.json("latest", {"run_ids": list(df["run_id"]),
                                                        "corpus_overlap": _as_json(result.tables["corpus_overlap"])}))
    result.paths["runs"] = str(writer.dir / "runs.csv")
    return result


def _as_json(df: pd.DataFrame) -> dict:
    """A table as JSON that pd.DataFrame(**it) makes again: its columns in their order, its values."""
    return {"columns": list(df.columns), "data": df.to_dict("records")}


def _replay(job: Job, sinks: list[Sink]) -> None:
    """Hand a finished run's steps, as it wrote them, to the sinks."""
    steps = job.run_dir().path / "steps.jsonl"
    for row in (read_steps(steps).to_dict("records") if sinks and steps.exists() and steps.stat().st_size else []):
        for sink in sinks:
            sink(row)


def _tokenizer(cfg: StrategiesConfig):
    from transformers import AutoTokenizer

    path = resolve_model_path(cfg.model, cfg.spec())
    try:
        tok = with_vocabulary(AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code,
                                                            **hub_options(path)))
    except LOAD_ERRORS as e:
        raise ModelNotFoundError(not_found_message(cfg.model, e)) from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
