"""The CUDA model on a CPU-only machine: each mechanism CUDA changes, by the bytes it implies, and
the caching allocator's rules.

    .venv/bin/python -m pytest tests/test_cuda_model.py -q        # about 30 s
"""

from __future__ import annotations

import dataclasses
import json
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from workbench.core import common
from workbench.core.config import ConfigError
from workbench.core.memory import allocator, cuda_model as cm, segments
from workbench.core.memory.accounting import (EMPTY_CACHE, EMPTY_CACHE_SERIAL, MemoryAccounting, MemoryReport, PeakSnapshot)
from workbench.core.memory.meta import model_config
from workbench.core.memory.plan import RUNGS, make_plan_optimizer, plan_from_flags, rung
from workbench.core.memory import plan as plan_module, predict as predict_module
from workbench.core.memory.predict import CUDA_STEPS, predict, simulate
from workbench.core.memory.snapshot import dump, predicted_snapshot, snapshot_from_report
from workbench.core.training import train
from tests.conftest import LINUX_RELEASE, WSL2_RELEASE, played_uname

MiB = 2**20
TINY = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": True, "max_position_embeddings": 256}


def saved_bytes(fn, *inputs, cuda: bool, autocast=None):
    """Bytes of the tensors autograd saves for backward in `fn(*inputs)`, inputs left out."""
    seen, total = {id(t.untyped_storage()) for t in inputs}, 0

    def pack(t):
        nonlocal total
        st = t.untyped_storage()
        if id(st) not in seen:
            seen.add(id(st))
            total += st.nbytes()
        return t

    mode = cm.CudaChoices() if cuda else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False):
            if mode:
                with mode:
                    out = fn(*inputs)
            else:
                out = fn(*inputs)
    return total, out


# ------------------------------------------------------------------------------------------------
# the mechanisms

def test_attention_saves_output_and_logsumexp_not_the_score_matrix():
    """With attention dropout the CPU takes SDPA's math path (it materialises B x H x S x S); CUDA's
    flash kernel keeps its output, the logsumexp and the dropout RNG state."""
    B, H, S, D = 2, 4, 128, 32
    with FakeTensorMode():
        q, k, v = (torch.randn(B, H, S, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        attn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)  # noqa: E731
        cuda, out = saved_bytes(attn, q, k, v, cuda=True)
        cpu, _ = saved_bytes(attn, q, k, v, cuda=False)
    # flash: the output (bf16) + logsumexp (B, H, S fp32) + philox seed and offset (uint64)
    assert cuda == B * H * S * D * 2 + B * H * S * 4 + 2 * 8 + 8
    assert out.shape == (B, H, S, D)
    # the CPU's math path keeps B x H x S x S probabilities (and their dropout mask): at least that much more
    assert cpu - cuda >= B * H * S * S * 2


def test_kernel_choice_follows_sdp_utils():
    def t(dtype, d=64, h=4):
        return torch.empty(1, h, 16, d, dtype=dtype, device="meta")

    bf, f32, f16 = torch.bfloat16, torch.float32, torch.float16
    assert cm.sdpa_backend(t(bf), t(bf), t(bf), is_causal=True) == "flash"
    assert cm.sdpa_backend(t(bf), t(bf, h=2), t(bf, h=2), enable_gqa=True) == "flash"  # grouped K/V
    assert cm.sdpa_backend(t(f32), t(f32), t(f32)) == "efficient"  # flash needs 16 bits
    # memory-efficient attention takes no grouped K/V (check_batch_size_and_num_heads_dense<false>): math
    assert cm.sdpa_backend(t(f32), t(f32, h=2), t(f32, h=2), enable_gqa=True) == "math"
    assert cm.sdpa_backend(t(f16), t(f16, h=2), t(f16, h=2), enable_gqa=True, sm=75) == "math"  # a T4's fp16
    assert cm.sdpa_backend(t(bf), t(bf, h=2), t(bf, h=2)) == "math"  # nor flash without enable_gqa
    assert cm.sdpa_backend(t(bf), t(bf, h=3), t(bf, h=3), enable_gqa=True) == "math"  # 4 % 3: no grouping
    assert cm.sdpa_backend(t(bf), t(bf), t(bf), attn_mask=torch.empty(1, device="meta")) == "efficient"
    assert cm.sdpa_backend(t(bf, d=512), t(bf, d=512), t(bf, d=512)) == "efficient"  # head_dim > 256
    # memory-efficient head sizes: a multiple of minimum_gemm_alignment (16 bytes with tensor cores, else 4
    # fp32 elements from sm_80, else any)
    assert cm.sdpa_backend(t(f32, d=60), t(f32, d=60), t(f32, d=60)) == "efficient"  # 60 % 4 == 0
    assert cm.sdpa_backend(t(f32, d=62), t(f32, d=62), t(f32, d=62)) == "math"
    assert cm.sdpa_backend(t(f32, d=62), t(f32, d=62), t(f32, d=62), sm=75) == "efficient"  # no fp32 tensor cores
    assert cm.sdpa_backend(t(f16, d=60), t(f16, d=60), t(f16, d=60), sm=75) == "math"  # fp16: 8 with tensor cores
    assert cm.sdpa_backend(t(f16, d=60), t(f16, d=60), t(f16, d=60), sm=60) == "efficient"  # Pascal: none
    assert cm.sdpa_backend(t(f16), t(f16), t(f16), sm=75) == "efficient"  # Turing: no flash
    assert cm.sdpa_backend(t(bf), t(bf), t(bf), sm=75) == "math"  # nor bf16 memory-efficient
    assert cm.sdpa_backend(t(f16, d=200), t(f16, d=200), t(f16, d=200), sm=89) == "flash"  # no grad here
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: training with a head dim in
    # (192, 224], or past 224 with dropout, is not flash's there (its backward would raise)
    def g(dtype, d):
        return t(dtype, d=d).requires_grad_()

    assert cm.sdpa_backend(g(f16, 200), g(f16, 200), g(f16, 200), sm=89) == "efficient"
    assert cm.sdpa_backend(g(f16, 200), g(f16, 200), g(f16, 200), sm=90) == "flash"  # only sm_86-89, 120-121
    assert cm.sdpa_backend(g(f16, 240), g(f16, 240), g(f16, 240), sm=120) == "flash"  # past 224, no dropout
    assert cm.sdpa_backend(g(f16, 240), g(f16, 240), g(f16, 240), dropout_p=0.1, sm=86) == "efficient"


def test_cudnn_attention_comes_first_on_hopper_and_blackwell_with_a_recent_cudnn(monkeypatch):
    """sdp_utils.cpp (torch 2.10 on): with a runtime cuDNN newer than 9.15.0, which torch's CUDA 13 wheels
    bundle, cuDNN's attention is tried before flash on sm_90 and sm_10x (the H200's bf16 rungs most
    likely ran it; the model had said flash). It takes what flash takes within its own limits."""
    bf, f32, f16 = torch.bfloat16, torch.float32, torch.float16

    def t(dtype=torch.bfloat16, d=64, h=4, s=16):
        return torch.empty(1, h, s, d, dtype=dtype, device="meta", requires_grad=True)

    assert cm.sdpa_backend(t(), t(), t(), is_causal=True, sm=90) == "cudnn"
    assert cm.sdpa_backend(t(f16), t(f16), t(f16), sm=100) == "cudnn"
    assert cm.sdpa_backend(t(), t(h=2), t(h=2), enable_gqa=True, sm=90) == "cudnn"  # grouped K/V, as flash
    assert cm.sdpa_backend(t(), t(h=2), t(h=2), sm=90) == "math"  # nor without enable_gqa
    assert cm.sdpa_backend(t(), t(), t(), attn_mask=torch.empty(1, 1, 16, 16, device="meta"), sm=90) == "cudnn"
    assert cm.sdpa_backend(t(), t(), t(), sm=89) == cm.sdpa_backend(t(), t(), t(), sm=120) == "flash"
    assert cm.sdpa_backend(t(), t(), t(), sm=80) == "flash"  # not preferred on Ampere
    # its limits: 16 bits, head dims at most 128 (192 with 128 for V), dropout in sixteenths, more than one key
    assert cm.sdpa_backend(t(f32), t(f32), t(f32), sm=90) == "efficient"
    assert cm.sdpa_backend(t(d=256), t(d=256), t(d=256), sm=90) == "flash"
    assert cm.sdpa_backend(t(d=192), t(d=192), t(d=128), sm=90) == "cudnn"
    assert cm.sdpa_backend(t(), t(), t(), dropout_p=0.1, sm=90) == "flash"
    assert cm.sdpa_backend(t(), t(), t(), dropout_p=0.125, sm=90) == "cudnn"
    assert cm.sdpa_backend(t(), t(s=1), t(s=1), sm=90) == "flash"
    # a cuDNN of 9.15.0 or older (torch's CUDA 12 wheels), or TORCH_CUDNN_SDPA_DEPRIORITIZED=1: flash first
    assert cm.prefers_cudnn(90) and not cm.prefers_cudnn(90, cudnn=91500) and not cm.prefers_cudnn(89)
    # major 9 or 10 with minor 0 or 3, as torch checks them (9.0 H100/H200, 10.0 B200, 10.3 B300; no card is 9.3)
    assert [sm for sm in range(80, 125) if cm.prefers_cudnn(sm)] == [90, 93, 100, 103]
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert cm.sdpa_backend(t(), t(), t(), sm=90) == "flash" and not cm.prefers_cudnn(100)
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED")
    # it keeps what flash keeps: the output and an fp32 logsumexp per query row (grouped K/V not repeated)
    B, H, S, D = 2, 4, 128, 32
    with FakeTensorMode():
        q = torch.randn(B, H, S, D, dtype=bf, requires_grad=True)
        k, v = (torch.randn(B, 2, S, D, dtype=bf, requires_grad=True) for _ in range(2))
        chosen = {}
        out = cm.cuda_sdpa(q, k, v, is_causal=True, enable_gqa=True, sm=90, chosen=chosen)
        assert chosen == {"cudnn": 1} and out.shape == (B, H, S, D)
        assert out.grad_fn._saved_logsumexp.dtype == torch.float32
        assert out.grad_fn._saved_logsumexp.numel() == B * H * S and out.grad_fn._saved_key.shape == (B, 2, S, D)
        out.sum().backward()
        assert k.grad.shape == (B, 2, S, D)


def test_flash_backward_makes_its_scratch_beside_the_gradients_and_frees_it():
    """flash_api.cpp's mha_bwd makes softmax_d and dq_accum (fp32, the sequence rounded up to 128 and
    the head dim to 32) and, for grouped K/V heads, dK and dV at the query's heads before summing them:
    its meta kernel makes only the gradients (at Llama-3-8B's shapes, 1 x 8192 tokens, 257 MiB missed
    in every attention backward). They live while the kernel's backward runs."""
    from workbench.core.memory.accounting import MemoryAccounting

    def backward_allocations(h_k, sm=89):
        B, H, S, D = 1, 8, 300, 64
        with FakeTensorMode():
            q = torch.randn(B, H, S, D, dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(B, h_k, S, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            with MemoryAccounting(torch.device("cpu"), timeline=True) as acc:
                out = cm.cuda_sdpa(q, k, v, is_causal=True, enable_gqa=True, sm=sm, chosen=(chosen := {}))
                mark = len(acc.timeline)
                out.sum().backward()
        events = acc.report().timeline[mark:]
        made = {s: n for s, n in events if n > 0}
        freed = {s for s, n in events if n < 0}
        return chosen, sorted(made.values()), [n for s, n in made.items() if s in freed]

    chosen, made, freed = backward_allocations(h_k=2)
    softmax_d, dq_accum, expanded = 8 * 384 * 4, 384 * 8 * 64 * 4, 300 * 8 * 64 * 2
    assert chosen == {"flash": 1}
    assert {softmax_d, dq_accum} <= set(made) and made.count(expanded) == 3  # dQ, and dK and dV expanded
    assert sorted(x for x in freed if x in (softmax_d, dq_accum, expanded)) == sorted(
        [softmax_d, dq_accum, expanded, expanded])  # all four freed within the backward
    _, made, _ = backward_allocations(h_k=8)  # the same heads: no expanded dK and dV
    assert {softmax_d, dq_accum} <= set(made) and made.count(expanded) == 3  # dQ, dK, dV (of 8 heads each)
    chosen, made, _ = backward_allocations(h_k=2, sm=90)  # cuDNN's backward: its workspace is not modelled
    assert chosen == {"cudnn": 1} and dq_accum not in made
    # the hooks hold no tensor: a training loop keeps the graph's nodes (its loss) after backward until the
    # next step, and hooks that held q and k had kept every layer's alive into the next forward (Llama 2
    # 7B's Hugging Face twin in the validation table: +326 MiB, its peak moved into the next forward)
    import gc
    import weakref

    with FakeTensorMode():
        x = torch.randn(1, 8, 64, 32, dtype=torch.bfloat16, requires_grad=True)
        q, k = x * 2, x[:, :2] * 2  # made in the step: nothing but the graph and the hooks may hold them
        out = cm.cuda_sdpa(q, k, k, is_causal=True, enable_gqa=True, sm=89, chosen={})
        refs = [weakref.ref(q), weakref.ref(k)]
        del q, k
        out.sum().backward()  # `out` (the graph's nodes) kept, as a loop keeps its loss
        gc.collect()
        assert [r() for r in refs] == [None, None]


def test_a_boolean_mask_is_made_additive_per_call_and_kept_by_the_memory_efficient_kernel(tmp_path):
    """sdpa's entry turns a boolean mask into an additive one in q's dtype, padded to 8 elements where
    its strides are not multiples of 8 (preprocess_mask), in every call: each layer makes its own,
    which the memory-efficient kernel keeps for backward. The model passed the shared boolean mask
    through (1 byte, unpadded), so a sliding-window model past its window (Mistral-7B-v0.1 from 4k
    tokens) was predicted gigabytes low. And grouped K/V heads outside flash (fp32 here) run the math
    kernel, not memory-efficient."""
    def kept(s):
        with FakeTensorMode():
            q, k, v = (torch.empty(1, 4, s, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
            chosen = {}
            out = cm.cuda_sdpa(q, k, v, attn_mask=torch.ones(1, 1, s, s, dtype=torch.bool), sm=89, chosen=chosen)
            assert chosen == {"efficient": 1}
            return out.grad_fn._saved_attn_bias

    bias = kept(20)
    assert bias.dtype == torch.float16 and bias.shape == (1, 1, 20, 20)
    assert bias.untyped_storage().nbytes() == 20 * 24 * 2  # its rows padded from 20 to 24 elements
    assert kept(24).untyped_storage().nbytes() == 24 * 24 * 2  # strides multiples of 8: not padded
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))  # 4 query heads, 2 K/V heads
    fp32 = predict(str(path), "fp32", batch=1, seq=32, device="cuda")
    bf16 = predict(str(path), "bf16", batch=1, seq=32, device="cuda")
    assert set(fp32.kernels) == {"math"} and set(bf16.kernels) == {"flash"}


def test_the_math_kernel_keeps_the_fp32_score_matrix_as_cuda_runs_it():
    """bf16 before sm_80 (T4, V100, RTX 20xx) has neither flash nor memory-efficient attention: CUDA
    runs SDPA's composite math kernel, which computes in fp32 and keeps the B x H x S x S softmax.
    The model ran the CPU's SDPA there, whose flash kernel keeps only the output and logsumexp: a
    T4's bf16 prediction was an Ampere card's (about 0.75 GiB low for Qwen2-0.5B at 512 tokens)."""
    B, H, KV, S, D = 1, 4, 2, 128, 32
    math_kernel = lambda q, k, v: torch.ops.aten._scaled_dot_product_attention_math(  # noqa: E731
        q, k, v, None, 0.0, True, None, enable_gqa=True)[0]
    attn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    with FakeTensorMode():
        q = torch.randn(B, H, S, D, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(B, KV, S, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        with cm.CudaChoices(sm=75) as mode:
            t4, _ = saved_bytes(attn, q, k, v, cuda=False)
        ampere, _ = saved_bytes(attn, q, k, v, cuda=True)
        cpu, _ = saved_bytes(attn, q, k, v, cuda=False)
        math, _ = saved_bytes(math_kernel, q, k, v, cuda=False)
    assert mode.kernels == {"math": 1}
    assert t4 == math and t4 - ampere >= B * H * S * S * 4  # the fp32 softmax, at least
    assert cpu < B * H * S * S  # (what the model ran before: the CPU's flash kernel)
    # the same numbers as torch's own math SDPA, with a boolean mask (sdpa's entry makes it additive)
    q, k, v = (torch.randn(B, H, 16, D, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.rand(16, 16) > 0.3
    mask[:, 0] = True
    with cm.CudaChoices(sm=75):
        ours = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(ours, theirs)


def test_dropout_mask_is_one_byte_on_cuda():
    n = 4096
    with FakeTensorMode():
        x = torch.randn(n, requires_grad=True)
        drop = lambda x: F.dropout(x * 2, p=0.1, training=True)  # noqa: E731  (x * 2: not a leaf)
        cuda, _ = saved_bytes(drop, x, cuda=True)
        cpu, _ = saved_bytes(drop, x, cuda=False)
    assert cuda == n * 1  # native_dropout's bool mask
    assert cpu == n * 4  # the CPU's fp32 noise tensor


def test_autocast_runs_cuda_fp32_list_ops_in_fp32():
    with FakeTensorMode():
        x = torch.randn(8, 64, dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with cm.CudaChoices():
                cuda = [F.softmax(x, -1).dtype, x.sum().dtype, torch.exp(x).dtype, (x ** 2).dtype,
                        F.layer_norm(x, (64,)).dtype, torch.mv(x.float(), x[0].float()).dtype]
            cpu = [F.softmax(x, -1).dtype, x.sum().dtype, torch.exp(x).dtype, (x ** 2).dtype,
                   F.layer_norm(x, (64,)).dtype, torch.mv(x.float(), x[0].float()).dtype]
    assert cuda == [torch.float32] * 5 + [torch.bfloat16]
    assert cpu == [torch.bfloat16] * 5 + [torch.float32]
    # norm and the vector and matrix norms compute in fp32 from the 16-bit input (fp32_append_dtype,
    # fp32_set_opt_dtype): no fp32 copy of it is made and kept for backward, as a cast would
    with FakeTensorMode():
        x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16), cm.CudaChoices():
            norms = [x.norm(), torch.norm(x), torch.linalg.vector_norm(x), torch.linalg.matrix_norm(x)]
    assert [n.dtype for n in norms] == [torch.float32] * 4
    assert all(n.grad_fn._saved_self.dtype == torch.bfloat16 for n in norms[:3] if hasattr(n.grad_fn, "_saved_self"))
    kept = [t for n in norms for t in (getattr(n.grad_fn, a) for a in dir(n.grad_fn) if a.startswith("_saved_"))
            if isinstance(t, torch.Tensor) and t.numel() == x.numel()]
    assert kept and all(t.dtype == torch.bfloat16 for t in kept)
    # sdpa under autocast casts a float mask as it casts q, k and v: the memory-efficient kernel keeps it in bf16
    with FakeTensorMode():
        q = torch.randn(1, 4, 16, 64, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = cm.cuda_sdpa(q, q, q, attn_mask=torch.zeros(1, 1, 16, 16), sm=89, chosen=(chosen := {}))
    assert chosen == {"efficient": 1} and out.grad_fn._saved_attn_bias.dtype == torch.bfloat16


def test_adamw_torch_is_foreach_for_cuda_and_single_tensor_on_cpu():
    plan = plan_from_flags(optimizer="adamw_torch")
    params = [torch.nn.Parameter(torch.zeros(4))]
    cpu_dev = torch.device("cpu")
    settings = plan.settings(1, 2)
    assert make_plan_optimizer(torch.nn.ParameterList(params), plan, settings, cpu_dev, target="cuda").defaults["foreach"] is True
    assert not make_plan_optimizer(torch.nn.ParameterList(params), plan, settings, cpu_dev).defaults["foreach"]


def test_foreach_adamw_holds_more_in_the_optimizer_step(tmp_path):
    """foreach takes sqrt(exp_avg_sq) of every parameter at once (one temporary the size of all
    parameters); the single-tensor loop holds two temporaries of one parameter (sqrt, then the
    division): the peak differs by all parameters' bytes less twice the largest's."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    plan = plan_from_flags(optimizer="adamw_torch")

    def opt_peak(device):
        p = predict(str(path), plan, batch=1, seq=32, device=device)
        return max(r["peak_bytes"] for r in p.phases if r["step"] == 1 and r["phase"] == "optimizer"), p

    cuda, p = opt_peak("cuda")
    cpu, _ = opt_peak("cpu")
    n = p.breakdown["weights"] - 64 * 4  # trainable fp32 bytes (less the rotary buffer)
    largest = 512 * 64 * 4
    assert cuda - cpu == pytest.approx(n - 2 * largest, abs=1024)


def test_foreach_adamws_step_counters_are_on_the_host_not_in_the_cards_allocator(tmp_path, monkeypatch):
    """torch's foreach (and single-tensor) AdamW keeps each parameter's step counter on the CPU, whatever the
    parameter's device; the fused one on the card. The simulation runs on the CPU and counted them as the card's: one
    512-byte block per parameter in the allocator model (Qwen2-0.5B: 290 of them)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    plan = plan_from_flags(optimizer="adamw_torch")
    report = simulate(model_config(str(path)), plan, batch=1, seq=32, steps=CUDA_STEPS, target="cuda")
    sizes = {serial: n for serial, n in report.timeline if n >= 0}
    counters = len(report.host_serials)
    # one per parameter: 12 per layer (q, k, v with biases, o, gate, up, down, two norms), the tied embedding, the norm
    assert counters == 2 * 12 + 2 and all(sizes[s] == 4 for s in report.host_serials)
    fused = simulate(model_config(str(path)), rung("fp32"), batch=1, seq=32, steps=CUDA_STEPS, target="cuda")
    assert not fused.host_serials  # adamw_fused: on the card, as a card runs it
    on_host = predict(str(path), plan, batch=1, seq=32, device="cuda")
    monkeypatch.setattr(plan_module, "host_step_counters", lambda optimizer: [])
    monkeypatch.setattr(predict_module, "host_step_counters", lambda optimizer: [])
    counted = predict(str(path), plan, batch=1, seq=32, device="cuda")
    assert counted.allocated_peak_bytes - on_host.allocated_peak_bytes == counters * 512
    monkeypatch.undo()  # and the memory snapshot, a card's allocator's view, has none of them either
    traced = predicted_snapshot(str(path), plan, batch=1, seq=32)["device_traces"][0]
    state = [e["size"] for e in traced if e["action"] == "alloc" and e["frames"][0]["filename"] == "optimizer_state"]
    assert state and 4 not in state, state


# ------------------------------------------------------------------------------------------------
# the caching allocator

def test_rounding_and_segment_sizes():
    assert allocator.round_size(1) == 512 and allocator.round_size(512) == 512 and allocator.round_size(513) == 1024
    assert allocator.segment_size(512) == 2 * MiB and allocator.segment_size(MiB) == 2 * MiB
    assert allocator.segment_size(MiB + 512) == 20 * MiB and allocator.segment_size(10 * MiB - 512) == 20 * MiB
    assert allocator.segment_size(10 * MiB) == 10 * MiB and allocator.segment_size(11 * MiB) == 12 * MiB


def test_allocator_reuses_splits_and_merges():
    a = allocator.CachingAllocator()
    x = a.malloc(100)
    assert (a.allocated, a.reserved) == (512, 2 * MiB)
    y = a.malloc(1000)  # split from the same small segment
    assert (a.allocated, a.reserved) == (512 + 1024, 2 * MiB)
    b1 = a.malloc(5 * MiB)  # a 20 MiB large segment, split
    b2 = a.malloc(5 * MiB)  # from its remainder
    assert a.reserved == 22 * MiB and a.segments == 2
    a.free(b1)
    a.free(b2)  # merged back into one 20 MiB free block
    c = a.malloc(19 * MiB)  # fits the merged block: no new segment
    assert a.reserved == 22 * MiB
    big = a.malloc(11 * MiB)  # its own segment, rounded to 12 MiB
    assert a.reserved == 34 * MiB
    a.free(big)
    again = a.malloc(11 * MiB + 512 * 1024)  # reuses it; 0.5 MiB left is not split off (large pool: > 1 MiB)
    assert a.reserved == 34 * MiB and again.size == 12 * MiB
    assert a.peak_reserved == 34 * MiB and a.peak_allocated >= 512 + 1024 + 19 * MiB + 12 * MiB
    for blk in (x, y, c, again):
        a.free(blk)
    assert a.allocated == 0 and a.reserved == 34 * MiB  # reserved memory stays cached


def test_a_freed_block_is_reused_only_on_its_own_stream():
    a = allocator.CachingAllocator()
    side = a.malloc(30 * MiB, stream=1)
    a.free(side)  # cached for stream 1
    main = a.malloc(30 * MiB)  # the default stream cannot take it: a segment of its own
    assert a.reserved == 60 * MiB and a.segments == 2
    again = a.malloc(30 * MiB, stream=1)  # stream 1 takes its own block back
    assert again is side and a.reserved == 60 * MiB
    a.free(main)
    a.free(again)
    a.release_cached()  # empty_cache gives back every stream's free segments
    assert a.reserved == 0
    events = [(1, 30 * MiB), (1, -1), (2, 30 * MiB), (2, -1)]
    assert allocator.replay(events, {}).reserved_peak_bytes == 30 * MiB
    assert allocator.replay(events, {}, streams={1: 1}).reserved_peak_bytes == 60 * MiB
    assert allocator.least_reserved(events, {}, upper=60 * MiB, streams={1: 1}) == 30 * MiB  # the cache is given back under a cap
    assert allocator.replay(events, {}, streams={1: 1}).reserved_by_stream == {0: 30 * MiB, 1: 30 * MiB}
    # the card's side: torch.cuda.memory_snapshot()'s segments, by stream handle, named where known
    snap = [{"stream": 0, "total_size": 2 * MiB}, {"stream": 94021, "total_size": 20 * MiB},
            {"stream": 94021, "total_size": 12 * MiB}, {"stream": 77, "total_size": 2 * MiB}]
    assert segments.reserved_by_stream(snap, {0: "default", 94021: "reduce"}) == {"default": 2 * MiB, "reduce": 32 * MiB,
                                                                             77: 2 * MiB}


def test_the_cache_at_an_out_of_memory_error_from_a_cards_trace():
    """tools/segment_probe.py RUNG OUT CAP reads a capped run's trace (torch's TraceEntry fields):
    the segments left when it ran out, each with the bytes live in it, biggest free room first;
    what was freed before the error is not counted, nor anything after it."""
    a, b = 0x7F0000000000, 0x7F0040000000
    trace = [{"action": "segment_alloc", "addr": a, "size": 20 * MiB},
             {"action": "alloc", "addr": a, "size": 8 * MiB}, {"action": "alloc", "addr": a + 8 * MiB, "size": 8 * MiB},
             {"action": "segment_alloc", "addr": b, "size": 40 * MiB}, {"action": "alloc", "addr": b, "size": 30 * MiB},
             {"action": "segment_alloc", "addr": 0x7F0080000000, "size": 2 * MiB},
             {"action": "segment_free", "addr": 0x7F0080000000, "size": 2 * MiB},  # given back before the error
             {"action": "free_requested", "addr": a, "size": 8 * MiB},  # not yet usable: still live
             {"action": "free_completed", "addr": a, "size": 8 * MiB},
             {"action": "oom", "size": 64 * MiB, "device_free": 10 * MiB},
             {"action": "alloc", "addr": b + 30 * MiB, "size": 4 * MiB}]  # after the error: not counted
    st = segments.at_oom(trace)
    assert (st["requested"], st["device_free"], st["reserved"], st["live"]) == (64 * MiB, 10 * MiB, 60 * MiB, 38 * MiB)
    assert [(r["size"], r["live"], r["free"]) for r in st["segments"]] == [(20 * MiB, 8 * MiB, 12 * MiB),
                                                                          (40 * MiB, 30 * MiB, 10 * MiB)]
    assert st["wholly_free"] == 0
    assert segments.at_oom(trace[:-2]) is None  # no error: no state


# ------------------------------------------------------------------------------------------------
# the prediction

def test_cuda_prediction_has_allocated_reserved_and_nvidia_smi(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    p = predict(str(path), "bf16", batch=2, seq=64, device="cuda", card="RTX 3060 12GB")
    ws = 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)  # two cuBLAS handles on sm_86
    assert p.kernels == {"flash": CUDA_STEPS * TINY["num_hidden_layers"]}  # one per layer and simulated step
    ckpt = predict(str(path), "bf16_ckpt", batch=2, seq=64, device="cuda", card="RTX 3060 12GB")
    assert ckpt.kernels == {"flash": 2 * p.kernels["flash"]}  # checkpointed: recomputed in backward too
    assert p.allocated_peak_bytes >= p.peak_bytes + ws
    assert p.reserved_peak_bytes >= p.allocated_peak_bytes and p.reserved_peak_bytes % (2 * MiB) == 0
    assert p.nvidia_smi_bytes == p.reserved_peak_bytes + cm.CONTEXT_BYTES
    assert p.allocated_peak_bytes <= p.needed_reserved_bytes <= p.reserved_peak_bytes
    assert p.fits and p.headroom_bytes == 12 * 2**30 - p.reserved_peak_bytes - cm.CONTEXT_BYTES
    cpu = predict(str(path), "bf16", batch=2, seq=64)
    assert cpu.device == "cpu" and cpu.reserved_peak_bytes == 0 and cpu.kernels == {}
    assert "emulated" not in p.note  # sm_86: bf16 is native
    # before sm_80 the memory is bf16's, the speed is not: the prediction says so
    t4 = predict(str(path), "bf16", batch=2, seq=64, device="cuda", card="T4 16GB")
    assert "bf16 on T4 16GB (sm_75) is emulated" in t4.note and t4.kernels == {"math": p.kernels["flash"]}
    assert "emulated" not in predict(str(path), "fp16", batch=2, seq=64, device="cuda", card="T4 16GB").note


def test_paged_optimizer_state_is_outside_the_allocators_figures(tmp_path, monkeypatch):
    """bitsandbytes' paged state is CUDA managed memory (cudaMallocManaged), which torch's
    max_memory_allocated / reserved never see (an H200 measured 4,904 MiB allocated for the paged
    rung of Qwen2-0.5B, 946 MiB under the unpaged one's): the replay leaves it out, nvidia-smi not.
    Only a parameter of 100,000 elements or more gets paged state (Optimizer8bit.get_state_buffer); a
    smaller one's, and the block-wise absmax, are torch's allocator's on a card (the model had paged
    the whole state: 15 MiB of Qwen2-0.5B's, and all of a LoRA's, whose adapters are small)."""
    monkeypatch.setattr(common.platform, "uname", played_uname(LINUX_RELEASE))
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "vocab_size": 2048}))  # the (tied) embedding: 131,072 elements
    plain = predict(str(path), "adamw8bit", batch=1, seq=32, device="cuda")
    fallback = "Paged optimizers are not supported on CPU"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        paged = predict(str(path), "paged_adamw8bit", batch=1, seq=32, device="cuda")
        on_cpu = predict(str(path), "paged_adamw8bit", batch=1, seq=32, device="cpu")
    # bitsandbytes' warning of its CPU fallback (a red box in every notebook) is not raised: on CPU
    # tensors the unpaged optimizer it falls back to is built as such, and the CPU row says it
    assert not [w for w in seen if fallback in str(w.message)]
    assert on_cpu.pageable_bytes == 0 and on_cpu.fit_bytes == on_cpu.peak_bytes  # nothing pages on the CPU
    assert on_cpu.note.startswith("on the CPU a paged optimizer runs unpaged")
    state = paged.pageable_bytes
    assert state == 2 * 2048 * 64 and plain.pageable_bytes == 0  # the embedding's two uint8 states alone
    assert paged.breakdown["optimizer_state"] > state  # the rest: smaller parameters' states, the absmax
    assert paged.peak_bytes == plain.peak_bytes  # the same tensors: only where they live differs
    assert paged.allocated_peak_bytes == plain.allocated_peak_bytes - state  # (each a 512-byte multiple)
    assert "(0.2 MiB: the two states of each parameter of 100,000 elements or more" in paged.note
    assert paged.fit_bytes == paged.reserved_peak_bytes >= paged.needed_reserved_bytes
    assert paged.nvidia_smi_bytes == paged.reserved_peak_bytes + paged.context_bytes + state
    # on a card with room for half the state beside the rest, the driver pages the other half out: nvidia-smi
    # shows the whole card in use, not more (it read 4,679 MiB on a 4,096 MiB card that "fits")
    rest = paged.reserved_peak_bytes + paged.context_bytes
    tight = dataclasses.replace(paged, card_bytes=rest + state // 2)
    assert tight.fits and tight.nvidia_smi_bytes == rest + state // 2 == tight.card_bytes
    assert dataclasses.replace(paged, card_bytes=rest + 2 * state).nvidia_smi_bytes == rest + state  # room for all
    # under WSL2 Windows' driver does not oversubscribe managed memory: the state cannot page out,
    # so it must fit on the card beside the allocator's need (auto-fit chose the paged rung there
    # exactly when the unpaged one did not fit, and it ran out of memory)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(common.platform, "uname", played_uname(WSL2_RELEASE))
        under_wsl = predict(str(path), "paged_adamw8bit", batch=1, seq=32, device="cuda")
    assert not under_wsl.pages_out and under_wsl.fit_bytes == paged.fit_bytes + state
    assert "cannot page out" in under_wsl.note and paged.pages_out


def test_pure_bf16_rungs_halve_the_weights(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    assert {"bf16_true", "bf16_true_lora"} <= set(RUNGS)
    full = predict(str(path), "fp32", batch=1, seq=32)
    pure = predict(str(path), "bf16_true", batch=1, seq=32)
    assert pure.breakdown["weights"] == pytest.approx(full.breakdown["weights"] / 2, abs=512)

    def state(p):  # the optimizer state when the second step's forward starts
        return next(r for r in p.phases if r["step"] == 1 and r["phase"] == "forward")["optimizer_state_bytes"]

    assert state(pure) == pytest.approx(state(full) / 2, abs=512) and state(full) > 0


def test_unknown_card_and_a_card_smaller_than_the_weights(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    with pytest.raises(ConfigError, match="unknown card"):
        cm.card("GTX 9999")
    assert cm.card("a100 80gb").total_bytes == 80 * 2**30 and cm.card("8").total_bytes == 8 * 2**30
    # a size with its unit written, and the one preset a name begins (both had been "unknown card")
    assert cm.card("8 GiB").total_bytes == cm.card("8gib").total_bytes == 8 * 2**30
    assert cm.card("T4") is cm.CARDS["T4 16GB"] and cm.card("h200") is cm.CARDS["H200 141GB"]
    # consumer Blackwell (sm_120): nvidia-smi's totals, flash attention first (cuDNN's is first only on
    # 9.0/10.0/10.3), the sm_90-and-later 32 MiB cuBLAS workspaces; torch's name finds the preset
    rtx = cm.card("RTX 5090")
    assert (rtx.name, rtx.total_bytes, rtx.sm, rtx.cublas_workspace_bytes) == ("RTX 5090 32GB", 32607 * 2**20, 120,
                                                                               32 * 2**20)
    assert cm.card("rtx 5060") is cm.CARDS["RTX 5060 Ti 16GB"] and cm.CARDS["RTX 5060 Ti 16GB"].sm == 120
    assert cm.card_of("NVIDIA GeForce RTX 5090", rtx.total_bytes, 120).sm == 120
    assert set(predict(str(path), "bf16", batch=1, seq=32, device="cuda", card="RTX 5090").kernels) == {"flash"}
    b200 = cm.card("B200")  # data-centre Blackwell, sm_100: cuDNN's attention first
    assert (b200.total_bytes, b200.sm) == (183359 * 2**20, 100)
    assert set(predict(str(path), "bf16", batch=1, seq=32, device="cuda", card="B200").kernels) == {"cudnn"}
    # the fixes offered are those that may fit: the fp32 weights are 0.41 MiB; bf16-true halves them, QLoRA's
    # 4-bit weights are about an eighth (a 0.5 GiB card had been told bf16-true for Qwen2-0.5B's 942 MiB)
    zero3 = "or ZeRO-3 offload, which keeps them on the host (--rung zero_offload_params)"
    for rung_, gib, fixes in (("fp32", 0.0003, "--precision bf16-true, --trainable qlora, "),
                              ("fp32", 0.0001, "--trainable qlora, "), ("fp32", 0.00003, ""),
                              ("bf16_true", 0.0001, "--trainable qlora, ")):  # no fix it already has
        with pytest.raises(ConfigError, match="smaller than the weights alone") as e:
            predict(str(path), rung_, batch=1, seq=32, device="cuda", card=gib)
        assert e.value.args[0].endswith(f"use a larger --card, {fixes}{zero3}"), (rung_, gib, e.value.args[0])


# ------------------------------------------------------------------------------------------------
# memory snapshots (the _dump_snapshot format)

def _trace_peak(snap):
    cur = peak = 0
    for e in snap["device_traces"][0]:
        cur += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        peak = max(peak, cur)
    return peak, cur


def test_predicted_snapshot_replays_to_the_allocator_figures(tmp_path):
    import pickle

    from torch.cuda import _memory_viz

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    snap = pickle.loads(dump(predicted_snapshot(str(path), "bf16", batch=2, seq=64), tmp_path / "s.pickle").read_bytes())
    p = predict(str(path), "bf16", batch=2, seq=64, device="cuda")
    peak, end = _trace_peak(snap)
    # as a card's trace: events carry the bytes asked for (a 64-wide bf16 bias: 128 B), blocks their
    # rounded size (512 B), so the timeline peaks below the allocated peak, which counts blocks
    assert 128 in {e["size"] for e in snap["device_traces"][0] if e["action"] == "alloc"}
    assert p.allocated_peak_bytes * 0.9 < peak < p.allocated_peak_bytes
    assert sum(s["total_size"] for s in snap["segments"]) == p.reserved_peak_bytes
    blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert end == sum(b["requested_size"] for b in blocks) < sum(s["allocated_size"] for s in snap["segments"])
    assert all(b["requested_size"] <= b["size"] for b in blocks)
    # the viewer (MemoryViz.js) places a segment's blocks end to end from its address and pairs each
    # live block with the trace's allocation at that address; one it cannot pair, it draws twice
    live = {}
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            del live[e["addr"]]
    placed = {}
    for s in snap["segments"]:
        addr = s["address"]
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                placed[addr] = b["requested_size"]
            addr += b["size"]
        assert addr == s["address"] + s["total_size"]
    assert placed == live
    assert "total_reserved: 24.0MiB" in _memory_viz.segsum(snap)  # torch's own reader parses it
    cats = {f["filename"] for e in snap["device_traces"][0] for f in e["frames"]}
    assert {"weights", "activations", "gradients", "optimizer_state"} <= cats


def test_the_snapshot_makes_the_workspaces_where_the_prediction_does(tmp_path):
    """A fresh process makes each cuBLAS workspace inside its thread's first matmul, right after the
    output (cuda_model.workspaces_in); the prediction places them there, and so does the exported
    snapshot: each workspace's allocation follows that op's output in the trace, and the segments
    it ends with are those of the allocator replay the prediction makes of the same timeline."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    snap = predicted_snapshot(str(path), "bf16", batch=2, seq=64)
    report = simulate(model_config(str(path)), rung("bf16"), batch=2, seq=64, steps=CUDA_STEPS, target="cuda",
                      sm=cm.DEFAULT_SM)
    made = cm.workspaces_in(cm.Card("", 0, cm.DEFAULT_SM), report.timeline_ops)
    assert [w[2] is not None for w in made] == [True, True]  # placed inside the step, not before it
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    at = [i for i, e in enumerate(allocs) if e["frames"][0]["filename"] == "workspace"]
    assert len(at) == 2 and at[0] > 0  # not the trace's first allocations
    for i, phase in zip(at, ("forward", "backward")):
        op = allocs[i - 1]["frames"][0]["name"]  # the allocation just before: the first matmul's output
        assert op.startswith(phase + ": ") and op.partition(": ")[2].startswith(cm.CUBLAS_OPS), op
    replayed = allocator.replay(report.timeline, report.timeline_roles, made, streams=report.timeline_streams)
    assert sum(s["total_size"] for s in snap["segments"]) == sum(replayed.reserved_by_stream.values())


def test_a_measured_cpu_step_exports_a_snapshot_with_the_predictions_peak(tmp_path):
    """Exported as torch.cuda.memory._snapshot() is, from a measured step: the same peak of the bytes asked
    for as the predicted one's (not the same snapshot: what is left at the end differs)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**{k: v for k, v in TINY.items() if k not in ("model_type", "architectures")})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    blocks = torch.randint(0, 512, (2, 32))
    plan = rung("fp32")
    settings = plan.settings(1, 2)
    with MemoryAccounting("cpu", timeline=True) as acc:
        acc.watch(model)
        train(model, blocks, settings, device="cpu")
    measured = snapshot_from_report(acc.report())
    predicted = snapshot_from_report(simulate(config, plan, batch=1, seq=32, n_blocks=2, timeline=True, instrumented=True))
    # the same peak of the bytes asked for (what is left at the end differs: here the loop made the optimizer)
    assert _trace_peak(measured)[0] == _trace_peak(predicted)[0] > 0
    assert len(measured["device_traces"][0]) > 100 and measured["segments"]


def test_each_card_preset_is_as_large_as_nvidia_smi_reports_it():
    """The presets' totals were nominal GiB: an L4 and an A10G 518-524 MiB larger than they are, an
    RTX 4090 12 MiB, an H100 361 MiB, so `--card` (no margin) said "fits" for steps that overrun the
    card. The totals nvidia-smi reports (its "used / total" column, as users post it)."""
    reported_mib = {"RTX 3060 12GB": 12288, "RTX 3090 24GB": 24576, "RTX 4060 8GB": 8188, "RTX 4060 Ti 8GB": 8188,
                    "RTX 4060 Ti 16GB": 16380, "RTX 4090 24GB": 24564, "T4 16GB": 15360, "RTX 2060 6GB": 6144,
                    "RTX 2080 Ti 11GB": 11264, "V100 32GB": 32768, "L4 24GB": 23034, "A10G 24GB": 23028,
                    "A100 40GB": 40960, "A100 80GB": 81920, "H100 80GB": 81559, "H200 141GB": 143771}
    for name, mib in reported_mib.items():
        assert cm.card(name).total_bytes == mib * 2**20, name


def test_a_real_card_takes_its_presets_measured_context_and_its_own_size():
    h200 = cm.card_of("NVIDIA H200", 143156 * MiB, 90)
    # where its context comes from is said, beside it: that card's own record, so its nvidia-smi figure
    # agrees there by construction (it read "modelled (per-card constant)" as any preset)
    assert h200.context_source.startswith("modelled (per-card constant, measured on an H200 by gpu-check")
    assert cm.card_of("NVIDIA GeForce RTX 4090", 24 * 2**30, 89).context_source == "modelled (per-card constant)"
    assert h200.context_bytes == 769 * MiB and h200.total_bytes == 143156 * MiB and h200.sm == 90
    # NVML's v1 used less the reserved peak read 1,384 MiB: the context and the driver's 615 MiB reserve, which
    # torch's total (a real card's) leaves out already and nvidia-smi's (the preset's) counts: both leave the
    # allocator the same room, and the predicted nvidia-smi figure is the context's alone
    preset = cm.card("H200 141GB")
    assert preset.driver_reserved_bytes == 615 * MiB and h200.driver_reserved_bytes == 0
    assert preset.usable_bytes == h200.usable_bytes == (143156 - 769) * MiB
    assert cm.card_of("NVIDIA GeForce RTX 4090", 24 * 2**30, 89).context_bytes == cm.CONTEXT_BYTES
    # a name that is not a preset's (or the wrong architecture) takes the modelled default
    assert cm.card_of("NVIDIA H200", 1, 80).context_bytes == cm.CONTEXT_BYTES
    assert cm.card_of("NVIDIA B200", 1, 100).context_bytes == cm.CONTEXT_BYTES


def test_card_here_is_this_machines_card(monkeypatch):
    import types

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--card here: this machine has no CUDA card"):
        cm.card("here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(
        name="Tesla T4", total_memory=15360 * MiB, major=7, minor=5))
    # a desktop card: the display and another process use 1,500 MiB, this process's context 400 and
    # its allocator holds 100; CUDA reports 13,460 free, and this process can have 13,560 of it
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (13460 * MiB, 15360 * MiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 100 * MiB)
    here = cm.card(" Here ")
    assert (here.name, here.total_bytes, here.sm) == ("Tesla T4", 15360 * MiB, 75)  # its own sm: fp16, math attention
    assert here.usable_bytes == 13560 * MiB and here.context_bytes == 1800 * MiB  # not the total less 500 modelled
    assert here.context_source.startswith("measured now")


def test_an_empty_cache_in_the_timeline_gives_back_the_wholly_free_segments(tmp_path):
    big, small = 30 * MiB, 512
    cached = [(1, big), (2, small), (1, -1), (3, big)]
    emptied = [(1, big), (2, small), (1, -1), (EMPTY_CACHE_SERIAL, EMPTY_CACHE), (3, big)]
    kept, given_back = allocator.replay(cached, {}), allocator.replay(emptied, {})
    # without it the second 30 MiB reuses the cached block; with it that segment went back to the
    # card, so the second needs a new one (the small segment holds a live block: it stays)
    assert kept.segments == 2 and given_back.segments == 3
    assert kept.reserved_peak_bytes == given_back.reserved_peak_bytes == big + 2 * MiB
    # the snapshot's trace says so: one segment_free, of the 30 MiB segment
    report = MemoryReport("cuda", PeakSnapshot(), {}, 1, timeline=emptied, timeline_steps=[0] * 5,
                          timeline_roles={}, timeline_ops=[""] * 5)
    trace = snapshot_from_report(report)["device_traces"][0]
    assert [e["size"] for e in trace if e["action"] == "segment_free"] == [big]
    assert [e["size"] for e in trace if e["action"] == "segment_alloc"] == [big, 2 * MiB, big]


def test_the_least_reserved_cap_counts_the_cached_blocks_the_allocator_gives_back():
    """Before it runs out of memory, the caching allocator frees its wholly free cached segments and
    retries (release_cached_blocks): the reserved peak of a card with room is not what the step needs."""
    big, bigger, small = 30 * MiB, 40 * MiB, 512
    events = [(1, big), (2, small), (1, -1), (3, bigger)]
    assert allocator.replay(events, {}).reserved_peak_bytes == big + 2 * MiB + bigger  # nothing presses: all kept
    need = allocator.least_reserved(events, {}, upper=big + 2 * MiB + bigger)
    assert need == 2 * MiB + bigger  # the 30 MiB segment is given back for the 40 MiB one
    allocator.replay(events, {}, limit=need)
    with pytest.raises(torch.OutOfMemoryError):
        allocator.replay(events, {}, limit=need - 2 * MiB)
    # a block still live keeps its segment: the 30 MiB stays when it is not freed before
    held = [(1, big), (2, small), (3, bigger)]
    assert allocator.least_reserved(held, {}, upper=big + 2 * MiB + bigger) == big + 2 * MiB + bigger


def test_freed_weights_in_the_cache_make_the_modelled_need_lower_but_fits_compares_the_peak():
    """DeepSpeed ZeRO-Offload flattened on the card: the weights' old blocks stay cached (the reserved
    peak a large card shows), and the model has a card near its limit get them back; fits compares the
    reserved peak, since the H200's least cap was 18.7% above the modelled need."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=16384, hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
    p = predict(config, "zero_offload", batch=1, seq=32, device="cuda", card="RTX 4090 24GB")
    assert "flattened on the card" in p.placement
    assert p.needed_reserved_bytes < p.reserved_peak_bytes and p.fit_bytes == p.reserved_peak_bytes
    assert p.headroom_bytes == p.card_bytes - p.reserved_peak_bytes - p.context_bytes


def test_a_pure_half_qlora_says_its_weights_train_in_fp32(tmp_path):
    """peft's prepare_model_for_kbit_training casts every weight but the 4-bit ones back to fp32, so
    `--precision bf16-true --trainable qlora` trains them in fp32 without autocast: predicted as
    run, and said (the search no longer offers it as the fast pure-bf16 setup: test_autofit)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    plan = plan_from_flags(precision="bf16-true", optimizer="adamw_torch", trainable="qlora", batch=1)
    p = predict(str(path), plan, batch=1, seq=32, device="cuda")
    assert "keeps every weight but the 4-bit ones in fp32" in p.note and set(p.kernels) == {"math"}
    mixed = predict(str(path), plan_from_flags(precision="bf16-mixed", optimizer="adamw_torch", trainable="qlora",
                                               batch=1), batch=1, seq=32, device="cuda")
    assert "4-bit ones in fp32" not in mixed.note and set(mixed.kernels) == {"flash"}


def test_a_prediction_says_when_the_allocators_settings_are_not_the_defaults_it_models(tmp_path, monkeypatch):
    """torch's own out-of-memory message suggests expandable segments; the allocator model plays the
    default segments, so a user who set them is told what the reserved figures are."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments: True")
    assert "sets expandable_segments, max_split_size_mb here" in predict(str(path), "bf16", batch=1, seq=32,
                                                                         device="cuda").note
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert "ALLOC_CONF" not in predict(str(path), "bf16", batch=1, seq=32, device="cuda").note
    # a setting of the split and rounding rules alone changes reserved figures too (it was not said)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:4,garbage_collection_threshold:0.6")
    assert "sets roundup_power2_divisions, garbage_collection_threshold here" in predict(
        str(path), "bf16", batch=1, seq=32, device="cuda").note
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")  # torch 2.13's own name for it
    assert "sets expandable_segments here" in predict(str(path), "bf16", batch=1, seq=32, device="cuda").note
    # what replaces torch's caching allocator altogether: CUDA's own, or none
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")
    assert "sets backend:cudaMallocAsync here" in predict(str(path), "bf16", batch=1, seq=32, device="cuda").note
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    assert "sets PYTORCH_NO_CUDA_MEMORY_CACHING here" in predict(str(path), "bf16", batch=1, seq=32,
                                                                  device="cuda").note
    monkeypatch.delenv("PYTORCH_NO_CUDA_MEMORY_CACHING")
    # the GradScaler, which torch disables without CUDA, is said to be left out of a simulated fp16 step
    assert "GradScaler's few bytes" in predict(str(path), "fp16", batch=1, seq=32, device="cuda").note


def test_the_math_kernel_adds_the_mask_in_place_as_on_a_card_and_computes_what_sdpa_computes():
    """torch's composite, called on fake tensors, adds the mask out of place (its branch for tensor
    subclasses): an S x S block a card never makes (the H200's trace: bmm's scores and the softmax,
    two per layer). The CUDA model runs the real-tensor branch op for op."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 16, 8, generator=g) for h in (4, 2, 2))
    for causal, mask in ((True, None), (False, torch.randn(16, 16, generator=g))):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                                enable_gqa=True)
        got = cm.math_attention(q, k, v, mask, is_causal=causal, enable_gqa=True)
        assert torch.allclose(got, want, atol=1e-5)
    half = cm.math_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True, enable_gqa=True)
    assert half.dtype == torch.bfloat16  # computed in fp32, returned in the inputs' dtype

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with FakeTensorMode() as fake:
        fq, fk, fv = (fake.from_tensor(t.requires_grad_()) for t in (q, k, v))
        with Ops() as ops:
            cm.cuda_sdpa(fq, fk, fv, is_causal=True, enable_gqa=True, sm=90)  # fp32, grouped: math
    assert "aten.add_.Tensor" in ops.seen and "aten.add.Tensor" not in ops.seen
    assert sum(op.startswith("aten.bmm") for op in ops.seen) == 2 and "aten._safe_softmax.default" in ops.seen
    # a card's step under a dispatch mode (the live-bytes count) takes torch's subclass branch: out of place
    with FakeTensorMode() as fake:
        fq, fk, fv = (fake.from_tensor(t) for t in (q, k, v))
        with Ops() as ops:
            cm.cuda_sdpa(fq, fk, fv, is_causal=True, enable_gqa=True, sm=90, under_a_mode=True)
    assert "aten.add.Tensor" in ops.seen and "aten.add_.Tensor" not in ops.seen
