"""Does every GPU path of the workbench work on this card, and how close are the predictions?

    make gpu-check                      # or: workbench gpu-check [--quick] [--only ladder,trace]
    workbench gpu-check --model data/configs/qwen2-0.5b.json --batch 1 --seq 512

Without CUDA it says so in one line and exits 0. On a CUDA machine it runs, in minutes:
- ladder: every rung that places anything on the GPU, measured on the card (random init from a
  config, random tokens), its CUDA-modelled prediction for the card at hand (`memory.predict(...,
  device="cuda", card=card_at_hand())`: allocated, reserved, nvidia-smi) beside
  `torch.cuda.max_memory_allocated`, `max_memory_reserved` and NVML's used memory, with the errors
  in percent and the segments by size beside the replay's (where a reserved miss lies); the plain step
  as a user's training runs it (`--counted`: under the live-bytes count); a failing rung is its row;
- strategies: study 1 under a real CUDA budget (`set_per_process_memory_fraction`) small enough
  that the strategies run out of memory for real and fall back to the CPU; afterwards
  `torch.cuda.memory_allocated()` must be back where it started;
- trace: a `torch.profiler` trace and a CUDA memory snapshot of one training iteration;
- any check another part adds (the least reserved cap two rungs train under, beside the prediction's
  "reserved needed": `studies/ladder/gpu_cap.py`; study 3's engine: `studies/split/gpu_check.py`;
  the notebooks and the memory monitor's cost: `front/gpu_programs.py`); versions and the card.
Results: results/gpu_check/{summary.json, report.md (rewritten after every check), trace.json,
memory_snapshot.pickle, notebooks/, runs/}. One H200 run is in data/measured/h200-2026-11-22/.

The logic (rows, errors, thresholds, verdicts, the summary and the report) is pure functions
tested on the CPU with fabricated measurements (tests/test_gpu_check.py); the functions marked
"CUDA" are the thin layer that measures.
"""

from __future__ import annotations

import gc
import importlib
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from workbench.core.common import MiB, one_line
from workbench.core.config import ConfigError
from workbench.core.memory import allocator
from workbench.core.memory import cuda_model
from workbench.core.memory.monitor import MemoryMonitor
from workbench.core.memory.plan import RUNGS
from workbench.core.memory.predict import predict
from workbench.core.results import atomic_write_json, atomic_write_text, environment, results_root, results_under
from workbench.core.training import TrainSettings, train
from workbench.front import gpu_programs
from workbench.studies.ladder import gpu_cap
from workbench.studies.ladder.config import LadderConfig
from workbench.studies.ladder.rungs import OFFLOADED, measure
from workbench.studies.ladder.runner import model_at_hand
from workbench.studies.split import gpu_check as split_gpu_check
from workbench.studies.strategies.config import StrategiesConfig
from workbench.studies.strategies.runner import run_strategies

# A prediction passes when it is within this share of the allocator's peak (allocated); reserved
# is shown beside it (the allocator rounds and caches, so reserved >= allocated) and checked
# loosely. Memory predicted for CUDA models CUDA's kernels and allocator (DESIGN.md section 3).
THRESHOLDS = {"allocated_pct": 15.0, "reserved_pct": 35.0}
TIME_LIMIT_S = 600  # the whole check should fit in ten minutes
NO_GPU_LINE = "workbench gpu-check: needs a CUDA GPU (torch.cuda.is_available() is False here); nothing to check"
# Modules that add checks (each defines gpu_checks() -> {name: fn(options) -> result dict}).


@dataclass(frozen=True)
class Options:
    out: Path
    model: str = "data/configs/qwen2-0.5b.json"
    tiny: bool = False  # with model "embedded": the tiny embedded base (--quick)
    batch: int = 1
    seq: int = 512
    steps: int = 3
    rungs: tuple[str, ...] = ()  # empty: every rung that uses the GPU
    study1_budget_mib: float = 2.0
    counted: bool = False  # the device rungs under the live-bytes count (as on 2026-11-22), not plain
    device: str = "cuda"
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------
# pure logic: rows, comparisons, verdicts, summary (tested on the CPU)

def error_pct(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured in percent; None when either is missing or measured is 0."""
    if predicted is None or measured is None or not measured:
        return None
    return 100.0 * (predicted - measured) / measured


def gpu_rungs(rungs: dict) -> tuple[str, ...]:
    """Every rung that places something on the GPU (all but CPU-only), in ladder order."""
    return tuple(n for n, p in rungs.items() if p.placement != "cpu")


def rung_row(name: str, prediction: dict[str, Any], measured: dict[str, Any], nvml: dict[str, float],
             thresholds: dict[str, float] = THRESHOLDS) -> dict[str, Any]:
    """One rung: prediction beside what the card measured, errors in percent, pass/fail.

    `prediction`: a CUDA-modelled Prediction.row() (allocated_peak_bytes, reserved_peak_bytes,
    nvidia_smi_bytes; a CPU one's predicted_peak_bytes and fit_bytes stand in), or {"error": ...}.
    `measured`: ladder.measure()'s row (status, cuda_max_allocated_bytes, cuda_max_reserved_bytes, measured_peak_bytes).
    `nvml`: {"nvml_used_peak_mib", "nvml_used_before_mib"} from the monitor (may be empty).
    """
    def mib(b):
        return None if b is None else b / MiB

    alloc, reserved = mib(measured.get("cuda_max_allocated_bytes")), mib(measured.get("cuda_max_reserved_bytes"))
    # a CUDA-modelled prediction has the allocator's two figures; a CPU one only its live bytes
    pred = mib(prediction.get("allocated_peak_bytes") or prediction.get("predicted_peak_bytes"))
    fit = mib(prediction.get("reserved_peak_bytes") or prediction.get("fit_bytes"))
    row = {
        "rung": name, "status": measured.get("status", "error"), "reason": measured.get("reason", ""),
        "method": prediction.get("method"), "prediction_error": prediction.get("error"),
        "predicted_allocated_mib": pred, "predicted_reserved_mib": fit,
        "cuda_max_allocated_mib": alloc, "cuda_max_reserved_mib": reserved,
        "accounted_peak_mib": (None if measured.get("measured_by") == "cuda allocator"
                               else mib(measured.get("measured_peak_bytes"))),
        "predicted_nvidia_smi_mib": mib(prediction.get("nvidia_smi_bytes") or None),
        "nvml_used_peak_mib": nvml.get("nvml_used_peak_mib"),
        "outside_allocator_mib": (nvml["nvml_used_peak_mib"] - reserved
                                  if "nvml_used_peak_mib" in nvml and reserved is not None else None),
        "nvml_used_delta_mib": (nvml["nvml_used_peak_mib"] - nvml["nvml_used_before_mib"]
                                if {"nvml_used_peak_mib", "nvml_used_before_mib"} <= set(nvml) else None),
        "error_vs_allocated_pct": error_pct(pred, alloc), "error_vs_reserved_pct": error_pct(fit, reserved),
        "step_ms": measured.get("step_ms"),  # and, where a library has side streams, each one's cache in MiB
        **{f"{k}_reserved_by_stream_mib": {s: b / MiB for s, b in (d.get("reserved_by_stream_bytes") or {}).items()} or None
           for k, d in (("predicted", prediction), ("cuda", measured))},
        **{f"{k}_segment_sizes": d.get("segment_sizes") or None for k, d in (("predicted", prediction), ("cuda", measured))},
    }
    row["segment_difference"] = allocator.segment_difference(row["predicted_segment_sizes"], row["cuda_segment_sizes"])
    if row["status"] != "ok":
        row["passed"] = None  # judged by ladder_verdict: an error on a GPU is a failure, an OOM is a result
    else:
        ea, er = row["error_vs_allocated_pct"], row["error_vs_reserved_pct"]
        row["passed"] = (ea is not None and abs(ea) <= thresholds["allocated_pct"]
                         and (er is None or abs(er) <= thresholds["reserved_pct"]))
    return row


def ladder_verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """pass when every rung ran (or ran out of memory for real) and every measured one is within
    the thresholds; the failures say which rung and why."""
    failures = []
    for r in rows:
        if r.get("prediction_error"):
            failures.append(f"{r['rung']}: the prediction failed: {r['prediction_error']}")
        elif r["status"] == "ok" and not r["passed"]:
            failures.append(f"{r['rung']}: prediction off by {r['error_vs_allocated_pct']:+.1f}% of allocated"
                            if r["error_vs_allocated_pct"] is not None else f"{r['rung']}: no allocator figure")
        elif r["status"] not in ("ok", "oom"):
            failures.append(f"{r['rung']}: {r['status']}: {r['reason']}")
    return {"status": "pass" if rows and not failures else "fail", "failures": failures, "rows": rows}


def study1_verdict(runs: list[dict[str, Any]], allocated_before: int, allocated_after: int) -> dict[str, Any]:
    """pass when at least one strategy ran out of CUDA memory for real and then finished on the
    CPU, and nothing is left allocated on the GPU afterwards."""
    import json

    fell_back = []
    for r in runs:
        history = r["history"] if isinstance(r["history"], list) else json.loads(r["history"] or "[]")
        cuda_oom = any(h["attempt"].startswith("cuda") and h["result"] == "oom" for h in history)
        cpu_ok = any(h["attempt"].startswith("cpu") and h["result"] == "ok" for h in history)
        if cuda_oom and cpu_ok:
            fell_back.append(r["strategy"])
    failures = []
    if not fell_back:
        failures.append("no strategy ran out of CUDA memory and fell back to the CPU")
    if allocated_after != allocated_before:
        failures.append(f"{allocated_after - allocated_before} bytes left allocated on the GPU after study 1")
    return {"status": "fail" if failures else "pass", "failures": failures, "fell_back": fell_back,
            "allocated_before_bytes": allocated_before, "allocated_after_bytes": allocated_after,
            "runs": [{k: r.get(k) for k in ("strategy", "status", "device_history", "peak_mem_mib")} for r in runs]}


def summarize(results: dict[str, dict[str, Any]], env: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The summary.json: every check's result, the overall status, versions and the card."""
    statuses = {name: r.get("status", "error") for name, r in results.items()}
    ok = bool(statuses) and all(s in ("pass", "not provided") for s in statuses.values())
    return {"status": "pass" if ok else "fail", "checks": statuses, "results": results, "environment": env,
            "seconds": seconds, "within_time_limit": seconds <= TIME_LIMIT_S, "thresholds": THRESHOLDS}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


def report_markdown(summary: dict[str, Any]) -> str:
    """The report section: the verdicts, the ladder table (prediction beside the card), study 1."""
    env = summary["environment"]
    lines = [f"## GPU check: {summary['status']}", "",
             f"Card: {env.get('gpu', '?')} ({env.get('gpu_total_mib', 0):.0f} MiB), torch {env.get('torch')}, "
             f"CUDA {env.get('cuda')}, {summary['seconds']:.0f} s"
             + ("" if summary["within_time_limit"] else f" (over the {TIME_LIMIT_S} s limit)") + ".", ""]
    lines += [f"- {name}: {status}" for name, status in summary["checks"].items()]
    ladder = summary["results"].get("ladder", {})
    if ladder.get("rows"):
        cols = ["rung", "status", "method", "predicted_allocated_mib", "cuda_max_allocated_mib", "error_vs_allocated_pct",
                "predicted_reserved_mib", "cuda_max_reserved_mib", "error_vs_reserved_pct",
                "predicted_nvidia_smi_mib", "nvml_used_peak_mib", "outside_allocator_mib", "passed"]
        lines += ["", "### Ladder: predicted beside measured on the card (MiB; error = (predicted - measured) / measured)",
                  "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in ladder["rows"]]
        lines += ["", "The CUDA budget caps the allocator's reserved memory (fragmentation and caching "
                      "included); the CPU budget counts live tensor bytes."]
        lines += [f"- {r['rung']}: {r['segment_difference']}" for r in ladder["rows"] if r.get("segment_difference")]
    s1 = summary["results"].get("strategies", {})
    if s1.get("runs"):
        lines += ["", f"### Study 1 under a {s1.get('budget_mib')} MiB CUDA budget", ""]
        lines += [f"- {r['strategy']}: {r['status']} ({r['device_history']})" for r in s1["runs"]]
        lines += [f"- left allocated on the GPU afterwards: "
                  f"{s1['allocated_after_bytes'] - s1['allocated_before_bytes']} bytes"]
    # a check that brings its own section (study 3's split check) has it printed as it is
    for name, r in summary["results"].items():
        if isinstance(r.get("report"), str) and r["report"].strip():
            lines += ["", r["report"].strip()]
    failures = [f"{n}: {f}" for n, r in summary["results"].items() for f in r.get("failures", [])]
    failures += [f"{n}: {r['error']}" for n, r in summary["results"].items() if r.get("error")]
    if failures:
        lines += ["", "### What failed", ""] + [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def write_results(out: Path, summary: dict[str, Any]) -> None:
    atomic_write_json(out / "summary.json", summary)
    atomic_write_text(out / "report.md", report_markdown(summary))


def checks() -> dict[str, Callable[[Options], dict[str, Any]]]:
    """The checks in order: the workbench's own, study 3's (owned by that package), the notebooks."""
    return {"environment": check_environment, "ladder": check_ladder, "strategies": check_strategies,
            "trace": check_trace, **gpu_cap.gpu_checks(), **split_gpu_check.gpu_checks(), **gpu_programs.gpu_checks()}


def run_checks(opts: Options, found: dict[str, Callable[[Options], dict[str, Any]]] | None = None,
               *, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every check (one failing does not stop the others), then write summary.json and report.md."""
    found = checks() if found is None else found
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    summary = summarize(results, {}, 0.0)
    for name, fn in found.items():
        if opts.extra.get("only") and name not in opts.extra["only"] and name != "environment":
            continue
        t = time.perf_counter()
        try:
            results[name] = fn(opts)
        except Exception as e:
            results[name] = {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
        results[name]["seconds"] = time.perf_counter() - t
        say(f"gpu-check {name}: {results[name].get('status')} ({results[name]['seconds']:.0f} s)")
        # written after every check: a check that hangs or a lease that ends keeps what came before
        summary = summarize(results, results.get("environment", {}).get("env", {}), time.perf_counter() - t0)
        write_results(opts.out, summary)
    return summary


# ------------------------------------------------------------------------------------------------
# CUDA: the thin layer that measures

def check_environment(opts: Options) -> dict[str, Any]:
    import torch

    env = environment()
    props = torch.cuda.get_device_properties(0)
    env.update(gpu=props.name, gpu_total_mib=props.total_memory / MiB, cuda=torch.version.cuda,
               capability=f"{props.major}.{props.minor}")
    for lib in ("accelerate", "bitsandbytes", "deepspeed", "pynvml"):
        try:
            env[lib] = getattr(importlib.import_module(lib), "__version__", "installed")
        except Exception as e:  # a missing library is a finding, not a crash
            env[lib] = f"unavailable ({type(e).__name__})"
    return {"status": "pass", "env": env}


def check_ladder(opts: Options) -> dict[str, Any]:
    """CUDA: every GPU rung measured on the card beside its prediction."""
    import torch

    cfg = LadderConfig(model=opts.model, base_size="tiny" if opts.tiny else "default", micro_batch=opts.batch,
                       seq_len=opts.seq, steps=opts.steps, reference_model="")
    config, load, blocks, _ = model_at_hand(cfg)
    here = card_at_hand(opts.device)
    rows, tracebacks = [], {}
    for name in opts.rungs or gpu_rungs(RUNGS):
        # one rung's failure (its prediction or its run) is that rung's row, not the end of the check
        try:
            # each rung beside the prediction of the step it runs: plain (no dispatch mode) unless
            # --counted measures the device rungs under the live-bytes count
            p = predict(config, name, batch=opts.batch, seq=opts.seq, n_blocks=len(blocks), device="cuda",
                        card=here, instrumented=opts.counted and name not in OFFLOADED, replay_steps=opts.steps).row()
        except Exception as e:
            p, tracebacks[f"{name} prediction"] = {"error": one_line(e)}, traceback.format_exc(limit=-12)
        torch.cuda.empty_cache()
        nvml = {}
        try:
            with MemoryMonitor(opts.device, interval_s=0.05) as mon:
                before = mon.sample().get("nvml_used_mib")
                m = measure(name, load, blocks, batch=opts.batch, steps=opts.steps, device=opts.device,
                            counted=opts.counted)
            if before is not None:
                nvml = {"nvml_used_peak_mib": mon.peak["nvml_used_mib"], "nvml_used_before_mib": before}
        except Exception as e:
            m, tracebacks[f"{name} measurement"] = {"status": "error", "reason": one_line(e)}, traceback.format_exc(limit=-12)
        rows.append(rung_row(name, p, m, nvml))
    torch.cuda.synchronize()
    before_gc = torch.cuda.memory_allocated()
    gc.collect()
    # what the rungs left on the card: held by cycles until a collection, or still referenced
    left = {"left_allocated_before_gc_bytes": before_gc, "left_allocated_after_gc_bytes": torch.cuda.memory_allocated()}
    options = {"model": opts.model, "batch": opts.batch, "seq": opts.seq, "steps": opts.steps, "counted": opts.counted}
    return {**ladder_verdict(rows), "tracebacks": tracebacks, "card": here.name, "sm": here.sm, "options": options, **left}


card_at_hand = cuda_model.card_at_hand  # CUDA: this card as the prediction's card


def check_strategies(opts: Options) -> dict[str, Any]:
    """CUDA: study 1 with a real CUDA budget that the strategies outgrow, then the CPU."""
    import torch

    cfg = StrategiesConfig(base_size="tiny", strategies=("full", "adapter"), seeds=(0,), token_budget=4096,
                           seq_len=64, micro_batch=4, eval_blocks=4, preflight=False,
                           devices=(f"cuda@{opts.study1_budget_mib:g}", "cpu"))
    torch.cuda.synchronize()
    gc.collect()  # what earlier checks left for the collector is not study 1's
    before = torch.cuda.memory_allocated()
    with results_under(opts.out / "runs"):
        df = run_strategies(cfg, progress=False).runs
    after = torch.cuda.memory_allocated()  # no gc.collect first: the fallback itself must free
    return {**study1_verdict(df.to_dict("records"), before, after), "budget_mib": opts.study1_budget_mib}


def check_trace(opts: Options) -> dict[str, Any]:
    """CUDA: a torch.profiler trace and a CUDA memory snapshot of one bf16 training iteration."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cfg = LadderConfig(model=opts.model, base_size="tiny" if opts.tiny else "default", micro_batch=opts.batch,
                       seq_len=opts.seq, reference_model="")
    _, load, blocks, _ = model_at_hand(cfg)
    model = load().to(opts.device)
    settings = TrainSettings(steps=1, micro_batch=opts.batch, precision="bf16", lr=1e-4)
    train(model, blocks, settings, device=opts.device)  # warm-up, outside the recordings
    opts.out.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as prof:
            train(model, blocks, settings, device=opts.device)
        torch.cuda.memory._dump_snapshot(str(opts.out / "memory_snapshot.pickle"))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    prof.export_chrome_trace(str(opts.out / "trace.json"))
    files = ["trace.json", "memory_snapshot.pickle"]
    missing = [f for f in files if not (opts.out / f).exists()]
    return {"status": "fail" if missing else "pass", "files": files, "failures": [f"{f} not written" for f in missing]}


# ------------------------------------------------------------------------------------------------
# the command

def register(sub) -> None:
    p = sub.add_parser("gpu-check", help="run every GPU path on this card and record what it measured (needs CUDA)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="", help="output folder (default: results/gpu_check)")
    p.add_argument("--model", default=Options.model, help="config.json or model directory for the ladder check")
    p.add_argument("--batch", type=int, default=Options.batch, help="sequences per step of the ladder check")
    p.add_argument("--seq", type=int, default=Options.seq, help="tokens per sequence of the ladder check")
    p.add_argument("--steps", type=int, default=Options.steps, help="steps per rung (the first is warm-up)")
    p.add_argument("--quick", action="store_true", help="the tiny embedded base instead of --model (seconds)")
    p.add_argument("--counted", action="store_true", help="measure the device rungs under the live-bytes count")
    p.add_argument("--only", default="", help="comma-separated checks to run (ladder, strategies, trace, split, notebooks, monitor)")
    p.set_defaults(func=_main)


def _main(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU_LINE)
        return 0

    out = Path(args.out) if args.out else results_root() / "gpu_check"
    opts = Options(out=out, model="embedded" if args.quick else args.model, tiny=args.quick, batch=args.batch,
                   seq=64 if args.quick else args.seq, steps=args.steps, counted=args.counted,
                   extra={"only": tuple(s for s in args.only.split(",") if s)})
    found = checks()
    unknown = [n for n in opts.extra["only"] if n not in found]
    if unknown:
        raise ConfigError(f"--only: unknown check {', '.join(unknown)}; checks: {', '.join(found)}")
    summary = run_checks(opts, found)
    print(f"gpu-check: {summary['status']} in {summary['seconds']:.0f} s; see {out / 'report.md'}")
    return 0 if summary["status"] == "pass" else 1
