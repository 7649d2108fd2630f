"""Tensors with shapes but no values: a meta model made fake, and transformers told the truth about them.

    from workbench.core.memory.fake import fakeify, unpacked_for_fake_inputs, fake_step
    fakeify(model, fake_mode)          # every meta parameter and buffer becomes a FakeTensor
    with unpacked_for_fake_inputs(), fake_mode: ...
    step = fake_step(model, n_blocks=4, seq=512, target="cuda", sm=90)   # the setup both share

Shared by the step prediction (workbench.core.memory.predict) and the simulated offload rungs
(workbench.core.memory.placement). Measured here: under fake tensors transformers thinks it is
being traced and builds an explicit seq x seq attention mask that a real run skips;
`find_packed_sequence_indices` answers "not packed" (None) for fake inputs, as for real unpacked ones.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from workbench.core.config import ConfigError
from workbench.core.memory import cuda_model
from workbench.core.memory.live_bytes import model_tensors
from workbench.core.memory.meta import model_label
from workbench.core.models import check_seq_len


def fakeify(model: torch.nn.Module, fake_mode: FakeTensorMode, device: str = "cpu") -> torch.nn.Module:
    """Turn every meta parameter and buffer into a fake tensor on `device`; tied stay tied.

    A real parameter that trains becomes a fake one too: QLoRA's adapters, which peft makes on
    the device of the (really quantized) 4-bit layer. Left real inside the fake step, an optimizer
    that sets `p.data` (bitsandbytes' 8-bit AdamW) turned it into a meta tensor and failed."""
    memo: dict[int, torch.Tensor] = {}
    dev = torch.device(device)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or isinstance(p, FakeTensor) or (p.device.type != "meta" and not p.requires_grad):
                continue
            if id(p) not in memo:
                fake = FakeTensor(fake_mode, p.data, dev) if p.device.type == "meta" else fake_mode.from_tensor(p.data)
                memo[id(p)] = torch.nn.Parameter(fake, requires_grad=p.requires_grad)
            module._parameters[name] = memo[id(p)]
        for name, b in list(module._buffers.items()):
            if b is None or b.device.type != "meta":
                continue
            if id(b) not in memo:
                memo[id(b)] = FakeTensor(fake_mode, b, dev)
            module._buffers[name] = memo[id(b)]
    return model


@contextlib.contextmanager
def unpacked_for_fake_inputs():
    """transformers builds an explicit mask for fake inputs; answer 'not packed' as for real ones."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices

    def find(position_ids):
        if isinstance(position_ids, FakeTensor):
            return None
        return original(position_ids)

    masking_utils.find_packed_sequence_indices = find
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


_GROUPED_MM = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)  # (torch 2.8 on)


class KernelOutputs(TorchDispatchMode):
    """Fake outputs as the real kernels make them, where torch's meta kernel disagrees with them.

    `aten._grouped_mm`, which transformers 5 runs the experts of MoE models through (Mixtral, Qwen2-MoE,
    OLMoE; forward and both gradients): torch 2.13's meta kernel takes bf16 only and pads the output's
    rows only on CUDA builds. The CPU and CUDA kernels take fp32, bf16 and fp16 (ATen's GroupedMMUtils.h,
    `_grouped_mm_validate_inputs`; all but bf16 on sm_90+ run its per-group mm loop into the output) and
    pad the rows to 16 bytes on every build but ROCm (`create_grouped_gemm_output_tensor`). Without this
    an fp32 or mixed-precision step of an MoE model stopped at the meta kernel's dtype check; checked on
    this CPU build: a (10, 6) fp32 output has row stride 8 and 312 bytes, as made here."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _GROUPED_MM and isinstance(args[0], FakeTensor):
            return grouped_mm_output(*args, **kwargs)
        return func(*args, **kwargs)


class GroupedMMRefused(ConfigError, RuntimeError):
    """An MoE model whose expert matrices torch._grouped_mm refuses (rows not 16-byte aligned): the real
    kernel's RuntimeError, and a one-line ConfigError for the command that predicted the step."""


def grouped_mm_output(mat_a, mat_b, offs=None, bias=None, out_dtype=None) -> torch.Tensor:
    """The tensor `torch._grouped_mm` returns, made (empty) as ATen makes it: size and padded strides."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if mat_a.dtype not in floats or mat_b.dtype not in floats:
        raise RuntimeError(f"Expected mat_a and mat_b to be Float32, BFloat16 or Float16, got {mat_a.dtype}, {mat_b.dtype}")
    if out_dtype not in (None, mat_a.dtype) or bias is not None:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype, and takes no bias")
    for m in (mat_a, mat_b):  # check_valid_strides_and_return_transposed: one unit stride, the other 16-byte aligned
        (s0, s1), (n0, n1), unit = m.stride()[-2:], m.shape[-2:], 16 // m.element_size()
        if not ((s0 == 1 and s1 >= max(1, n0) and s1 % unit == 0) or (s1 == 1 and s0 >= max(1, n1) and s0 % unit == 0)):
            raise GroupedMMRefused(
                f"an expert matrix of shape {tuple(m.shape)} in {str(m.dtype).removeprefix('torch.')} has rows that "
                f"are not a multiple of 16 bytes ({unit} elements): torch._grouped_mm, which transformers runs the "
                f"experts of MoE models through, refuses it (the model cannot train on this torch either); make "
                f"hidden_size and the experts' intermediate size multiples of 8")
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a2:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    align = 16 // mat_a.element_size()
    row = -(-size[-1] // align) * align
    stride = [size[1] * row, row, 1] if a2 == b2 else [row, 1]
    return torch.empty_strided(size, stride, dtype=mat_a.dtype, device=mat_a.device)


@contextlib.contextmanager
def _with_kernel_outputs(choices: ContextManager):
    with choices as mode, KernelOutputs():
        yield mode


def check_step(config: Any, seq: int, steps: int) -> None:
    """What a simulated step refuses before anything is built: too few steps, too long a sequence."""
    if steps < 2:
        raise ValueError("simulate at least two steps: the steady state starts at the second")
    check_seq_len(config, seq, model_label(config))


@dataclass
class FakeStep:
    """What every simulated step shares (workbench.core.memory.predict.simulate and
    workbench.core.memory.offload.simulate_placed): the fake mode, the model made fake, the fake
    training blocks, the fake twins of the real tensors the model keeps, and the choices of the
    device the step is for."""

    fake_mode: FakeTensorMode
    model: torch.nn.Module
    blocks: torch.Tensor
    # Real tensors in the model (bitsandbytes' quantized weights and their quantization state)
    # meet fake activations; fake mode converts them to fake twins, memoized while the real one
    # lives. Their bytes are counted once, under the real tensor: the twins are aliases.
    twins: list[torch.Tensor]
    cuda: bool
    # CUDA's kernel, dropout and autocast choices for a cuda target; for either, fake outputs as the
    # kernels make them where the model needs it (KernelOutputs)
    choices: ContextManager


def fake_step(model: torch.nn.Module, *, n_blocks: int, seq: int, target: str = "cpu", sm: int | None = None,
              under_a_mode: bool = False) -> FakeStep:
    """Make the meta `model` fake and build what a simulated step of it needs (see FakeStep).
    `under_a_mode`: the step as a card runs it under a Python dispatch mode (the live-bytes count)."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakeify(model, fake_mode)
    with fake_mode:
        blocks = torch.zeros((n_blocks, seq), dtype=torch.long)
    twins = [fake_mode.from_tensor(t) for t in model_tensors(model) if not isinstance(t, FakeTensor)]
    cuda = torch.device(target).type == "cuda"
    choices = cuda_model.cuda_step(sm or cuda_model.DEFAULT_SM, under_a_mode) if cuda else contextlib.nullcontext()
    # only where experts are stacked in 3-D weights (the operand _grouped_mm multiplies by): the mode
    # costs a dense model's step about 9% more time for nothing
    if any(p.dim() == 3 for p in model.parameters()):
        choices = _with_kernel_outputs(choices)
    return FakeStep(fake_mode, model, blocks, twins, cuda, choices)
