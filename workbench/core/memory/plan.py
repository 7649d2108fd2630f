"""What changes about a training step: the Plan, the named rungs, and building a plan.

    from workbench.core.memory.plan import RUNGS, rung, plan_from_flags
    RUNGS["bf16_ckpt"]                         # a Plan: precision, checkpointing, optimizer, ...
    plan_from_flags(precision="bf16-true", trainable="lora", lora_targets=("q_proj", "v_proj"))

Each rung is a small frozen `Plan` (study 2's ladder), built from the one above it
with `compose`, so a rung says only what it changes:

    Tier 1  fp32 -> fp16 / bf16 autocast (fp32 weights) -> pure bf16 weights, grads and AdamW
            state (bf16_true) -> + gradient checkpointing -> + smaller micro-batch with
            gradient accumulation
    Tier 2  8-bit AdamW, paged 8-bit AdamW (bitsandbytes); LoRA (also over pure bf16); QLoRA (4-bit NF4 base);
            accelerate device_map with max_memory (layers on the CPU); DeepSpeed ZeRO-Offload
            (optimizer on the CPU; optimizer and parameters on the CPU)
    Tier 3  CPU only

A setup that is not a rung composes from the command line's names with `plan_from_flags`.
`apply_trainable` and `make_plan_optimizer` turn a plan into a model and an optimizer the same way
for a real run (study 2's rungs, study 1's preflight) and for a prediction over fake tensors
(`workbench.core.memory.predict`), so the two run the same step. Plans live in core because every
study uses them; measuring a rung and auto-fit are study 2's (workbench.studies.ladder.rungs).
"""


from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers.pytorch_utils import Conv1D

from workbench.core.config import ConfigError
from workbench.core.trainable import (StrategyNotApplicable, apply_strategy, keep_4bit_backward, lora_config,
                                      names_module)
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
OFFLOADS = ("device_map", "zero_offload", "zero_offload_params")  # a card's and the host's memory: one on a CPU
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

    def split(self, batch: int) -> tuple[int, int]:
        """(micro-batch, micro-batches per step) for `batch` sequences per step, the whole batch kept:
        `accum` micro-batches when `accum` divides it, else the fewest more that do (batch 6 at accum 4:
        6 of 1), or `batch` micro-batches of one when the batch is smaller than `accum`."""
        n = next((n for n in range(self.accum, batch + 1) if batch % n == 0), batch)
        return batch // n, n

    def settings(self, batch: int, steps: int, **overrides: Any) -> TrainSettings:
        """The TrainSettings this plan runs with for `batch` sequences per optimizer step."""
        micro, n = self.split(batch)
        return TrainSettings.from_dict(
            dict(steps=steps, micro_batch=micro, grad_accum=n,
                 precision=self.autocast_precision, grad_checkpointing=self.grad_checkpointing, **overrides)
        )

    def cannot_run_here(self, device: torch.device) -> str | None:
        """Why this plan cannot be measured on `device` (None: it can)."""
        if self.placement in OFFLOADS:
            if device.type != "cuda":
                return (f"{self.placement} moves tensors between a GPU and the host; measured on the CPU, "
                        f"where both are the same memory, it has no device peak (`workbench gpu-check` "
                        f"measures it on a card)")
        if self.precision == "fp16" and device.type != "cuda":  # fp16_true runs anywhere: no GradScaler
            return ("fp16 autocast with a GradScaler needs CUDA, and this measurement is on the CPU (which runs "
                    "bf16 autocast; `workbench gpu-check` measures a card)")
        return None

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items()}


# ------------------------------------------------------------------------------------------------
# the registry: each rung is the one above it plus one change

def _ladder() -> dict[str, Plan]:
    fp32 = Plan("fp32", 1, "fp32 weights, grads and fused AdamW state (the baseline)", speed_rank=3)
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
    pure_lora = pure.compose("bf16_true_lora", "pure bf16 base + LoRA r=8 on every decoder linear (peft; its "
                             "adapters, their grads and AdamW state fp32, peft's default)",
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

# QLoRA's recipe (Dettmers et al. 2023): NF4 weights, their absmax quantized again (double quantization).
# quantize_4bit and a 4-bit load through transformers (bnb_4bit_config) both use it, so a prediction
# quantizes as the run it is compared with loads.
DOUBLE_QUANT = True


def bnb_4bit_config(compute_dtype: torch.dtype):
    """transformers' BitsAndBytesConfig for loading a model in 4 bits as quantize_4bit quantizes one."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=DOUBLE_QUANT,
                              bnb_4bit_compute_dtype=compute_dtype)


def quantize_4bit(model: torch.nn.Module, compute_dtype: torch.dtype, *, skip: tuple[str, ...] = ("lm_head",),
                  device: torch.device | None = None) -> int:
    """Replace every nn.Linear outside `skip` by a bitsandbytes NF4 Linear4bit, in place. GPT-2's
    Conv1D layers (a linear layer stored transposed) are replaced too, their weight transposed, as
    transformers' own 4-bit loading does; before, a GPT-2 model kept them whole and QLoRA on it
    stopped with a traceback.

    The weights are quantized for real (bitsandbytes cannot run under fake tensors) on `device`
    (default: the device the layer is on): on CUDA by bitsandbytes' CUDA kernels, so a QLoRA model
    keeps its 4-bit weights and quantization state there. A model on the host quantized onto a
    card (as ladder.rungs.measure loads one) sends one layer's fp32 copy there at a time, which
    bitsandbytes frees after quantizing it: the card never holds all the fp32 linear weights at once
    (most of a 7B model's 30 GB; card_load.quantize_onto_card replays it). On the CPU on the CPU; on the meta
    device (a prediction needs the bytes, not the values) from zeros on the CPU, once per shape:
    layers of one shape get copies of the same result (their own storage; a 7B model's 196 layers
    have 6 shapes, and quantizing each on the CPU took most of a prediction's time).
    Returns the number of layers replaced.
    """
    try:
        import bitsandbytes as bnb
    except ImportError as e:  # a QLoRA row that says so (skipped), not a study ended in a traceback
        raise StrategyNotApplicable("QLoRA needs bitsandbytes, which is not installed") from e

    n = 0
    zeros: dict[tuple[int, ...], tuple[torch.Tensor, Any]] = {}  # meta: shape -> (4-bit data, quant state)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            conv1d = isinstance(child, Conv1D)
            if not (type(child) is torch.nn.Linear or conv1d) or any(full.endswith(s) for s in skip):
                continue
            in_features, out_features = child.weight.shape if conv1d else (child.in_features, child.out_features)
            q = bnb.nn.Linear4bit(in_features, out_features, child.bias is not None,
                                  compute_dtype=compute_dtype, compress_statistics=DOUBLE_QUANT, quant_type="nf4",
                                  device="meta")
            w = child.weight.data.T.contiguous() if conv1d else child.weight.data
            if w.device.type != "meta":
                q.weight = bnb.nn.Params4bit(w.float(), requires_grad=False, compress_statistics=DOUBLE_QUANT,
                                             quant_type="nf4", module=q)._quantize(device or w.device)
            else:
                if tuple(w.shape) not in zeros:
                    done = bnb.nn.Params4bit(torch.zeros(w.shape, dtype=torch.float32), requires_grad=False,
                                             compress_statistics=DOUBLE_QUANT, quant_type="nf4")._quantize(torch.device("cpu"))
                    zeros[tuple(w.shape)] = (done.data, done.quant_state)
                data, state = zeros[tuple(w.shape)]
                q.weight = bnb.nn.Params4bit(data.clone(), requires_grad=False, quant_state=copy.deepcopy(state),
                                             compress_statistics=DOUBLE_QUANT, quant_type="nf4", module=q, bnb_quantized=True)
                q.quant_state = q.weight.quant_state
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(module, child_name, q)
            n += 1
    keep_4bit_backward(model)  # an evaluation in eval mode must not take the gradient away
    return n


def check_lora_targets(model: torch.nn.Module, targets: tuple[str, ...]) -> None:
    """Each target must name a linear module of `model` (peft matches a name's last parts): an
    nn.Linear, a 4-bit one, or GPT-2's Conv1D (peft wraps it; c_attn is GPT-2's usual target)."""
    names = [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))]
    missing = [t for t in targets if not any(names_module(n, (t,)) for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ConfigError(f"--lora-targets {','.join(missing)} names no linear module of this model; "
                          f"use some of: {','.join(leaves)}")


def apply_trainable(model: torch.nn.Module, plan: Plan, device: torch.device | None = None) -> torch.nn.Module:
    """What trains under the plan, on `model` (real or on the meta device): the same selection
    code as study 1 (workbench.core.trainable), after 4-bit quantization for QLoRA (onto `device`,
    default the model's: quantize_4bit). A pure-half plan casts the weights to 16 bits first (peft
    then keeps LoRA adapters in fp32, its default)."""

    if plan.pure_half:
        model = model.to(plan.half_dtype)
    if plan.trainable == "full":
        return model
    if plan.lora_targets is not None:
        check_lora_targets(model, plan.lora_targets)
    if plan.trainable == "qlora":
        from peft import prepare_model_for_kbit_training

        quantize_4bit(model, plan.half_dtype or torch.float32, device=device)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=plan.grad_checkpointing)
    if plan.lora_targets is not None:
        from peft import get_peft_model

        if plan.trainable == "lora":
            for p in model.parameters():
                p.requires_grad_(False)
        return get_peft_model(model, lora_config(model, plan.lora_rank, list(plan.lora_targets)))
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

    # Paging is CUDA unified memory: on CPU tensors bitsandbytes runs a paged optimizer unpaged, with
    # a warning at its first step (a red box in every notebook and app). That is this class, built
    # as such; the row's note says so (predict.py).
    paged = plan.optimizer == "paged_adamw8bit" and device.type == "cuda"
    cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
    return cls(params, lr=settings.lr, weight_decay=settings.weight_decay)


def host_step_counters(optimizer) -> list[torch.Tensor]:
    """The step counters torch's foreach and single-tensor loops keep on the host whatever their parameter's
    device (a CPU scalar each: torch/optim/adam.py `_init_group`); fused and capturable ones keep theirs on it."""
    return [s["step"] for g in optimizer.param_groups if not (g.get("fused") or g.get("capturable"))
            for p in g["params"] if isinstance((s := optimizer.state.get(p, {})).get("step"), torch.Tensor)]


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
    if micro <= 0:
        raise ConfigError(f"--micro-batch must be a positive integer, got {micro}")
    if batch % micro:
        raise ConfigError(f"--micro-batch {micro} must divide --batch {batch} (the effective batch stays the same)")
    if lora_targets is not None and trainable not in ("lora", "qlora"):
        raise ConfigError("--lora-targets needs --trainable lora or qlora")
    help_ = (f"{precision}, {optimizer}, {trainable}" + (f" r={lora_rank}" if trainable in ("lora", "qlora") else "")
             + (", checkpointing" if checkpointing else "") + (f", micro-batch {micro}" if micro != batch else ""))
    return Plan(name, 0, help_, precision=CLI_PRECISIONS[precision], grad_checkpointing=checkpointing,
                accum=batch // micro, optimizer=CLI_OPTIMIZERS[optimizer], trainable=trainable,
                lora_rank=lora_rank, lora_targets=tuple(lora_targets) if lora_targets else None)


PAGED_FROM = 100_000  # bitsandbytes' Optimizer8bit.get_state_buffer: a parameter this large gets paged state


def paged_state(optimizer) -> list[torch.Tensor]:
    """What a paged bitsandbytes optimizer puts in CUDA managed memory (get_paged): the two states of
    each parameter of PAGED_FROM elements or more. The rest is torch's allocator's, as a card runs it:
    a smaller parameter's states (torch.zeros_like), the block-wise absmax, the quantization maps."""
    return [s[k] for p, s in optimizer.state.items() if p.numel() >= PAGED_FROM
            for k in ("state1", "state2") if isinstance(s.get(k), torch.Tensor)]
