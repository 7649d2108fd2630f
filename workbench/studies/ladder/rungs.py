"""Which change makes a fine-tune fit, and what does each change cost? The memory ladder.

    from workbench.studies.ladder.rungs import RUNGS, rung, auto_fit
    RUNGS["bf16_ckpt"]                         # a Plan: precision, checkpointing, optimizer, ...
    choice = auto_fit("data/configs/qwen2-0.5b.json", batch=1, seq=512, budget_mib=6144)
    choice.rung, choice.table                  # the fastest rung predicted to fit; every rung's figure

Each rung is a small frozen `Plan` (DESIGN.md section 2, "Study 2"), built from the one above it
with `compose`, so a rung says only what it changes:

    Tier 1  fp32 -> fp16 / bf16 autocast (fp32 weights) -> pure bf16 weights, grads and AdamW
            state (bf16_true) -> + gradient checkpointing -> + smaller micro-batch with
            gradient accumulation
    Tier 2  8-bit AdamW, paged 8-bit AdamW (bitsandbytes); LoRA (also over pure bf16); QLoRA (4-bit NF4 base);
            accelerate device_map with max_memory (layers on the CPU); DeepSpeed ZeRO-Offload
            (optimizer on the CPU; optimizer and parameters on the CPU)
    Tier 3  CPU only

A setup that is not a rung composes from the command line's names with `plan_from_flags`
(`workbench estimate --precision bf16-true --trainable lora --lora-targets q_proj,v_proj ...`).

`build(plan, model_or_config, ...)` turns a plan into (model, optimizer, settings) the same way
for a real run and for a prediction over fake tensors, so the two run the same step.
Auto-fit ranks rungs by `speed_rank`: the expected cost of the rung's mechanism on a GPU (lower
is faster), overridden by measured step times when the caller has them. On a real
out-of-memory error `run_with_fallback` steps down to the next rung that is predicted to fit.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from workbench.core.config import ConfigError
from workbench.core.training import TrainSettings, make_optimizer

# "bf16"/"fp16": autocast over fp32 weights (bf16-mixed / fp16-mixed); "bf16_true"/"fp16_true": pure
# half-precision weights, gradients and optimizer state (torchtune's and LitGPT's bf16-true).
Precision = Literal["fp32", "bf16", "fp16", "bf16_true", "fp16_true"]
PRECISIONS = ("fp32", "bf16", "fp16", "bf16_true", "fp16_true")
# "adamw": fused AdamW (what the workbench trains with); "adamw_torch": what torch.optim.AdamW()
# picks on the target device (foreach on CUDA, single-tensor on the CPU).
Optimizer = Literal["adamw", "adamw_torch", "adamw8bit", "paged_adamw8bit"]
OPTIMIZERS = ("adamw", "adamw_torch", "adamw8bit", "paged_adamw8bit")
TRAINABLES = ("full", "lora", "qlora", "adapter", "freeze_lower", "freeze_embeddings", "bitfit")
PLACEMENTS = ("device", "device_map", "zero_offload", "zero_offload_params", "cpu")
# the command line's names (issue 10) -> the plan's
CLI_PRECISIONS = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16-true": "bf16_true",
                  "fp16-true": "fp16_true"}
CLI_OPTIMIZERS = {"adamw_torch": "adamw_torch", "adamw_fused": "adamw", "adamw_8bit": "adamw8bit",
                  "paged_adamw_8bit": "paged_adamw8bit"}
# "full", LoRA/QLoRA, or any of study 1's structural strategies (workbench.core.trainable).
Trainable = Literal["full", "lora", "qlora", "adapter", "freeze_lower", "freeze_embeddings", "bitfit"]
Placement = Literal["device", "device_map", "zero_offload", "zero_offload_params", "cpu"]


@dataclass(frozen=True)
class Plan:
    """One rung: what changes about the training step, and how it is expected to rank for speed."""

    name: str
    tier: int
    help: str
    precision: Precision = "fp32"
    grad_checkpointing: bool = False
    accum: int = 1  # the batch is split into `accum` micro-batches (gradient accumulation)
    optimizer: Optimizer = "adamw"
    trainable: Trainable = "full"
    placement: Placement = "device"
    lora_rank: int = 8
    speed_rank: float = 0.0  # expected relative cost on a GPU; lower is faster
    lora_targets: tuple[str, ...] | None = None  # module names LoRA wraps (None: every decoder linear)

    def __post_init__(self):
        for field_, value, known in (("precision", self.precision, PRECISIONS), ("optimizer", self.optimizer, OPTIMIZERS),
                                     ("trainable", self.trainable, TRAINABLES), ("placement", self.placement, PLACEMENTS)):
            if value not in known:
                raise ConfigError(f"unknown {field_} {value!r}; choose one of: {', '.join(known)}")
        if self.lora_targets is not None and self.trainable not in ("lora", "qlora"):
            raise ConfigError(f"lora_targets needs trainable lora or qlora, not {self.trainable!r}")

    @property
    def half_dtype(self) -> torch.dtype | None:
        """The 16-bit dtype this plan computes in (None: fp32)."""
        return {"bf16": torch.bfloat16, "bf16_true": torch.bfloat16, "fp16": torch.float16,
                "fp16_true": torch.float16}.get(self.precision)

    @property
    def pure_half(self) -> bool:
        """Weights, gradients and optimizer state in 16 bits (no autocast, no fp32 master copy)."""
        return self.precision.endswith("_true")

    @property
    def autocast_precision(self) -> str:
        """The training loop's autocast setting: pure half-precision runs without autocast."""
        return "fp32" if self.pure_half else self.precision

    def compose(self, name: str, help: str, **changes: Any) -> "Plan":
        """A new rung: this one plus `changes`."""
        return dataclasses.replace(self, name=name, help=help, **changes)

    def settings(self, batch: int, steps: int, **overrides: Any) -> TrainSettings:
        """The TrainSettings this plan runs with for `batch` sequences per optimizer step."""
        micro = max(1, batch // self.accum)
        return TrainSettings.from_dict(
            dict(steps=steps, micro_batch=micro, grad_accum=max(1, batch // micro),
                 precision=self.autocast_precision, grad_checkpointing=self.grad_checkpointing, **overrides)
        )

    def cannot_run_here(self, device: torch.device) -> str | None:
        """Why this plan cannot be measured on `device` (None: it can)."""
        if self.placement in ("device_map", "zero_offload", "zero_offload_params"):
            if device.type != "cuda":
                return (f"{self.placement} moves tensors between a GPU and the host; on a machine "
                        f"without a GPU both are the same memory, so there is no device peak to measure")
        if self.precision == "fp16" and device.type != "cuda":  # fp16_true runs anywhere: no GradScaler
            return "fp16 autocast with a GradScaler needs CUDA (the CPU runs bf16 autocast instead)"
        return None

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items()}


# ------------------------------------------------------------------------------------------------
# the registry: each rung is the one above it plus one change

def _ladder() -> dict[str, Plan]:
    fp32 = Plan("fp32", 1, "fp32 weights, grads and AdamW state (the baseline)", speed_rank=3)
    bf16 = fp32.compose("bf16", "bf16 autocast (weights and optimizer state stay fp32)",
                        precision="bf16", speed_rank=1)
    fp16 = fp32.compose("fp16", "fp16 autocast + GradScaler (CUDA only)", precision="fp16", speed_rank=1.1)
    ckpt = bf16.compose("bf16_ckpt", "bf16 + gradient checkpointing (recompute activations in backward)",
                        grad_checkpointing=True, speed_rank=4)
    accum = ckpt.compose("bf16_ckpt_accum", "bf16 + checkpointing + micro-batch / 4 with 4x accumulation",
                         accum=4, speed_rank=5)
    adam8 = ckpt.compose("adamw8bit", "bf16 + checkpointing + bitsandbytes 8-bit AdamW",
                         optimizer="adamw8bit", tier=2, speed_rank=6)
    paged = ckpt.compose("paged_adamw8bit", "bf16 + checkpointing + paged 8-bit AdamW (state in CUDA unified memory)",
                         optimizer="paged_adamw8bit", tier=2, speed_rank=6.5)
    lora = ckpt.compose("lora", "bf16 + checkpointing + LoRA r=8 on every decoder linear (peft)",
                        trainable="lora", tier=2, speed_rank=7)
    qlora = lora.compose("qlora", "bf16 + checkpointing + 4-bit NF4 base (bitsandbytes) + LoRA r=8",
                         trainable="qlora", speed_rank=8)
    dmap = ckpt.compose("device_map", "bf16 + checkpointing + accelerate device_map/max_memory (layers on the CPU)",
                        placement="device_map", tier=2, speed_rank=9)
    zero = ckpt.compose("zero_offload", "bf16 + checkpointing + DeepSpeed ZeRO-2, optimizer on the CPU",
                        placement="zero_offload", tier=2, speed_rank=10)
    zero_p = ckpt.compose("zero_offload_params", "bf16 + checkpointing + DeepSpeed ZeRO-3, optimizer and parameters on the CPU",
                          placement="zero_offload_params", tier=2, speed_rank=11)
    pure = fp32.compose("bf16_true", "pure bf16 weights, grads and AdamW state (torchtune / LitGPT bf16-true)",
                        precision="bf16_true", speed_rank=0.9)
    pure_lora = pure.compose("bf16_true_lora", "pure bf16 + LoRA r=8 on every decoder linear (peft)",
                             trainable="lora", tier=2, speed_rank=6.8)
    cpu = fp32.compose("cpu", "CPU only: everything in host memory, nothing on the device",
                       placement="cpu", tier=3, speed_rank=20)
    rungs = (fp32, fp16, bf16, pure, ckpt, accum, adam8, paged, lora, pure_lora, qlora, dmap, zero, zero_p, cpu)
    return {r.name: r for r in rungs}


RUNGS: dict[str, Plan] = _ladder()


def rung(name: str | Plan) -> Plan:
    """The plan called `name`; a clear error naming the known rungs otherwise."""
    if isinstance(name, Plan):
        return name
    if name not in RUNGS:
        raise ConfigError(f"unknown rung {name!r}; known rungs: {', '.join(RUNGS)}")
    return RUNGS[name]


# ------------------------------------------------------------------------------------------------
# building a plan: the same code for real weights and for fake tensors

def quantize_4bit(model: torch.nn.Module, compute_dtype: torch.dtype, *, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every nn.Linear outside `skip` by a bitsandbytes NF4 Linear4bit, in place.

    The weights are quantized for real (bitsandbytes cannot run under fake tensors) on the
    device the layer is on: on CUDA by bitsandbytes' CUDA kernels, so a QLoRA model on a GPU
    keeps its 4-bit weights and quantization state there; on the CPU on the CPU; on the meta
    device (a prediction needs the bytes, not the values) from zeros on the CPU.
    Returns the number of layers replaced.
    """
    import bitsandbytes as bnb

    n = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not torch.nn.Linear or any(full.endswith(s) for s in skip):
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, child.bias is not None,
                                  compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                                  device="meta")
            w = child.weight.data
            on = torch.device("cpu") if w.device.type == "meta" else w.device
            w = torch.zeros(w.shape, dtype=torch.float32) if w.device.type == "meta" else w.float()
            q.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4",
                                         module=q)._quantize(on)
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(module, child_name, q)
            n += 1
    return n


def check_lora_targets(model: torch.nn.Module, targets: tuple[str, ...]) -> None:
    """Each target must name a linear module of `model` (peft matches a name's last parts)."""
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ConfigError(f"--lora-targets {','.join(missing)} names no linear module of this model; "
                          f"use some of: {','.join(leaves)}")


def apply_trainable(model: torch.nn.Module, plan: Plan) -> torch.nn.Module:
    """What trains under the plan, on `model` (real or on the meta device): the same selection
    code as study 1 (workbench.core.trainable), after 4-bit quantization for QLoRA. A pure-half plan
    casts the weights to 16 bits first (peft then keeps LoRA adapters in fp32, its default)."""
    from workbench.core.trainable import apply_strategy

    if plan.pure_half:
        model = model.to(plan.half_dtype)
    if plan.trainable == "full":
        return model
    if plan.lora_targets is not None:
        check_lora_targets(model, plan.lora_targets)
    if plan.trainable == "qlora":
        from peft import prepare_model_for_kbit_training

        quantize_4bit(model, plan.half_dtype or torch.float32)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=plan.grad_checkpointing)
    if plan.lora_targets is not None:
        from peft import LoraConfig, get_peft_model

        if plan.trainable == "lora":
            for p in model.parameters():
                p.requires_grad_(False)
        cfg = LoraConfig(r=plan.lora_rank, lora_alpha=2 * plan.lora_rank, lora_dropout=0.0,
                         target_modules=list(plan.lora_targets), task_type="CAUSAL_LM")
        return get_peft_model(model, cfg)
    return apply_strategy(model, plan.trainable, lora_rank=plan.lora_rank)[0]


def make_plan_optimizer(model: torch.nn.Module, plan: Plan, settings: TrainSettings, device: torch.device,
                        target: str | torch.device | None = None):
    """The plan's optimizer over the model's trainable parameters (built outside fake mode:
    bitsandbytes' constructors read tensor values). `target`: the device the step is for, when
    it is simulated elsewhere (adamw_torch resolves to foreach on CUDA, single-tensor on the CPU)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if plan.optimizer == "adamw":
        return make_optimizer(params, settings, device)
    if plan.optimizer == "adamw_torch":
        on = torch.device(target or device)
        if not params:
            raise ConfigError("nothing to train: no parameter requires a gradient")
        # torch's default (foreach=None) picks foreach for CUDA tensors, the single-tensor loop elsewhere.
        foreach = on.type == "cuda" if on.type != device.type else None
        return torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay, foreach=foreach)
    import bitsandbytes as bnb

    cls = bnb.optim.AdamW8bit if plan.optimizer == "adamw8bit" else bnb.optim.PagedAdamW8bit
    return cls(params, lr=settings.lr, weight_decay=settings.weight_decay)


def plan_from_flags(*, precision: str = "fp32", optimizer: str = "adamw_torch", trainable: str = "full",
                    lora_rank: int = 8, lora_targets: tuple[str, ...] | None = None, checkpointing: bool = False,
                    batch: int = 1, micro_batch: int | None = None, name: str = "custom") -> Plan:
    """A plan composed from the command line's names (issue 10): `--precision bf16-mixed` etc."""
    if precision not in CLI_PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; choose one of: {', '.join(CLI_PRECISIONS)}")
    if optimizer not in CLI_OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; choose one of: {', '.join(CLI_OPTIMIZERS)}")
    if trainable not in TRAINABLES:
        raise ConfigError(f"unknown trainable set {trainable!r}; choose one of: {', '.join(TRAINABLES)}")
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank <= 0:
        raise ConfigError(f"--lora-rank must be a positive integer, got {lora_rank!r}")
    micro = batch if micro_batch is None else micro_batch
    if micro <= 0 or batch % micro:
        raise ConfigError(f"--micro-batch {micro} must divide --batch {batch} (the effective batch stays the same)")
    if lora_targets is not None and trainable not in ("lora", "qlora"):
        raise ConfigError("--lora-targets needs --trainable lora or qlora")
    help_ = (f"{precision}, {optimizer}, {trainable}" + (f" r={lora_rank}" if trainable in ("lora", "qlora") else "")
             + (", checkpointing" if checkpointing else "") + (f", micro-batch {micro}" if micro != batch else ""))
    return Plan(name, 0, help_, precision=CLI_PRECISIONS[precision], grad_checkpointing=checkpointing,
                accum=batch // micro, optimizer=CLI_OPTIMIZERS[optimizer], trainable=trainable,
                lora_rank=lora_rank, lora_targets=tuple(lora_targets) if lora_targets else None)


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
) -> dict[str, Any]:
    """Train `steps` steps of `plan` on a fresh model from `load()` and measure its device peak.

    The peak is counted by MemoryAccounting (live tensor bytes on `device`, the same count the
    prediction makes over fake tensors; on CUDA the allocator's peak is reported beside it).
    A budget turns a too-large peak into torch.OutOfMemoryError (status "oom", a row, not a gap).
    Step time and tokens/s leave out the first step (warm-up: allocation, kernel selection).
    """
    from workbench.core.memory.accounting import MemoryAccounting
    from workbench.core.training import train

    plan = rung(plan)
    device = torch.device(device)
    row: dict[str, Any] = {"rung": plan.name, "tier": plan.tier, "batch": batch, "seq": int(blocks.shape[1]),
                           "steps": steps, "device": str(device), "budget_mib": budget_mib}
    run_on = torch.device("cpu") if plan.placement == "cpu" else device
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
        except torch.OutOfMemoryError as e:
            return {**row, "status": "oom", "reason": str(e)[:300]}
        except Exception as e:  # a library missing or failing: say so, report no figure
            return {**row, "status": "not measured", "reason": f"{plan.placement} failed: {type(e).__name__}: {e}"[:300]}
    rows: list[dict[str, Any]] = []
    try:
        model = apply_trainable(load().to(run_on), plan)
        settings = plan.settings(batch, steps, lr=lr)
        optimizer = make_plan_optimizer(model, plan, settings, run_on)
        budget = int(budget_mib * 2**20) if budget_mib is not None and plan.placement != "cpu" else None
        if run_on.type == "cuda":
            torch.cuda.reset_peak_memory_stats(run_on)
        with MemoryAccounting(run_on, budget_bytes=budget) as acc:
            acc.watch(model)
            probe = None if run_on.type == "cuda" else (lambda: acc.current_bytes / 2**20)  # CUDA: the allocator's figure
            result = train(model, blocks, settings, device=run_on, optimizer=optimizer,
                           sinks=[rows.append, *sinks], extra={"rung": plan.name}, memory_probe=probe)
    except torch.OutOfMemoryError as e:
        return {**row, "status": "oom", "reason": str(e)[:300]}
    report = acc.report()
    timed = [r for r in rows if r["step"] > 1] or rows
    step_ms = sorted(r["step_ms"] for r in timed)[len(timed) // 2]  # median
    out = {
        **row, "status": "ok", "reason": "",
        "measured_peak_bytes": report.steady_peak_bytes,
        "measured_first_step_peak_bytes": max((p.bytes for (s, _), p in report.phase_peaks.items() if s == 0), default=0),
        "measured_where": report.where(),
        "step_ms": step_ms, "tokens_per_s": settings.tokens_per_step(blocks.shape[1]) / (step_ms / 1e3),
        "loss_after": result.final_loss,
        **{f"measured_{c}_bytes": b for c, b in report.breakdown().items()},
    }
    if plan.placement == "cpu":
        # CPU only: the count is host memory; the device holds nothing.
        out["measured_host_bytes"], out["measured_peak_bytes"] = out["measured_peak_bytes"], 0
    if run_on.type == "cuda":
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(run_on)
        out["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(run_on)
    return out


# ------------------------------------------------------------------------------------------------
# CUDA only: the rungs that move tensors between the GPU and the host, each through its library

OFFLOADED = ("device_map", "zero_offload", "zero_offload_params")


def zero_config(plan: Plan, settings: TrainSettings) -> dict[str, Any]:
    """The DeepSpeed config of a ZeRO-Offload rung: ZeRO-2 with the optimizer (state and the
    CPU Adam step) on the host; ZeRO-3 with the parameters on the host as well."""
    if plan.placement not in ("zero_offload", "zero_offload_params"):
        raise ValueError(f"{plan.name} is not a ZeRO rung")
    zero: dict[str, Any] = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if plan.placement == "zero_offload_params":
        zero.update(stage=3, offload_param={"device": "cpu", "pin_memory": True})
    return {
        "train_micro_batch_size_per_gpu": settings.micro_batch,
        "gradient_accumulation_steps": settings.grad_accum,
        "gradient_clipping": settings.max_grad_norm,
        "bf16": {"enabled": plan.precision == "bf16"},
        "fp16": {"enabled": plan.precision == "fp16"},
        "optimizer": {"type": "AdamW", "params": {"lr": settings.lr, "weight_decay": settings.weight_decay}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def device_map_memory(model: torch.nn.Module, gpu_index: int, *, gpu_share: float = 0.5) -> dict[Any, int]:
    """`max_memory` for accelerate: the GPU gets `gpu_share` of the weights' bytes, the host the rest
    (so about half the decoder layers run on the CPU, which is what this rung is about)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {gpu_index: max(1, int(weights * gpu_share)), "cpu": 4 * weights + 2**30}


def measure_offloaded(plan: Plan, load: Callable[[], torch.nn.Module], blocks: torch.Tensor, *, batch: int,
                      steps: int, device: torch.device, lr: float, sinks: tuple = ()) -> dict[str, Any]:
    """CUDA only. Train `plan` with its own mechanism and report the allocator's peaks.

    device_map: accelerate's `infer_auto_device_map` under `max_memory` places whole decoder layers
    on the GPU or the host and `dispatch_model(main_device="cpu")` runs each layer where it lives
    (host layers train on the CPU; hooks move activations across). ZeRO: `deepspeed.initialize`
    with `zero_config` in one process (world size 1, NCCL).
    """
    if device.type != "cuda":
        raise RuntimeError(f"{plan.placement} is measured on a CUDA device only, not {device}")
    import os

    settings = plan.settings(batch, steps, lr=lr)
    model = load()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    rows: list[dict[str, Any]] = []
    extra = {"rung": plan.name}
    if plan.placement == "device_map":
        from accelerate import dispatch_model, infer_auto_device_map

        memory = device_map_memory(model, device.index or 0)
        dmap = infer_auto_device_map(model, max_memory=memory,
                                     no_split_module_classes=list(getattr(model, "_no_split_modules", None) or []))
        model = dispatch_model(model, device_map=dmap, main_device="cpu")
        from workbench.core.training import train

        result = train(model, blocks, settings, device=device, sinks=[rows.append, *sinks], extra=extra)
        loss, placed = result.final_loss, f"{sum(d != 'cpu' for d in dmap.values())}/{len(dmap)} modules on the GPU"
    else:
        import deepspeed

        for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511").items():
            os.environ.setdefault(k, v)
        if plan.grad_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                          config=zero_config(plan, settings))
        from workbench.core.training import BlockSampler

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
                total += float(loss) / settings.grad_accum
            dt = time.perf_counter() - t0
            row = {**extra, "step": step + 1, "loss": total, "step_ms": dt * 1e3,
                   "tokens_per_s": settings.tokens_per_step(blocks.shape[1]) / dt,
                   "mem_mib": torch.cuda.memory_allocated(device) / 2**20}
            rows.append(row)
            for sink in sinks:
                sink(row)
        loss, placed = rows[-1]["loss"], f"DeepSpeed {deepspeed.__version__}, ZeRO stage {zero_config(plan, settings)['zero_optimization']['stage']}"
        if hasattr(engine, "destroy"):
            engine.destroy()
        del engine
    timed = [r for r in rows if r["step"] > 1] or rows
    step_ms = sorted(r["step_ms"] for r in timed)[len(timed) // 2]
    out = {"status": "ok", "reason": "", "measured_by": "cuda allocator",
           "measured_peak_bytes": torch.cuda.max_memory_allocated(device),
           "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
           "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device),
           "measured_where": placed, "step_ms": step_ms,
           "tokens_per_s": settings.tokens_per_step(blocks.shape[1]) / (step_ms / 1e3), "loss_after": loss}
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
        """Rungs predicted to fit, fastest first: the order to try them in."""
        return [r["rung"] for r in sorted(self.table, key=lambda r: r["rank"]) if r["fits"]]


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
) -> FitChoice:
    """Pick the fastest rung predicted to fit `budget_mib` for `model` at `batch` x `seq`.

    `model` is a name, config.json path, PretrainedConfig or nn.Module (see predict.predict).
    Speed: measured `step_ms` where given, else the rung's `speed_rank`. Rungs that place
    nothing on the device (cpu) always fit and come last. `device`: the target; paged
    optimizer state can page out only on CUDA, so elsewhere it counts in full.
    """
    from workbench.core.memory.predict import predict

    budget = _check_budget(budget_mib)
    names = list(rungs or RUNGS)
    for n in names:
        rung(n)
    table = []
    for n in names:
        plan = RUNGS[n]
        p = (predictions or {}).get(n) or predict(model, n, batch=batch, seq=seq)
        need = p.fit_bytes if torch.device(device).type == "cuda" else p.peak_bytes
        measured = (step_ms or {}).get(n)
        # Measured step times rank first (in ms); rungs without one follow, by their speed prior.
        rank = (0, measured) if measured is not None else (1, plan.speed_rank)
        table.append({
            "rung": n, "tier": plan.tier, "predicted_peak_bytes": p.peak_bytes, "fit_bytes": need,
            "method": p.method, "fits": need <= budget, "rank": rank,
        })
    fitting = sorted((r for r in table if r["fits"]), key=lambda r: r["rank"])
    return FitChoice(fitting[0]["rung"] if fitting else None, budget, table)


def run_with_fallback(
    choice: FitChoice,
    attempt: Callable[[str], Any],
    *,
    log: Callable[[str], None] = print,
) -> tuple[str, Any, list[dict[str, Any]]]:
    """Try the fitting rungs fastest first; on a real OOM step down to the next one.

    `attempt(rung_name)` runs the job (inside its own device budget) and returns its result.
    Returns (rung that worked, its result, one row per attempt with its status).
    """
    tries = []
    for name in choice.order():
        t0 = time.perf_counter()
        try:
            result = attempt(name)
        except torch.OutOfMemoryError as e:
            tries.append({"rung": name, "status": "oom", "seconds": time.perf_counter() - t0, "error": str(e)[:200]})
            log(f"auto-fit: {name} ran out of memory; stepping down the ladder")
            continue
        tries.append({"rung": name, "status": "ok", "seconds": time.perf_counter() - t0, "error": ""})
        return name, result, tries
    raise torch.OutOfMemoryError(
        f"auto-fit: no rung fits {choice.budget_bytes / 2**20:.0f} MiB "
        f"(tried: {', '.join(t['rung'] for t in tries) or 'none predicted to fit'})"
    )
