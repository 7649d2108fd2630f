"""Auto-fit that keeps the training the same: the fastest setup predicted to fit a card, searched jointly.

    from workbench.core.memory import cuda_model, plan
    from workbench.studies.ladder.autofit import search
    card = cuda_model.card("RTX 4060 Ti 8GB")                # the budget: what the card leaves after its CUDA context
    choice = search("data/configs/qwen2-0.5b.json", plan.plan_from_flags(precision="bf16-mixed", batch=8),
                    batch=8, seq=512, budget_mib=card.usable_bytes / 2**20, card=card.name)
    choice.plan, choice.micro_batch, choice.why        # what to run, and why this one
    choice.table                                       # every setup tried, in order (predicted or ruled out)

The space: micro-batch (each divisor of the batch, with accumulation making up the rest, so the
effective batch never changes), activation checkpointing, precision (bf16-mixed, bf16-true; and
fp16-mixed on a card before sm_80, where bf16 is emulated), optimizer (8-bit and paged 8-bit
AdamW) and placement (DeepSpeed ZeRO-Offload of the optimizer),
starting from the user's own setup; LoRA only when `allow_lora` (it changes what trains, so a
setup that keeps the trainable set always ranks before one that does not).

Order: by a prior cost of each mechanism on a GPU (`COSTS`, every factor with its reason), cheapest
first; the setups are predicted in that order (fake tensors, the CUDA model) until one fits, so the
first that fits is the fastest by the prior and the search predicts only what it must. A setup is
not predicted where a prediction made already rules it out (`ruled_out`): its weights alone exceed
the card, or its weights and optimizer state alone exceed the budget, as predicted for a setup that
differs from it only in micro-batch and checkpointing (they hold the same tensors); or, looking for
step-downs once one fits, its weights and optimizer state alone need as much as the setup kept last.
A 7B model on a 12 GB card predicted every setup, 12-33 s each here, to find the same weights too big
each time.

Margin: a setup fits when its predicted peak plus a margin is within the budget. The margin is the
prediction's own measured error, not a fixed guess, for the figure that is compared:
- the bytes (allocated peak): data/prediction_error.json, written by the validation against
  published GPU peaks: the worst error for that precision when at least `min_family_rows` rows of
  it were checked, else the worst overall;
- on CUDA the budget caps the allocator's reserved peak, so the margin adds how far the reserved
  prediction fell below a real card's at worst for the setup's placement (on the card, in the
  gpu-check records under data/measured/, re-predicted with this checkout's code where
  `repredicted.json` is beside them, and in the published reserved peaks the validation wrote
  beside the bytes' margins; `card_records.reserved_shortfall`).
Each setup gets its own margin (each library allocates its own way). On a real out-of-memory error `run_with_step_down` tries the next setup that fits, still
at the same effective batch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from tqdm import tqdm

from workbench.core.common import MiB, mib_text
from workbench.core.config import ConfigError
from workbench.core.fallback import out_of_memory, release
from workbench.core.memory import cuda_model
from workbench.core.memory.monitor import bf16_native
from workbench.core.memory.plan import CLI_OPTIMIZERS, OFFLOADS, Plan
from workbench.core.memory.predict import WeightsExceedCard, predict
from workbench.studies.ladder.card_records import CARD_RECORDS, card_reserved_errors, reserved_shortfall
from workbench.studies.ladder.validation import MARGINS_FILE

# Prior cost of a step on a GPU relative to the user's setup (lower is faster); each factor states
# its reason. They order setups; they are not a speed prediction.
COSTS = {
    "precision": {"fp32": 1.0, "bf16": 0.5, "fp16": 0.5, "bf16_true": 0.45, "fp16_true": 0.45},
    # data-sheet dense throughput: A100 TF32 156 vs BF16 312 TFLOP/s; pure 16-bit also halves weight traffic.
    # An assumption for fp32: the workbench does not enable TF32, and torch's default fp32 matmul is plain
    # FP32 (19.5 TFLOP/s on an A100), so the real gap is larger; it only ranks fp32 setups earlier, never later
    "checkpointing": 4 / 3,  # recomputes the forward in backward: forward 2N of 6N FLOPs per token
    "accumulation_step": 0.03,  # per extra micro-batch: launch and optimizer-free overhead (assumption)
    "optimizer": {"adamw": 1.0, "adamw_torch": 1.0, "adamw8bit": 1.02, "paged_adamw8bit": 1.04},
    # the update is a few % of a step; 8-bit adds (de)quantisation, paging adds host transfers (assumption)
    "zero_offload": 1.5,  # the optimizer step on the host over PCIe (assumption; ZeRO-Offload overlaps part of it)
    "zero_offload_params": 3.0,  # that, and every weight copied to the card in forward, recompute and backward
    # (ZeRO-3 prefetches to overlap them; assumption: the slowest placement, tried last)
    "lora": 0.7,  # no weight gradients: backward 2N instead of 4N of 6N FLOPs (ranked after same-training setups)
    # bf16 before sm_80 (T4, V100, RTX 20xx): no bf16 tensor cores, so torch emulates it (is_bf16_supported()
    # counts emulation): ranked as fp32's rate, after fp16 (assumption: at best fp32's speed)
    "bf16_before_sm80": 1.0,
}
PRECISION_FAMILY = {"bf16": "bf16-mixed", "fp16": "fp16-mixed", "bf16_true": "bf16-true", "fp16_true": "fp16-true",
                    "fp32": "fp32"}
OPTIMIZER_FLAG = {name: flag for flag, name in CLI_OPTIMIZERS.items()}  # a setup's name uses --optimizer's names


def prediction_margin(plan: Plan, path=MARGINS_FILE, *, device: str = "cpu", records=CARD_RECORDS) -> tuple[float, str]:
    """(margin as a fraction, where it comes from) for a prediction of `plan` on `device`: the
    bytes' measured error; on CUDA plus the reserved peak's shortfall measured on a card."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing: run `python benchmarks/predict_ladder.py --validate` to derive "
                          "the prediction's margin from published GPU measurements") from None
    family = PRECISION_FAMILY.get(plan.precision, plan.precision)
    by = data.get("by_precision_pct", {})
    rows = data.get("rows_by_precision", {}).get(family, 0)
    if family in by and rows >= data.get("min_family_rows", 1):
        pct, why = by[family], f"worst error of the {rows} {family} rows in the validation ({by[family]:.1f}%)"
    else:
        thin = f"only {rows} {family} row(s) validated" if rows else f"no {family} row was validated"
        pct, why = data["overall_pct"], f"worst error of any validation row ({data['overall_pct']:.1f}%; {thin})"
    if torch.device(device).type != "cuda":
        return pct / 100, why
    # the card records' reserved peaks and the published ones (written beside the margins by the validation)
    short, short_why = reserved_shortfall(plan.placement, card_reserved_errors(records) + data.get("reserved_rows", []))
    return (pct + short) / 100, f"{why} + {short_why}"


def cost(plan: Plan, sm: int = cuda_model.DEFAULT_SM) -> float:
    """The prior cost of `plan` on a card of compute capability `sm` (x 10)."""
    c = COSTS["bf16_before_sm80"] if bf16_emulated_plan(plan, sm) else COSTS["precision"][plan.precision]
    c *= COSTS["optimizer"][plan.optimizer]
    c *= COSTS["checkpointing"] if plan.grad_checkpointing else 1.0
    c *= 1 + COSTS["accumulation_step"] * (plan.accum - 1)
    c *= COSTS.get(plan.placement, 1.0) if plan.placement in ("zero_offload", "zero_offload_params") else 1.0
    c *= COSTS["lora"] if plan.trainable in ("lora", "qlora") else 1.0
    return c


def bf16_emulated_plan(plan: Plan, sm: int | None) -> bool:
    """Whether `plan` trains in bf16 on a card (compute capability `sm` x 10) that emulates it."""
    return sm is not None and not bf16_native(sm) and plan.precision.startswith("bf16")


def candidates(setup: Plan, batch: int, *, allow_lora: bool = False, sm: int | None = None) -> list[Plan]:
    """The setups the search may choose: `setup` changed in any of the searched dimensions; every
    one has the same effective batch (micro-batch x accumulation = `batch`). `sm`: the compute
    capability (x 10) of the card searched for; before sm_80, where bf16 is emulated, fp16 autocast
    with a GradScaler (fp16-mixed) is offered beside bf16 for an fp32 or bf16-mixed setup."""
    fp16 = ("fp16",) if sm is not None and not bf16_native(sm) and setup.precision in ("fp32", "bf16") else ()
    # pure bf16 is offered except to QLoRA: peft's prepare_model_for_kbit_training upcasts every weight
    # but the 4-bit ones to fp32, so "bf16-true" there trains in fp32 without autocast (slower, not faster)
    pure = () if setup.trainable == "qlora" else ("bf16_true",)
    precisions = dict.fromkeys([setup.precision, *(p for p in ("bf16", *pure) if setup.precision == "fp32"),
                                *(pure if setup.precision == "bf16" else ()), *fp16])
    optimizers = dict.fromkeys([setup.optimizer, "adamw8bit", "paged_adamw8bit"])
    trainables = dict.fromkeys([setup.trainable, *(("lora",) if allow_lora and setup.trainable == "full" else ())])
    placements = dict.fromkeys([setup.placement, "zero_offload", "zero_offload_params"] if setup.placement == "device"
                               else [setup.placement])
    out, seen = [], set()
    for micro in [m for m in range(batch, 0, -1) if batch % m == 0]:
        for precision in precisions:
            for ckpt in dict.fromkeys([setup.grad_checkpointing, True]):
                for optimizer in optimizers:
                    for trainable in trainables:
                        for placement in placements:
                            if placement.startswith("zero_") and (optimizer != setup.optimizer or trainable == "qlora"):
                                # the host runs DeepSpeed's own Adam: no 8-bit state to choose; 4-bit weights
                                # are not offloaded (rungs.measure_offloaded does not run QLoRA so)
                                continue
                            # DeepSpeed keeps an fp32 master on the host whatever the weights: a pure-half
                            # setup trains there as its mixed twin does (rungs.zero_config), offered once
                            prec = precision.removesuffix("_true") if placement.startswith("zero_") else precision
                            flag = OPTIMIZER_FLAG.get(optimizer, optimizer)
                            name = (f"{PRECISION_FAMILY[prec]}, {flag}, {trainable}"
                                    + (", checkpointing" if ckpt else "") + f", micro-batch {micro}"
                                    + (f" x {batch // micro}" if micro != batch else "")
                                    + {"zero_offload": ", ZeRO-Offload", "zero_offload_params": ", ZeRO-3 offload"}.get(placement, ""))
                            if name in seen:
                                continue
                            seen.add(name)
                            out.append(dataclasses.replace(
                                setup, name=name, help=name, precision=prec, grad_checkpointing=ckpt,
                                accum=batch // micro, optimizer=optimizer, trainable=trainable, placement=placement))
    return out


def _weights_key(plan: Plan) -> tuple | None:
    """What the weights on the card depend on (None: they depend on more, ZeRO-3 gathers them as it goes)."""
    return (plan.precision, plan.trainable, plan.placement) if plan.placement in ("device", "zero_offload") else None


def _floor_key(plan: Plan) -> tuple | None:
    """What the weights and optimizer state on the card depend on (None: not only on this; the
    offload placements keep the state on the host and flatten or gather the weights as they go)."""
    return (plan.precision, plan.optimizer, plan.trainable) if plan.placement == "device" else None


def floor_bytes(p) -> int:
    """A lower bound of the fit figure of any setup that differs from `p`'s only in micro-batch and
    checkpointing: its weights and optimizer state (less paged state, outside the fit figure but
    under WSL2, where leaving it out only weakens the bound), live all through a steady step whatever
    the activations, in live bytes (the fit figure, the reserved peak on a card or the live peak on
    the CPU, holds at least them). Not the allocator's figure for them: a block the allocator
    does not split counts whole, so that depends on what the setup allocated before (Qwen2-0.5B,
    bf16-mixed at 4 x 512: 27 MiB more AdamW state allocated without checkpointing than with it)."""
    return p.breakdown.get("weights", 0) + (0 if p.pageable_bytes else p.breakdown.get("optimizer_state", 0))


NOT_A_STEP_DOWN = "not a step down"  # a row ruled out so may fit: its `fits` is None (not known)


def ruled_out(plan: Plan, margin: float, budget: int, too_big: dict, floors: dict,
              kept: tuple[float, str] = (math.inf, "")) -> tuple[float | None, str, str]:
    """(the lower bound of `plan`'s need in MiB or None, why it is not predicted, the setup whose
    prediction showed it) where a prediction made already shows it cannot fit, or cannot be a step
    down from the setup kept last (`kept`: its need in bytes and its name; a step down needs less);
    (None, "", "") where it must be predicted. `too_big`: weights key -> the setup whose weights alone
    exceeded the card; `floors`: floor key -> (floor bytes, setup)."""
    if _weights_key(plan) in too_big:
        return None, "its weights alone exceed the card", too_big[_weights_key(plan)]
    floor, src = floors.get(_floor_key(plan), (0, ""))  # neither dict has a None key
    if floor * (1 + margin) > budget:
        return floor / MiB, "its weights and optimizer state alone exceed the budget with the margin", src
    if floor and floor >= kept[0]:
        why = f"its weights and optimizer state alone need as much as {kept[1]} (kept): {NOT_A_STEP_DOWN}"
        return floor / MiB, why, src
    return None, "", ""


@dataclass
class SetupChoice:
    plan: Plan | None  # None: nothing is predicted to fit
    batch: int
    budget_bytes: int
    margin: float
    margin_source: str
    table: list[dict[str, Any]] = field(default_factory=list)  # every setup tried, in order (predicted or ruled out)
    fitting: list[Plan] = field(default_factory=list)  # the step-down order: fastest first, each needing less
    given: Plan | None = None  # the setup searched from
    given_name: str = ""  # the search's name of the setup as given (its row, where predicted)

    def settings(self, p: Plan) -> dict[str, str]:
        return {"precision": PRECISION_FAMILY.get(p.precision, p.precision),
                "optimizer": OPTIMIZER_FLAG.get(p.optimizer, p.optimizer), "trainable": p.trainable,
                "checkpointing": "on" if p.grad_checkpointing else "off", "micro-batch": str(self.batch // p.accum),
                "placement": p.placement}

    @property
    def changes(self) -> list[str]:
        """What the chosen setup changes of the one searched from ("precision fp32 -> bf16-true", ...)."""
        if self.plan is None or self.given is None:
            return []
        a, b = self.settings(self.given), self.settings(self.plan)
        return [f"{k} {a[k]} -> {b[k]}" for k in a if a[k] != b[k]]

    def _given_text(self) -> str:  # the chosen setup's changes, and what was found of the setup as given
        if not self.changes:
            return "; it is your setup as given"
        row = next((r for r in self.table if r["need_mib"] is not None and r["setup"] == self.given_name), None)
        found = ("your setup as given was not predicted: one expected faster fits first" if row is None else
                 f"your setup as given {'fits too' if row['fits'] else 'does not fit'}, "
                 f"{mib_text(row['with_margin_mib'])} MiB with its margin")
        return f"; it changes {', '.join(self.changes)} ({found})"

    @property
    def micro_batch(self) -> int | None:
        return self.batch // self.plan.accum if self.plan else None

    @property
    def why(self) -> str:
        if self.plan is None:
            skipped = sum(1 for r in self.table if r["not_predicted"])
            return (f"nothing fits {mib_text(self.budget_bytes / MiB)} MiB with the prediction's margin "
                    f"({self.margin:.1%} for the setup as given: {self.margin_source}; "
                    f"{len(self.table) - skipped} setups predicted"
                    + (f", {skipped} not predicted, ruled out by those: their weights alone exceed the card, or "
                       "their weights and optimizer state the budget" if skipped else "") + ")")
        at = next(i for i, r in enumerate(self.table) if r["setup"] == self.plan.name)
        row, faster = self.table[at], [r["setup"] for r in self.table[:at] if not r["fits"]]  # before it
        paged = (f" with its {mib_text(row['paged_mib'])} MiB of paged optimizer state paged out to the host"
                 if row["fits_only_paged_out"] else "")
        return (f"{self.plan.name}: predicted {mib_text(row['need_mib'])} MiB + {self.margin:.1%} margin "
                f"({self.margin_source}) = {mib_text(row['with_margin_mib'])} MiB <= "
                f"{mib_text(self.budget_bytes / MiB)} MiB{paged}; "
                f"{len(faster)} setup(s) expected faster did not fit" + (f" (first: {faster[0]})" if faster else "")
                + self._given_text())


def search(model: Any, setup: Plan, *, batch: int, seq: int, budget_mib: float, device: str = "cuda",
           card: str | float | None = None, allow_lora: bool = False, margin: float | None = None,
           margin_source: str = "given", keep: int = 3, runnable: Callable[[Plan], bool] | None = None,
           progress: bool = False, load: str = "dtype") -> SetupChoice:
    """The fastest setup (by the prior cost) predicted to fit `budget_mib` with its margin
    (`prediction_margin` for each setup on `device`, or `margin` for all when given).

    Predicts candidates cheapest first until one fits, then until `keep` - 1 more fit that each need
    less than the one kept before (the step-down order for a real out-of-memory error: a setup
    needing as much as one that ran out would run out too; the others are in `table`). `runnable`:
    only candidates it accepts are searched (a study running on this machine leaves out what cannot
    run here). A candidate a prediction made already rules out (it cannot fit; or, once one fits, it
    cannot need less than the setup kept last) is not predicted (`ruled_out`; its row says why,
    `not_predicted`): the choice and the step-down order are those of predicting every candidate.
    On the CPU (`device` "cpu") no setup offloads. `progress`: a bar on standard error, one tick per
    setup (each predicted one a simulated step: seconds to a minute). `load` (CUDA): how the weights reach the card (`predict`'s: "dtype", as
    `model.to("cuda")` moves a model; "host", as the workbench's own tries load it)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        raise ConfigError(f"batch must be a positive integer, got {batch!r}")
    if not budget_mib > 0:
        raise ConfigError(f"the budget must be a positive number of MiB, got {budget_mib!r}")
    budget = int(budget_mib * MiB)
    fixed = None if margin is None else (margin, margin_source)
    margin_of = (lambda plan: fixed) if fixed else (lambda plan: prediction_margin(plan, device=device))
    the_card = cuda_model.card(card)
    sm = the_card.sm if the_card is not None else cuda_model.DEFAULT_SM
    on_cuda = torch.device(device).type == "cuda"  # on the CPU the host is the device: nothing to offload to
    ranked = sorted((p for p in candidates(setup, batch, allow_lora=allow_lora, sm=sm)
                     if (on_cuda or p.placement not in OFFLOADS) and (runnable is None or runnable(p))),
                    key=lambda p: (p.trainable != setup.trainable, cost(p, sm)))
    choice = SetupChoice(None, batch, budget, *margin_of(setup), given=setup)
    choice.given_name = next((p.name for p in ranked if choice.settings(p) == choice.settings(setup)), "")
    last_need = math.inf
    too_big: dict[tuple, str] = {}  # what earlier predictions showed (ruled_out)
    floors: dict[tuple, tuple[int, str]] = {}
    with tqdm(total=len(ranked), desc="auto-fit", unit="setup", disable=not progress, file=sys.stderr) as bar:
        least = math.inf  # while nothing fits: the least need with its margin so far (a user may stop there)
        for plan in ranked:
            bar.set_postfix_str(plan.name if choice.plan or least == math.inf else
                                f"{plan.name}; nothing fits yet, the least need {mib_text(least / MiB)} MiB with "
                                f"its margin, over the budget's {mib_text(budget_mib)} MiB")
            t0 = time.perf_counter()
            m, src = margin_of(plan)
            row = {"setup": plan.name, "prior_cost": round(cost(plan, sm), 3), "margin": m, "fits": False,
                   "kept": False, "changes_what_trains": plan.trainable != setup.trainable, "need_mib": None,
                   "with_margin_mib": None, "paged_mib": 0.0, "fits_only_paged_out": False}
            floor_mib, why_not, by = ruled_out(plan, m, budget, too_big, floors,
                                               (last_need, choice.fitting[-1].name if choice.fitting else ""))
            if why_not:
                choice.table.append({**row, "method": "not predicted", "floor_mib": floor_mib, "not_predicted": why_not,
                                     "ruled_out_by": by, "predict_seconds": 0.0,
                                     "fits": None if why_not.endswith(NOT_A_STEP_DOWN) else False})
                bar.update()
                continue
            try:
                p = predict(model, plan, batch=batch, seq=seq, device=device, card=the_card,  # "here" read once
                            load=load)
            except WeightsExceedCard:  # a setup that does not fit, not the end of the search
                p = None
                if _weights_key(plan) is not None:
                    too_big.setdefault(_weights_key(plan), plan.name)
            else:
                if _floor_key(plan) is not None:
                    floors.setdefault(_floor_key(plan), (floor_bytes(p), plan.name))
            need = math.inf if p is None else p.fit_bytes if torch.device(device).type == "cuda" else p.peak_bytes
            fits = need * (1 + m) <= budget
            least = min(least, need * (1 + m))
            # a paged optimizer's state is left out of the need (it pages out under pressure): say where
            # the setup fits only because it does, which costs host transfers in every step that touches it
            paged = 0 if p is None or not p.pages_out else p.pageable_bytes
            choice.table.append({**row, "method": "weights > card" if p is None else p.method,
                                 **({} if p is None else {"need_mib": need / MiB,
                                                          "with_margin_mib": need * (1 + m) / MiB,
                                                          "host_mib": p.host_bytes / MiB}),
                                 "fits": fits, "paged_mib": paged / MiB,
                                 "fits_only_paged_out": fits and paged > 0 and (need + paged) * (1 + m) > budget,
                                 "floor_mib": None if p is None else floor_bytes(p) / MiB, "not_predicted": "",
                                 "ruled_out_by": "",
                                 "predict_seconds": round(time.perf_counter() - t0, 1)})
            bar.update()
            if fits and need < last_need:  # a step down from the setup kept before
                choice.table[-1]["kept"], last_need = True, need
                choice.fitting.append(plan)
                if choice.plan is None:
                    choice.plan, choice.margin, choice.margin_source = plan, m, src
                if len(choice.fitting) >= keep:
                    # the bar ends here, not at its total: the setups left are slower (a bar left
                    # at 19/80 with half an hour to go read as a search cut short)
                    bar.total = bar.n
                    bar.set_postfix_str(f"stopped: {keep} setups fit, each needing less than the one before; the "
                                        f"{len(ranked) - len(choice.table)} left are slower by the prior")
                    break
    return choice


class NoSetupFits(torch.OutOfMemoryError):
    """Every setup auto-fit tried ran out of memory; `tries` says how each did."""

    def __init__(self, message: str, tries: list[dict[str, Any]]):
        super().__init__(message)
        self.tries = tries


def run_with_step_down(choice: SetupChoice, attempt: Callable[[Plan], Any], *,
                       log: Callable[[str], None] = print) -> tuple[Plan, Any, list[dict[str, Any]]]:
    """Run `attempt(plan)` with the chosen setup; on a real out-of-memory error (torch's, or CUDA's
    own: `fallback.out_of_memory`) step down to the next setup predicted to fit (the same effective
    batch); any other error is raised, carrying the tries so far and its own (`e.tries`; its status is
    the error's `status`, else "error"). Returns (plan that ran, its result, tries); raises NoSetupFits
    (an OutOfMemoryError, with the tries) when none ran."""
    tries = []
    for plan in choice.fitting:
        try:
            result = attempt(plan)
        except Exception as e:
            if not out_of_memory(e):
                e.tries = [*tries, {"setup": plan.name, "status": getattr(e, "status", "error"),
                                    "error": str(e)[:200]}]
                raise
            tries.append({"setup": plan.name, "status": "oom", "error": str(e)[:200]})
            log(f"auto-fit: {plan.name} ran out of memory; stepping down (same effective batch {choice.batch})")
        else:
            tries.append({"setup": plan.name, "status": "ok", "error": ""})
            return plan, result, tries
        release("cuda")  # what the failed setup left cached, outside the `except` (its frames held the tensors)
    raise NoSetupFits(f"auto-fit: no setup fits {mib_text(choice.budget_bytes / MiB)} MiB "
                      f"(tried: {', '.join(t['setup'] for t in tries) or 'none predicted to fit'})", tries)
