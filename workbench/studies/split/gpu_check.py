"""Study 3 on a real card: does the split engine train like AdamW, overlap backward, and how fast is it against k?

    make gpu-check                          # runs this as the `split` check (workbench/front/gpu_check.py)
    workbench gpu-check --only split        # this check alone; --quick: a smaller model

On the CUDA card, on one small randomly initialised Qwen2-style model and random tokens:
- parity: the engine (fp32, k=0.5; and with max_grad_norm clipping every step) against
  torch.optim.AdamW (+ clip_grad_norm_) with each weight's AdamW on the side the engine updates it
  (the card's fused kernel for the card's weights, the CPU's for the host's): the same arithmetic,
  so what is left is the engine's pipelining; the largest weight difference within 1% of one step
  (lr). Beside it, measured and not judged: the same run against AdamW on the card for every
  weight (the CPU and CUDA fused kernels round differently; on an H200 that was 3e-5 on the
  embedding after 3 steps, 3% of lr, with 0 between two runs of that reference);
- overlap: in how many measured iterations a host update started before backward ended, and
  the share of host parameters already updated when it ended;
- rates: alpha (accelerator / host update time per parameter) and the transfer rates through the
  pinned staging rings (GB/s), as the engine measured them;
- tokens/s against k (static sweep and adaptive; the adaptive run is longer, and its iterations
  after its last move of k are timed apart) beside DeepSpeed ZeRO-Offload and torchao's
  CPUOffloadOptimizer on the same model and data (a row saying why, where one cannot run). Both
  update every fp32 weight on the host: the engine's fp32 run at k=0 is compared with them, and its
  fastest fp32 run beside it with its k (at k=1 nothing is offloaded);
- the pinned bytes (the staging rings only; bounded whatever the model).

The rows, the comparisons and the verdict are pure functions tested on the CPU with fabricated
numbers (tests/test_offload_gpu_check.py); `check_split` is the thin CUDA layer that measures.
"""

from __future__ import annotations

import copy
import time
from typing import Any

from workbench.core.common import one_line
from workbench.core.fallback import release
from workbench.studies.split import _cuda
from workbench.studies.split.adam import AdamHP
from workbench.studies.split.balance import settled
from workbench.studies.split.engine import SplitEngine
from workbench.studies.split.reference import reference_at
from workbench.studies.split.zero_baseline import NOT_INSTALLED, run_zero_offload

ITERATIONS, WARMUP = 6, 2  # per run; the first WARMUP iterations are left out of every mean
# the adaptive run: its first decision comes at iteration 3 (rows lag a step), a fit of backward
# against k two steps after it; longer, so that the iterations after its last move can be timed apart
ADAPTIVE_ITERATIONS = 12
K_SWEEP = (0.0, 0.25, 0.5, 0.75, 1.0)
LR, WEIGHT_DECAY, CLIP = 1e-3, 0.01, 0.05  # CLIP: small enough that every step is clipped
PARITY_ATOL_LR = 1e-2  # tolerance in units of lr (clipping's norm is summed in another order)
# a small model that still gives the card and the host measurable work (~30M parameters)
SMALL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=8192, batch=8, seq=256)
QUICK = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=2048, batch=4, seq=64)


# ------------------------------------------------------------------------------------------------
# pure logic (tested on the CPU)

def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and x == x]
    return sum(xs) / len(xs) if xs else None


def overlapped_iterations(events: list[dict]) -> list[int]:
    """Iterations in which some host update started before that iteration's backward ended."""
    bwd_end = {e["iteration"]: e["end_ms"] for e in events if e["activity"] == "backward"}
    return sorted({e["iteration"] for e in events if e["activity"] == "host update"
                   and e["iteration"] in bwd_end and e["start_ms"] < bwd_end[e["iteration"]]})


def timeline_problems(events: list[dict], tol_ms: float = 0.05) -> list[str]:
    """Spans that end before they start: the sign of two clocks mixed (there must be one)."""
    return [f"iteration {e['iteration']} {e['activity']} {e.get('what', '')}: ends {e['start_ms'] - e['end_ms']:.3f} ms "
            f"before it starts" for e in events if e["end_ms"] < e["start_ms"] - tol_ms]


# balance_path's columns: (key, engine row field, scale: seconds to ms; k, alpha and k_next as they are)
BALANCE_PATH = (("k", "k_actual", 1), ("iteration_ms", "iteration_ms", 1), ("backward_ms", "backward_ms", 1),
                ("host_busy_ms", "host_busy_ms", 1), ("host_update_ms", "host_update_ms", 1),
                ("to_host_ms", "to_host_ms", 1), ("to_accel_ms", "to_accel_ms", 1),
                ("accel_update_ms", "accel_update_ms", 1), ("t_backward_ms", "t_backward_s", 1e3),
                ("t_interference_ms", "t_interference_s", 1e3), ("t_update_host_ms", "t_update_host_s", 1e3),
                ("t_host_side_ms", "t_host_side_s", 1e3), ("alpha", "alpha", 1), ("k_next", "k_next", 1))


def run_row(name: str, rows: list[dict], events: list[dict], warmup: int = WARMUP, **extra) -> dict[str, Any]:
    """One engine run: means over the measured iterations (after warm-up), rates, overlap, pinned bytes."""
    keep = [r for r in rows if r["iteration"] >= warmup] or rows
    ev = [e for e in events if e["iteration"] >= warmup] if any(e["iteration"] >= warmup for e in events) else events
    ms = sum(r["iteration_ms"] for r in keep)
    to_h_ms, to_a_ms = sum(r["to_host_ms"] for r in keep), sum(r["to_accel_ms"] for r in keep)
    last = keep[-1] if keep else {}
    return {
        "run": name, "status": "ok", "iterations": len(rows), "warmup": warmup,
        "k_actual": _mean([r["k_actual"] for r in keep]),
        "tokens_per_s": sum(r["tokens"] for r in keep) / (ms / 1e3) if ms > 0 else None,
        "iteration_ms": _mean([r["iteration_ms"] for r in keep]),
        "backward_ms": _mean([r["backward_ms"] for r in keep]),
        # the host's stages at work, overlaps once (the balance's T_host for the share it had)
        "host_busy_ms": _mean([r.get("host_busy_ms") for r in keep if r.get("host_params")]),
        "accel_idle_share": _mean([r["accel_idle_share"] for r in keep]),
        "host_done_before_bwd_end_share": _mean([r["host_done_before_bwd_end_share"] for r in keep]),
        "overlapped_iterations": len(overlapped_iterations(ev)),
        "measured_iterations": len(keep),
        "alpha": last.get("alpha"),
        "k_next": last.get("k_next"),
        # backward's measured slowdown with every update on the host (adaptive runs: fitted over k)
        "interference_ms": None if last.get("t_interference_s") is None else last["t_interference_s"] * 1e3,
        "k_path": [round(r["k_actual"], 3) for r in rows],  # every iteration's k, warm-up included
        # what each iteration's balance saw (ms, warm-up included): why k went where it went
        "balance_path": [{key: None if r.get(src) is None else round(r[src] * scale, 3)
                          for key, src, scale in BALANCE_PATH} for r in rows],
        "d2h_gb_per_s": sum(r["to_host_bytes"] for r in keep) / (to_h_ms * 1e6) if to_h_ms > 0 else None,
        "h2d_gb_per_s": sum(r["to_accel_bytes"] for r in keep) / (to_a_ms * 1e6) if to_a_ms > 0 else None,
        "pinned_bytes": last.get("pinned_bytes"),
        "staging_bytes": last.get("staging_bytes"),
        "final_loss": rows[-1]["loss"] if rows else None,
        "timeline_problems": timeline_problems(ev),
        **extra,
    }


def baseline_row(name: str, rows: list[dict] | None, reason: str | None, warmup: int = WARMUP) -> dict[str, Any]:
    """A library baseline: its tokens/s over the measured iterations, or why it did not run."""
    if reason or not rows:
        status = NOT_INSTALLED if reason == NOT_INSTALLED else "unavailable"
        return {"run": name, "status": status, "reason": reason or "no rows", "tokens_per_s": None}
    keep = [r for r in rows if r["iteration"] >= warmup] or rows
    ms = sum(r["iteration_ms"] for r in keep)
    return {"run": name, "status": "ok", "reason": "", "iterations": len(rows),
            "tokens_per_s": sum(r["tokens"] for r in keep) / (ms / 1e3) if ms > 0 else None,
            "iteration_ms": ms / len(keep), "final_loss": rows[-1]["loss"], "k_actual": 0.0}


def parity_row(name: str, reference: dict, masters: dict, lr: float, atol_lr: float = PARITY_ATOL_LR) -> dict[str, Any]:
    """Largest |engine - AdamW| over all weights (tensors on the CPU), against atol_lr * lr."""
    diffs = {n: float((masters[n].float() - w.float()).abs().max()) for n, w in reference.items()}
    worst = max(diffs, key=diffs.get)
    return {"run": name, "max_abs_diff": diffs[worst], "worst_param": worst, "atol": atol_lr * lr,
            "passed": diffs[worst] <= atol_lr * lr and all(d == d for d in diffs.values())}


def split_verdict(parity: list[dict], runs: list[dict], baselines: list[dict],
                  pinned_limit_bytes: int, references: list[dict] = ()) -> dict[str, Any]:
    """pass when the engine matches AdamW, every engine run ran, host updates overlapped backward
    in the host-only run, the timeline is on one clock, the pinned bytes are the bounded rings, and
    each library baseline ran. A baseline not installed is recorded, not failed; one installed that
    fails (out of memory, NCCL, its op build, an API change) fails the check, with its reason (its
    error is caught: the engine's runs are measured whatever it does). Comparisons, against each
    baseline's tokens/s: the engine's fp32 run at k=0 (every update on the host, as the baselines do)
    and its fastest fp32 run, with its k."""
    failures = [f"parity {p['run']}: max |diff| {p['max_abs_diff']:.3g} > {p['atol']:.3g} ({p['worst_param']})"
                for p in parity if not p["passed"]]
    for r in runs:
        if r["status"] != "ok":
            failures.append(f"{r['run']}: {r['status']}: {r.get('reason', '')}")
            continue
        failures += [f"{r['run']}: {p}" for p in r["timeline_problems"][:3]]
        if r.get("pinned_bytes") is not None and r["pinned_bytes"] > pinned_limit_bytes:
            failures.append(f"{r['run']}: {r['pinned_bytes']} bytes pinned (limit {pinned_limit_bytes})")
        share = r.get("accel_idle_share")
        if share is not None and not 0.0 <= share <= 1.0:
            failures.append(f"{r['run']}: accelerator idle share {share:.3f} outside [0, 1]")
    failures += [f"baseline {b['run']}: {b['status']}: {b.get('reason', '')}" for b in baselines
                 if b["status"] not in ("ok", NOT_INSTALLED)]
    # the study's reference at 16 bits (reference.plain_adamw): fp16 is unavailable without CUDA
    failures += [f"{r['run']}: {r['status']}: {r['reason']}" for r in references if r["status"] == "error"]
    host_only = [r for r in runs if r["status"] == "ok" and r.get("k_target") == 0.0]
    for r in host_only:
        if r["overlapped_iterations"] == 0:
            failures.append(f"{r['run']}: no host update started before backward ended in "
                            f"{r['measured_iterations']} measured iterations")
    # the baselines train fp32 weights with every optimizer update on the host: the engine's like-for-like
    # run is fp32 at k=0; its fastest fp32 run is beside it, with its k (k=1 updates every weight on the
    # card: no offload at all, the memory the baselines save spent)
    fp32 = [r for r in runs if r["status"] == "ok" and r.get("tokens_per_s") and r.get("precision", "fp32") == "fp32"]
    same = next((r for r in fp32 if r.get("k_target") == 0.0), None)
    best = max(fp32, key=lambda r: r["tokens_per_s"]) if fp32 else None
    comparisons = []
    for b in baselines:
        c = {"baseline": b["run"], "status": b["status"], "baseline_tokens_per_s": b.get("tokens_per_s"),
             "same_offload_run": same["run"] if same else None,
             "same_offload_tokens_per_s": same["tokens_per_s"] if same else None, "same_offload_speedup": None,
             "best_engine_run": best["run"] if best else None,
             "best_engine_k": best.get("k_actual") if best else None,
             "best_engine_tokens_per_s": best["tokens_per_s"] if best else None, "speedup": None}
        if b["status"] == "ok" and b.get("tokens_per_s"):
            if same:
                c["same_offload_speedup"] = same["tokens_per_s"] / b["tokens_per_s"]
            if best:
                c["speedup"] = best["tokens_per_s"] / b["tokens_per_s"]
        comparisons.append(c)
    return {"status": "fail" if failures else "pass", "failures": failures, "parity": parity, "runs": runs,
            "baselines": baselines, "comparisons": comparisons, "references": list(references)}


def _f(v, spec=".1f") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, float) else str(v)


def split_markdown(result: dict[str, Any]) -> str:
    """The report section of the split check (tokens/s against k beside the baselines)."""
    lines = [f"### Study 3 split engine on the card: {result['status']}", ""]
    if result.get("model"):
        lines += [f"Model: {result['model']}; pinned bytes: {result.get('pinned_bytes')}.", ""]
    lines += [f"- parity {p['run']}: max |engine - AdamW| = {p['max_abs_diff']:.3g} (limit {p['atol']:.3g})"
              for p in result.get("parity", [])]
    lines += [f"- measured, not judged: {p['run']}: max |engine - AdamW| = {p['max_abs_diff']:.3g} ({p['worst_param']})"
              for p in result.get("kernel_differences", [])]
    cols = ["run", "status", "k_actual", "tokens_per_s", "backward_ms", "host_busy_ms", "accel_idle_share", "host_done_before_bwd_end_share",
            "overlapped_iterations", "alpha", "d2h_gb_per_s", "h2d_gb_per_s", "pinned_bytes"]
    rows = result.get("runs", []) + result.get("references", []) + result.get("baselines", [])
    if rows:
        lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            lines.append("| " + " | ".join(_f(r.get(c), ".3g" if c in ("alpha", "accel_idle_share",
                                                                     "host_done_before_bwd_end_share", "k_actual")
                                              else ".1f") for c in cols) + " |")
    fixed = [r for r in result.get("runs", []) if r.get("status") == "ok" and r.get("k_target") is not None
             and r.get("precision", "fp32") == "fp32" and r.get("tokens_per_s")]
    for r in result.get("runs", []):
        if r.get("run") == "adaptive" and r.get("k_path"):
            lines.append(f"- adaptive: k by iteration {', '.join(f'{k:g}' for k in r['k_path'])}; backward's measured "
                         f"slowdown with every update on the host: {_f(r.get('interference_ms'))} ms")
            if r.get("settled_tokens_per_s"):
                best = max(fixed, key=lambda x: x["tokens_per_s"]) if fixed else None
                than = f"; the fastest fixed k: {best['run']}, {best['tokens_per_s']:,.0f} tokens/s" if best else ""
                lines.append(f"- adaptive after its last move (k={r['settled_k']:.3g} from iteration "
                             f"{r['settled_from']}): {r['settled_tokens_per_s']:,.0f} tokens/s{than} "
                             "(measured, not judged)")
            elif "settled_k" in r:
                lines.append("- adaptive: fewer than two measured iterations at its last k "
                             "(not settled within the run)")
    for c in result.get("comparisons", []):
        if c["speedup"] is None:
            lines.append(f"- {c['baseline']}: {c['status']}")
            continue
        same = (f"{c['same_offload_run']} (every update on the host, as the baseline) {c['same_offload_speedup']:.2f}x"
                if c.get("same_offload_speedup") is not None else "no fp32 run at k=0")
        lines.append(f"- vs {c['baseline']} (tokens/s, fp32): {same}; the fastest, {c['best_engine_run']} (k "
                     f"{_f(c.get('best_engine_k'), '.3g')} of the weights updated on the card), {c['speedup']:.2f}x")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# CUDA: the thin layer that measures

def _model(shape: dict):
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**{k: v for k, v in shape.items() if k not in ("batch", "seq")})
    return transformers.Qwen2ForCausalLM(cfg)


def _reference(base, batches, clip: float = 0.0, host: frozenset = frozenset()) -> dict:
    """Plain training with torch.optim.AdamW (fused) and clip_grad_norm_. `host`: parameter names
    whose AdamW runs on the CPU (an fp32 copy, its gradient copied over), as the engine updates
    them; the rest on the model's device. With the engine's placement this is the same arithmetic
    on the same sides: the engine's pipelining (hooks, rings, threads, order) must change nothing."""
    import torch

    model = copy.deepcopy(base).to(batches[0].device)
    params = dict(model.named_parameters())
    on_host = {n: params[n].detach().float().cpu().requires_grad_() for n in host}
    opt = torch.optim.AdamW([p for n, p in params.items() if n not in host], lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    host_opt = torch.optim.AdamW(list(on_host.values()), lr=LR, weight_decay=WEIGHT_DECAY, fused=True) if on_host else None
    for b in batches:
        model(input_ids=b, labels=b).loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if host_opt is not None:
            for n, master in on_host.items():
                master.grad = params[n].grad.float().cpu()
            host_opt.step()
            host_opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for n, master in on_host.items():
                    params[n].copy_(master)
        model.zero_grad(set_to_none=True)
    return {n: (on_host[n] if n in on_host else p).detach().float().cpu() for n, p in params.items()}


def _engine(base, batches, **kw):

    eng = SplitEngine(copy.deepcopy(base), hp=AdamHP(lr=LR, weight_decay=WEIGHT_DECAY), device=batches[0].device, **kw)
    try:
        for b in batches:
            eng.step(b)
        eng.finish()
        out = eng.rows, eng.events, eng.master_weights(), eng.pinned_bytes, eng.placement()
    except BaseException:  # close() would wait for a step that failed; abort() frees the model for good
        eng.abort()
        raise
    eng.close()
    return out


def _torchao_rows(base, batches) -> tuple[list[dict], str | None]:
    """torchao's CPUOffloadOptimizer (overlaps only the gradient copies; Adam runs in step())."""
    import torch

    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        try:
            from torchao.prototype.low_bit_optim import CPUOffloadOptimizer
        except ImportError:
            return [], NOT_INSTALLED
    model = copy.deepcopy(base).to(batches[0].device)
    sync = torch.cuda.synchronize if batches[0].is_cuda else (lambda: None)
    try:
        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True, lr=LR, weight_decay=WEIGHT_DECAY)
        rows = []
        for i, b in enumerate(batches):
            sync()
            t0 = time.perf_counter()
            loss = model(input_ids=b, labels=b).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            sync()
            dt = time.perf_counter() - t0
            rows.append({"iteration": i, "loss": loss.item(), "iteration_ms": dt * 1e3, "tokens": b.numel()})
        return rows, None
    except Exception as e:  # an API change in torchao is a finding, not a crash
        return [], one_line(e, 200)


def check_split(opts) -> dict[str, Any]:
    """CUDA: parity, overlap, rates, tokens/s against k, the baselines, pinned bytes. (With
    opts.device "cpu" the same code runs on the CPU: the tests' dry run of this layer.)"""
    import torch


    shape = QUICK if getattr(opts, "tiny", False) else SMALL
    base = _model(shape)
    g = torch.Generator().manual_seed(1)
    device = torch.device(getattr(opts, "device", "cuda"))
    batches = [torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=g).to(device)
               for _ in range(max(ITERATIONS, ADAPTIVE_ITERATIONS))]
    n_params = sum(p.numel() for p in base.parameters())

    parity, kernels = [], []
    for name, kw, clip in (("fp32 k=0.5", {}, 0.0), (f"fp32 k=0.5 max_grad_norm={CLIP}", {"max_grad_norm": CLIP}, CLIP)):
        _, _, masters, _, placement = _engine(base, batches[:3], k=0.5, **kw)
        host = frozenset(n for n, side in placement.items() if side == "host")
        parity.append(parity_row(name, _reference(base, batches[:3], clip, host=host), masters, LR))
        # beside it, measured not judged: the same run against AdamW on the card for every weight,
        # which differs by the CPU and CUDA fused AdamW kernels' rounding
        kernels.append(parity_row(f"{name} vs AdamW all on {device.type}", _reference(base, batches[:3], clip),
                                  masters, LR))

    runs = []
    specs = [(f"k={k:g}", dict(k=k), k) for k in K_SWEEP] + [("adaptive", dict(k=0.0, adaptive=True), None)]
    specs.append(("bf16 k=0", dict(k=0.0, precision="bf16"), 0.0))
    specs.append(("fp16 k=0", dict(k=0.0, precision="fp16"), 0.0))
    for name, kw, k in specs:
        try:
            adaptive = kw.get("adaptive", False)
            rows, events, _, _, _ = _engine(base, batches[:ADAPTIVE_ITERATIONS if adaptive else ITERATIONS], **kw)
            runs.append(run_row(name, rows, events, warmup=WARMUP, k_target=k, precision=kw.get("precision", "fp32"),
                                **(settled(rows, WARMUP) if adaptive else {})))
        except Exception as e:
            runs.append({"run": name, "status": "error", "reason": f"{type(e).__name__}: {e}"[:300], "k_target": k})

    try:  # out of memory on the card, an NCCL error: the baseline's reason, not the end of the runs measured above
        zrows, zreason = run_zero_offload(copy.deepcopy(base).to(device), batches[:ITERATIONS], LR, WEIGHT_DECAY,
                                          "fp32")
    except Exception as e:
        zrows, zreason = [], f"{type(e).__name__}: {e}"[:300]
    release(device)  # what a failed baseline left cached (outside the except: its frames held it)
    trows, treason = _torchao_rows(base, batches[:ITERATIONS])
    baselines = [baseline_row("DeepSpeed ZeRO-Offload", zrows, zreason, warmup=WARMUP),
                 baseline_row("torchao CPUOffloadOptimizer", trows, treason, warmup=WARMUP)]
    hp = AdamHP(lr=LR, weight_decay=WEIGHT_DECAY)
    references = [reference_at(base, batches[:ITERATIONS], hp, p, WARMUP) for p in ("bf16", "fp16")]
    release(device)  # what a failed reference left cached
    limit = _cuda.staging_bytes(4, 8 * 2**20, torch.float32)  # the engine's default rings, fp32
    result = split_verdict(parity, runs, baselines, limit, references)
    result["kernel_differences"] = kernels
    result.update(model=f"Qwen2-style, {n_params / 1e6:.1f}M parameters, batch {shape['batch']} x {shape['seq']}",
                  n_params=n_params, pinned_bytes=max((r.get("pinned_bytes") or 0) for r in runs),
                  pinned_limit_bytes=limit, iterations=ITERATIONS, adaptive_iterations=ADAPTIVE_ITERATIONS,
                  warmup=WARMUP)
    result["report"] = split_markdown(result)
    return result


def gpu_checks():
    """The checks this package adds to `workbench gpu-check` (workbench/front/gpu_check.py runs them after its own)."""
    return {"split": check_split}
