"""Will this fine-tune fit, without a GPU and without the weights? Predicting the peak of a step.

    from workbench.core.memory.predict import predict
    p = predict("data/configs/qwen2-0.5b.json", "bf16_ckpt", batch=1, seq=512)
    p.peak_bytes, p.breakdown, p.where, p.method        # method: predicted | estimated

The prediction runs the real training loop (`workbench.core.training.train`, the same code a measured run uses) over
FakeTensorMode tensors: every op computes its output's shape, dtype and storage but no values, and
`MemoryAccounting` counts the live bytes per category and phase exactly as it does for real tensors. Two optimizer
steps are simulated (by default) and the figure reported is the peak of the last one, when the optimizer state
already exists (the steady state). With gradient accumulation a step for the CPU (no allocation timeline) simulates
its first `ACCUM_SIMULATED` micro-batches, not all: from the second on, each repeats the same live bytes (the
gradients exist, the new ones are summed into them), so the rest would add time, not figures (checked equal; one
alone is not). A CUDA step simulates every micro-batch: the allocator model replays its timeline, and under a cap a
longer run of repeated micro-batches can need more (Llama 2 7B, bf16-mixed LoRA with checkpointing at 1 x 8 x 1024:
36 MiB more needed than from three of the eight).

Workarounds, all measured here:
- Under fake tensors transformers thinks it is being traced and builds an explicit seq x seq attention mask that a
  real run skips; `find_packed_sequence_indices` answers "not packed" (None) for fake inputs, as it does for real
  unpacked ones.
- `Module.to()` and peft's `get_peft_model` fail on fake parameters: the model is built on the meta device, peft is
  applied there, then each parameter becomes a fake CPU tensor.
- bitsandbytes' Linear4bit cannot be built under fake mode: QLoRA layers are quantized for real (from zeros; the
  bytes are what matter) and fake activations run through them. 8-bit optimizers read values in their constructor:
  they are built outside fake mode, stepped inside.
- `.item()` / `float(loss)` have no value to return: the accounting answers 1.0 (an optimizer step count, so
  single-tensor AdamW's bias correction is defined).

The offload rungs accelerate `device_map` and DeepSpeed ZeRO-2 with the optimizer offloaded are simulated with each
tensor at its place, the card or host memory, as the library places and copies it (workbench.core.memory.offload): the
device peak is the card's, `host_bytes` the host's. So is ZeRO-3 with the parameters offloaded as well: DeepSpeed's
own parameter coordinator decides which weights are on the card at each module (workbench.core.memory.zero3). fp16
autocast for a CPU target cannot be simulated here: its figures are *estimated* from the bf16 simulation, and the
result says so (`method="estimated"` and a `note`).

`device="cpu"` (the default) predicts a CPU step, exactly. `device="cuda"` makes the simulated step take CUDA's
choices (attention kernel, dropout masks, autocast lists, optimizer; simulated) and replays its allocations through
the caching allocator (modelled): see workbench/core/memory/cuda_model.py.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from workbench.core.common import MiB, in_wsl, mib_text
from workbench.core.config import ConfigError
from workbench.core.memory import allocator, card_load, cuda_model
from workbench.core.memory.accounting import CATEGORIES, MemoryAccounting, MemoryReport
from workbench.core.memory.fake import check_step, fake_step, unpacked_for_fake_inputs
from workbench.core.memory.meta import build_meta_model, model_config, model_label
from workbench.core.memory.monitor import bf16_emulated_on
from workbench.core.memory.offload import SIMULATED_PLACEMENTS, simulate_placed
from workbench.core.memory.plan import (PAGED_FROM, Plan, apply_trainable, host_step_counters, make_plan_optimizer,
                                        paged_state, rung)
from workbench.core.memory.zero3 import STREAM_NAMES
from workbench.core.models import check_seq_len
from workbench.core.training import train

CUDA_STEPS = 3  # steps simulated for a CUDA target: the allocator model repeats the third relative to the second
ACCUM_SIMULATED: int | None = 3  # micro-batches simulated per CPU step with accumulation (docstring)
class WeightsExceedCard(ConfigError):
    """The card is smaller than the setup's weights alone (auto-fit: a setup that does not fit)."""


@dataclass
class Prediction:
    """The predicted device peak of a steady-state training step for one rung."""

    rung: str
    model: str
    batch: int
    seq: int
    peak_bytes: int  # steady-state peak on the device
    breakdown: dict[str, int]  # bytes per category at that peak
    where: str  # "step 2, backward (op)"
    method: str  # "predicted" (simulated over fake tensors) or "estimated" (see note)
    note: str = ""
    seconds: float = 0.0  # predict()'s own time, plus the least cap's replay once read (needed_reserved_bytes)
    first_step_peak_bytes: int = 0
    host_bytes: int = 0  # bytes the rung keeps in host memory instead (offload, CPU only)
    host_breakdown: dict[str, int] = field(default_factory=dict)  # offload rungs: host bytes per category at its peak
    placement: str = ""  # offload rungs: what lives where (the simulation's summary)
    pageable_bytes: int = 0  # device bytes that can page out to the host under pressure
    pages_out: bool = True  # not under WSL2, whose driver (Windows') does not oversubscribe managed memory
    phases: list[dict[str, Any]] = field(default_factory=list)
    device: str = "cpu"
    # CUDA only (device="cuda"): the allocator model's figures (modelled) and the card
    allocated_peak_bytes: int = 0  # max_memory_allocated: rounded blocks + cuBLAS workspaces
    reserved_peak_bytes: int = 0  # max_memory_reserved: the allocator's segments (on a card with room)
    needed: Callable[[], int] | None = field(default=None, repr=False, compare=False)  # needed_reserved_bytes' replay
    context_bytes: int = 0  # CUDA context outside the allocator (a per-card constant)
    context_source: str = ""  # where context_bytes comes from (Card.context_source)
    allocated_breakdown: dict[str, int] = field(default_factory=dict)  # rounded bytes per category at that peak
    reserved_by_stream_bytes: dict[str, int] = field(default_factory=dict)  # a library's side streams: each one's cache
    segment_sizes: dict[str, int] = field(default_factory=dict)  # the allocator's segments at the end: MiB -> count
    replayed_steps: int = 0  # training steps the allocator replayed (the last simulated one repeated)
    steady: bool | None = None  # whether the allocator's state repeated within them (None: a set number asked)
    card: str = ""
    card_bytes: int = 0
    kernels: dict[str, int] = field(default_factory=dict)  # attention kernels the step used

    @functools.cached_property
    def needed_reserved_bytes(self) -> int:  # the least reserved cap it runs under, modelled (measured low on a card)
        t0, value, self.needed = time.perf_counter(), (self.needed() if self.needed else 0), None  # timeline let go
        self.seconds += time.perf_counter() - t0  # the prediction's seconds count the replay, once made
        return value

    @property
    def nvidia_smi_bytes(self) -> int:
        """What nvidia-smi would show in use for the process (NVML's v2 used: the driver's reserve left out; for
        the whole card with `--card here`, whose context is all in use there now): reserved + the CUDA context + the paged
        optimizer state resident on the card: all of it while nothing presses it out; on a card, at most
        the room the rest leaves (the driver moves its other pages to the host; under WSL2 it cannot)."""
        used, paged = self.reserved_peak_bytes + self.context_bytes, self.pageable_bytes
        room = self.card_bytes - used if self.card_bytes and self.pages_out else paged
        return used + max(0, min(paged, room)) if self.device == "cuda" else 0

    @property
    def fit_bytes(self) -> int:
        """What must fit in the device budget (paged optimizer state can be evicted). On CUDA the allocator's
        reserved peak, which a budget caps (a card's memory or set_per_process_memory_fraction; paged state is
        managed memory, outside it); on the CPU the live bytes. Not `needed_reserved_bytes`: on the H200
        (2026-11-26) the least cap a step trained under was 5.7% and 23% above it (docs/card-records.md)."""
        paged = 0 if self.pages_out else self.pageable_bytes  # what of the paged state must fit anyway
        if self.device == "cuda" and self.reserved_peak_bytes:
            # paged state is outside the allocator's figures already
            return self.reserved_peak_bytes + paged
        return self.peak_bytes - self.pageable_bytes + paged

    @property
    def fits(self) -> bool | None:
        """Whether the card holds it: reserved + the CUDA context within the card's memory."""
        return None if not self.card_bytes else self.headroom_bytes >= 0

    @property
    def headroom_bytes(self) -> int | None:
        return None if not self.card_bytes else self.card_bytes - self.fit_bytes - self.context_bytes

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / MiB

    def row(self) -> dict[str, Any]:
        return {
            "rung": self.rung, "model": self.model, "batch": self.batch, "seq": self.seq, "method": self.method,
            "predicted_peak_bytes": self.peak_bytes, "predicted_peak_mib": self.peak_mib, "fit_bytes": self.fit_bytes,
            "first_step_peak_bytes": self.first_step_peak_bytes, "host_bytes": self.host_bytes, "where": self.where,
            "note": self.note, **{f"{c}_bytes": self.breakdown.get(c, 0) for c in CATEGORIES},
            **{f"host_{c}_bytes": self.host_breakdown.get(c, 0) for c in CATEGORIES},
            "device": self.device, "allocated_peak_bytes": self.allocated_peak_bytes,
            "reserved_peak_bytes": self.reserved_peak_bytes, "needed_reserved_bytes": self.needed_reserved_bytes,
            "predict_seconds": self.seconds,  # read after needed_reserved_bytes: its replay counted
            "context_bytes": self.context_bytes, "context_source": self.context_source,
            "nvidia_smi_bytes": self.nvidia_smi_bytes, "card": self.card, "card_bytes": self.card_bytes,
            "fits": self.fits, "headroom_bytes": self.headroom_bytes, "reserved_by_stream_bytes": self.reserved_by_stream_bytes,
            "replayed_steps": self.replayed_steps, "steady": self.steady, "segment_sizes": self.segment_sizes,
            "attention_kernels": self.kernels,
        }


# ------------------------------------------------------------------------------------------------
# simulation

def simulate(config, plan: Plan, *, batch: int, seq: int, steps: int = 2, n_blocks: int | None = None,
             target: str = "cpu", sm: int | None = None, timeline: bool = False, instrumented: bool = False) -> MemoryReport:
    """Run `steps` real training steps of `plan` over fake tensors and account their bytes.

    `n_blocks`: how many blocks the training set holds (the loop keeps a shuffled index of them, 8 bytes each);
    default: just enough for the simulated steps. `target`: the device the step is for: "cpu" (exact), or "cuda"
    (CUDA's kernel, dropout, autocast and optimizer choices on a card of compute capability `sm`, and the allocation
    timeline for the allocator model). `timeline`: record the allocation timeline for a CPU target too (for a memory
    snapshot). `instrumented`: the step as this workbench's own live-bytes count runs it (a dispatch mode: autograd
    sums every multi-use tensor's gradients out of place), to compare with that count; default: the plain step (the
    engine's in-place sums, workbench.core.memory.accounting).
    """
    check_step(config, seq, steps)
    device = torch.device("cpu")
    step = fake_step(apply_trainable(build_meta_model(config), plan), n_blocks=n_blocks or batch * steps, seq=seq,
                     target=target, sm=sm, under_a_mode=instrumented)
    model, settings = step.model, plan.settings(batch, steps)
    optimizer = make_plan_optimizer(model, plan, settings, device, target=target)  # outside fake mode (bnb reads values)
    with (unpacked_for_fake_inputs(), step.fake_mode,
          MemoryAccounting(device, stub_scalars=True, timeline=step.cuda or timeline,
                           plain_engine=not instrumented, cpu_kernels=not step.cuda) as acc):
        acc.watch(model)
        acc.alias(step.twins)
        # a pure-half plan casts the weights to 16 bits, QLoRA quantizes them (apply_trainable): a loader that
        # converts them on the card, or quantizes them onto it, replays it (card_load); LoRA's adapters come after
        casts = card_load.loaded_on_card(model, plan.half_dtype if plan.pure_half else None, acc.serials_of)
        with step.choices as mode:
            train(model, step.blocks, settings, device=device, optimizer=optimizer,
                  run_micro_batches=None if step.cuda or timeline else ACCUM_SIMULATED)
    report = acc.report()
    report.timeline_casts = tuple(casts)
    report.kernels = dict(mode.kernels) if step.cuda else {}
    if step.cuda:  # on a card these are outside its allocator: foreach AdamW's step counters, a paged optimizer's state
        report.host_serials = frozenset(acc.serials_of(host_step_counters(optimizer)))
        if plan.optimizer == "paged_adamw8bit" and (paged := paged_state(optimizer)):
            report.paged_serials, report.paged_bytes = frozenset(acc.serials_of(paged)), sum(t.nbytes for t in paged)
    return report


def _estimate_fp16(config, plan: Plan, *, batch: int, seq: int, steps: int, instrumented: bool = False) -> MemoryReport:
    """fp16 autocast for a CPU target cannot be simulated (the CPU's autocast has no fp16 with a
    GradScaler): the bf16 simulation stands in, with the same 2-byte activations."""
    if plan.placement != "device":
        raise ValueError(f"{plan.placement} is simulated, not estimated (workbench.core.memory.offload)")
    return simulate(config, plan.compose(plan.name, plan.help, precision="bf16"), batch=batch, seq=seq, steps=steps,
                    instrumented=instrumented)


def _placement_text(plan: Plan, summary: dict[str, Any]) -> str:
    if plan.placement == "device_map":
        return (f"accelerate infer_auto_device_map put {summary['modules_on_device']} of "
                f"{summary['modules_on_device'] + summary['modules_on_host']} modules on the card, the rest train on the host")
    if plan.placement == "zero_offload_params":
        return (f"DeepSpeed ZeRO-3: the {summary['offloaded_parameters']} weights in host memory, each gathered to the card "
                f"as DeepSpeed's parameter coordinator fetches and releases it ({summary['persistent_parameters']} small ones "
                f"kept after the first step); a {summary['reduce_bucket_elements']:,}-element reduce bucket on the card; "
                f"fp32 master, gradients and AdamW state of {summary['trained_parameters']:,} parameters on the host")
    dt = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(plan.half_dtype, "fp32")
    return (f"DeepSpeed ZeRO-2: {dt} weights and a {summary['reduce_bucket_elements']:,}-element reduce bucket on the "
            f"card; fp32 master, gradients and AdamW state of {summary['offloaded_parameters']:,} parameters on the host; "
            f"weights flattened {'on the card (their old blocks stay cached)' if summary['flattened_on'] == 'device' else 'on the host (no room on the card)'}")


def predict(model: Any, rung_name: str | Plan = "fp32", *, batch: int = 1, seq: int = 512, steps: int | None = None,
            n_blocks: int | None = None, spec=None, device: str = "cpu", card=None,
            instrumented: bool = False, replay_steps: int | None = None, workspaces: str = "fresh",
            load: str = "dtype", after: str | Plan | None = None,
            after_instrumented: bool | None = None, zero3_from: str = "host") -> Prediction:
    """Predict the steady-state device peak of `rung_name` for `model` at `batch` x `seq`.

    `model`: a hub id, a model directory or config.json, a PretrainedConfig or an nn.Module (its config; the weights
    are never read). `device`: "cpu" (the default: a CPU step; byte-exact against the live-bytes count when
    `instrumented`) or "cuda" (CUDA's choices simulated, its allocator and context modelled). `card`: a preset name
    or GiB (workbench.core.memory.cuda_model.CARDS) to say whether it fits. `instrumented`: predict the step as the
    workbench's own live-bytes count runs it (to compare with that count, see `simulate`); default: the plain step.
    `steps`: training steps simulated (default 2 on the CPU, where the second is the steady state; 3 for CUDA, whose
    allocator model repeats the third relative to the second). `replay_steps` (CUDA): how many steps the allocator
    replays, for comparing with a run of that many; default: until its cache is steady (the reserved peak of a long
    run). `workspaces` (CUDA): "fresh" (the default: a process whose first matmuls make the cuBLAS workspaces inside
    the step, as a training script's does; cuda_model.workspaces_in) or "held" (a process that ran this step before,
    a notebook kernel that trained already: cuda_model.after_a_run). `load` (CUDA): how the weights reach the card
    (card_load.LOADS): "dtype" (the default: in their dtype, as `model.to("cuda")` moves a model), "host" (as
    this workbench's runs load them: converted on the host, QLoRA's quantized onto the card layer by layer) or
    "card" (as its runs did until 2026-11-26: in fp32, converted there). `after` (with "held"): the setup whose run
    made the workspaces (its first step replayed in place of this one's: a process that trained it first, as
    gpu-check's ladder ran rungs after the first; `after_instrumented`: whether it ran under the live-bytes count,
    default as this one); default: this setup. `zero3_from` (ZeRO-3): where the model is partitioned from: "host"
    (the default: weight by weight, as this workbench runs it) or "card" (the engine moved it there whole first, as
    the workbench ran it for the card records of 2026-11-22 and 2026-11-26). Raises ConfigError for an unknown rung,
    a non-positive shape or a card smaller than the weights alone, ModelNotFoundError for a config that is not one.
    """
    plan = rung(rung_name)
    for name, v in (("batch", batch), ("seq", seq)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r}; choose cpu or cuda")
    if workspaces not in cuda_model.WORKSPACES:
        raise ConfigError(f"unknown workspaces {workspaces!r}; choose {' or '.join(cuda_model.WORKSPACES)}")
    if load not in card_load.LOADS:
        raise ConfigError(f"unknown load {load!r}; choose {', '.join(card_load.LOADS)}")
    if after is not None and workspaces != "held":
        raise ConfigError("after names the setup that ran first in the process; use it with workspaces='held'")
    if after is not None and rung(after).placement != "device":
        raise ConfigError(f"after={rung(after).name} trains {rung(after).placement}: only a setup trained on the card "
                          "is replayed before this one")
    the_card = cuda_model.card(card)
    if the_card is not None and device != "cuda":
        raise ConfigError("--card describes a CUDA card; use it with --device cuda")
    sm = the_card.sm if the_card else cuda_model.DEFAULT_SM
    steps = steps or (CUDA_STEPS if device == "cuda" else 2)
    config = model_config(model, spec)
    check_seq_len(config, seq, model_label(config))
    t0 = time.perf_counter()
    host = 0
    pageable = 0
    simulated_fp16 = plan.precision == "fp16" and device == "cuda"
    host_breakdown: dict[str, int] = {}
    placement = ""
    if plan.placement in SIMULATED_PLACEMENTS:
        # fp16 autocast (device_map) cannot run on a CPU target: bf16's 2-byte activations stand in
        as_bf16 = plan.placement == "device_map" and plan.precision == "fp16" and not simulated_fp16
        sim = plan.compose(plan.name, plan.help, precision="bf16") if as_bf16 else plan
        placed = simulate_placed(config, sim, batch=batch, seq=seq, steps=steps, n_blocks=n_blocks, target=device, sm=sm,
                                 instrumented=instrumented, zero3_from=zero3_from,
                                 card_bytes=the_card.usable_bytes if the_card else None)
        report = placed.device
        report.kernels = placed.kernels
        method = "estimated" if as_bf16 else "predicted"
        peak, breakdown, where = report.steady_peak_bytes, report.breakdown(), report.where()
        host, host_breakdown = placed.host.steady_peak_bytes, placed.host.breakdown()
        placement = _placement_text(plan, placed.summary)
        note = (f"simulated placement: {placement}; host memory {mib_text(host / MiB)} MiB at its own peak"
                + ("; estimated: fp16 autocast needs CUDA, bf16 simulated instead" if as_bf16 else ""))
    elif plan.precision == "fp16" and not simulated_fp16:
        report = _estimate_fp16(config, plan, batch=batch, seq=seq, steps=steps, instrumented=instrumented)
        method = "estimated"
        note = ("estimated: the bf16 simulation (same 2-byte activations); fp16 autocast needs CUDA, which a "
                "CPU-only torch cannot simulate; the GradScaler adds a few bytes")
        peak, breakdown, where = report.steady_peak_bytes, report.breakdown(), report.where()
    else:
        # the cpu rung trains on the CPU whatever the card: the CPU's kernels, dropout masks and autocast rules
        report = simulate(config, plan, batch=batch, seq=seq, steps=steps, n_blocks=n_blocks,
                          target="cpu" if plan.placement == "cpu" else device, sm=sm, instrumented=instrumented)
        method, note = "predicted", ""
        peak, breakdown, where = report.steady_peak_bytes, report.breakdown(), report.where()
        if plan.placement == "cpu":
            # Everything lives in host memory: the simulated peak is the host's; the device holds nothing.
            host, peak, host_breakdown, breakdown = peak, 0, breakdown, dict.fromkeys(CATEGORIES, 0)
            note = f"CPU only: nothing is on the device; host memory {mib_text(host / MiB)} MiB at its own peak (simulated)"
        if plan.optimizer == "paged_adamw8bit" and device == "cuda":
            pageable = report.paged_bytes
            note = (f"paged 8-bit state ({mib_text(pageable / MiB)} MiB: the two states of each parameter of "
                    f"{PAGED_FROM:,} elements or more; the rest is in torch's allocator) lives in CUDA unified "
                    "memory outside torch's allocator; ") + (
                "under WSL2 (Windows' driver) it cannot page out to the host, so it must fit on the card too"
                if in_wsl() else "it is counted here but can page to the host under pressure (fit_bytes leaves it out)")
        elif plan.optimizer == "paged_adamw8bit":
            note = ("on the CPU a paged optimizer runs unpaged (as bitsandbytes does there): the same state as "
                    "8-bit AdamW, all of it in the budget; on a card it lives in CUDA unified memory and can "
                    "page out (--device cuda)")
    if plan.precision == "fp16" and device == "cuda" and method == "predicted":
        note = (note + "; " if note else "") + ("the GradScaler's few bytes (its scale, growth tracker and found-inf "
                                                "flag) are not simulated: torch disables it without CUDA")
    if device == "cuda" and (settings := cuda_model.allocator_settings()):
        note = (note + "; " if note else "") + (f"PYTORCH_(CUDA_)ALLOC_CONF or the environment sets {', '.join(settings)} here: "
                                                "the reserved figures model the default allocator's segments and reuse "
                                                "(with expandable ones a card's reserved peak is usually nearer the "
                                                "allocated one; with cudaMallocAsync or no caching: not modelled)")
    if plan.trainable == "qlora" and plan.pure_half:  # what the step simulated did: said, not changed
        note = (note + "; " if note else "") + ("QLoRA: peft's prepare_model_for_kbit_training keeps every weight but "
                                                "the 4-bit ones in fp32, so a pure-half setup trains them in fp32 "
                                                "(no autocast: bf16-mixed runs them in half precision)")
    micro, n = plan.split(batch)
    if n != plan.accum:
        note = (note + "; " if note else "") + (f"batch {batch} is not {plan.accum} equal micro-batches: {n} of "
                                                f"{micro} instead (the batch per step kept)")
    emulated = the_card and plan.placement != "cpu" and plan.precision.startswith("bf16") and \
        bf16_emulated_on(the_card.name, the_card.sm)
    if emulated:  # the memory is bf16's; the speed is not (auto-fit offers fp16-mixed there)
        note = (note + "; " if note else "") + emulated
    if the_card is not None and the_card.total_bytes < breakdown.get("weights", 0):
        q, w, room = plan.trainable == "qlora", breakdown["weights"], the_card.total_bytes  # the fixes that may fit:
        fixes = [f for f, ok in (("--precision bf16-true", not (plan.pure_half or q) and w / 2 < room),  # 2 bytes,
                                 ("--trainable qlora", not q and w / (8 - 4 * plan.pure_half) < room)) if ok]  # ~0.5
        raise WeightsExceedCard(f"{the_card.name} ({room / 2**20:,.1f} MiB) is smaller than the weights alone "
                                f"({w / 2**20:,.1f} MiB); use a larger --card, " + "".join(f"{f}, " for f in fixes)
                                + "or ZeRO-3 offload, which keeps them on the host (--rung zero_offload_params)")
    cuda: dict[str, Any] = {}
    if device == "cuda" and report.timeline is not None and plan.placement in ("device", *SIMULATED_PLACEMENTS):
        last = min(replay_steps or report.steps, report.steps) - 1  # the last step replayed as simulated
        made = cuda_model.workspaces_in(the_card or cuda_model.Card("", 0, sm), report.timeline_ops)
        events, steps_of, roles, streams = (report.timeline, report.timeline_steps, report.timeline_roles,
                                            report.timeline_streams)
        events, steps_of, roles, made = card_load.replay_load(load, events, steps_of, report.timeline_ops, roles,
                                                              report.timeline_casts, made)
        before = None
        if workspaces == "held" and after is not None and rung(after).name != plan.name:  # made by another setup's run
            o = simulate(config, rung(after), batch=batch, seq=seq, steps=steps, target=device, sm=sm,
                         instrumented=instrumented if after_instrumented is None else after_instrumented)
            made = cuda_model.workspaces_in(the_card or cuda_model.Card("", 0, sm), o.timeline_ops)
            before = (o.timeline, o.timeline_steps, o.timeline_roles)
            *before, made = card_load.replay_load(load, *before[:2], o.timeline_ops, before[2], o.timeline_casts, made)
        if workspaces == "held" and any(len(w) == 3 and w[2] is not None for w in made):  # made by a run before
            events, steps_of, roles, streams, _ = cuda_model.after_a_run(events, steps_of, roles, streams, before)
        steady_from = next((i for i, s in enumerate(steps_of) if s >= last), 0)
        outside = (report.paged_serials if pageable else frozenset()) | report.host_serials
        run = dict(steps_of=steps_of, simulated_steps=report.steps, until=replay_steps or allocator.STEADY)
        alloc = allocator.replay(events, roles, made, steady_from=steady_from, outside=outside, streams=streams, **run)
        cuda = dict(allocated_peak_bytes=alloc.steady_allocated_peak_bytes,
                    reserved_peak_bytes=alloc.steady_reserved_peak_bytes,
                    needed=lambda: allocator.least_reserved(events, roles, made, outside, streams=streams,
                                                            upper=alloc.reserved_peak_bytes, **run),
                    allocated_breakdown=alloc.by_category_at_peak,
                    reserved_by_stream_bytes=({STREAM_NAMES.get(k, k): v for k, v in alloc.reserved_by_stream.items()}
                                              if report.timeline_streams else {}),
                    context_bytes=(the_card.context_bytes if the_card else cuda_model.CONTEXT_BYTES),
                    context_source=(the_card or cuda_model.Card("", 0, sm)).context_source,
                    replayed_steps=alloc.replayed_steps, steady=alloc.steady, segment_sizes=alloc.segment_sizes)
        if alloc.steady is False:
            note = (note + "; " if note else "") + (f"the allocator's cache was still changing after {alloc.replayed_steps} "
                                                    "replayed steps: the reserved figures are those steps' peaks")
    return Prediction(
        rung=plan.name, model=model_label(config), batch=batch, seq=seq, peak_bytes=int(peak),
        breakdown=breakdown, where=where, method=method, note=note, seconds=time.perf_counter() - t0,
        first_step_peak_bytes=report.first_step_peak_bytes,
        host_bytes=int(host), host_breakdown=host_breakdown, placement=placement, pageable_bytes=int(pageable),
        pages_out=not in_wsl(), phases=report.rows(), device=device,
        card=the_card.name if the_card else "", card_bytes=the_card.total_bytes - the_card.driver_reserved_bytes if the_card else 0,
        kernels=dict(report.kernels or {}), **cuda,
    )
