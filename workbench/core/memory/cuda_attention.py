"""The attention kernel a CUDA card runs, chosen and run on fake CPU tensors (the CUDA model's part
for `scaled_dot_product_attention`; workbench.core.memory.cuda_model routes SDPA here).

`sdpa_backend` picks the kernel as torch's sdp_utils.cpp does for the card's compute capability;
`cuda_sdpa` runs it through its aten op (flash and memory-efficient: their meta kernels, which save
what the card's kernels save), or `math_attention`, the composite math kernel as it runs on a card's
real tensors.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import torch

DEFAULT_SM = 80  # a card-less CUDA prediction assumes an Ampere data-centre card
# The runtime cuDNN a prediction assumes: what the pinned torch's default wheel (CUDA 13) bundles. Torch's
# CUDA 13 builds carry cuDNN 9.15.1 or later (2.10: 9.15.1.9, pytorch#173677; 2.11: 9.17.1, pytorch#173216);
# its CUDA 12 wheels carry older ones, under which flash comes first on every card. Only whether it is
# newer than 9.15.0 changes a choice here (prefers_cudnn). gpu-check records the card's own choice.
ASSUMED_CUDNN = 91501


def prefers_cudnn(sm: int, cudnn: int = ASSUMED_CUDNN) -> bool:
    """sdp_utils.cpp's check_prefer_cudnn_attention (torch 2.10 on, CUDA 13 builds): cuDNN's attention
    is tried before flash on data-centre Hopper and Blackwell (compute capability 9.0, 10.0 and 10.3:
    H100/H200, B200, B300; `(major == 9 || major == 10) && (!minor || minor == 3)`) where the runtime
    cuDNN is newer than 9.15.0 (its fix for sequence lengths not a multiple of 128, pytorch#169849),
    unless TORCH_CUDNN_SDPA_DEPRIORITIZED=1."""
    return (os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED") != "1" and cudnn > 91500
            and sm // 10 in (9, 10) and sm % 10 in (0, 3))


def cudnn_takes(q, k, v, attn_mask, dropout_p, enable_gqa, sm: int) -> bool:
    """sdp_utils.cpp's can_use_cudnn_attention for dense inputs, with the cuDNN ASSUMED_CUDNN: 16-bit
    inputs on sm_80 to sm_121, a dropout that is a multiple of 1/16, heads as flash takes them (grouped
    K/V with enable_gqa), batch and heads at most 65,535, head dims multiples of 8 and at most 128
    (check_cudnn_tensor_shapes; 256 needs a cuDNN past 9.22, and 192 for Q and K with 128 for V is
    taken on sm_90 and sm_10x), more than one key, last dims contiguous. (A mask it takes, as an
    additive bias; with deterministic algorithms on it is refused, which the model does not see.)"""
    d_qk, d_v = q.shape[-1], v.shape[-1]
    same_heads = q.shape[-3] == k.shape[-3] == v.shape[-3]
    grouped = enable_gqa and k.shape[-3] == v.shape[-3] and q.shape[-3] % k.shape[-3] == 0
    limit_ok = (d_qk <= 128 and d_v <= 128) or (sm // 10 in (9, 10) and (d_qk, d_v) == (192, 128))
    return (q.dtype in (torch.float16, torch.bfloat16) and 80 <= sm <= 121 and dropout_p * 16 == int(dropout_p * 16)
            and (same_heads or grouped) and max(q.shape[0], q.shape[-3]) <= 65535 and limit_ok
            and d_qk % 8 == 0 and d_v % 8 == 0 and k.shape[-2] != 1 and all(t.stride(-1) == 1 for t in (q, k, v))
            and not (dropout_p and q.shape[-2] == 1))



def sdpa_backend(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False, *,
                 sm: int = DEFAULT_SM) -> str:
    """'cudnn', 'flash', 'efficient' or 'math' for these inputs on a card of compute capability `sm`
    (cuDNN's first where prefers_cudnn, as on an H100, H200 or B200 with torch's CUDA 13 wheels).

    Grouped K/V heads (Llama, Qwen2, Mistral: transformers passes enable_gqa=True when there is no
    mask) only flash takes: memory-efficient attention checks the heads with
    check_batch_size_and_num_heads_dense<false /*supports_gqa*/>, so without flash (fp32, bf16 before
    sm_80, fp16 on a T4) such a call runs the math kernel, with its S x S scores."""
    if prefers_cudnn(sm) and cudnn_takes(q, k, v, attn_mask, dropout_p, enable_gqa, sm):
        return "cudnn"
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


def flash_backward_scratch(node, q, k) -> None:
    """What flash attention's backward makes beside the gradients (flash_api.cpp's mha_bwd), which its
    meta kernel does not: softmax_d (B x H x S, S rounded up to 128, fp32), dq_accum (B x S x H x the
    head dim rounded up to 32, or 64 past 128; fp32), and, for grouped K/V heads, dK and dV at the query's
    heads before they are summed to the K/V heads (dk_expanded, dv_expanded, in q's dtype). They live
    while the kernel's backward runs: made here just before it (a hook on its node), freed just after
    (the card makes them after dQ, dK and dV: the same peak, the allocator's blocks in another order)."""
    b, h, s, d = q.shape
    s_k, h_k = k.shape[-2], k.shape[-3]
    s_r, d_r = -(-s // 128) * 128, -(-d // (32 if d <= 128 else 64)) * (32 if d <= 128 else 64)
    # sizes only: a hook that held q or k would keep them alive after backward for as long as the graph's
    # nodes live (a training loop's loss keeps them until the next step: +326 MiB of Llama 2 7B's)
    dtype, device = q.dtype, q.device
    held: list[torch.Tensor] = []

    def make(grad_outputs):
        held.append(torch.empty(b * h * s_r, dtype=torch.float32, device=device))  # softmax_d
        held.append(torch.empty(b * s_r * h * d_r, dtype=torch.float32, device=device))  # dq_accum
        if h_k != h:
            held.extend(torch.empty(b * s_k * h * d, dtype=dtype, device=device) for _ in range(2))
        return None

    node.register_prehook(make)
    node.register_hook(lambda grad_inputs, grad_outputs: held.clear())


def autocast_inputs(device_type: str, *tensors):
    """The tensors sdpa is given, as autocast hands them to its kernel where it is on for `device_type`
    (sdpa is on its lower-precision list: every fp32 tensor argument cast to autocast's dtype)."""
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dt = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dt) if t is not None and t.dtype == torch.float32 else t for t in tensors)


def cuda_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
              sm: int = DEFAULT_SM, chosen: dict | None = None, under_a_mode: bool = False):
    """Run the kernel CUDA would pick, through its aten op (its meta kernel runs on fake CPU tensors;
    the math kernel is composite, so it runs as CUDA would run it)."""
    q, k, v, attn_mask = autocast_inputs("cpu", q, k, v, attn_mask)  # (the kernel keeps a float mask so)
    backend = sdpa_backend(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, sm=sm)
    if chosen is not None:
        chosen[backend] = chosen.get(backend, 0) + 1
    with torch.autocast("cpu", enabled=False):
        if backend == "flash":  # flash takes grouped K/V as they are (and no mask)
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                       scale=scale)[0]
            if out.grad_fn is not None:
                flash_backward_scratch(out.grad_fn, q, k)
            return out
        # sdpa's entry (attention.cpp) turns a boolean mask into an additive one in q's dtype once the
        # kernel is chosen, in every call: each layer makes its own S x S mask, which the memory-efficient
        # kernel keeps for backward (a sliding-window model's mask past its window, a padding mask)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            zero, minus_inf = (torch.scalar_tensor(x, dtype=q.dtype, device=q.device) for x in (0.0, -math.inf))
            attn_mask = torch.where(attn_mask, zero, minus_inf)  # convert_boolean_attn_mask (cuDNN's: _cudnn)
        if backend == "cudnn":  # grouped K/V as they are; it keeps the output and an fp32 logsumexp, as flash
            # does. Not modelled: the workspace cuDNN's graph takes through the caching allocator in each
            # call (its size is cuDNN's heuristics'), and its 8-byte seed and offset on the card (meta here)
            grad = q.requires_grad or k.requires_grad or v.requires_grad  # should_compute_logsumexp
            return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, attn_mask, grad, dropout_p, is_causal,
                                                                        False, scale=scale)[0]
        if backend == "efficient":
            # preprocess_mask: a mask whose strides (all but the last) are not multiples of 8 elements is
            # padded by 8 - S % 8 and sliced back (pad_bias<8>), a copy the kernel keeps
            unaligned = attn_mask is not None and any(st % 8 for st in attn_mask.stride()[:-1])
            if attn_mask is not None and (unaligned or attn_mask.stride(-1) != 1):
                last = attn_mask.shape[-1]
                attn_mask = torch.nn.functional.pad(attn_mask, (0, 8 - last % 8))[..., :last]
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, attn_mask, q.requires_grad or k.requires_grad, dropout_p, is_causal, scale=scale)[0]
        # math: on CUDA the composite kernel, which computes in fp32 (16-bit inputs upcast) and keeps
        # the B x H x S x S softmax for backward; the CPU's SDPA would take its own flash kernel
        # (output and logsumexp). Grouped K/V it repeats to the query's heads itself (enable_gqa).
        if under_a_mode:  # a dispatch mode makes every tensor subclass-like: torch's composite, as it runs then
            return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, None,
                                                                      scale=scale, enable_gqa=enable_gqa)[0]
        return math_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def math_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """attention.cpp's `_scaled_dot_product_attention_math` as it runs on a card's real tensors, op for op.
    Called on fake tensors, torch's own composite takes its branch for tensor subclasses, which adds the
    mask out of place (`areAnyTensorSubclassLike`: a B x H x S x S copy per call that no card makes);
    a real tensor adds it in place, unless a Python dispatch mode is on (`anyModeEnabled`: then every
    tensor is subclass-like, so a card's step under the live-bytes count adds out of place too:
    `cuda_sdpa(under_a_mode=True)` keeps torch's composite). On the H200 (2026-11-26) the card's trace
    had two S x S blocks per fp32 layer (bmm's scores, freed, and the softmax) where the composite on
    fake tensors made three: the allocated peak alike, the allocator's layout not (one 520 MiB segment
    fewer predicted).
    Not modelled: with attention dropout (GPT-2's 0.1; Llama, Qwen2, Phi and Pythia have none)
    at::dropout runs on CPU tensors, so it keeps the CPU's fp32 noise where CUDA's native_dropout keeps
    a 1-byte mask: 3-4 bytes an S x S element too many, over-predicted."""
    origin = q.dtype
    # allowFP16BF16ReductionMathSDP is off by default: 16-bit inputs are computed in fp32
    q, k, v = (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in (q, k, v))
    negative = scale is not None and scale < 0
    factor = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(q.size(-1)))  # calculate_scale().sqrt()
    query = q * (-factor if negative else factor)
    if is_causal:  # the causal mask, made additive (convert_boolean_attn_mask)
        causal = torch.ones(query.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        attn_mask = torch.where(causal.logical_not(), -math.inf, torch.scalar_tensor(0.0, dtype=query.dtype))
    if enable_gqa and q.size(-3) != k.size(-3):  # pre_process_group_query_attention_input
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    attn = torch.matmul(query, k.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn.add_(attn_mask)
    attn = torch.ops.aten._safe_softmax(attn, -1)
    if dropout_p > 0.0:
        attn = torch.dropout(attn, dropout_p, True)
    return torch.matmul(attn, v).to(origin)


def _backend_names() -> dict[int, str]:
    """torch.nn.attention.SDPBackend's values (as torch._fused_sdp_choice returns them) by the names used here."""
    from torch.nn.attention import SDPBackend

    ours = {"MATH": "math", "FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient",
            "CUDNN_ATTENTION": "cudnn", "OVERRIDEABLE": "overrideable"}
    return {int(getattr(SDPBackend, n)): name for n, name in ours.items() if hasattr(SDPBackend, n)}


@contextlib.contextmanager
def counting_choices(counts: dict[str, int], device_type: str = "cuda") -> Iterator[dict[str, int]]:
    """Count, by kernel, what torch picks for each scaled_dot_product_attention call made inside on
    `device_type`, with the call's own arguments (torch._fused_sdp_choice: the selection the call makes),
    as a prediction's `kernels` counts its choices (calls on another device, the host's layers of a
    device_map run, are not counted, as the prediction does not count them). On a card: which kernel
    ran. Where autocast is on, the cast the call would make inside (sdpa is on autocast's lower-precision
    list) is made first, so the choice sees what the kernel gets and no tensor is made twice."""
    import torch.nn.functional as F

    real, names = F.scaled_dot_product_attention, _backend_names()

    def counted(query, key, value, *args, **kwargs):
        if query.device.type == device_type:  # a float mask is cast too (positional, or attn_mask=)
            query, key, value, mask = autocast_inputs(device_type, query, key, value,
                                                      kwargs.get("attn_mask", args[0] if args else None))
            args, kwargs = ((mask, *args[1:]), kwargs) if args else (args, {**kwargs, "attn_mask": mask})
            name = names.get(int(torch._fused_sdp_choice(query, key, value, *args, **kwargs)), "unknown")
            counts[name] = counts.get(name, 0) + 1
        return real(query, key, value, *args, **kwargs)

    F.scaled_dot_product_attention = counted
    try:
        yield counts
    finally:
        F.scaled_dot_product_attention = real
