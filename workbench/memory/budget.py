"""How is "a GPU of N MiB" enforced, on a GPU and on a machine without one?

    with device_budget("cpu", budget_mib=48) as budget:
        ...                                  # raises torch.OutOfMemoryError past 48 MiB live
        budget.peak_mib

On CUDA the allocator enforces it (`torch.cuda.set_per_process_memory_fraction`, as torchtune
does to emulate smaller cards) and the peak is `torch.cuda.max_memory_allocated`. On the CPU the
workbench counts live tensor bytes (LiveBytes) and raises the same `torch.OutOfMemoryError`, so
the fallback logic cannot tell the two apart (DESIGN.md section 3). Without a budget the context
still measures the peak.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from workbench.memory.live_bytes import MiB, LiveBytes


@dataclass
class DeviceBudget:
    device: torch.device
    budget_mib: float | None
    live: LiveBytes | None = None

    @property
    def current_mib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / MiB
        return self.live.current_mib if self.live else float("nan")

    @property
    def peak_mib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / MiB
        return self.live.peak_mib if self.live else float("nan")

    def track_module(self, module: torch.nn.Module) -> None:
        """Count tensors made outside the budget's view (weights loaded by C++ code)."""
        if self.live is not None:
            self.live.track_module(module)


class device_budget:
    """Context manager enforcing an optional memory budget on `device` and measuring its peak."""

    def __init__(self, device: str | torch.device, budget_mib: float | None = None):
        if budget_mib is not None and budget_mib <= 0:
            raise ValueError(f"budget_mib must be positive, got {budget_mib}")
        self.device = torch.device(device)
        self.budget_mib = budget_mib
        self._state: DeviceBudget | None = None

    def __enter__(self) -> DeviceBudget:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            if self.budget_mib is not None:
                total = torch.cuda.get_device_properties(self.device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, self.budget_mib * MiB / total), self.device)
            self._state = DeviceBudget(self.device, self.budget_mib)
        else:
            budget = int(self.budget_mib * MiB) if self.budget_mib is not None else None
            live = LiveBytes(self.device, budget_bytes=budget)
            live.__enter__()
            self._state = DeviceBudget(self.device, self.budget_mib, live)
        return self._state

    def __exit__(self, *exc) -> None:
        state = self._state
        if state.live is not None:
            state.live.__exit__(*exc)
        gc.collect()
        if self.device.type == "cuda":
            if self.budget_mib is not None:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            torch.cuda.empty_cache()
