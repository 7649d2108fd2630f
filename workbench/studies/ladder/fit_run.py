"""Auto-fit on the machine at hand: search for the setup, run it under the budget, step down on a real OOM.

    from workbench.studies.ladder.fit_run import search_here, run_choice
    choice = search_here(config, RUNGS["fp32"], device="cuda", batch=8, seq=128, budget_mib=4096)
    ran, tries = run_choice(choice, config, load, blocks, device="cuda", batch=8, budget_mib=4096)

On a card (`device` cuda, cuda:N) the search predicts the card's step (CUDA's kernels and caching
allocator, for the card at hand: the reserved peak, which a card's budget caps; the weights loaded as
`measure` loads them, `predict(load="host")`), each setup with its
own margin, the prediction's error measured on cards (`autofit.prediction_margin`). Each try runs on
the card under a real CUDA budget (`device_budget`: torch's allocator capped at `budget_mib` with
`set_per_process_memory_fraction`, so running out is the card's own out-of-memory error), measured by
the allocator's peaks with no dispatch mode (`measure(counted=False)`: the step a user's training
runs), and what the try before left is given back first (`release_held`: garbage, the cuBLAS
workspaces, the cache), so each try starts as a fresh process would.

On the CPU the budget is played: live tensor bytes counted and capped (`measure(budget_mib=...)`), and
the search keeps the CPU prediction's tested tolerance as its margin.

Either way the step-down order is the search's (each setup needing less than the one before, the
same effective batch), then the ladder's bottom rung, the CPU with no budget. A try whose predicted
host memory is past what this machine has free is not run (a CPU step past it is not an
out-of-memory error: the kernel's OOM killer takes the study) and counts as out of memory.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from workbench.core.common import MiB, past_free_memory
from workbench.core.memory import cuda_model
from workbench.core.memory.budget import device_budget
from workbench.core.memory.monitor import release_held
from workbench.core.memory.plan import RUNGS, Plan
from workbench.core.memory.predict import predict
from workbench.studies.ladder.autofit import NoSetupFits, SetupChoice, run_with_step_down, search
from workbench.studies.ladder.rungs import measure

# Auto-fit's margin when the budget is played on the CPU: the prediction of a CPU step is exact to the
# byte on the real CPU steps measured here and within 1% in the tests (tests/test_memory.py); a card keeps
# its measured error.
CPU_MARGIN = 0.01
CPU_MARGIN_SOURCE = "the CPU prediction's tested tolerance"
TRY_STEPS = 2  # steps each try trains: the second step is the steady one (the first allocates the optimizer state)


def search_here(config: Any, setup: Plan, *, device: str | torch.device, batch: int, seq: int, budget_mib: float,
                progress: bool = False) -> SetupChoice:
    """auto-fit's search for what can run on `device`: the card at hand's step with the margins measured
    on cards, or the CPU's step with the CPU's tolerance."""
    device = torch.device(device)
    runnable = (lambda p: p.cannot_run_here(device) is None)  # noqa: E731 (one line, named by its use)
    if device.type == "cuda":
        # the step its tries run: the weights converted on the host (QLoRA's quantized onto the card), then moved
        return search(config, setup, batch=batch, seq=seq, budget_mib=budget_mib, device="cuda",
                      card=cuda_model.card_at_hand(device), keep=2, runnable=runnable, progress=progress,
                      load="host")
    return search(config, setup, batch=batch, seq=seq, budget_mib=budget_mib, device="cpu", margin=CPU_MARGIN,
                  margin_source=CPU_MARGIN_SOURCE, keep=2, runnable=runnable, progress=progress)


def run_choice(choice: SetupChoice, config: Any, load: Callable[[], torch.nn.Module], blocks: torch.Tensor, *,
               device: str | torch.device, batch: int, budget_mib: float, lr: float = 1e-4, sinks: tuple = (),
               on_event: Callable[..., None] = lambda **row: None) -> tuple[str | None, list[dict[str, Any]]]:
    """Run `choice` (its step-down order, then the cpu rung) on `device` under `budget_mib`; returns the
    setup that ran (None: none did) and one row per try (setup, device, status, error; the one that ran
    with its measured peaks). `on_event(rung=, attempt=, result=)` hears how each try ended (skipped, oom,
ok...), as the study's event rows did before."""
    device = torch.device(device)
    cpu = torch.device("cpu")
    measured: dict[str, dict[str, Any]] = {}  # by setup: the measurement of each try that trained
    host_mib = {r["setup"]: r.get("host_mib") or 0.0 for r in choice.table}

    def attempt(plan: Plan) -> dict[str, Any]:
        on = cpu if plan.placement == "cpu" else device
        name = f"auto-fit {plan.name}"
        if on.type == "cuda":
            # the card's step keeps only an offloaded setup's share in host memory (the search predicted it)
            short = past_free_memory(host_mib.get(plan.name, 0.0), drop=getattr(load, "drop", None))
            too_big = f"its predicted host memory {short}: not run" if short else None
        else:  # the step as the live-bytes count runs it: all of it host memory here
            too_big = past_free(predict(config, plan, batch=batch, seq=int(blocks.shape[1]), n_blocks=len(blocks),
                                        instrumented=True), drop=getattr(load, "drop", None))
        if too_big:
            on_event(rung=plan.name, attempt=name, result="skipped")
            raise torch.OutOfMemoryError(too_big)
        if on.type == "cuda":
            release_held(on)  # what the try before held (its workspaces, its cache): a fresh process has none
            with device_budget(on, budget_mib):  # the card's allocator capped: its own out-of-memory error
                m = measure(plan, load, blocks, batch=batch, steps=TRY_STEPS, device=on, counted=False, lr=lr,
                            sinks=sinks)
        else:  # played: live bytes counted (measure gives the cpu rung, the last resort, no budget at all)
            m = measure(plan, load, blocks, batch=batch, steps=TRY_STEPS, lr=lr, sinks=sinks, budget_mib=budget_mib)
        on_event(rung=plan.name, attempt=name, result=m["status"])  # ok too: a live chart's status line ends on it
        if m["status"] == "oom":
            raise torch.OutOfMemoryError(m["reason"])
        if m["status"] != "ok":
            raise TryFailed(m["status"], f"{plan.name}: {m['status']}: {m['reason']}")
        measured[plan.name] = m
        return m

    # the ladder's bottom rung is the last resort: nothing stays on the device
    order = SetupChoice(choice.plan, choice.batch, choice.budget_bytes, choice.margin, choice.margin_source,
                        choice.table, [*choice.fitting, RUNGS["cpu"]])
    try:
        ran, _, tries = run_with_step_down(order, attempt, log=lambda s: None)
        chosen = ran.name
    except NoSetupFits as e:  # how each try went, then the verdict
        chosen, tries = None, [*e.tries, {"setup": None, "status": "oom", "error": str(e)}]
    except RuntimeError as e:  # a setup that cannot run here after all: the tries before it, then its own
        chosen, tries = None, getattr(e, "tries", None) or [{"setup": None, "status": "error", "error": str(e)[:200]}]
    placement = {p.name: p.placement for p in order.fitting}
    for t in tries:
        if t["setup"] is not None:
            t["device"] = str(cpu if placement.get(t["setup"]) == "cpu" else device)
    if chosen is not None:
        tries[-1].update(_figures(measured[chosen]))
    return chosen, tries


class TryFailed(RuntimeError):
    """A try that ended neither trained nor out of memory (`status`: measure()'s, e.g. skipped or error)."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


def past_free(p, drop: Callable[[], bool] | None = None) -> str | None:
    """Why a CPU step predicted as `p` is not measured here (None: it may be). A CPU step past the
    free memory raises no OutOfMemoryError: the OOM killer takes the study with it. `drop`: as
    `past_free_memory`'s (a kept model given back first)."""
    short = past_free_memory(max(p.peak_bytes, p.first_step_peak_bytes, p.host_bytes) / MiB, drop=drop)
    return f"predicted peak {short}: not measured" if short else None


def _figures(m: dict[str, Any]) -> dict[str, Any]:
    """The try that ran: its peaks in MiB (on a card the allocator's, the reserved one the budget caps)."""
    out = {"measured_peak_mib": m.get("measured_peak_bytes", 0) / MiB, "step_ms": m.get("step_ms")}
    if "cuda_max_reserved_bytes" in m:
        out["measured_reserved_mib"] = m["cuda_max_reserved_bytes"] / MiB
    if "measured_host_bytes" in m:
        out["measured_host_mib"] = m["measured_host_bytes"] / MiB
    return out
