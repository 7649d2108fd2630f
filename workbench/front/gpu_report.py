"""`workbench gpu-check`'s rows, verdicts, summary and report: pure functions of what the card
measured and what was predicted, tested on the CPU with fabricated measurements
(tests/test_gpu_check.py). `front/gpu_check.py` runs the checks that feed them.

    row = rung_row("fp32", prediction.row(), measure(...), nvml)   # prediction beside the card
    write_results(out, summarize(results, env, seconds))           # summary.json, report.md
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workbench.core.common import OUT_OF_TIME, MiB
from workbench.core.memory.segments import segment_difference
from workbench.core.results import atomic_write_json, atomic_write_text

# A prediction passes when it is within this share of the allocator's peak (allocated); reserved
# is shown beside it (the allocator rounds and caches, so reserved >= allocated) and checked
# loosely. Memory predicted for CUDA models CUDA's kernels and allocator (workbench.core.memory.cuda_model).
THRESHOLDS = {"allocated_pct": 15.0, "reserved_pct": 35.0}
TIME_LIMIT_S = 600  # the whole check should fit in ten minutes
TIME_SPENT = f"{OUT_OF_TIME} before it began"


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured in percent; None when either is missing or measured is 0."""
    if predicted is None or measured is None or not measured:
        return None
    return 100.0 * (predicted - measured) / measured


def gpu_rungs(rungs: dict) -> tuple[str, ...]:
    """Every rung that places something on the GPU (all but CPU-only), in ladder order, the paged optimizer's
    last: bitsandbytes never frees its managed memory (`get_paged`), which on the H200 (2026-11-26) stayed in
    every later rung's NVML figures and free memory (outside the allocator: 1,384 MiB, then 2,408)."""
    names = [n for n, p in rungs.items() if p.placement != "cpu"]
    return tuple(sorted(names, key=lambda n: rungs[n].optimizer == "paged_adamw8bit"))  # stable: the rest in order


def rung_row(name: str, prediction: dict[str, Any], measured: dict[str, Any], nvml: dict[str, float],
             thresholds: dict[str, float] = THRESHOLDS) -> dict[str, Any]:
    """One rung: prediction beside what the card measured, errors in percent, pass/fail.

    `prediction`: a CUDA-modelled Prediction.row() (allocated_peak_bytes, reserved_peak_bytes,
    nvidia_smi_bytes; a CPU one's predicted_peak_bytes and fit_bytes stand in), or {"error": ...}.
    `measured`: ladder.measure()'s row (status, cuda_max_allocated_bytes, cuda_max_reserved_bytes, measured_peak_bytes).
    `nvml`: {"nvml_used_peak_mib", "nvml_used_before_mib", "nvml_total_mib", "nvml_driver_reserved_mib"}
    from the monitor (may be empty or partial).
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
        # the prediction's verdict on this card (the fit figure + the context, no margin; None: not judged)
        "predicted_fits_card": prediction.get("fits"), "predicted_headroom_mib": mib(prediction.get("headroom_bytes")),
        "predicted_fit_mib": mib(prediction.get("fit_bytes")), "predicted_margin": prediction.get("margin"),
        "free_before_mib": mib(measured.get("free_before_bytes")),  # what the card had free before the run
        "predicted_allocated_mib": pred, "predicted_reserved_mib": fit,
        "cuda_max_allocated_mib": alloc, "cuda_max_reserved_mib": reserved,
        "accounted_peak_mib": (None if measured.get("measured_by") == "cuda allocator"
                               else mib(measured.get("measured_peak_bytes"))),
        "predicted_nvidia_smi_mib": mib(prediction.get("nvidia_smi_bytes") or None),
        "nvml_used_peak_mib": nvml.get("nvml_used_peak_mib"),
        # what nvidia-smi shows used (NVML v2): v1's less the driver's reserve, beside predicted_nvidia_smi_mib
        "nvidia_smi_used_peak_mib": (nvml["nvml_used_peak_mib"] - nvml["nvml_driver_reserved_mib"]
                                     if nvml.get("nvml_driver_reserved_mib") is not None
                                     and nvml.get("nvml_used_peak_mib") is not None else None),
        # NVML v1's used includes the driver's reserve; torch's total (gpu_total_mib) leaves it out
        "nvml_total_mib": nvml.get("nvml_total_mib"), "nvml_driver_reserved_mib": nvml.get("nvml_driver_reserved_mib"),
        "outside_allocator_mib": (nvml["nvml_used_peak_mib"] - reserved
                                  if "nvml_used_peak_mib" in nvml and reserved is not None else None),
        "nvml_used_delta_mib": (nvml["nvml_used_peak_mib"] - nvml["nvml_used_before_mib"]
                                if {"nvml_used_peak_mib", "nvml_used_before_mib"} <= set(nvml) else None),
        # what this rung added outside the allocator (a paged optimizer's managed state, a communicator): NVML's
        # rise less the allocator's; outside_allocator_mib also holds the context and what earlier rungs left
        "outside_allocator_rise_mib": (nvml["nvml_used_peak_mib"] - nvml["nvml_used_before_mib"]
                                       - (reserved - mib(measured["reserved_before_bytes"]))
                                       if {"nvml_used_peak_mib", "nvml_used_before_mib"} <= set(nvml)
                                       and reserved is not None and "reserved_before_bytes" in measured else None),
        "error_vs_allocated_pct": error_pct(pred, alloc), "error_vs_reserved_pct": error_pct(fit, reserved),
        "step_ms": measured.get("step_ms"),
        # ZeRO-3: "host" where the run partitioned the model from the host (rungs.partition_on_host); before, the
        # engine moved it to the card whole first (card_records re-predicts such a record's rung so)
        "zero3_partitioned_from": measured.get("zero3_partitioned_from"),
        # "host" where measure() converted the weights on the host (QLoRA's quantized onto the card layer by layer);
        # before, it moved the fp32 model to the card and converted it there (card_records: predict(load="card"))
        "load": measured.get("load"),
        # and, where a library has side streams, each one's cache in MiB
        **{f"{k}_reserved_by_stream_mib": {s: b / MiB for s, b in (d.get("reserved_by_stream_bytes") or {}).items()} or None
           for k, d in (("predicted", prediction), ("cuda", measured))},
        **{f"{k}_segment_sizes": d.get("segment_sizes") or None for k, d in (("predicted", prediction), ("cuda", measured))},
        # the attention kernels by calls: the prediction's choices, and what torch picked on the card
        **{f"{k}_attention_kernels": d.get("attention_kernels") or None for k, d in (("predicted", prediction),
                                                                                       ("cuda", measured))},
    }
    row["segment_difference"] = segment_difference(row["predicted_segment_sizes"], row["cuda_segment_sizes"])
    if row["status"] != "ok":
        row["passed"] = None  # judged by ladder_verdict: an error is a failure, an OOM a result unless predicted room
    else:
        ea, er = row["error_vs_allocated_pct"], row["error_vs_reserved_pct"]
        row["passed"] = (ea is not None and abs(ea) <= thresholds["allocated_pct"]
                         and (er is None or abs(er) <= thresholds["reserved_pct"]))
    return row


def kernels_differ(row: dict[str, Any]) -> str | None:
    """Where the card ran attention kernels other than those the prediction chose: which (None when
    they agree, or either is unknown: a rung with no attention on the card, a prediction that failed)."""
    predicted, card = row.get("predicted_attention_kernels"), row.get("cuda_attention_kernels")
    if not predicted or not card or set(predicted) == set(card):
        return None
    return (f"the card's attention ran {', '.join(sorted(card))}, the prediction chose {', '.join(sorted(predicted))} "
            "(cuda_attention.sdpa_backend's rule for this card and torch: the saved tensors differ by kernel)")


def ladder_verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """pass when every rung ran (or ran out of memory where the prediction did not say it had room),
    every measured one is within the thresholds and at least one trained; the failures say which
    rung and why."""
    failures = []
    for r in rows:
        if wrong := kernels_differ(r):  # whatever the bytes say: the model claims the card's kernel
            failures.append(f"{r['rung']}: {wrong}")
        if wrong := fit_verdict_wrong(r):
            failures.append(f"{r['rung']}: {wrong}")
        elif r.get("prediction_error"):
            failures.append(f"{r['rung']}: the prediction failed: {r['prediction_error']}")
        elif r["status"] == "ok" and not r["passed"]:
            failures.append(f"{r['rung']}: prediction off by {r['error_vs_allocated_pct']:+.1f}% of allocated"
                            if r["error_vs_allocated_pct"] is not None else f"{r['rung']}: no allocator figure")
        elif r["status"] not in ("ok", "oom"):
            failures.append(f"{r['rung']}: {r['status']}: {r['reason']}")
    if rows and all(r["status"] == "oom" for r in rows):  # nothing trained: nothing compared
        failures.append("every rung ran out of memory, so no prediction was compared (a card too small for the "
                        "check's model: --model, --seq or --batch smaller)")
    return {"status": "pass" if rows and not failures else "fail", "failures": failures, "rows": rows}


def fit_verdict_wrong(row: dict[str, Any], thresholds: dict[str, float] = THRESHOLDS) -> str:
    """What the card's outcome says was wrong with the prediction's fit figure ("" when nothing): it
    ran out of memory though the figure with its measured margin (what auto-fit adds; without one, the
    reserved threshold) was below what the card had free before the run, or it trained though the
    figure was above that by more than the reserved threshold (an over-prediction the check allows in
    a rung that trained). What was free is measured (other processes, the context and this process's
    live memory out); where it was not read, the card less the modelled context, as the verdict took it."""
    status, fit, free = row["status"], row.get("predicted_fit_mib"), row.get("free_before_mib")
    if row.get("predicted_fits_card") is None or status not in ("ok", "oom"):
        return ""  # no card in the prediction, or no outcome to hold it to
    if fit is None:  # no figure: the weights alone exceed the card (WeightsExceedCard)
        return "" if status == "oom" else "predicted not to fit (its weights alone exceed the card), yet it trained"
    if free is None:
        free = fit + row["predicted_headroom_mib"]
    margin = row.get("predicted_margin")
    margin = thresholds["reserved_pct"] / 100 if margin is None else margin
    if status == "oom" and fit * (1 + margin) < free:
        need, room = _apart(fit * (1 + margin), free)
        return (f"predicted to need {_apart(fit, free)[0]} MiB ({need} with its {margin:.1%} margin), with "
                f"{room} MiB free on the card before it ran, yet it ran out of memory")
    if status == "ok" and fit * (1 - thresholds["reserved_pct"] / 100) > free:
        need, room = _apart(fit, free)
        return f"predicted to need {need} MiB, more than the {room} MiB free before it ran, yet it trained"
    return ""


def _apart(a: float, b: float) -> tuple[str, str]:
    """Two MiB figures a verdict compares, in whole MiB unless that rounds them equal (8,099.6 against
    8,100.4 read "8,100 against 8,100"): then with as many decimals as tell them apart (at most 3)."""
    for digits in range(4):
        x, y = f"{a:,.{digits}f}", f"{b:,.{digits}f}"
        if x != y:
            break
    return x, y


def study1_verdict(runs: list[dict[str, Any]], allocated_before: int, allocated_after: int) -> dict[str, Any]:
    """pass when at least one strategy ran out of CUDA memory for real and then finished on the
    CPU, and nothing is left allocated on the GPU afterwards."""
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


# a check's status while the run is under way: the files are rewritten after every check, so a run
# killed part-way (a lent card's hard limit) leaves them saying which check it died in and which never began
UNFINISHED = {"pending": "not reached: the run ended before it began",
              "running": "the run ended in it (killed: no result), or is still in it",
              "killed": "a signal or an interrupt ended the run in it: no result"}


def short_of_time(result: dict[str, Any]) -> bool:
    """A check that did not begin under --time-budget, or failed only for parts of it that did not
    (a ladder rung, a notebook, cap trials): nothing in it was measured wrong."""
    failures = result.get("failures") or []
    return result.get("status") == "not run" or (
        result.get("status") == "fail" and not result.get("error") and bool(failures)
        and all(OUT_OF_TIME in f for f in failures))


def status_words(status: str, result: dict[str, Any]) -> str:
    """A check's status as the report and the shell say it: a check failed only by parts the time
    budget cut off or kept from beginning is incomplete (nothing it measured failed)."""
    if status == "fail" and short_of_time(result):
        return f"incomplete ({OUT_OF_TIME} before parts of it began or while they ran; what ran passed)"
    return status + (f" ({UNFINISHED[status]})" if status in UNFINISHED else "")


def summarize(results: dict[str, dict[str, Any]], env: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The summary.json: every check's result and the overall status: incomplete while a check is
    pending or running; fail when a check failed; incomplete when the time budget kept parts from
    beginning and nothing that ran failed; else pass. Versions and the card beside them."""
    statuses = {name: r.get("status", "error") for name, r in results.items()}
    short = [name for name, r in results.items() if short_of_time(r)]
    failed = [name for name, s in statuses.items() if s not in ("pass", "not provided", *UNFINISHED) and name not in short]
    status = ("incomplete" if any(s in UNFINISHED for s in statuses.values()) else "fail" if failed
              else "incomplete" if short else "pass" if statuses else "fail")
    return {"status": status, "checks": statuses, "results": results, "environment": env,
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
             f"Card: {env.get('gpu', '?')} ("
             + (f"{env['gpu_total_mib']:.0f} MiB" if env.get("gpu_total_mib") else "memory not read yet") + f"), torch {env.get('torch')}, "
             f"CUDA {env.get('cuda')}, {summary['seconds']:.0f} s"
             + ("" if summary["within_time_limit"] else f" (over the {TIME_LIMIT_S} s limit)") + ".", ""]
    lines += [f"- {name}: {status_words(status, summary['results'].get(name, {}))}"
              for name, status in summary["checks"].items()]
    ladder = summary["results"].get("ladder", {})
    if ladder.get("rows"):
        cols = ["rung", "status", "method", "predicted_allocated_mib", "cuda_max_allocated_mib", "error_vs_allocated_pct",
                "predicted_reserved_mib", "cuda_max_reserved_mib", "error_vs_reserved_pct",
                "predicted_nvidia_smi_mib", "nvidia_smi_used_peak_mib", "nvml_used_peak_mib", "outside_allocator_mib",
                "outside_allocator_rise_mib",
                "predicted_fits_card", "predicted_attention_kernels", "cuda_attention_kernels", "passed"]
        lines += ["", "### Ladder: predicted beside measured on the card (MiB; error = (predicted - measured) / measured)",
                  "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in ladder["rows"]]
        lines += ["", "The CUDA budget caps the allocator's reserved memory (fragmentation and caching "
                      "included); the CPU budget counts live tensor bytes. predicted_nvidia_smi_mib is shown, "
                      "not judged: it adds a per-card constant for the CUDA context, the H200's taken from "
                      "its own gpu-check records (on that card it agrees by construction), beside what nvidia-smi "
                      "shows used (nvidia_smi_used_peak_mib: NVML's v1 used, nvml_used_peak_mib, less the driver's "
                      "reserve)."]
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
