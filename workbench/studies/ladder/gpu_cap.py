"""gpu-check's cap check: the least reserved memory a rung trains under on the card, beside the
prediction's "reserved needed".

    workbench gpu-check --only cap

A card's memory (or `torch.cuda.set_per_process_memory_fraction`) caps the caching allocator's
reserved bytes, and before it raises out of memory the allocator gives its wholly free cached
segments back and retries. So what a card must hold is not the reserved peak a card with room shows
but the least cap the step trains under; `predict` models it by replaying the step under caps
(`allocator.least_reserved`). Auto-fit's "fits" no longer compares it but the reserved peak: the
least cap this check measured on the H200 was up to 18.7% above the modelled need (see
`Prediction.fit_bytes`). This check measures it: for each
rung in CAP_RUNGS it trains once to warm up, once uncapped, then bisects the cap between that run's
allocated and reserved peaks, each trial a fresh run of the rung under
`set_per_process_memory_fraction` with the cap counted above what the process holds before it.

Before each run the process gives back what a fresh process would not hold: garbage, the cuBLAS
workspaces (`release_held`) and then every wholly free cached segment. The workspaces matter: the
first run makes them inside whatever segment is free at its first matmul, and one left there keeps
that whole segment reserved after `empty_cache`, its free room used by the next run. On the H200
(2026-11-26, data/measured/h200-2026-11-26/) the uncapped run's reserved bytes grew less than its
allocated bytes above what was held (bf16_true_lora: 2,336 against 2,858 MiB), so the trials drew
on room the process already held, and the least cap (2,304 MiB, 28% under the prediction) was not
what the step needs. With the workspaces released, each run makes its own as a fresh process
does, and the prediction's "reserved needed" is compared whole (its workspaces included). Where
this torch has no way to release them, they stay, and the modelled workspaces are taken off the
prediction as before; the row says which (`workspaces_released`) and what was held.

The bisection (`allocator.least_cap`, which the prediction's capped replays use too) and the rows
are plain functions, tested on the CPU, and the CUDA layer is played there with stand-ins for
torch.cuda's calls and the rung's run (tests/test_gpu_check.py); `check_cap` measures on CUDA only.
"""

from __future__ import annotations

from typing import Any

import torch

from workbench.core.common import OUT_OF_TIME, MiB, one_line, past_free_memory
from workbench.core.memory import allocator
from workbench.core.memory import cuda_model
from workbench.core.memory.monitor import can_release_workspaces, indexed, release_held
from workbench.core.memory.predict import WeightsExceedCard, predict
from workbench.core.parallel import run_ahead
from workbench.studies.ladder.config import LadderConfig
from workbench.studies.ladder.rungs import measure
from workbench.studies.ladder.runner import model_at_hand

# an on-card rung and the one whose cached blocks the card gives back most (DeepSpeed's flattening)
CAP_RUNGS = ("bf16_true_lora", "zero_offload")
STEP = 16 * MiB  # the bisection's resolution (0.5% of these rungs' peaks; a trial costs seconds)
TRIAL_STEPS = 2  # steps per capped run (the prediction replays as many: predict(replay_steps=...))
TARGET_PCT = 5.0  # the target for reserved figures


def cap_row(rung: str, *, predicted_needed: int, workspaces: int, predicted_reserved: int, least: int | None,
            uncapped: dict[str, Any], tried: list[tuple[int, bool]], reason: str = "",
            held: tuple[int, int] | None = None) -> dict[str, Any]:
    """One rung's row (MiB): the prediction's need beside the least cap it trained under.
    `workspaces`: the modelled workspace bytes the process held through the trials (0 when it
    released them before each), taken off the prediction; `held`: (reserved, allocated) bytes the
    process held before the uncapped run, above which each cap was counted."""
    need = (predicted_needed - workspaces) / MiB
    measured = None if least is None else least / MiB
    err = None if measured is None else 100.0 * (need - measured) / measured
    return {
        "rung": rung, "status": "ok" if measured is not None else "not measured", "reason": reason,
        "predicted_needed_mib": round(need, 1), "measured_least_cap_mib": measured,
        "error_pct": None if err is None else round(err, 2),
        "predicted_reserved_peak_mib": round((predicted_reserved - workspaces) / MiB, 1),
        "uncapped_reserved_mib": uncapped.get("reserved_mib"), "uncapped_allocated_mib": uncapped.get("allocated_mib"),
        "trials": [{"cap_mib": c / MiB, "ran": ok} for c, ok in tried], "workspaces_released": not workspaces,
        "held_reserved_mib": None if held is None else held[0] / MiB,
        "held_allocated_mib": None if held is None else round(held[1] / MiB, 1),
        "passed": err is not None and abs(err) <= TARGET_PCT,
    }


def cap_verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    # out of memory uncapped, or the weights alone more than the card (predicted): results, not failures
    failures = [f"{r['rung']}: {r['reason'] or 'not measured'}" for r in rows
                if r["status"] not in ("ok", "oom", "too big")]
    failures += [f"{r['rung']}: reserved needed off by {r['error_pct']:+.1f}% of the least cap it trained under"
                 for r in rows if r["status"] == "ok" and not r["passed"]]
    # out of memory uncapped is held to the prediction, as the ladder's check holds it: with room for the
    # need and the target's margin free before the run, it is a fault (on the H200 any small rung's OOM is)
    failures += [f"{r['rung']}: predicted to need {r['predicted_needed_mib']:,.0f} MiB, with "
                 f"{r['free_before_mib']:,.0f} MiB free before it ran, yet it ran out of memory uncapped"
                 for r in rows if r["status"] == "oom" and r.get("free_before_mib") is not None
                 and r["predicted_needed_mib"] * (1 + TARGET_PCT / 100) < r["free_before_mib"]]
    if rows and all(r["status"] in ("oom", "too big") for r in rows):  # nothing trained: nothing compared
        failures.append("every rung was too big for the card or ran out of memory uncapped, so no least cap was "
                        "found (a card too small for the check's model: --model, --seq or --batch smaller)")
    return {"status": "pass" if rows and not failures else "fail", "rows": rows, "failures": failures,
            "report": cap_markdown(rows)}


def cap_markdown(rows: list[dict[str, Any]]) -> str:
    cols = ["rung", "predicted_needed_mib", "measured_least_cap_mib", "error_pct", "predicted_reserved_peak_mib",
            "uncapped_reserved_mib", "held_reserved_mib", "passed"]
    kept = [r["rung"] for r in rows if r.get("workspaces_released") is False and r.get("status") == "ok"]
    title = ("### Reserved needed: predicted beside the least cap each rung trained under (MiB; each cap counted "
             "above what the process held before the run")
    title += f"; the cuBLAS workspaces held throughout and left out for {', '.join(kept)})" if kept else ")"
    lines = [title, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("-" if r.get(c) is None else str(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# CUDA: the thin layer that measures

def check_cap(opts) -> dict[str, Any]:
    cfg = LadderConfig(model=opts.model, base_size="tiny" if opts.tiny else "default", micro_batch=opts.batch,
                       seq_len=opts.seq, steps=TRIAL_STEPS, reference_model="")
    config, load, blocks, _ = model_at_hand(cfg, keep=True)  # made once, a copy for each run
    dev = indexed(opts.device)  # set_per_process_memory_fraction raises ValueError for "cuda"
    card = cuda_model.card_at_hand(dev)
    before = torch.cuda.get_per_process_memory_fraction(dev)  # a notebook's own cap comes back after each trial
    workspaces = 0  # released before each run (below), so the prediction is compared whole
    if not can_release_workspaces():  # then held() cannot release them either: they stay through the trials
        workspaces = sum(n for _, n in card.cublas_workspaces)

    def held() -> tuple[int, int]:
        """What the process holds before a run (reserved, allocated), after giving back what a fresh
        process would not hold (the workspaces, where it can)."""
        release_held(dev)
        return torch.cuda.memory_reserved(dev), torch.cuda.memory_allocated(dev)

    def run(name: str) -> dict[str, Any]:
        return measure(name, load, blocks, batch=opts.batch, steps=TRIAL_STEPS, device=dev, counted=False)

    names = opts.extra.get("cap_rungs") or CAP_RUNGS
    # as measure() loads them; CPU work (each replayed under caps too), made side by side where there are cores
    items = {name: (config, name, dict(batch=opts.batch, seq=opts.seq, n_blocks=len(blocks), device="cuda",
                                       card=card, replay_steps=TRIAL_STEPS, load="host")) for name in names}
    ahead, how = run_ahead(cap_prediction, items, desc="cap predictions")
    rows = []
    for name in names:
        # neither a spent budget nor a failed prediction ends the check: each is the rung's row
        p = ({"error": f"{OUT_OF_TIME} before it began"} if opts.out_of_time() else
             ahead.pop(name, None) or cap_prediction(items[name]))
        if "too_big" in p:  # no cap to find on this card (the ladder's check runs it: its OOM agrees)
            rows.append({"rung": name, "status": "too big", "reason": p["too_big"], "trials": [], "passed": None})
            continue
        if "error" in p:
            rows.append({"rung": name, "status": "not measured", "reason": p["error"], "trials": [], "passed": False})
            continue
        needed = p["needed"]
        # ZeRO-Offload's host state: the OOM killer, as in the ladder (the kept model given back first)
        if short := past_free_memory(p["host"] / MiB, drop=getattr(load, "drop", None)):
            rows.append({"rung": name, "status": "skipped", "reason": f"its predicted host memory {short}",
                         "trials": [], "passed": None})
            continue
        row = dict(rung=name, predicted_needed=needed, workspaces=workspaces,
                   predicted_reserved=p["reserved"])
        tried: list[tuple[int, bool]] = []  # the trials so far, kept in a row that ends early
        try:
            run(name)  # warm-up: kernels chosen and loaded, libraries' lazy state made
            res0, alloc0 = held()
            free_before = torch.cuda.mem_get_info(dev)[0] + res0 - alloc0  # the card's free and this process's cache
            free = run(name)  # uncapped: its peaks above what is held bound the bisection
            if free.get("status") != "ok":
                reason = str(free.get("reason") or free.get("status"))  # measure()'s own text, already one line
                rows.append(cap_row(**row, least=None, uncapped={}, tried=[], reason=reason.splitlines()[0][:300]))
                if free.get("status") == "oom":  # a result where the prediction left no room (cap_verdict)
                    rows[-1].update(status="oom", passed=None, free_before_mib=round(free_before / MiB, 1))
                continue
            hi = free["cuda_max_reserved_bytes"] - res0
            uncapped = {"reserved_mib": hi / MiB, "allocated_mib": (free["cuda_max_allocated_bytes"] - alloc0) / MiB}
            # no cap above what is held can be below this (the held segments' free room counted in)
            lo = max(0, free["cuda_max_allocated_bytes"] - res0)

            def runs(cap: int) -> bool:
                if opts.out_of_time():  # --time-budget: no trial begins past it
                    raise TimeoutError(f"{OUT_OF_TIME} after {len(tried)} trials")
                res, _ = held()
                torch.cuda.set_per_process_memory_fraction(min(1.0, (res + cap) / card.total_bytes), dev)
                try:
                    out = run(name)
                finally:
                    torch.cuda.set_per_process_memory_fraction(before, dev)
                if out.get("status") not in ("ok", "oom"):  # a failure other than memory is no answer
                    raise RuntimeError(out.get("reason") or out.get("status"))
                tried.append((cap, out["status"] == "ok"))
                return out["status"] == "ok"

            least, _ = allocator.least_cap(runs, lo, hi, STEP)
            rows.append(cap_row(**row, least=least, uncapped=uncapped, tried=tried, held=(res0, alloc0)))
        except Exception as e:  # one rung's failure is its row (with the trials it had)
            rows.append(cap_row(**row, least=None, uncapped={}, tried=tried, reason=one_line(e)))
    return {**cap_verdict(rows), "predicted": how, "loads": dict(getattr(load, "timings", {}))}


def cap_prediction(item: tuple) -> dict[str, Any]:
    """One rung's prediction as the cap check reads it: {needed, reserved, host} bytes, or {too_big} (its
    weights alone are more than the card) or {error}, each one line. `item`: (config, rung, predict's keywords)."""
    config, name, kw = item
    try:
        p = predict(config, name, **kw)
        # "needed" is replayed under caps when read: a failure there is this rung's row too
        return {"needed": p.needed_reserved_bytes, "reserved": p.reserved_peak_bytes, "host": p.host_bytes}
    except WeightsExceedCard as e:
        return {"too_big": one_line(e)}
    except Exception as e:
        return {"error": one_line(e)}


def gpu_checks():
    """The checks this package adds to `workbench gpu-check` (workbench/front/gpu_check.py runs them)."""
    return {"cap": check_cap}
