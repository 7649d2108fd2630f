"""What DeepSpeed's ZeRO-3 parameter coordinator does, event by event, recorded the same way in a real
DeepSpeed run (on its CPU accelerator, in a subprocess) and in the simulation (workbench.core.memory.zero3).

At each call of the coordinator (`fetch_sub_module`, `release_sub_module`, `reset_step`,
`release_and_reset_all`, `release_backward_leftovers`) it records the call, its module's name, and
which parameters are then on the device (gathered or being gathered: on a GPU the copy exists from
the gather's issue). Each bucket reduce is recorded as (gradients, elements, concatenated).
"""

from __future__ import annotations

import contextlib
from typing import Callable
from unittest import mock

import torch

EVENTS = ("fetch_sub_module", "release_sub_module", "reset_step", "release_and_reset_all", "release_backward_leftovers")


@contextlib.contextmanager
def recording(model_of: Callable[[], torch.nn.Module], events: list):
    """Append [call, module name, forward, resident parameter names] to `events` at each coordinator call."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C

    on_device = (ZeroParamStatus.AVAILABLE, ZeroParamStatus.INFLIGHT)

    def wrap(name):
        orig = getattr(C, name)

        def recorded(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            model = model_of()
            modules = {id(m): n or "<root>" for n, m in model.named_modules()}
            names: dict[int, str] = {}
            for n, p in model.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), n)
            module = args[0] if args and isinstance(args[0], torch.nn.Module) else None
            resident = sorted(names[id(p)] for p in model.parameters() if getattr(p, "ds_status", None) in on_device)
            events.append([name, modules.get(id(module)) if module is not None else None, kwargs.get("forward"), resident])
            return out
        return recorded

    with contextlib.ExitStack() as stack:
        for name in EVENTS:
            stack.enter_context(mock.patch.object(C, name, wrap(name)))
        yield


@contextlib.contextmanager
def recording_reduces(reduces: list):
    """Append (gradients, elements, concatenated) for each of DeepSpeed's stage-3 bucket reduces."""
    from deepspeed.runtime.zero import stage3

    orig = stage3.reduce_scatter_coalesced

    def recorded(tensors, group=None):
        out = orig(tensors, group)
        base = out[0]._base if out[0]._base is not None else out[0]
        reduces.append((len(tensors), sum(t.numel() for t in tensors),
                        not any(base.data_ptr() == t.data_ptr() for t in tensors)))
        return out

    with mock.patch.object(stage3, "reduce_scatter_coalesced", recorded):
        yield
