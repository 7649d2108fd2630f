"""Does every GPU path of the workbench work on this card, and how close are the predictions?

    make gpu-check                      # or: workbench gpu-check [--quick] [--only ladder,trace]
    workbench gpu-check --time-budget 430   # under a hard limit: what has not begun by then is 'not run'
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
- any check another part adds (the cap: `studies/ladder/gpu_cap.py`; auto-fit's step-down:
  `studies/ladder/gpu_autofit.py`; study 3's engine: `studies/split/gpu_check.py`; the notebooks and
  the memory monitor's cost: `front/gpu_programs.py`); versions and the card.
Results: results/gpu_check/{summary.json, report.md (rewritten after every check), trace.json,
memory_snapshot.pickle, notebooks/, runs/ (runs/notebooks/<notebook>/: the notebooks check's)}. Three H200
runs: data/measured/h200-2026-11-22/, -11-26/, -11-30/. The logic (rows, errors, thresholds, verdicts, the
summary and the report) is pure functions in front/gpu_report.py, tested on the CPU with fabricated
measurements (tests/test_gpu_check.py); the functions here marked "CUDA" are the thin layer that measures.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from workbench.core.common import MiB, one_line, past_free_memory
from workbench.core.config import ConfigError
from workbench.core.fallback import driver_too_old, no_kernels, out_of_memory
from workbench.core.memory import cuda_model
from workbench.core.memory.cuda_attention import counting_choices
from workbench.core.memory.monitor import (MemoryMonitor, bf16_native, can_release_workspaces, release_card,
                                           release_held)
from workbench.core.memory.plan import RUNGS
from workbench.core.memory.predict import WeightsExceedCard, predict
from workbench.core.models import load_config
from workbench.core.parallel import run_ahead
from workbench.core.results import check_folder, environment, results_root, results_under
from workbench.core.training import TrainSettings, train
from workbench.front import gpu_programs
from workbench.front.gpu_report import (TIME_SPENT, gpu_rungs, ladder_verdict, rung_row, study1_verdict, summarize,
                                         status_words, write_results)
from workbench.studies.ladder import gpu_autofit, gpu_cap
from workbench.studies.ladder.autofit import prediction_margin
from workbench.studies.ladder.config import LadderConfig
from workbench.studies.ladder.rungs import OFFLOADED, measure
from workbench.studies.ladder.runner import model_at_hand
from workbench.studies.split import gpu_check as split_gpu_check
from workbench.studies.strategies.config import StrategiesConfig
from workbench.studies.strategies.runner import run_strategies

NO_GPU_LINE = "workbench gpu-check: needs a CUDA GPU (torch.cuda.is_available() is False here); nothing to check"


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
    # time.perf_counter() after which no check and no ladder rung starts (--time-budget): a lent card's
    # call that ends at a hard limit keeps every finished check and says which did not run
    deadline_at: float | None = None

    def out_of_time(self) -> bool:
        return self.deadline_at is not None and time.perf_counter() > self.deadline_at


NOT_RUN = {"status": "not run", "reason": TIME_SPENT}


def checks() -> dict[str, Callable[[Options], dict[str, Any]]]:
    """The checks in order, the quick ones first and the cap's bisection (minutes of trials, its
    finding on record twice) last, so a lent card's one call under --time-budget leaves out the least.
    A module that adds checks defines gpu_checks() -> {name: fn(options) -> result dict}."""
    programs = gpu_programs.gpu_checks()
    return {"environment": check_environment, "ladder": check_ladder, "strategies": check_strategies,
            "trace": check_trace, **split_gpu_check.gpu_checks(), "monitor": programs["monitor"],
            **gpu_autofit.gpu_checks(), "notebooks": programs["notebooks"], **gpu_cap.gpu_checks()}


class Terminated(SystemExit):
    """SIGTERM (`timeout`'s at a lent card's hard limit, a closed lease) as an exception: the check it
    ends is recorded as killed, and finally blocks run. (A notebook's kernel, in a session of its own,
    exits when this process does: ipykernel watches its parent.)"""

    def __init__(self, signum: int):
        super().__init__(128 + signum)  # a shell's exit status for a process ended by that signal
        self.signal_name = signal.Signals(signum).name


def _terminated(signum, frame) -> None:
    raise Terminated(signum)


def _say(line: str) -> None:
    print(line, flush=True)  # a pipe buffers, and a run killed at a hard limit would take its progress with it


def run_checks(opts: Options, found: dict[str, Callable[[Options], dict[str, Any]]] | None = None,
               *, say: Callable[[str], None] = _say) -> dict[str, Any]:
    """Run every check (one failing does not stop the others); summary.json and report.md are written
    before the first and after every check, a check marked running while it runs and the ones after it
    pending, so the files of a run killed part-way say where it ended (its status: incomplete)."""
    found = checks() if found is None else found
    only = opts.extra.get("only")
    names = [n for n in found if not only or n in only or n == "environment"]
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {n: {"status": "pending"} for n in names}

    def write() -> dict[str, Any]:
        summary = summarize(results, results.get("environment", {}).get("env", {}), time.perf_counter() - t0)
        write_results(opts.out, summary)
        return summary

    summary = write()
    for name in names:
        t = time.perf_counter()
        results[name] = {"status": "running"}
        write()
        try:
            results[name] = dict(NOT_RUN) if name != "environment" and opts.out_of_time() else found[name](opts)
        except Exception as e:
            results[name] = {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
        except BaseException as e:  # SIGTERM (Terminated), ^C: this check is killed, and the run ends here
            why = getattr(e, "signal_name", type(e).__name__)
            results[name] = {"status": "killed", "error": f"{why} after {time.perf_counter() - t:.0f} s in this check",
                             "seconds": time.perf_counter() - t}
            say(f"gpu-check {name}: killed ({why}); the checks after it did not run")
            write()
            raise
        try:
            try:  # a sticky CUDA error (a device-side assert) raises here again: said, and the next check runs
                release_card()
            except Exception as e:
                results[name]["release_error"] = one_line(e)
        finally:  # a SIGTERM in this second too: the finished check's result is written before the run ends
            results[name]["seconds"] = time.perf_counter() - t
            summary = write()
        say(f"gpu-check {name}: {status_words(results[name].get('status'), results[name])} ({results[name]['seconds']:.0f} s)")
    return summary


# ------------------------------------------------------------------------------------------------
# CUDA: the thin layer that measures

def check_environment(opts: Options) -> dict[str, Any]:
    import torch

    env = environment()
    props = torch.cuda.get_device_properties(0)
    env.update(gpu=props.name, gpu_total_mib=props.total_memory / MiB, cuda=torch.version.cuda,
               cudnn=torch.backends.cudnn.version(),  # past 9.15.0 on sm_90/10x: cuDNN's attention first
               capability=f"{props.major}.{props.minor}",
               # the allocator's settings (expandable segments change every reserved figure); {} when unset
               alloc_conf={v: os.environ[v] for v in cuda_model.ALLOC_CONF_VARS if v in os.environ})
    for lib in ("accelerate", "bitsandbytes", "deepspeed", "torchao", "papermill", "pynvml"):
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
    config, load, blocks, _ = model_at_hand(cfg, keep=True)  # made once, a copy for each rung
    here = card_at_hand(opts.device)
    rows, tracebacks = [], {}
    # each rung measured as a fresh process runs it: its first matmuls make the cuBLAS workspaces (one after
    # another found them made, and reserved up to 8% less on the H200); else the first makes them for all
    fresh = can_release_workspaces()  # release_held below, before each rung's measurement
    names = opts.rungs or gpu_rungs(RUNGS)
    first = names[0] if RUNGS[names[0]].placement == "device" else None  # else each held rung after itself
    # a rung that accumulates at a batch it splits: at --batch 1 bf16_ckpt_accum ran bf16_ckpt's step (1 micro-batch)
    batch = {name: max(opts.batch, RUNGS[name].accum) for name in names}
    # beside the prediction of the step it runs: plain unless --counted (the live-bytes count); loaded as measure() loads
    items = {name: (config, name, dict(batch=batch[name], seq=opts.seq, n_blocks=len(blocks), device="cuda", card=here,
                                       instrumented=opts.counted and name not in OFFLOADED, replay_steps=opts.steps,
                                       load="host", **({"workspaces": "fresh"} if fresh or name == names[0] else
                                                       {"workspaces": "held", "after": first})))
             for name in names}
    # CPU work (~20 s a rung of Qwen2-0.5B on a CI core), made side by side first where there are cores (the H200's 16)
    t, (ahead, how) = time.perf_counter(), run_ahead(_prediction, items, desc="predictions")
    predicted_s = time.perf_counter() - t  # ahead (else ~0: one by one below); of the check's 213 s on 2026-11-30
    for name in names:
        if opts.out_of_time():
            rows.append(rung_row(name, {}, dict(NOT_RUN), {}))
            continue
        # one rung's failure (its prediction or its run) is that rung's row, not the end of the check
        p, tb = ahead.pop(name, None) or _prediction(items[name])
        if tb:
            tracebacks[f"{name} prediction"] = tb
        release_held(opts.device)
        # an offload rung's host state (ZeRO: 16 bytes a parameter) past this machine's free memory
        # would have the OOM killer end gpu-check (a laptop, a WSL2 VM with half the host's memory)
        if short := past_free_memory(p.get("host_bytes", 0) / MiB, drop=getattr(load, "drop", None)):
            rows.append(rung_row(name, p, {"status": "skipped", "reason": f"its predicted host memory {short}"}, {}))
            continue
        nvml = {}
        try:
            with MemoryMonitor(opts.device, interval_s=0.05) as mon, counting_choices({}) as kernels:
                before, held = mon.sample().get("nvml_used_mib"), torch.cuda.memory_reserved(opts.device)
                # what it may take: others' use, the context and what this process holds live out
                room = card_free_now(opts.device).usable_bytes - torch.cuda.memory_allocated(opts.device)
                m = {**measure(name, load, blocks, batch=batch[name], steps=opts.steps, device=opts.device,
                               counted=opts.counted), "free_before_bytes": room, "reserved_before_bytes": held,
                     "attention_kernels": kernels}  # the kernel torch picked for each attention call
            if before is not None:
                nvml = {"nvml_used_peak_mib": mon.peak["nvml_used_mib"], "nvml_used_before_mib": before,
                        **{k: mon.peak[k] for k in ("nvml_total_mib", "nvml_driver_reserved_mib") if k in mon.peak}}
        except Exception as e:
            m, tracebacks[f"{name} measurement"] = {"status": "error", "reason": one_line(e)}, traceback.format_exc(limit=-12)
        rows.append(rung_row(name, p, m, nvml))
    rows = [{**r, "batch": batch[r["rung"]], "micro_batches": RUNGS[r["rung"]].split(batch[r["rung"]])[1]} for r in rows]
    torch.cuda.synchronize(opts.device)
    before_gc, _ = torch.cuda.memory_allocated(opts.device), gc.collect()
    # what the rungs left on the card: held by cycles until a collection, or still referenced
    left = {"left_allocated_before_gc_bytes": before_gc, "left_allocated_after_gc_bytes": torch.cuda.memory_allocated(opts.device)}
    options = {"model": opts.model, "batch": opts.batch, "seq": opts.seq, "steps": opts.steps, "counted": opts.counted,
               "predicted": how, "predicted_s": round(predicted_s, 1), "loads": dict(getattr(load, "timings", {})),
               "workspaces": "released before each rung" if fresh else "held from the first rung on"}
    return {**ladder_verdict(rows), "tracebacks": tracebacks, "card": here.name, "sm": here.sm, "options": options, **left}


def _prediction(item) -> tuple[dict[str, Any], str | None]:
    """(the prediction's row, its traceback if it failed) of one rung: `item` is (config, rung, predict's keywords)."""
    config, name, kw = item
    try:
        return {**predict(config, name, **kw).row(),  # with the margin auto-fit adds: it fits with it
                "margin": prediction_margin(RUNGS[name], device="cuda")[0]}, None
    except WeightsExceedCard as e:  # a verdict, not a failure: the card's out-of-memory error should agree
        return {"method": "weights > card", "fits": False, "note": one_line(e)}, None
    except Exception as e:
        return {"error": one_line(e)}, traceback.format_exc(limit=-12)


card_at_hand = cuda_model.card_at_hand  # CUDA: this card as the prediction's card
card_free_now = cuda_model.card_free_now  # CUDA: what a run may take there now


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
    """CUDA: a torch.profiler trace and a CUDA memory snapshot of one mixed-precision training
    iteration of the check's model (bf16; fp16 before sm_80, where bf16 is emulated). Where that step
    does not fit the card (Qwen2-0.5B's needs about 8.7 GB), the tiny embedded base's, and it says so."""
    import torch

    major, minor = torch.cuda.get_device_capability(opts.device)
    precision = "bf16" if bf16_native(10 * major + minor) else "fp16"
    try:
        return {**_trace(opts, precision), "model": opts.model, "precision": precision}
    except Exception as e:  # torch's or CUDA's own (a cuBLAS handle on a full card); the tiny base: no retry
        if opts.tiny or not out_of_memory(e):
            raise
        why = one_line(e, 160)  # (the error's frames, which hold the model, go with the except block)
    gc.collect()
    torch.cuda.empty_cache()
    tiny = dataclasses.replace(opts, model="embedded", tiny=True, seq=64)
    return {**_trace(tiny, precision), "model": "embedded (tiny)", "precision": precision,
            "note": f"{opts.model}'s step ran out of memory on this card ({why}): traced the tiny base instead"}


def _trace(opts: Options, precision: str) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    cfg = LadderConfig(model=opts.model, base_size="tiny" if opts.tiny else "default", micro_batch=opts.batch,
                       seq_len=opts.seq, reference_model="")
    _, load, blocks, _ = model_at_hand(cfg)
    model = load().to(opts.device)
    settings = TrainSettings(steps=1, micro_batch=opts.batch, precision=precision, lr=1e-4)
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
    names = ", ".join(n for n in checks() if n != "environment")  # the environment is always read
    p.add_argument("--only", default="", help=f"comma-separated checks to run ({names}; environment: always run)")
    p.add_argument("--rungs", default="", help="comma-separated ladder rungs for the ladder check (default: every "
                                               "rung that uses the GPU), measured in this order")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start no check and no ladder rung after this many seconds (they are reported 'not run'); "
                        "leave room for the longest one (a rung: up to a minute) under a hard limit")
    p.set_defaults(func=_main)


def _options(args) -> Options:
    """The run's options, every argument checked (a one-line ConfigError) before anything needs CUDA:
    a command prepared on a machine without a GPU for a lent card's one call fails here, not there."""
    if args.time_budget is not None and not args.time_budget > 0:
        raise ConfigError(f"--time-budget must be a positive number of seconds, got {args.time_budget:g}")
    for flag, value, least, why in (("--batch", args.batch, 1, ""), ("--seq", args.seq, 1, ""),
                                    ("--steps", args.steps, 2, " (the first step is warm-up)")):
        if value < least:
            raise ConfigError(f"{flag} must be at least {least}{why}, got {value}")
    out = Path(args.out).resolve() if args.out else results_root() / "gpu_check"  # absolute: kernels run in notebooks/
    check_folder(out, "--out" if args.out else "the results folder")  # a card's one call found it after its checks
    if args.quick and (args.model != Options.model or args.seq != Options.seq):  # were dropped without a word
        raise ConfigError("--quick runs the tiny embedded base at --seq 64: give --quick, or --model and --seq")
    deadline = None if args.time_budget is None else time.perf_counter() + args.time_budget
    only, rungs = (tuple(s for s in a.split(",") if s) for a in (args.only, args.rungs))
    if unknown := [n for n in only if n not in (found := checks())]:
        raise ConfigError(f"--only: unknown check {', '.join(unknown)}; checks: {', '.join(found)}")
    if bad := [r for r in rungs if r not in gpu_rungs(RUNGS)]:
        raise ConfigError(f"--rungs: {', '.join(bad)} is no rung that uses the GPU; "
                          f"rungs: {', '.join(gpu_rungs(RUNGS))}")
    if rungs and only and "ladder" not in only:  # the ladder check alone reads them
        raise ConfigError("--rungs chooses the ladder check's rungs: add ladder to --only, or drop --rungs")
    if not args.quick and args.model != Options.model:  # read here, not on the card (--quick's base: minutes)
        load_config(args.model)
    return Options(out=out, model="embedded" if args.quick else args.model, tiny=args.quick, batch=args.batch,
                   seq=64 if args.quick else args.seq, steps=args.steps, counted=args.counted, rungs=rungs,
                   extra={"only": only}, deadline_at=deadline)


def _main(args) -> int:
    import torch

    opts = _options(args)
    if not torch.cuda.is_available():
        if old := driver_too_old():  # a GPU machine that cannot run the check
            print(f"workbench gpu-check: {old}")
            return 1
        print(NO_GPU_LINE)
        return 0
    if missing := no_kernels(torch.cuda.current_device()):
        print(f"workbench gpu-check: {missing}")
        return 1
    previous = signal.signal(signal.SIGTERM, _terminated)  # a hard limit's SIGTERM: recorded, not lost
    try:
        summary = run_checks(opts)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"gpu-check: {summary['status']} in {summary['seconds']:.0f} s; see {opts.out / 'report.md'}")
    return 0 if summary["status"] == "pass" else 1
