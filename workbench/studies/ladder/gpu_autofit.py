"""gpu-check's auto-fit check: does study 2's auto-fit step down on the card's own out-of-memory error?

    workbench gpu-check --only autofit

Study 2 runs auto-fit's choice on a card under a real CUDA budget (studies/ladder/fit_run.py). This
check makes the first setup run out of memory for real: it predicts two setups of the check's model on
the card at hand, fp32 and pure bf16 (about half its need), and runs auto-fit's step-down order
(fp32, then bf16-true, then the CPU) under a cap halfway between fp32's allocated peak (no cap below
it holds the step) and bf16-true's reserved peak (what a card with room holds for it), the allocator
capped with `set_per_process_memory_fraction`. fp32 must run out of memory on the card (the
allocator's error, not a prediction's skip), bf16-true must then train under the same cap, and the
failed setup must leave nothing allocated on the card. Where the two needs are too close for a cap
between them to be clear of the prediction's error (the tiny base of --quick, whose needs are mostly
the allocator's 20 MiB segments and the cuBLAS workspace), or where that cap would be past what the
card can give (a card under about 6 GB for Qwen2-0.5B at 1 x 512: bf16-true would not fit it), the cap
is half of fp32's allocated peak and the step-down must end on the CPU.

The plan, the verdict and its report are plain functions, tested on the CPU (tests/test_fit_run.py,
where `check_autofit`'s CUDA layer is also played); `check_autofit` runs on CUDA only.
"""

from __future__ import annotations

from typing import Any

import torch

from workbench.core.common import OUT_OF_TIME, MiB
from workbench.core.memory import cuda_model
from workbench.core.memory.monitor import indexed, release_held
from workbench.core.memory.plan import RUNGS
from workbench.core.memory.predict import predict
from workbench.studies.ladder.autofit import SetupChoice
from workbench.studies.ladder.config import LadderConfig
from workbench.studies.ladder.fit_run import run_choice
from workbench.studies.ladder.runner import model_at_hand

FIRST, NEXT = "fp32", "bf16_true"
# a cap between the two needs is used when each is this far from it (else the cap could land inside the
# prediction's error: the card records' worst reserved miss on the card is 5.5%, fp32 before the card ran it)
CLEAR = 0.10
# what the card may hold after the step-down above what it held before, both read after `release_held`
# (garbage, the cuBLAS workspaces, the cache): a leaked model's tensors are more. Read without the
# release, a run leaves its workspaces (65-66 MiB on the H200 after any ladder rung: two cuBLAS
# workspaces of 32 MiB, the forward's thread's and autograd's, and 1-2 MiB more) and the check failed
# on a card even where the failed setup had freed all it held.
LEFT_TOLERANCE_MIB = 64.0


def plan_cap(first_allocated_mib: float, next_reserved_mib: float,
             room_mib: float = float("inf")) -> tuple[float, list[str]]:
    """(cap in MiB, the setups to try): halfway between the first setup's allocated peak (a cap below it
    cannot hold the step, whatever the allocator gives back) and the next one's reserved peak (a cap
    above it holds the step as a card with room runs it), where both are clear of it and the card can
    give it (`room_mib`: what its allocator can reserve); else half of the first's allocated peak with
    only the first on the card (the step-down then ends on the CPU)."""
    cap = (first_allocated_mib + next_reserved_mib) / 2
    if first_allocated_mib >= cap * (1 + CLEAR) and next_reserved_mib * (1 + CLEAR) <= cap <= room_mib:
        return cap, [FIRST, NEXT]
    return first_allocated_mib / 2, [FIRST]


def autofit_verdict(tries: list[dict[str, Any]], *, cap_mib: float, needs_mib: dict[str, float], setups: list[str],
                    left_before_mib: float, left_after_mib: float) -> dict[str, Any]:
    """Pass when the first setup ran out of memory on the card, the step-down ended on the setup expected
    (the second where it was tried, else the CPU) within the cap, and nothing was left on the card."""
    expected = setups[1] if len(setups) > 1 else "cpu"
    failures = []
    first = tries[0] if tries else {}
    if first.get("setup") != setups[0] or first.get("status") != "oom":
        failures.append(f"{setups[0]} (allocated peak predicted {needs_mib[setups[0]]:,.0f} MiB) did not run out of "
                        f"memory under a "
                        f"{cap_mib:,.0f} MiB cap: {first.get('status', 'not tried')} {first.get('error', '')}".strip())
    elif "predicted host memory" in first.get("error", "") or not str(first.get("device", "")).startswith("cuda"):
        failures.append(f"{setups[0]} was not run on the card: {first.get('error')}")
    ran = [t for t in tries if t.get("status") == "ok"]
    if not ran:
        failures.append(f"nothing trained after the step-down (expected {expected}): "
                        + "; ".join(f"{t.get('setup')}: {t.get('status')}" for t in tries))
    elif ran[-1]["setup"] != expected:
        failures.append(f"the step-down ended on {ran[-1]['setup']}, not {expected}")
    elif expected != "cpu" and (ran[-1].get("measured_reserved_mib") or 0) > cap_mib:
        failures.append(f"{expected} reserved {ran[-1]['measured_reserved_mib']:,.0f} MiB, past the "
                        f"{cap_mib:,.0f} MiB cap (the budget did not cap the allocator)")
    if left_after_mib > left_before_mib + LEFT_TOLERANCE_MIB:
        failures.append(f"the card holds {left_after_mib - left_before_mib:,.0f} MiB more allocated after the "
                        "step-down than before it (the failed setup's tensors were not freed)")
    return {"status": "fail" if failures else "pass", "failures": failures, "tries": tries, "cap_mib": cap_mib,
            "predicted_needs_mib": needs_mib, "expected": expected, "left_before_mib": left_before_mib,
            "left_after_mib": left_after_mib,
            "report": autofit_markdown(tries, cap_mib, needs_mib, left_before_mib, left_after_mib)}


def autofit_markdown(tries: list[dict[str, Any]], cap_mib: float, needs_mib: dict[str, float],
                     before_mib: float, after_mib: float) -> str:
    lines = [f"### Auto-fit's step-down on the card's own out-of-memory error (cap {cap_mib:,.0f} MiB)", "",
             "| setup | predicted (MiB: the first's allocated peak, the next's reserved) | device | status | "
             "reserved peak (MiB) | error |", "|---|---|---|---|---|---|"]
    for t in tries:
        need = needs_mib.get(t.get("setup"))  # (the rungs' setups are named as the rungs)
        lines.append(f"| {t.get('setup')} | {'-' if need is None else f'{need:,.0f}'} | {t.get('device', '-')} | "
                     f"{t.get('status')} | {t.get('measured_reserved_mib', '-')} | {str(t.get('error', ''))[:120]} |")
    lines += ["", f"Allocated on the card before the step-down {before_mib:,.1f} MiB, after it {after_mib:,.1f} MiB."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# CUDA: the thin layer that measures

def check_autofit(opts) -> dict[str, Any]:
    cfg = LadderConfig(model=opts.model, base_size="tiny" if opts.tiny else "default", micro_batch=opts.batch,
                       seq_len=opts.seq, reference_model="")
    config, load, blocks, _ = model_at_hand(cfg, keep=True)  # made once, a copy for each setup tried
    dev = indexed(opts.device)
    card = cuda_model.card_at_hand(dev)
    p = {name: predict(config, name, batch=opts.batch, seq=opts.seq, device="cuda", card=card, load="host")
         for name in (FIRST, NEXT)}  # as measure() loads them
    if opts.out_of_time():  # --time-budget: its predictions took the rest, and its runs would end past the kill
        return {"status": "not run", "reason": f"{OUT_OF_TIME} before its step-down began (after its predictions)"}
    needs = {FIRST: p[FIRST].allocated_peak_bytes / MiB, NEXT: p[NEXT].fit_bytes / MiB}
    cap, setups = plan_cap(needs[FIRST], needs[NEXT], cuda_model.card_free_now(dev).usable_bytes / MiB)
    plans = [RUNGS[s] for s in setups]
    choice = SetupChoice(plans[0], opts.batch, int(cap * MiB), 0.0, "gpu-check: a cap between the setups' needs",
                         fitting=plans)
    release_held(dev)
    before = torch.cuda.memory_allocated(dev) / MiB
    _, tries = run_choice(choice, config, load, blocks, device=dev, batch=opts.batch, budget_mib=cap)
    release_held(dev)  # as before the step-down: what is left is tensors
    after = torch.cuda.memory_allocated(dev) / MiB
    return autofit_verdict(tries, cap_mib=cap, needs_mib=needs, setups=setups, left_before_mib=before,
                           left_after_mib=after)


def gpu_checks():
    """The checks this module adds to `workbench gpu-check` (workbench/front/gpu_check.py runs them)."""
    return {"autofit": check_autofit}
