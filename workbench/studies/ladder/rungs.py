"""Measuring a rung on the machine at hand, and the rung-level auto-fit (study 2).

    from workbench.studies.ladder.rungs import measure, auto_fit
    choice = auto_fit("data/configs/qwen2-0.5b.json", batch=1, seq=512, budget_mib=6144)
    choice.rung, choice.table                  # the fastest rung predicted to fit; every rung's figure

The rungs themselves (the Plan registry) live in workbench.core.memory.plan. Auto-fit ranks rungs
by `speed_rank`: the expected cost of the rung's mechanism on a GPU (lower is faster), overridden
by measured step times where the caller passes them (no command does yet). Running a
choice, with a step down to the next one on a real out-of-memory error, is
workbench.studies.ladder.autofit.run_with_step_down, for rungs and composed setups alike.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from workbench.core.common import clear_stale_build_lock, in_wsl, single_process_group
from workbench.core.config import ConfigError
from workbench.core.fallback import out_of_memory
from workbench.core.memory.accounting import MemoryAccounting
from workbench.core.memory.offload import REDUCE_BUCKET_SIZE, infer_device_map
from workbench.core.memory.plan import RUNGS, Plan, apply_trainable, make_plan_optimizer, rung
from workbench.core.memory.predict import predict
from workbench.core.memory.segments import reserved_by_stream, segment_sizes
from workbench.core.training import BlockSampler, TrainSettings, train
from workbench.studies.ladder.autofit import bf16_emulated_plan, prediction_margin

# ------------------------------------------------------------------------------------------------
# measuring a rung on the machine at hand

def measure(
    plan: Plan | str,
    load: Callable[[], torch.nn.Module],
    blocks: torch.Tensor,
    *,
    batch: int,
    steps: int,
    device: str | torch.device = "cpu",
    budget_mib: float | None = None,
    sinks: tuple = (),
    lr: float = 1e-4,
    counted: bool = True,
) -> dict[str, Any]:
    """Train `steps` steps of `plan` on a fresh model from `load()` and measure its device peak.

    The peak is counted by MemoryAccounting (live tensor bytes on `device`, the same count the
    prediction makes over fake tensors; on CUDA the allocator's peak is reported beside it).
    A budget turns a too-large peak into torch.OutOfMemoryError (status "oom", a row, not a gap).
    Step time and tokens/s leave out the first step (warm-up: allocation, kernel selection).

    `counted=False` (CUDA only, no budget): no count, so no dispatch mode changes the step (under
    one, autograd sums every multi-use gradient out of place: `accounting.is_engine_sum`); the
    allocator's peaks are the measurement, of the step a user's training runs. Compare it with
    `predict(..., instrumented=False)`; the counted step with `instrumented=True`.
    """

    plan = rung(plan)
    device = torch.device(device)
    row: dict[str, Any] = {"rung": plan.name, "tier": plan.tier, "batch": batch, "seq": int(blocks.shape[1]),
                           "steps": steps, "device": str(device), "budget_mib": budget_mib}
    run_on = torch.device("cpu") if plan.placement == "cpu" else device
    if not counted and (run_on.type != "cuda" or budget_mib is not None):
        raise ValueError("an uncounted measurement reads the CUDA allocator's peaks: it needs a rung trained "
                         "on a CUDA device and no budget")
    reason = plan.cannot_run_here(device)
    if reason:
        return {**row, "status": "skipped", "reason": reason}
    if plan.placement in OFFLOADED:
        # Measured through its own mechanism (accelerate / DeepSpeed), never as the plain bf16
        # step below: that would put bf16_ckpt's figure under this rung's name.
        try:
            out = {**row, **measure_offloaded(plan, load, blocks, batch=batch, steps=steps, device=device,
                                              lr=lr, sinks=sinks)}
            if budget_mib is not None and out.get("measured_peak_bytes", 0) > budget_mib * 2**20:
                # The libraries allocate outside the live-bytes count, so the budget is checked on the peak.
                raise torch.OutOfMemoryError(f"{plan.name}: peak {out['measured_peak_bytes'] / 2**20:.1f} MiB "
                                             f"> budget {budget_mib:g} MiB")
            return out
        except Exception as e:  # out of memory; else a library missing or failing: say so, report no figure
            if out_of_memory(e):
                return {**row, "status": "oom", "reason": str(e)[:300]}
            return {**row, "status": "not measured", "reason": f"{plan.placement} failed: {type(e).__name__}: {e}"[:300]}
    rows: list[dict[str, Any]] = []
    try:
        # converted on the host, QLoRA's layers quantized onto the card one at a time, then moved: the
        # card never holds the whole fp32 model (a 7B QLoRA or bf16-true LoRA setup would run out of memory
        # loading it)
        model = apply_trainable(load(), plan, device=run_on).to(run_on)
        settings = plan.settings(batch, steps, lr=lr)
        optimizer = make_plan_optimizer(model, plan, settings, run_on)
        budget = int(budget_mib * 2**20) if budget_mib is not None and plan.placement != "cpu" else None
        if run_on.type == "cuda":
            gc.collect()  # an earlier run's garbage in reference cycles would count in this peak
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(run_on)
        with MemoryAccounting(run_on, budget_bytes=budget) if counted else contextlib.nullcontext() as acc:
            if counted:
                acc.watch(model)
            probe = None if run_on.type == "cuda" else acc.take_window_peak_mib  # each step's peak; CUDA: the allocator's
            result = train(model, blocks, settings, device=run_on, optimizer=optimizer,
                           sinks=[rows.append, *sinks], extra={"rung": plan.name}, memory_probe=probe)
    except Exception as e:
        if not out_of_memory(e):
            raise
        return {**row, "status": "oom", "reason": str(e)[:300]}
    timed = [r for r in rows if r["step"] > 1] or rows
    step_ms = sorted(r["step_ms"] for r in timed)[len(timed) // 2]  # median
    out = {**row, "status": "ok", "reason": "", "step_ms": step_ms,
           "tokens_per_s": settings.tokens_per_step(blocks.shape[1]) / (step_ms / 1e3), "loss_after": result.final_loss}
    if counted:
        report = acc.report()
        out.update({
            "measured_peak_bytes": report.steady_peak_bytes,
            "measured_first_step_peak_bytes": report.first_step_peak_bytes,
            "measured_where": report.where(),
            **{f"measured_{c}_bytes": b for c, b in report.breakdown().items()},
        })
    else:
        out.update({"measured_by": "cuda allocator", "measured_peak_bytes": torch.cuda.max_memory_allocated(run_on),
                    "measured_where": "the plain step (no dispatch mode)"})
    if plan.placement == "cpu":
        # CPU only: the count is host memory; the device holds nothing.
        out["measured_host_bytes"], out["measured_peak_bytes"] = out["measured_peak_bytes"], 0
    if run_on.type == "cuda":
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(run_on)
        out["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(run_on)
        # the segments (none given back during the steps: the reserved peak's), beside the replay's
        out["segment_sizes"] = segment_sizes(torch.cuda.memory_snapshot())
        out["load"] = "host"  # how the weights reached the card: predict(load="host") replays it (card_load)
    return out


# ------------------------------------------------------------------------------------------------
# CUDA only: the rungs that move tensors between the GPU and the host, each through its library

OFFLOADED = ("device_map", "zero_offload", "zero_offload_params")


def zero_config(plan: Plan, settings: TrainSettings) -> dict[str, Any]:
    """The DeepSpeed config of a ZeRO-Offload rung: ZeRO-2 with the optimizer (state and the
    CPU Adam step) on the host; ZeRO-3 with the parameters on the host as well."""
    if plan.placement not in ("zero_offload", "zero_offload_params"):
        raise ValueError(f"{plan.name} is not a ZeRO rung")
    # the host's copies pinned (8 bytes a parameter and more), except under WSL2, whose pinned memory is
    # limited: there they are pageable (slower transfers; the card's memory is the same)
    pin = not in_wsl()
    zero: dict[str, Any] = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": pin},
                            "reduce_bucket_size": REDUCE_BUCKET_SIZE}  # what the prediction simulates
    if plan.placement == "zero_offload_params":
        zero.update(stage=3, offload_param={"device": "cpu", "pin_memory": pin})
    return {
        "train_micro_batch_size_per_gpu": settings.micro_batch,
        "gradient_accumulation_steps": settings.grad_accum,
        "gradient_clipping": settings.max_grad_norm,
        # DeepSpeed trains the 16-bit weights over an fp32 master on the host, with no autocast: a pure-half
        # setup (bf16-true) runs as bf16 does; fp32 trains fp32 weights (not cast: 4 bytes each on the card)
        "bf16": {"enabled": plan.half_dtype == torch.bfloat16},
        "fp16": {"enabled": plan.half_dtype == torch.float16},
        "optimizer": {"type": "AdamW", "params": {"lr": settings.lr, "weight_decay": settings.weight_decay}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def partition_on_host(model: torch.nn.Module, plan: Plan, config: dict[str, Any]) -> None:
    """ZeRO-3: partition `model`, on the host, parameter by parameter before `deepspeed.initialize`,
    as DeepSpeed's docs partition a model already built (`zero.Init(module=model)`): each weight is
    copied to the card alone (DeepSpeed's device of LOCAL_RANK), then to its host partition, and its
    copy there is freed. Given a model not yet partitioned, the engine would move the whole model to
    the card first and partition it there (engine.py `_configure_distributed_model`): a model larger
    than the card would run out of memory before its first step (Qwen2-7B: 15.2 GB in bf16). The
    engine leaves a partitioned model as it is, so what it does to one that is not is done here
    first: the weights cast to the 16-bit dtype it trains (`zero_config`; the buffers keep theirs),
    the buffers moved to the card the weights are gathered on."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.engine import CASTABLE_DTYPES

    for p in model.parameters():
        if plan.half_dtype is not None and p.dtype in CASTABLE_DTYPES:
            p.data = p.data.to(plan.half_dtype)
    local = torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0"))))  # zero.Init's
    for b in model.buffers():
        b.data = b.data.to(local)
    deepspeed.zero.Init(module=model, config_dict_or_path=config)


def _deepspeed_streams(engine) -> dict[int, str]:
    """The CUDA stream handles of a DeepSpeed engine's side streams, named as the ZeRO-3 simulation
    names them (workbench.core.memory.zero3.STREAM_NAMES); the default stream's handle is 0."""
    names = {0: "default"}
    opt = engine.optimizer
    offload = getattr(opt, "parameter_offload", None)
    for stream, name in ((getattr(opt, "reduce_and_partition_stream", None), "reduce"),
                         (getattr(offload, "_DeepSpeedZeRoOffload__allgather_stream", None), "allgather")):
        if stream is not None and getattr(stream, "cuda_stream", 0):
            names[stream.cuda_stream] = name
    return names


def measure_offloaded(plan: Plan, load: Callable[[], torch.nn.Module], blocks: torch.Tensor, *, batch: int,
                      steps: int, device: torch.device, lr: float, sinks: tuple = ()) -> dict[str, Any]:
    """CUDA only. Train `plan` with its own mechanism and report the allocator's peaks.

    device_map: accelerate's `infer_auto_device_map` under `max_memory` places whole decoder layers
    on the GPU or the host and `dispatch_model(main_device="cpu")` runs each layer where it lives
    (host layers train on the CPU; hooks move activations across). ZeRO: `deepspeed.initialize`
    with `zero_config` in one process (world size 1, NCCL); ZeRO-3's model partitioned on the host
    first (`partition_on_host`).
    """
    if device.type != "cuda":
        raise RuntimeError(f"{plan.placement} is measured on a CUDA device only, not {device}")
    if plan.trainable == "qlora":  # bitsandbytes' 4-bit weights are neither dispatched nor partitioned here
        raise ConfigError(f"QLoRA is not measured with {plan.placement} (its 4-bit weights are not offloaded here); "
                          "measure it on the card (placement device)")
    settings = plan.settings(batch, steps, lr=lr)
    model = apply_trainable(load(), plan)  # what trains, as the prediction simulates it (LoRA, frozen layers)
    # in training mode, as the training loop sets it: from_pretrained gives an eval-mode model, and DeepSpeed's
    # engine never sets the mode, so its rungs ran without checkpointing (transformers checkpoints a layer in
    # training mode only) and without dropout, where the prediction simulates both
    model.train()
    gc.collect()  # an earlier run's garbage in reference cycles would count in this peak
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    rows: list[dict[str, Any]] = []
    extra = {"rung": plan.name}
    by_stream: dict = {}  # ZeRO: the card's reserved bytes per stream at the end (its side streams' caches)
    if plan.placement == "device_map":
        from accelerate import dispatch_model

        dmap = {k: (device.index or 0) if v == 0 else v for k, v in infer_device_map(model).items()}
        model = dispatch_model(model, device_map=dmap, main_device="cpu")

        result = train(model, blocks, settings, device=device, sinks=[rows.append, *sinks], extra=extra)
        loss, placed = result.final_loss, f"{sum(d != 'cpu' for d in dmap.values())}/{len(dmap)} modules on the GPU"
        snapshot = torch.cuda.memory_snapshot()
    else:
        import deepspeed

        single_process_group(device)  # in-memory store, loopback sockets: DeepSpeed's own rendezvous listens on all
        if plan.grad_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            if getattr(model, "config", None) is not None:  # what transformers does then anyway, without its warning
                model.config.use_cache = False
        # ZeRO-3's zero.Init replaces torch.nn.functional.linear for the rest of the process
        # (memory_efficient_linear); it is put back below, so that later rungs run torch's own
        linear = torch.nn.functional.linear
        from deepspeed.runtime.zero import parameter_offload

        stacked = len(parameter_offload.FWD_MODULE_STACK)  # ZeRO-3 puts the model on this module-level list
        engine = None
        try:
            clear_stale_build_lock("cpu_adam")  # the offloaded optimizer is DeepSpeed's CPU Adam, built on first use
            config = zero_config(plan, settings)
            if plan.placement == "zero_offload_params":
                partition_on_host(model, plan, config)
            engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                              config=config)

            sampler = BlockSampler(len(blocks), settings.seed)  # the same batches as the training loop
            for step in range(steps):
                t0 = time.perf_counter()
                idx = sampler.take(settings.micro_batch * settings.grad_accum)
                total = 0.0
                for micro in idx.split(settings.micro_batch):
                    b = blocks[micro].to(engine.device)
                    loss = engine(input_ids=b, labels=b).loss
                    engine.backward(loss)
                    engine.step()
                    total += float(loss.detach()) / settings.grad_accum  # no requires_grad warning (seen on a card)
                dt = time.perf_counter() - t0
                row = {**extra, "step": step + 1, "loss": total, "step_ms": dt * 1e3,
                       "tokens_per_s": settings.tokens_per_step(blocks.shape[1]) / dt,
                       "mem_mib": torch.cuda.memory_allocated(device) / 2**20}
                rows.append(row)
                for sink in sinks:
                    sink(row)
            loss, placed = rows[-1]["loss"], f"DeepSpeed {deepspeed.__version__}, ZeRO stage {config['zero_optimization']['stage']}"
            placed += ", host copies pageable (WSL2 limits pinned memory)" if in_wsl() else ""
            snapshot = torch.cuda.memory_snapshot()
            by_stream = reserved_by_stream(snapshot, _deepspeed_streams(engine))
        finally:  # also after an error (out of memory): its gradient hooks would hold the model for good
            torch.nn.functional.linear = linear
            # ZeRO-3's engine put the model on DeepSpeed's FWD_MODULE_STACK (and a forward that ran out of memory
            # left its modules there); destroy() takes neither off: its gathered and persistent weights stayed
            del parameter_offload.FWD_MODULE_STACK[stacked:]
            if engine is not None and hasattr(engine, "destroy"):
                engine.destroy()
            engine = None
    timed = [r for r in rows if r["step"] > 1] or rows
    step_ms = sorted(r["step_ms"] for r in timed)[len(timed) // 2]
    out = {"status": "ok", "reason": "", "measured_by": "cuda allocator",
           "measured_peak_bytes": torch.cuda.max_memory_allocated(device),
           "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
           "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device),
           "measured_where": placed, "step_ms": step_ms, "reserved_by_stream_bytes": by_stream,
           "segment_sizes": segment_sizes(snapshot),
           "tokens_per_s": settings.tokens_per_step(blocks.shape[1]) / (step_ms / 1e3), "loss_after": loss,
           **({"zero3_partitioned_from": "host"} if plan.placement == "zero_offload_params" else {})}
    del model
    return out


# ------------------------------------------------------------------------------------------------
# auto-fit

@dataclass
class FitChoice:
    rung: str | None  # None: nothing is predicted to fit
    budget_bytes: int
    table: list[dict[str, Any]]  # one row per rung: predicted peak, fits, rank

    def order(self) -> list[str]:
        """Rungs predicted to fit, fastest first, each needing less than the one before: the order to
        step down in on a real out-of-memory error (a rung needing as much as one that ran out would too)."""
        out, last = [], math.inf
        for r in sorted((r for r in self.table if r["fits"]), key=lambda r: r["rank"]):
            if r["fit_bytes"] < last:
                out, last = out + [r["rung"]], r["fit_bytes"]
        return out


def _check_budget(budget_mib: float) -> int:
    if isinstance(budget_mib, bool) or not isinstance(budget_mib, (int, float)) or not budget_mib > 0:
        raise ConfigError(f"budget must be a positive number of MiB, got {budget_mib!r}")
    return int(budget_mib * 2**20)


def auto_fit(
    model: Any,
    *,
    batch: int,
    seq: int,
    budget_mib: float,
    rungs: tuple[str, ...] | None = None,
    step_ms: dict[str, float] | None = None,
    predictions: dict[str, Any] | None = None,
    device: str | torch.device = "cuda",
    margin: float | None = None,
    sm: int | None = None,
) -> FitChoice:
    """Pick the fastest rung predicted to fit `budget_mib` for `model` at `batch` x `seq`.

    `model` is a name, config.json path, PretrainedConfig or nn.Module (see predict.predict).
    Speed: measured `step_ms` where given, else the rung's `speed_rank`; on a card of compute
    capability `sm` (x 10) before sm_80, where bf16 is emulated (fp32's speed or slower), the bf16
    rungs rank after fp32 and fp16. Rungs that place nothing on the device (cpu) always fit and
    come last. `device`: the target; paged optimizer state can page out only on CUDA, so elsewhere
    it counts in full. A rung fits when its need plus `margin` (a fraction) is within the budget;
    None: each rung's measured margin (workbench.studies.ladder.autofit.prediction_margin on `device`).
    """

    budget = _check_budget(budget_mib)
    names = list(rungs or RUNGS)
    for n in names:
        rung(n)
    table = []
    target = torch.device(device).type
    for n in names:
        plan = RUNGS[n]  # predicted for the target: a CPU step's live bytes are not a card's reserved bytes
        p = (predictions or {}).get(n) or predict(model, n, batch=batch, seq=seq, device=target)
        need = p.fit_bytes if target == "cuda" else p.peak_bytes
        m = margin if margin is not None else prediction_margin(plan, device=str(device))[0]
        measured = (step_ms or {}).get(n)
        # Measured step times rank first (in ms); rungs without one follow, by their speed prior.
        rank = ((0, measured) if measured is not None else (3, plan.speed_rank) if plan.placement == "cpu"
                else (2 if bf16_emulated_plan(plan, sm) else 1, plan.speed_rank))
        table.append({
            "rung": n, "tier": plan.tier, "predicted_peak_bytes": p.peak_bytes, "fit_bytes": need,
            "method": p.method, "margin": m, "fits": need * (1 + m) <= budget, "rank": rank,
        })
    fitting = sorted((r for r in table if r["fits"]), key=lambda r: r["rank"])
    return FitChoice(fitting[0]["rung"] if fitting else None, budget, table)
