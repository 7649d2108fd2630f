"""One training loop for every study: how does a model train, step by step, and what does each step cost?

    from workbench.core.training import TrainSettings, train, evaluate_perplexity
    result = train(model, train_blocks, TrainSettings(steps=100, micro_batch=8), sinks=[print])

The loop knows nothing about widgets, plots or files: it calls each sink with one plain dict
per optimizer step (step, loss, lr, tokens, step_ms, tokens_per_s, mem_mib; on CUDA also the
peak allocated / reserved MiB and NVML's used MiB, see memory.monitor.step_memory). Live charts and the
results writer are sinks. It supports autocast (bf16 or fp16 on CUDA with a grad scaler; bf16 on
CPU), gradient checkpointing, micro-batches with gradient accumulation, a warm-up + cosine or
linear schedule, and gradient clipping; it is seeded and deterministic on the CPU.

Labels: Hugging Face causal LMs shift labels inside the loss, so the loop passes
`labels=input_ids` unshifted (the published PyTorch twin shifted them twice).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

import torch

from workbench.core.common import Sink
from workbench.core.config import Config, ConfigError, param
from workbench.core.memory import monitor


class LossDiverged(FloatingPointError):
    """The training loss became NaN or infinite; the run's later figures would mean nothing."""


def check_loss(loss: float, step: int, lr: float) -> None:
    """Raise LossDiverged where the loss of `step` (from 1) is not finite, naming the peak `lr`."""
    if not math.isfinite(loss):
        raise LossDiverged(f"the loss became {loss} at step {step} (peak learning rate {lr:g}); "
                           "lower the learning rate")


@dataclass(frozen=True)
class TrainSettings(Config):
    steps: int = param(100, "optimizer steps to take")
    micro_batch: int = param(8, "sequences per forward/backward pass")
    grad_accum: int = param(1, "micro-batches accumulated per optimizer step")
    lr: float = param(1e-3, "peak learning rate")
    warmup_steps: int = param(0, "steps climbing linearly to the peak (0..steps; see lr_at)")
    schedule: Literal["cosine", "linear", "constant"] = param("cosine", "decay after warm-up")
    min_lr_ratio: float = param(0.1, "the floor of the decay as a share of the peak (see lr_at)")
    weight_decay: float = param(0.0, "AdamW weight decay")
    max_grad_norm: float = param(1.0, "gradient clipping norm (0 = off)")
    precision: Literal["fp32", "bf16", "fp16"] = param("fp32", "autocast dtype (fp16 needs CUDA)")
    grad_checkpointing: bool = param(False, "recompute activations in backward (saves memory)")
    seed: int = param(0, "seed for data order and dropout")

    def __post_init__(self):
        for name in ("steps", "micro_batch", "grad_accum"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ConfigError(f"warmup_steps must be in 0..steps (0..{self.steps}), got {self.warmup_steps}"
                              + (": lower warmup_steps or raise steps" if self.warmup_steps > 0 else ""))
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio (the decay's floor as a share of the peak) must be in [0, 1], "
                              f"got {self.min_lr_ratio}")

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based) of `steps`, counted as Hugging Face's
        schedulers count (`get_cosine_schedule_with_warmup`, `get_linear_schedule_with_warmup`), except
        that warm-up starts at lr / warmup_steps rather than 0:

        - warm-up: steps 0 .. w-1 climb linearly to the peak, lr * (i + 1) / w (w = warmup_steps);
        - decay: from the peak at step w over steps - w steps, towards the floor lr * min_lr_ratio,
          which step `steps` (one past the last) would take: the last step is one decay step above it
          (0.1001 of the peak at the study's 146 steps, 0.145 at the tiny study's 8). "constant"
          stays at the peak.

        Every run in results/ and the README, and the embedded base, trained on this curve; a
        change to it changes them all (a session that moved the floor to the last step was undone
        for this reason, 2026-11-28).
        """
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.lr * self.min_lr_ratio
        if self.schedule == "linear":
            return floor + (self.lr - floor) * (1 - progress)
        return floor + (self.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def tokens_per_step(self, seq_len: int) -> int:
        return self.micro_batch * self.grad_accum * seq_len


@dataclass
class TrainResult:
    steps: int
    tokens: int
    seconds: float  # every step's own time, the first included
    final_loss: float
    losses: list[float] = field(default_factory=list)
    first_step_seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Tokens a second over the steps after the first (its warm-up: on a card the first matmuls make
        the cuBLAS handles and load the kernels; study 2 leaves it out too); a run of one step is all there is."""
        steps, secs = (self.steps - 1, self.seconds - self.first_step_seconds) if self.steps > 1 else (1, self.seconds)
        return self.tokens * steps / self.steps / secs if secs > 0 else float("nan")


def autocast(device: torch.device, precision: str):
    """The autocast context for a precision on a device (fp32: no autocast)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError("fp16 autocast needs a CUDA device; use bf16 or fp32 on the CPU")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_optimizer(params: Iterable[torch.nn.Parameter], settings: TrainSettings, device: torch.device):
    """AdamW, fused where torch has a fused kernel (CPU and CUDA): the fastest choice on both."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ConfigError("nothing to train: no parameter requires a gradient")
    fused = device.type in ("cpu", "cuda") and all(p.dtype.is_floating_point for p in params)
    return torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay, fused=fused or None)


class BlockSampler:
    """Seeded epoch-wise shuffling of token blocks: the same seed gives the same batches."""

    def __init__(self, n_blocks: int, seed: int):
        self.n = n_blocks
        self.gen = torch.Generator().manual_seed(seed)
        self._order = torch.empty(0, dtype=torch.long)
        self._pos = 0

    def take(self, k: int) -> torch.Tensor:
        out = []
        while k > 0:
            if self._pos >= len(self._order):
                self._order = torch.randperm(self.n, generator=self.gen)
                self._pos = 0
            chunk = self._order[self._pos : self._pos + k]
            self._pos += len(chunk)
            k -= len(chunk)
            out.append(chunk)
        return torch.cat(out)


def train(
    model: torch.nn.Module,
    blocks: torch.Tensor,
    settings: TrainSettings,
    *,
    device: torch.device | str | None = None,
    sinks: Iterable[Sink] = (),
    optimizer: torch.optim.Optimizer | None = None,
    memory_probe: Callable[[], float | dict | None] | None = None,
    extra: dict[str, Any] | None = None,
    run_micro_batches: int | None = None,
) -> TrainResult:
    """Train `model` on `blocks` (LongTensor n_blocks x seq_len) for `settings.steps` steps.

    `run_micro_batches`: run only the first N micro-batches of each step (the memory prediction's
    shortcut, workbench.core.memory.predict; the step's blocks are still drawn, its loss still
    divided by `grad_accum`). None: all of them, as training must.

    `memory_probe` is called once per step and returns the step's peak device memory in MiB for its
    row (`mem_mib`; e.g. `LiveBytes.take_window_peak_mib`, `DeviceBudget.step_peak_mib`), or the row's
    memory columns (`DeviceBudget.step_memory`: a played card's modelled reserved peak too); None: on
    CUDA the allocator's peak so far, on the CPU nothing. `extra` is copied into every row.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if blocks.dim() != 2 or len(blocks) == 0:
        raise ConfigError("blocks must be a non-empty (n_blocks, seq_len) tensor")
    sinks = list(sinks)
    extra = dict(extra or {})
    torch.manual_seed(settings.seed)
    autocast(device, settings.precision)  # rejects fp16 without CUDA before anything runs
    use_cache, was_checkpointing = None, getattr(model, "is_activation_checkpointing", False)
    if settings.grad_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if getattr(model, "config", None) is not None:  # what transformers does then anyway, without its warning
            use_cache, model.config.use_cache = getattr(model.config, "use_cache", None), False
    try:
        model.train()
        if optimizer is None:
            optimizer = make_optimizer(model.parameters(), settings, device)
        trainable = [p for g in optimizer.param_groups for p in g["params"]]
        if settings.precision == "bf16" or any(p.dtype == torch.bfloat16 for p in trainable):
            if note := monitor.bf16_emulated(device):
                warnings.warn(note, stacklevel=2)
        scaler = torch.amp.GradScaler("cuda") if settings.precision == "fp16" else None
        if memory_probe is None and device.type == "cuda":
            # the run's peak so far
            memory_probe = lambda: torch.cuda.max_memory_allocated(device) / 2**20  # noqa: E731

        gpu_columns = monitor.step_memory(device) if sinks else None  # CUDA peaks and NVML; None on the CPU
        sampler = BlockSampler(len(blocks), settings.seed)
        seq_len = blocks.shape[1]
        tokens_per_step = settings.tokens_per_step(seq_len)
        losses: list[float] = []
        tokens = 0
        first = 0.0  # the first step's time (its warm-up)
        seconds = 0.0  # the steps' own time: what the sinks take (a live chart's redraw, a file write) is not training
        for step in range(settings.steps):
            t0 = time.perf_counter()
            lr = settings.lr_at(step)
            for g in optimizer.param_groups:
                g["lr"] = lr
            idx = sampler.take(settings.micro_batch * settings.grad_accum)
            loss_sum = torch.zeros((), device=device)
            for micro in idx.split(settings.micro_batch)[:run_micro_batches]:
                batch = blocks[micro].to(device, non_blocking=True)
                with autocast(device, settings.precision):
                    out = model(input_ids=batch, labels=batch)
                loss = out.loss / settings.grad_accum
                del out  # the output holds the logits: free them before backward (one logits tensor less at the peak)
                (scaler.scale(loss) if scaler else loss).backward()
                loss_sum += loss.detach()
            if scaler:
                scaler.unscale_(optimizer)
            if settings.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(trainable, settings.max_grad_norm)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value = float(loss_sum)  # a device sync point: the step's time includes its work
            dt = time.perf_counter() - t0
            first = dt if step == 0 else first
            seconds += dt
            tokens += tokens_per_step
            losses.append(loss_value)
            if sinks:
                row = {
                    **extra,
                    "step": step + 1,
                    "loss": loss_value,
                    "lr": lr,
                    "tokens": tokens,
                    "step_ms": dt * 1e3,
                    "tokens_per_s": tokens_per_step / dt if dt > 0 else float("nan"),
                    **_memory_columns(memory_probe),
                    **(gpu_columns() if gpu_columns else {}),
                }
                for sink in sinks:
                    sink(row)
            check_loss(loss_value, step + 1, settings.lr)
        return TrainResult(settings.steps, tokens, seconds, losses[-1], losses, first_step_seconds=first)
    finally:  # as it was, also when a step raises (an error, a notebook cell interrupted)
        if settings.grad_checkpointing and not was_checkpointing:
            model.activation_checkpointing_disable()
        if use_cache is not None:
            model.config.use_cache = use_cache


@torch.no_grad()
def evaluate_perplexity(
    model: torch.nn.Module,
    blocks: torch.Tensor,
    *,
    batch_size: int = 16,
    device: torch.device | str | None = None,
    precision: str = "fp32",
    max_blocks: int | None = None,
) -> float:
    """Token-weighted held-out perplexity: exp(total NLL / predicted tokens). A mean loss that is not
    finite (weights turned NaN by the last update, whose own loss was still finite) or whose exp
    overflows a float (past 709.78 nats) raises LossDiverged: the run's figures would mean nothing."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    if max_blocks is not None:
        blocks = blocks[:max_blocks]
    total, count = 0.0, 0
    model.eval()
    try:
        for batch in blocks.split(batch_size):
            batch = batch.to(device)
            with autocast(device, precision):
                out = model(input_ids=batch, labels=batch)
            n = batch.shape[0] * (batch.shape[1] - 1)  # the model predicts every token but the first
            total += float(out.loss) * n
            count += n
            del out
    finally:
        model.train(was_training)
    nll = total / count
    if not math.isfinite(nll) or nll > _EXP_MAX:
        raise LossDiverged(f"the held-out loss is {nll:.4g} nats a token: perplexity "
                           f"{'is not a number' if not math.isfinite(nll) else 'past any float'}; the weights have "
                           "diverged (lower the learning rate)")
    return math.exp(nll)


_EXP_MAX = math.log(sys.float_info.max)  # 709.78: math.exp overflows past it


def _memory_columns(probe: Callable[[], float | dict | None] | None) -> dict[str, Any]:
    """A step row's memory columns from the probe: its figure as mem_mib, or the columns it gives."""
    got = probe() if probe else None
    return dict(got) if isinstance(got, dict) else {"mem_mib": got}
