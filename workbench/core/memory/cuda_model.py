"""What does a CUDA card do differently from the CPU, and what will nvidia-smi show? The CUDA model.

    from workbench.core.memory.predict import predict
    p = predict("data/configs/qwen2-0.5b.json", "bf16", batch=1, seq=512, device="cuda", card="RTX 4060 Ti 8GB")
    p.allocated_peak_bytes, p.reserved_peak_bytes, p.nvidia_smi_bytes, p.fits

A prediction for a CUDA card runs the same training step over fake *CPU* tensors (a CPU-only torch
cannot run CUDA kernels, not even fake ones: autograd cannot make a CUDA leaf's accumulator), with
`cuda_step()` active, which makes the choices CUDA would make (simulated):

- attention: `scaled_dot_product_attention` goes to the kernel torch's sdp_utils.cpp picks on the
  card (flash, then memory-efficient, then math; cuDNN attention is not modelled), called through
  its aten op so autograd saves what that kernel saves (flash and memory-efficient: output +
  logsumexp, no S x S matrix; math, bf16 before sm_80: the composite kernel's fp32 S x S softmax);
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
never freed; a process that has run a matmul before holds them already.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from workbench.core import training
from workbench.core.common import MiB
from workbench.core.config import ConfigError

GiB = 2**30

# ------------------------------------------------------------------------------------------------
# cards: memory, compute capability, and the CUDA context (modelled)

# CUDA context + kernel images: memory a process holds on the card outside torch's allocator.
# Not measured here; discuss.pytorch.org reports 700-800 MiB before lazy module loading
# ("High gpu memory overhead", "What is the reason for pytorch's GPU memory floor?": 723 MiB);
# with CUDA_MODULE_LOADING=LAZY (torch's default since CUDA 11.7) it is smaller. Modelled at
# 500 MiB on every card, +-250 MiB; `workbench gpu-check` measures it (NVML used - reserved):
# an H200 (sm_90, CUDA 13) measured 1,384 MiB, well above this, so on other cards too it may be low.
CONTEXT_BYTES = 500 * MiB


@dataclass(frozen=True)
class Card:
    name: str
    total_bytes: int  # what the card reports as total (nvidia-smi)
    sm: int  # compute capability x 10 (86: sm_86)
    context_bytes: int = CONTEXT_BYTES
    # where context_bytes comes from; "here" (card_free_now) measures what is in use on the card now
    context_source: str = "modelled (per-card constant)"

    @property
    def usable_bytes(self) -> int:
        """What the card leaves after the CUDA context: the most its allocator can reserve."""
        return self.total_bytes - self.context_bytes

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
    timeline_ops); a cached free block it fits is split, and the rest of that segment can no longer
    hold what it held before. On the H200 (2026-11-26) the backward's workspace took a freed 298 MiB
    logits block this way, and the next step's logits needed a segment more (+298 MiB reserved).
    "held": a process that has made them already (a notebook kernel that trained before): both
    exist before the step, each in its own segment. Without ops (a report with no timeline), held."""
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


CARDS = {c.name: c for c in (
    Card("RTX 3060 12GB", 12 * GiB, 86),
    Card("RTX 3090 24GB", 24 * GiB, 86),
    Card("RTX 4060 8GB", 8 * GiB, 89),
    Card("RTX 4060 Ti 8GB", 8 * GiB, 89),
    Card("RTX 4060 Ti 16GB", 16 * GiB, 89),
    Card("RTX 4090 24GB", 24 * GiB, 89),
    Card("T4 16GB", 15 * GiB, 75),
    # before sm_80 (bf16 emulated, no flash attention); torch's CUDA 12.9 and 13 builds start at sm_75,
    # so a V100 or a P100 (Kaggle's) trains under a CUDA 12.6 build. The V100 16GB's and the P100's
    # totals are torch's (get_device_properties as users post it: total_memory=16160MB, 16280MB; ECC
    # takes its share), the others nominal
    Card("RTX 2060 6GB", 6 * GiB, 75),
    Card("RTX 2080 Ti 11GB", 11 * GiB, 75),
    Card("V100 16GB", 16160 * MiB, 70),
    Card("V100 32GB", 32 * GiB, 70),
    Card("P100 16GB", 16280 * MiB, 60),
    Card("L4 24GB", 23 * GiB, 89),
    Card("A10G 24GB", 23 * GiB, 86),
    Card("A100 40GB", 40 * GiB, 80),
    Card("A100 80GB", 80 * GiB, 80),
    Card("H100 80GB", 80 * GiB, 90),
    # measured by `workbench gpu-check` (2026-11-22; torch 2.11, CUDA 13.0, driver 580): NVML's used
    # memory less max_memory_reserved was 1,366-1,384 MiB on every rung before bitsandbytes' paged
    # state or DeepSpeed added memory of their own; nvidia-smi reports 143,771 MiB
    Card("H200 141GB", 143771 * MiB, 90, context_bytes=1384 * MiB),
)}
DEFAULT_SM = 80  # a card-less CUDA prediction assumes an Ampere data-centre card


def card(spec: str | float | Card | None) -> Card | None:
    """A card preset by name (case and spaces ignored), a size in GiB (sm_80 assumed), or "here":
    this machine's card as it is now (card_free_now: what CUDA reports free)."""

    if spec is None or isinstance(spec, Card):
        return spec
    if str(spec).strip().lower() == "here":
        if not torch.cuda.is_available():
            raise ConfigError("--card here: this machine has no CUDA card; name one (e.g. 'T4 16GB') or give its GiB")
        return card_free_now()
    try:
        gib = float(spec)
    except (TypeError, ValueError):
        key = str(spec).lower().replace(" ", "").replace("gb", "")
        for c in CARDS.values():
            if c.name.lower().replace(" ", "").replace("gb", "") == key:
                return c
        raise ConfigError(f"unknown card {spec!r}; use a size in GiB or one of: {', '.join(CARDS)}") from None
    if not (gib > 0 and math.isfinite(gib)):
        raise ConfigError(f"--card must be a positive size in GiB or a card name, got {spec!r}")
    return Card(f"{gib:g} GiB card", int(gib * GiB), DEFAULT_SM)


def card_of(name: str, total_bytes: int, sm: int) -> Card:
    """A real card as torch reports it ("NVIDIA GeForce RTX 4090"): its own memory and compute
    capability, with the context constant of the preset it is (name and sm), else the default."""
    preset = next((c for c in CARDS.values() if " ".join(c.name.split()[:-1]) in name and c.sm == sm), None)
    return Card(name, total_bytes, sm, preset.context_bytes if preset else CONTEXT_BYTES)


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
# attention: the kernel sdp_utils.cpp picks (torch 2.13 rules, default priority flash > efficient > math)

def sdpa_backend(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False, *,
                 sm: int = DEFAULT_SM) -> str:
    """'flash', 'efficient' or 'math' for these inputs on a card of compute capability `sm`.

    Grouped K/V heads (Llama, Qwen2, Mistral: transformers passes enable_gqa=True when there is no
    mask) only flash takes: memory-efficient attention checks the heads with
    check_batch_size_and_num_heads_dense<false /*supports_gqa*/>, so without flash (fp32, bf16 before
    sm_80, fp16 on a T4) such a call runs the math kernel, with its S x S scores."""
    d_qk, d_v = q.shape[-1], v.shape[-1]
    grad = q.requires_grad or k.requires_grad or v.requires_grad
    half = (torch.float16, torch.bfloat16) if sm >= 80 else (torch.float16,)
    same_heads = q.shape[-3] == k.shape[-3] == v.shape[-3]
    # check_grouped_query_attention: K and V with the same heads, a divisor of the query's
    grouped = enable_gqa and k.shape[-3] == v.shape[-3] and q.shape[-3] % k.shape[-3] == 0
    flash = (attn_mask is None and d_qk == k.shape[-1] == d_v and d_qk <= 256 and 80 <= sm <= 121
             and q.dtype in half and not (is_causal and q.shape[-2] != k.shape[-2]) and (same_heads or grouped))
    if flash and grad and sm in (86, 87, 88, 89, 120, 121):
        # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
        flash = d_qk <= 192 or (dropout_p == 0 and d_qk > 224)
    if flash:
        return "flash"
    eff_dtypes = (torch.float16, torch.float32, torch.bfloat16) if sm >= 80 else (torch.float16, torch.float32)
    # check_head_dim_size_mem_efficient: head sizes divisible by minimum_gemm_alignment, which is
    # 128 bits where tensor cores are used (sm_80 up; 16 bits on sm_7x), else 4 elements from sm_80, else 1
    half16 = q.dtype in (torch.float16, torch.bfloat16)
    tensor_cores = sm >= 80 or (sm >= 70 and half16)
    align = max(4 if sm >= 80 else 1, 128 // (16 if half16 else 32) if tensor_cores else 1)
    if (sm >= 50 and same_heads and d_qk == k.shape[-1] and d_qk % align == 0 and d_v % align == 0
            and q.dtype in eff_dtypes):
        return "efficient"
    return "math"


def cuda_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
              sm: int = DEFAULT_SM, chosen: dict | None = None):
    """Run the kernel CUDA would pick, through its aten op (its meta kernel runs on fake CPU tensors;
    the math kernel is composite, so it runs as CUDA would run it)."""
    if torch.is_autocast_enabled("cpu"):  # sdpa is on CUDA autocast's lower-precision list
        dt = torch.get_autocast_dtype("cpu")
        q, k, v = (t.to(dt) if t.dtype == torch.float32 else t for t in (q, k, v))
    backend = sdpa_backend(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, sm=sm)
    if chosen is not None:
        chosen[backend] = chosen.get(backend, 0) + 1
    with torch.autocast("cpu", enabled=False):
        if backend == "flash":  # flash takes grouped K/V as they are (and no mask)
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                        scale=scale)[0]
        # sdpa's entry (attention.cpp) turns a boolean mask into an additive one in q's dtype once the
        # kernel is chosen, in every call: each layer makes its own S x S mask, which the memory-efficient
        # kernel keeps for backward (a sliding-window model's mask past its window, a padding mask)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            zero, minus_inf = (torch.scalar_tensor(x, dtype=q.dtype, device=q.device) for x in (0.0, -math.inf))
            attn_mask = torch.where(attn_mask, zero, minus_inf)  # convert_boolean_attn_mask
        if backend == "efficient":
            # preprocess_mask: a mask whose strides (all but the last) are not multiples of 8 elements is
            # padded by 8 - S % 8 and sliced back (pad_bias<8>), a copy the kernel keeps
            if attn_mask is not None and (any(st % 8 for st in attn_mask.stride()[:-1]) or attn_mask.stride(-1) != 1):
                last = attn_mask.shape[-1]
                attn_mask = torch.nn.functional.pad(attn_mask, (0, 8 - last % 8))[..., :last]
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, attn_mask, q.requires_grad or k.requires_grad, dropout_p, is_causal, scale=scale)[0]
        # math: on CUDA the composite kernel, which computes in fp32 (16-bit inputs upcast) and keeps
        # the B x H x S x S softmax for backward; the CPU's SDPA would take its own flash kernel
        # (output and logsumexp). Grouped K/V it repeats to the query's heads itself (enable_gqa).
        # Not modelled: with attention dropout (GPT-2's 0.1; Llama, Qwen2, Phi and Pythia have none) the
        # composite's at::dropout runs inside aten on CPU tensors, so it keeps the CPU's fp32 noise where
        # CUDA's native_dropout keeps a 1-byte mask: 3-4 bytes an S x S element too many, over-predicted.
        # (Passing the composite a bool dropout_mask would keep CUDA's bytes, but torch prints a
        # C++ warning, "only for testing", that no Python filter catches.)
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, None,
                                                                  scale=scale, enable_gqa=enable_gqa)[0]


# ------------------------------------------------------------------------------------------------
# autocast: where CUDA's op lists differ from the CPU's (aten/src/ATen/autocast_mode.cpp)

CUDA_FP32 = frozenset("acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow "
                      "__pow__ __rpow__ softplus layer_norm group_norm cosine_similarity logsumexp renorm dist "
                      "norm".split())
CUDA_FP32_OPT_DTYPE = frozenset("softmax log_softmax sum prod cumsum cumprod".split())
CUDA_LOWER = frozenset("addmv addr einsum mv chain_matmul multi_dot".split())


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

    def __init__(self, sm: int = DEFAULT_SM):
        super().__init__()
        self.sm = sm
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
            return cuda_sdpa(*args, **kwargs, sm=self.sm, chosen=self.kernels)
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
def cuda_step(sm: int = DEFAULT_SM):
    """The simulated step makes CUDA's choices; fp16 autocast and the GradScaler run on fake CPU tensors."""
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
        recompute = CudaChoices(sm)
        recompute.suspended = int(any(m.suspended for m in CudaChoices.active))
        recompute.kernels = mode.kernels  # a recomputed attention is a kernel call too
        return contextlib.nullcontext(), recompute

    def checkpoint_with_choices(function, *args, **kwargs):
        if not kwargs.get("use_reentrant", True) and "context_fn" not in kwargs:
            kwargs["context_fn"] = choices_as_now
        return checkpoint(function, *args, **kwargs)

    training.autocast = autocast
    modeling_utils.checkpoint = checkpoint_with_choices
    mode = CudaChoices(sm)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*GradScaler is enabled, but CUDA is not available.*")
            with mode:
                yield mode
    finally:
        training.autocast = original
        modeling_utils.checkpoint = checkpoint
