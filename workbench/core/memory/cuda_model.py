"""What does a CUDA card do differently from the CPU, and what will nvidia-smi show? The CUDA model.

    from workbench.core.memory.predict import predict
    p = predict("data/configs/qwen2-0.5b.json", "bf16", batch=1, seq=512, device="cuda", card="RTX 4060 Ti 8GB")
    p.allocated_peak_bytes, p.reserved_peak_bytes, p.nvidia_smi_bytes, p.fits

A prediction for a CUDA card runs the same training step over fake *CPU* tensors (a CPU-only torch
cannot run CUDA kernels, not even fake ones: autograd cannot make a CUDA leaf's accumulator), with
`cuda_step()` active, which makes the choices CUDA would make (simulated):

- attention (workbench.core.memory.cuda_attention): `scaled_dot_product_attention` goes to the kernel
  torch's sdp_utils.cpp picks on the card (cuDNN first where torch prefers it: sm_90/sm_100-class
  cards with a cuDNN past 9.15; then flash, memory-efficient, math), called through its aten op so
  autograd saves what that kernel saves (flash and memory-efficient: output + logsumexp, no S x S
  matrix), or for math (fp32 where flash does not run, bf16 before sm_80) the composite kernel op
  for op as it runs on real tensors (its fp32 S x S softmax kept);
- dropout: `native_dropout`, as `at::dropout` picks for CUDA tensors (a 1-byte bool mask; the CPU
  keeps an fp32/bf16 noise tensor);
- autocast: the CPU's autocast runs (it casts matmuls and linears as CUDA's does and keeps the
  cast-weight cache); on top, the ops that only CUDA's lists name are corrected: CUDA runs
  `softmax`, `log_softmax`, `sum`, `cumsum`, `prod` with dtype=float32, casts 16-bit inputs of
  `exp`, `log`, `pow`, `rsqrt`, `layer_norm`, ... to fp32 and `einsum`, `addmv`, `mv`, ... to 16 bits.
  Ops only the CPU's fp32 list names (fft, linalg, quantile, ...) are not reverted;
- optimizer: `adamw_torch` is built with foreach=True (torch's default for CUDA tensors).

Then the allocator (modelled, workbench.core.memory.allocator): the step's allocation timeline
replayed through the rules of c10/cuda/CUDACachingAllocator.cpp gives the allocated peak (rounded
block sizes, what `max_memory_allocated` reports) and the reserved peak (segments,
`max_memory_reserved`). nvidia-smi adds the CUDA context (a per-card constant, modelled) to the
reserved figure; the cuBLAS workspaces (`Card.cublas_workspaces`) are allocations inside it.
Where they are made matters (`workspaces_in`): in a fresh process, each thread's first cuBLAS call
makes its workspace right after that call's output, from whatever cached block fits, and it is
never freed; a process that ran the step before holds them where that run made them (`after_a_run`).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from workbench.core import training
from workbench.core.common import MiB
from workbench.core.config import ConfigError
from workbench.core.memory.accounting import EMPTY_CACHE, EMPTY_CACHE_SERIAL
from workbench.core.memory.cuda_attention import (DEFAULT_SM, cuda_sdpa, math_attention, prefers_cudnn,  # noqa: F401
                                                  sdpa_backend)

GiB = 2**30
# ------------------------------------------------------------------------------------------------
# cards: memory, compute capability, and the CUDA context (modelled)

# CUDA context + kernel images: memory a process holds on the card outside torch's allocator.
# Not measured here. The one figure a source states with its setup: discuss.pytorch.org, "What is
# the reason for pytorch's GPU memory floor?" (torch 1.x, eager module loading): `th.randn(1).cuda()`
# took 723 MiB, of which 2 MiB is the tensor's segment, so 721 MiB of context ("High gpu memory
# overhead": "~700+MB", "~800mb"). Lazy module loading (CUDA's default on Linux since 12.2) is said
# to be smaller, by no figure we found; the one card measured here with it (an H200, sm_90, CUDA
# 13, after a training step: NVML used - reserved - the driver's 615 MiB reserve) held 769 MiB. So 721 MiB on every
# card without a measurement of its own, a stated constant likelier low than high. (It was 500 MiB, attributed to
# those reports, which give no such figure: an audit, 2026-11-28.)
CONTEXT_BYTES = 721 * MiB


ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch 2.13 reads both (c10 AllocatorConfig.h)


# the allocator settings torch 2.13 reads (c10/core/AllocatorConfig.h) that change its segments or
# reuse: the model plays the defaults (expandable_segments:false is the default)
ALLOC_SETTINGS = ("expandable_segments:true", "max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb",
                  "roundup_power2_divisions", "garbage_collection_threshold")


def allocator_settings() -> list[str]:
    """The settings of ALLOC_SETTINGS this process's PYTORCH_(CUDA_)ALLOC_CONF makes (not modelled), and
    what replaces the caching allocator itself: CUDA's own (backend:cudaMallocAsync) or none
    (PYTORCH_NO_CUDA_MEMORY_CACHING=1, each tensor its own cudaMalloc)."""
    conf = ",".join(os.environ.get(v, "") for v in ALLOC_CONF_VARS).replace(" ", "").lower()
    found = [s.split(":")[0] for s in ALLOC_SETTINGS if s in conf]
    found += ["backend:cudaMallocAsync"] if "backend:cudamallocasync" in conf else []
    return found + (["PYTORCH_NO_CUDA_MEMORY_CACHING"] if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1" else [])


@dataclass(frozen=True)
class Card:
    name: str
    total_bytes: int  # what the card reports as total (a preset: nvidia-smi's; a card at hand: torch's)
    sm: int  # compute capability x 10 (86: sm_86)
    context_bytes: int = CONTEXT_BYTES
    context_source: str = "modelled (per-card constant)"  # its source; "here" (card_free_now): in use on the card now
    # the driver's and firmware's reserve (NVML v2 `reserved`): in nvidia-smi's total, not in torch's nor nvidia-smi's
    # used. Measured on the H200 (0.43% of it); 0 on other presets (their room too high if theirs is alike)
    driver_reserved_bytes: int = 0

    @property
    def usable_bytes(self) -> int:
        """What the card leaves after the CUDA context and the driver's reserve: the most its allocator can reserve."""
        return self.total_bytes - self.context_bytes - self.driver_reserved_bytes

    @property
    def cublas_workspace_bytes(self) -> int:
        """torch's default cuBLAS workspace per handle (aten/src/ATen/cuda/CublasHandlePool.cpp,
        parseChosenWorkspaceSize): 32 MiB on sm_90/10x/12x, else 4096 KiB x 2 + 16 KiB x 8."""
        return 4096 * 8 * 1024 if self.sm // 10 in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8

    @property
    def cublas_workspaces(self) -> list[tuple[str, int]]:
        """The workspaces a training step holds, made before it and never freed: two cuBLAS
        handles, the forward's thread and autograd's device thread for backward."""
        ws = self.cublas_workspace_bytes
        return [("cuBLAS workspace (forward)", ws), ("cuBLAS workspace (backward)", ws)]


# aten ops that call cuBLAS (as the dispatch mode sees them: linear and matmul arrive decomposed)
CUBLAS_OPS = ("mm.", "addmm.", "bmm.", "baddbmm.", "addbmm.", "addmv.", "mv.", "_scaled_mm.")
WORKSPACES = ("fresh", "held")


def workspaces_in(card: "Card", ops: list[str] | None, workspaces: str = "fresh") -> list[tuple]:
    """The cuBLAS workspaces as the allocator replay takes them (allocator.replay's extra_allocs).

    "fresh" (a training script's own process, a kernel's first run): torch makes a handle's workspace
    inside its first cuBLAS call (CublasHandlePool.cpp, getCurrentCUDABlasHandle: one per handle and
    stream), through the caching allocator, after the call's output: the forward's on the thread
    that runs the model, backward's on autograd's device thread. Each is placed right after the
    output of the first cuBLAS op of its phase in the simulated timeline (`ops`, the report's
    timeline_ops); a cached free block it fits is split (on the H200 the backward's took a freed 298
    MiB logits block, and the next step's logits needed a segment more: +298 MiB reserved).
    "held": both exist before the step, each in its own segment. This is the ops-less case (a report
    with no timeline); `predict(workspaces="held")` replays a run before the step (`after_a_run`)."""
    if workspaces not in WORKSPACES:
        raise ValueError(f"workspaces must be one of {', '.join(WORKSPACES)}, got {workspaces!r}")
    names = card.cublas_workspaces
    if workspaces == "held" or not ops:
        return list(names)
    at = {}
    for i, op in enumerate(ops):
        phase, _, name = op.partition(": ")
        if phase in ("forward", "backward") and phase not in at and name.startswith(CUBLAS_OPS):
            at[phase] = i
    return [(name, n, at.get(phase)) for (name, n), phase in zip(names, ("forward", "backward"))]


def after_a_run(events, steps_of, roles: dict, streams: dict | None, before=None):
    """The timeline of a process that has run this step before ("held" workspaces: a notebook kernel
    that trained already, a gpu-check rung after another): the first step replayed as a fresh process
    runs it (`workspaces_in`'s positions make the workspaces inside it), everything it made freed and
    the cache emptied (`torch.cuda.empty_cache()`, as gpu-check and the studies do between runs), then
    the step. A workspace stays where that first run made it, in a segment it keeps with the rest of
    that segment free (on the H200, measured after fp32 in one process: bf16_ckpt 9,342 MiB reserved,
    9,356 so predicted; adamw8bit 6,384 and 6,382). The prefix's serials are negated (-s - 1) and
    its steps are -1, so replay's step logic (cuts, the steady state) sees only the step. `before`:
    (events, steps_of, roles) of another setup whose first step is replayed instead, a process that
    trained that setup first (its streams taken as the default one's; on the H200, fp32 after
    bf16_true_lora: 9,792 MiB measured, 9,790 so predicted). Returns (events, steps_of, roles,
    streams, prefix length)."""
    b_events, b_steps, b_roles = before if before is not None else (events, steps_of, roles)
    n = next((i for i, k in enumerate(b_steps) if k >= 1), len(b_events))
    live: dict[int, None] = {}
    for serial, nbytes in b_events[:n]:
        if nbytes >= 0:
            live[serial] = None
        elif nbytes == -1:
            live.pop(serial, None)
    prefix = [(serial if nbytes == EMPTY_CACHE else -serial - 1, nbytes) for serial, nbytes in b_events[:n]]
    prefix += [(-serial - 1, -1) for serial in live] + [(EMPTY_CACHE_SERIAL, EMPTY_CACHE)]
    roles = {**roles, **{-k - 1: r for k, r in b_roles.items()}}
    if before is None:
        streams = {**(streams or {}), **{-k - 1: st for k, st in (streams or {}).items()}} or None
    return prefix + list(events), [-1] * len(prefix) + list(steps_of), roles, streams, len(prefix)


CARDS = {c.name: c for c in (
    # totals as nvidia-smi reports them (its "MiB / NMiB" column, read in users' posted outputs, each
    # figure the same in several): the Ada cards and the L4, A10G and H100 show less than their
    # nominal GiB (RTX 4090: 24,564 MiB; L4: 23,034; A10G: 23,028; H100 80GB, SXM and PCIe: 81,559)
    Card("RTX 3060 12GB", 12 * GiB, 86),
    Card("RTX 3090 24GB", 24 * GiB, 86),
    Card("RTX 4060 8GB", 8188 * MiB, 89),
    Card("RTX 4060 Ti 8GB", 8188 * MiB, 89),
    Card("RTX 4060 Ti 16GB", 16380 * MiB, 89),
    Card("RTX 4090 24GB", 24564 * MiB, 89),
    # consumer Blackwell (sm_120: flash, not cuDNN, first; the sm_86-89 head-dim rule for training)
    Card("RTX 5060 Ti 16GB", 16311 * MiB, 120),
    Card("RTX 5090 32GB", 32607 * MiB, 120),
    Card("T4 16GB", 15 * GiB, 75),
    # before sm_80 (bf16 emulated, no flash attention); torch's CUDA 12.9 and 13 builds start at sm_75,
    # so a V100 or a P100 (Kaggle's) trains under a CUDA 12.6 build. The V100 16GB's and the P100's
    # totals are torch's (get_device_properties as users post it: total_memory=16160MB, 16280MB; ECC
    # takes its share)
    Card("RTX 2060 6GB", 6 * GiB, 75),
    Card("RTX 2080 Ti 11GB", 11 * GiB, 75),
    Card("V100 16GB", 16160 * MiB, 70),
    Card("V100 32GB", 32 * GiB, 70),
    Card("P100 16GB", 16280 * MiB, 60),
    Card("L4 24GB", 23034 * MiB, 89),
    Card("A10G 24GB", 23028 * MiB, 86),
    Card("A100 40GB", 40 * GiB, 80),
    Card("A100 80GB", 80 * GiB, 80),
    Card("H100 80GB", 81559 * MiB, 90),
    Card("B200 180GB", 183359 * MiB, 100),  # data-centre Blackwell: cuDNN's attention first, as on sm_90
    # measured by `workbench gpu-check` (2026-11-22; torch 2.11, CUDA 13.0, driver 580): NVML's v1 used less
    # max_memory_reserved was 1,366-1,384 MiB on every rung before paged state or DeepSpeed added their own. It
    # counts the driver's reserve (v2: 615 MiB on every rung of 2026-11-30), which nvidia-smi's used leaves out:
    # context 1,384 - 615 = 769 MiB. nvidia-smi's total is 143,771 MiB, torch's 143,156 (the reserve out)
    Card("H200 141GB", 143771 * MiB, 90, context_bytes=769 * MiB,
         context_source="modelled (per-card constant, measured on an H200 by gpu-check on 2026-11-22 and "
                        "2026-11-30: that card's figure agrees by construction)",
         driver_reserved_bytes=615 * MiB),
)}


MAX_CARD_GIB = 1024  # more than any card's memory (an H200's 141 GiB, a B200's 180)


def card(spec: str | float | Card | None) -> Card | None:
    """A card preset by name (case and spaces ignored), a size in GiB (sm_80 assumed), or "here":
    this machine's card as it is now (card_free_now: what CUDA reports free)."""

    if spec is None or isinstance(spec, Card):
        return spec
    if str(spec).strip().lower() == "here":
        if not torch.cuda.is_available():
            raise ConfigError("--card here: this machine has no CUDA card; name one (e.g. 'T4 16GB') or give its GiB")
        return card_free_now()
    text = str(spec).strip()
    try:  # a number of GiB, its unit written or not ("8", "8 GiB"; "8GB" is a name, GB not being GiB)
        gib = float(text[:-3] if text.lower().endswith("gib") else text)
    except (TypeError, ValueError):
        key = text.lower().replace(" ", "").replace("gb", "")
        names = {c.name.lower().replace(" ", "").replace("gb", ""): c for c in CARDS.values()}
        if key in names:
            return names[key]
        begun = [c for n, c in names.items() if key and n.startswith(key)]  # "T4": the one preset it begins
        if len(begun) == 1:
            return begun[0]
        raise ConfigError(f"unknown card {spec!r}" + (f" (it begins {', '.join(c.name for c in begun)})" if begun else "")
                          + f"; give its size as a number of GiB (e.g. 8) or one of: {', '.join(CARDS)}") from None
    if not (0 < gib <= MAX_CARD_GIB):  # a NaN or infinity fails it too; 1e9 had given a terabyte of headroom
        near = [c for c in CARDS if text.upper() in c.upper().split()]  # "4090": RTX 4090 24GB
        raise ConfigError(f"--card must be a card name or its size in GiB (more than 0, at most {MAX_CARD_GIB:,}), "
                          f"got {spec!r}" + (f"; did you mean {', '.join(map(repr, near))}?" if near else ""))
    return Card(f"{gib:g} GiB card", int(gib * GiB), DEFAULT_SM)


def card_of(name: str, total_bytes: int, sm: int) -> Card:
    """A real card as torch reports it ("NVIDIA GeForce RTX 4090"): its own memory and compute
    capability, with the context constant of the preset it is (name and sm), else the default (torch's total:
    the driver's reserve out already)."""
    preset = next((c for c in CARDS.values() if " ".join(c.name.split()[:-1]) in name and c.sm == sm), None)
    return Card(name, total_bytes, sm, preset.context_bytes, preset.context_source) if preset else \
        Card(name, total_bytes, sm)


def card_at_hand(device="cuda") -> Card:
    """CUDA: this machine's card as a prediction's card (card_of: its preset's context, if any)."""
    props = torch.cuda.get_device_properties(device)
    return card_of(props.name, props.total_memory, props.major * 10 + props.minor)


def card_free_now(device="cuda") -> Card:
    """CUDA: this machine's card as this process finds it now. A desktop card drives a display and
    others' processes share a card: what this process's allocator can take is what CUDA reports free
    (their memory and this process's context already out) plus what it holds itself. The rest is
    the card's "context" here, measured, so a prediction's fits and headroom are the card's as it is,
    and its nvidia-smi figure is the whole card's."""
    at_hand = card_at_hand(device)
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free - torch.cuda.memory_reserved(device)
    return Card(at_hand.name, total, at_hand.sm, in_use,
                "measured now: this process's CUDA context and what other processes use")


# ------------------------------------------------------------------------------------------------
# autocast: where CUDA's op lists differ from the CPU's (aten/src/ATen/autocast_mode.cpp)

CUDA_FP32 = frozenset("acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow "
                      "__pow__ __rpow__ softplus layer_norm group_norm cosine_similarity logsumexp renorm dist".split())
# fp32_set_opt_dtype, and norm's fp32_append_dtype: computed and returned in fp32 from the 16-bit input,
# which is what backward keeps (no fp32 copy of it, as a cast to fp32 would make)
CUDA_FP32_OPT_DTYPE = frozenset("softmax log_softmax sum prod cumsum cumprod linalg_vector_norm linalg_matrix_norm "
                                "norm".split())
CUDA_LOWER = frozenset("addmv addr einsum mv chain_matmul linalg_multi_dot".split())  # (Python's names)


def _cast(obj, to, src):
    if isinstance(obj, torch.Tensor) and obj.is_floating_point() and obj.dtype in src:
        return obj.to(to)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(o, to, src) for o in obj)
    return obj


class CudaChoices(TorchFunctionMode):
    """Reroutes SDPA, dropout and the CUDA-only autocast list entries; everything else runs as is.

    `host()` suspends every active instance: code that a CUDA run executes on the CPU (the layers
    accelerate's device_map keeps in host memory) makes the CPU's choices."""

    active: list["CudaChoices"] = []  # entered instances, innermost last

    def __init__(self, sm: int = DEFAULT_SM, under_a_mode: bool = False):
        super().__init__()
        self.sm = sm
        self.under_a_mode = under_a_mode  # the card's run is under a dispatch mode (cuda_attention.cuda_sdpa)
        self.kernels: dict[str, int] = {}  # attention kernels chosen, for the report
        self.suspended = 0

    def __enter__(self):
        CudaChoices.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        CudaChoices.active.remove(self)
        return super().__exit__(*exc)

    @staticmethod
    @contextlib.contextmanager
    def host():
        modes = list(CudaChoices.active)
        for m in modes:
            m.suspended += 1
        try:
            yield
        finally:
            for m in modes:
                m.suspended -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if self.suspended:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "scaled_dot_product_attention":
            return cuda_sdpa(*args, **kwargs, sm=self.sm, chosen=self.kernels, under_a_mode=self.under_a_mode)
        if func is torch.nn.functional.dropout:
            x = args[0]
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            inplace = kwargs.get("inplace", args[3] if len(args) > 3 else False)
            if training and 0 < p < 1 and not inplace and x.numel() > 0:
                return torch.native_dropout(x, p, True)[0]  # 1-byte mask, as at::dropout on CUDA
        if torch.is_autocast_enabled("cpu"):
            half = (torch.float16, torch.bfloat16)
            if name in CUDA_FP32_OPT_DTYPE and kwargs.get("dtype") is None and args \
                    and isinstance(args[0], torch.Tensor) and args[0].dtype in half:
                kwargs["dtype"] = torch.float32
            elif name in CUDA_FP32:
                args, kwargs = _cast(args, torch.float32, half), {k: _cast(v, torch.float32, half) for k, v in kwargs.items()}
            elif name in CUDA_LOWER:
                dt = torch.get_autocast_dtype("cpu")
                args = _cast(args, dt, (torch.float32,))
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_step(sm: int = DEFAULT_SM, under_a_mode: bool = False):
    """The simulated step makes CUDA's choices; fp16 autocast runs on fake CPU tensors. The GradScaler does
    not: torch disables it without CUDA, so its few 512-byte blocks (scale, growth tracker, found-inf
    flag, the scaled loss) are not in the step (predict's note says so).
    `under_a_mode`: as a card runs the step under a Python dispatch mode (the live-bytes count)."""
    original = training.autocast

    def autocast(device, precision):
        if precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)

    # Checkpointed layers recompute in backward, where this mode is not on the stack: give the
    # recomputation the same choices, or it saves different tensors than the forward did.
    from transformers import modeling_utils

    checkpoint = modeling_utils.checkpoint

    def choices_as_now():  # called in the forward: a layer running on the host recomputes on the host
        recompute = CudaChoices(sm, under_a_mode)
        recompute.suspended = int(any(m.suspended for m in CudaChoices.active))
        recompute.kernels = mode.kernels  # a recomputed attention is a kernel call too
        return contextlib.nullcontext(), recompute

    def checkpoint_with_choices(function, *args, **kwargs):
        if not kwargs.get("use_reentrant", True) and "context_fn" not in kwargs:
            kwargs["context_fn"] = choices_as_now
        return checkpoint(function, *args, **kwargs)

    training.autocast = autocast
    modeling_utils.checkpoint = checkpoint_with_choices
    mode = CudaChoices(sm, under_a_mode)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*GradScaler is enabled, but CUDA is not available.*")
            with mode:
                yield mode
    finally:
        training.autocast = original
        modeling_utils.checkpoint = checkpoint
