"""gpu-check's checks that run whole programs of the workbench on this machine's card.

    workbench gpu-check --only notebooks,monitor

notebooks: every study notebook executed headless on the card, kept.
Each study notebook runs through papermill (`workbench.front.notebooks.run_notebook`, the same path
as `workbench reproduce --quick`) with its quick parameters, in a fresh kernel on this machine; the
executed notebooks go to <out>/notebooks/, their study runs to <out>/runs/notebooks/<notebook>/
(never the user's results/), a folder emptied before each execution. Where each study's runs trained
is read back from the runs.csv that execution wrote, so "ran on the GPU" is what the runs recorded,
not what was asked. (It was the rows past the table's length before, which a second check into the
same folder found empty: runs.csv replaces a row of the same settings, so its length stays.)
- study 1 (strategies): its default attempts on a CUDA machine are the card, then the CPU (run
  without the quick budget: ON_A_CARD); a run counts where it finished (its `device`), not where it
  was attempted, and some must have finished on the card;
- study 2 (ladder): its rungs are measured on the CPU by design (the ladder check measures the
  card's); its auto-fit runs on the card (`device: auto`) under a real CUDA budget, ON_A_CARD's
  (the quick 3 MiB is less than a card's first matmul reserves: every setup would be predicted not to
  fit, and it would end on the CPU), and its row's `device` must say the setup it ran trained there;
- study 3 (split): `device: auto` is the card; its rows must say they ran on CUDA.

monitor: the memory monitor on the card (NVML and torch's CUDA counters, issue 11 item 7): what it
costs a training run (`memory.monitor.overhead`, the method of benchmarks/monitor_overhead.py, ABBA
order in one run), and whether its rows carry the card's figures. The cost is a figure beside its
target, not a verdict (one noisy run does not make the monitor broken); the rows are the verdict.

The verdicts and the device read-back are plain functions, tested on the CPU with stand-ins
(tests/test_gpu_check.py); `check_monitor` runs on the CPU as well (its rows then have no card figures).
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from workbench.core.common import OUT_OF_TIME, one_line
from workbench.core.memory.monitor import overhead
from workbench.core.results import read_table, results_under
from workbench.core.training import TrainSettings, train
from workbench.front.gpu_report import TIME_SPENT
from workbench.front.notebooks import available, run_notebook

# the studies whose runs must have trained on the card (study 2's: its auto-fit's; its rungs run on the CPU)
EXPECTS_GPU = {"strategies": True, "ladder": True, "split": True}
# columns of a study's runs.csv that say where a run trained: study 1's `device` (the attempt that
# finished; its `device_history` lists every attempt, skipped and out-of-memory ones too), study 2's
# `device` (where auto-fit's setup trained) and study 3's `hardware`
DEVICE_COLUMNS = ("device", "hardware")
# the quick parameters the check changes (it runs only on a card). Study 1's quick budget (13 MiB, sized
# for the CPU playing a card) is below what a card's first matmul reserves (a cuBLAS workspace from the
# caching allocator: 8 MiB, in a 20 MiB segment, or 32 MiB from sm_90): every card attempt was skipped in
# pre-flight and the runs trained on the CPU (the H200 record of 2026-11-26, passed by reading the
# attempts). Without a budget they train on the card; running out of memory there is the strategies check's.
# Study 2's auto-fit gets a budget its tiny setups fit on a card (70 MiB predicted on an H200 at the quick
# 4 x 64, two 32 MiB cuBLAS workspaces in it); stepping down on a card's error is the autofit check's.
# Its reference model's predictions are left out: CPU work the same on any machine (CI runs them), and
# 44 s of the card's time on 2026-11-30, when the time budget cut the notebook off in the next step.
ON_A_CARD = {"strategies": {"budget_mib": 0.0}, "ladder": {"budget_mib": 256.0, "reference_model": ""}}
NOTEBOOK_TIMEOUT_S = 300
# benchmarks/monitor_overhead.py's target: the monitor may cost a run at most 1% of its time
MONITOR_TARGET = 1.01
# how long one timed run of the monitor check lasts: long enough that the monitor's once-per-run start
# and stop (reported apart) is not most of what is timed, short enough for 2 x 4 runs in a minute
RUN_S = 3.0
# what a monitor row must carry on a card (on the CPU: the process's resident set)
CARD_COLUMNS = ("nvml_used_mib", "cuda_allocated_mib", "cuda_reserved_mib", "cuda_max_allocated_mib")


def devices_recorded(runs: pd.DataFrame) -> list[str]:
    """The distinct places the measured rows say they trained on ('cuda@13', 'cpu', 'this machine
    (cuda)', ...); modelled and published rows (study 3 has both) trained nowhere here."""
    if "source" in runs:
        runs = runs[runs["source"] == "measured"]
    seen: list[str] = []
    for col in DEVICE_COLUMNS:
        if col in runs:
            for v in runs[col].dropna().astype(str):
                if v and v not in seen:
                    seen.append(v)
    return seen


def notebook_row(name: str, study: str, status: str, seconds: float, output: Path, error: str | None,
                 devices: list[str]) -> dict[str, Any]:
    """One executed notebook: did it run, where did its runs train, does that pass."""
    used_gpu = any("cuda" in d for d in devices)
    expects = EXPECTS_GPU.get(study, False)
    passed = status == "ok" and (used_gpu or not expects)
    why = (error if status != "ok" else
           "" if passed else f"its runs did not train on the GPU (they recorded: {', '.join(devices) or 'nothing'})")
    return {"notebook": name, "study": study, "status": status, "seconds": round(seconds, 1),
            "output": str(output), "devices": devices, "used_gpu": used_gpu, "expects_gpu": expects,
            "passed": passed, "why": why or ""}


def notebooks_verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    failures = [f"{r['notebook']}: {r['why']}" for r in rows if not r["passed"]]
    lines = ["### Study notebooks executed on this machine", "",
             "| notebook | status | s | runs trained on | on the GPU | passed |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['notebook']} | {r['status']} | {r['seconds']:.0f} | {', '.join(r['devices']) or '-'} | "
              f"{'yes' if r['used_gpu'] else 'no (the CPU plays the card)' if not r['expects_gpu'] else 'no'} | "
              f"{'yes' if r['passed'] else 'no'} |" for r in rows]
    return {"status": "pass" if rows and not failures else "fail", "failures": failures, "rows": rows,
            "report": "\n".join(lines)}


def check_notebooks(opts, *, execute: Callable | None = None) -> dict[str, Any]:
    """Execute every study notebook (quick parameters, with ON_A_CARD's changes) on this machine;
    `execute` stands in for run_notebook in tests. One failing notebook is its row; the others still run."""
    execute = execute or run_notebook
    rows = []
    for nb in available():
        out = opts.out / "notebooks" / f"{nb.name}.ipynb"
        if opts.out_of_time():  # under --time-budget: a notebook that would begin past it is its row
            rows.append(notebook_row(nb.name, nb.study, "not run", 0.0, out, TIME_SPENT, []))
            continue
        runs = opts.out / "runs" / "notebooks" / nb.name
        shutil.rmtree(runs, ignore_errors=True)  # its rows are this execution's, whatever ran before
        t0 = time.perf_counter()
        with results_under(runs):
            try:  # papermill's limit is per cell: under a budget each cell's is what is left of it
                execute(nb.path, {**nb.quick, **ON_A_CARD.get(nb.study, {})}, out, timeout_s=NOTEBOOK_TIMEOUT_S,
                        deadline=opts.deadline_at)
                status, error = "ok", None
            except Exception as e:
                # a cell cut off at what was left of the budget (cell_limit) ran out of time; it did not fail
                cut = isinstance(e, TimeoutError) and opts.out_of_time()
                status, error = ("not finished", f"{OUT_OF_TIME} while it ran ({one_line(e)})") if cut else \
                    ("error", one_line(e))
        added = read_table(runs / nb.study / "runs.csv")
        rows.append(notebook_row(nb.name, nb.study, status, time.perf_counter() - t0, out, error,
                                 devices_recorded(added)))
    return notebooks_verdict(rows)


def monitor_verdict(result: dict[str, Any], device: str) -> dict[str, Any]:
    """pass when the monitor sampled and, on a card, every row has the card's figures; the cost is
    reported beside its target."""
    rows = result["rows"]
    want = CARD_COLUMNS if device.startswith("cuda") else ("rss_mib",)
    missing = sorted({c for r in rows for c in want if r.get(c) is None})
    failures = (["the monitor sent no rows"] if not rows else
                [f"monitor rows without {', '.join(missing)}"] if missing else [])
    ratio = result["ratio"]
    report = (f"### Memory monitor on {device}\n\nWith the monitor sampling every {result['interval_s']:g} s, a "
              f"training run took {ratio:.4f}x its time without it ({result['rounds']} off/on pairs, ABBA; "
              f"median pair {result['median_round_ratio']:.4f}; {result['samples']} samples; a run without it "
              f"{result['off_s'] / result['rounds']:.2f} s); target <= {MONITOR_TARGET}: "
              f"{'met' if ratio <= MONITOR_TARGET else 'not met'}. Opening, starting and stopping it around "
              f"nothing took {1e3 * result['start_stop_s']:.1f} ms (once a run, whatever its length).")
    peaks = {c: max(r[c] for r in rows) for c in want if rows and not missing}
    return {"status": "fail" if failures else "pass", "failures": failures, "overhead_ratio": ratio,
            "target": MONITOR_TARGET, "target_met": ratio <= MONITOR_TARGET, "peaks_mib": peaks,
            **{k: result[k] for k in ("off_s", "on_s", "round_ratios", "median_round_ratio", "samples", "interval_s",
                                  "start_stop_s")},
            "report": report}


def monitor_workload(device: Any, steps: int = 15) -> tuple[Callable[[], Any], int]:
    """The run whose cost the monitor is measured on (here and in benchmarks/monitor_overhead.py):
    `steps` training steps of a small random Qwen2 (hidden 128, 4 layers, vocab 2048; batch 8 x 128,
    fused AdamW) on `device`. Returns (run, parameter count)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device)
    blocks = torch.randint(0, 2048, (256, 128), generator=torch.Generator().manual_seed(0))
    settings = TrainSettings(steps=steps, micro_batch=8, lr=1e-4)
    return (lambda: train(model, blocks, settings, device=device)), sum(p.numel() for p in model.parameters())


def check_monitor(opts, *, rounds: int = 4, steps: int = 15, run_s: float = RUN_S) -> dict[str, Any]:
    """The monitor around `monitor_workload` on `opts.device`, its cost and its rows; the workload
    lengthened to last about `run_s` a run (`workload_lasting`)."""
    run, steps = workload_lasting(opts.device, steps, run_s)
    return {**monitor_verdict(overhead(run, opts.device, rounds=rounds), str(opts.device)), "steps": steps}


def workload_lasting(device: Any, steps: int, run_s: float,
                     clock: Callable[[], float] = time.perf_counter) -> tuple[Callable[[], Any], int]:
    """`monitor_workload` with enough steps that one run lasts about `run_s` here (at least `steps`):
    timed once after a warm-up, then scaled. On the H200 (2026-11-26) the 15 steps took 0.3 s, and
    the check timed the monitor's start and stop (NVML's handle) more than its sampling: 1.11x, where
    a real run of minutes pays that once."""
    import torch

    run, _ = monitor_workload(device, steps)
    if run_s <= 0:
        return run, steps
    run()  # warm-up: kernels chosen, allocator filled

    def sync() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    t0 = clock()
    run()
    sync()
    secs = clock() - t0
    if secs >= run_s:
        return run, steps
    more = math.ceil(steps * run_s / max(secs, 1e-3))
    return monitor_workload(device, more)[0], more


def gpu_checks() -> dict[str, Callable]:
    # gpu_check.checks() places them: the monitor (seconds) early, the notebooks (minutes) late
    return {"monitor": check_monitor, "notebooks": check_notebooks}
