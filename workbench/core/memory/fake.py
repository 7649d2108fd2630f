"""Tensors with shapes but no values: a meta model made fake, and transformers told the truth about them.

    from workbench.core.memory.fake import fakeify, unpacked_for_fake_inputs
    fakeify(model, fake_mode)          # every meta parameter and buffer becomes a FakeTensor
    with unpacked_for_fake_inputs(), fake_mode: ...

Shared by the step prediction (workbench.core.memory.predict) and the simulated offload rungs
(workbench.core.memory.placement). FIELD_NOTES.md: under fake tensors transformers thinks it is
being traced and builds an explicit seq x seq attention mask that a real run skips;
`find_packed_sequence_indices` answers "not packed" (None) for fake inputs, as for real unpacked ones.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode



def fakeify(model: torch.nn.Module, fake_mode: FakeTensorMode, device: str = "cpu") -> torch.nn.Module:
    """Turn every meta parameter and buffer into a fake tensor on `device`; tied stay tied."""
    memo: dict[int, torch.Tensor] = {}
    dev = torch.device(device)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            if id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(FakeTensor(fake_mode, p.data, dev), requires_grad=p.requires_grad)
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
