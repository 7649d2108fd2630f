"""The few pieces only a CUDA machine runs: pinned host buffers, copy side streams, events.

Kept apart so that the engine reads the same on both devices and so that what the CPU-only
tests cannot reach is small and in one place. Tests that need it are skipped without a GPU.
"""

from __future__ import annotations

import torch


def host_empty_like(t: torch.Tensor, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """A host buffer shaped like `t`; page-locked on CUDA machines so copies are true DMA."""
    return torch.empty(t.shape, dtype=dtype, device="cpu", pin_memory=pinned)


class Copier:
    """Device->host gradient copies and host->device weight copies on their own streams, so
    that they run beside the backward kernels on the compute stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def to_host(self, grad: torch.Tensor, stage: torch.Tensor) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        # the gradient was produced on the compute stream: the copy must wait for it
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.d2h):
            start.record()
            stage.copy_(grad, non_blocking=True)
            end.record()
        grad.record_stream(self.d2h)  # the caller drops its reference; keep the memory until copied
        return start, end

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.h2d):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
        return start, end

    @staticmethod
    def wait(event: torch.cuda.Event) -> None:
        """Make the compute stream wait for a copy (no host block)."""
        torch.cuda.current_stream().wait_event(event)


class Clock:
    """Milliseconds on one time base for host work (perf_counter) and device work (events).

    The bases are aligned once, at construction, with a device synchronisation.
    """

    def __init__(self, device: torch.device):
        import time

        self.cuda = device.type == "cuda"
        self._pc = time.perf_counter
        if self.cuda:
            torch.cuda.synchronize(device)
            self._e0 = torch.cuda.Event(enable_timing=True)
            self._e0.record()
            torch.cuda.synchronize(device)
        self._t0 = self._pc()

    def host_ms(self) -> float:
        return (self._pc() - self._t0) * 1e3

    def mark(self):
        """Now on the accelerator's timeline: a float on CPU, an event on CUDA."""
        if not self.cuda:
            return self.host_ms()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def ms(self, mark) -> float:
        if isinstance(mark, float):
            return mark
        mark.synchronize()
        return self._e0.elapsed_time(mark)
