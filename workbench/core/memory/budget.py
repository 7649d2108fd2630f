"""How is "a GPU of N MiB" enforced, on a GPU and on a machine without one?

    with device_budget("cpu", budget_mib=48) as budget:
        ...                                  # raises torch.OutOfMemoryError past 48 MiB live
        budget.peak_mib

On CUDA the allocator enforces it (`torch.cuda.set_per_process_memory_fraction`, as torchtune
does to emulate smaller cards) and the peak is `torch.cuda.max_memory_allocated`. On the CPU the
workbench counts live tensor bytes (LiveBytes) and raises the same `torch.OutOfMemoryError`, so
the fallback logic cannot tell the two apart. Without a budget the context
still measures the peak.

The two budgets do not cap the same thing. CUDA's caps the caching allocator's *reserved* memory
(sizes rounded to 512 B, 2 MiB segments for small tensors, 20 MiB ones for 1-10 MiB, free blocks
cached, fragmentation): a card OOMs with fewer live bytes than its size. The default CPU budget
caps *live* tensor bytes, so a played 8 GB card fits more than a real one. With
`allocator="cuda"` the CPU budget plays the card's allocator too: every storage LiveBytes sees
is malloc'd from (and freed to) the modelled allocator (allocator.CachingAllocator, modelled,
one stream), the budget caps its reserved bytes, and the budget reports `peak_mib` (allocated,
rounded, as max_memory_allocated) and `peak_reserved_mib` (as max_memory_reserved).

Under WSL2 a CUDA run in this context (study 1's attempts), budget or not, is capped at the card's
room when it begins (what CUDA reports free plus what this process holds, and no wider than a
fraction the notebook set): there the driver spills past the card into shared system memory, many
times slower, where a card runs out of memory (microsoft/WSL#11050), and nothing falls back.

On CUDA a fraction the process had set before (a notebook playing a smaller card, torchtune's way)
is replaced by the budget's for the run, which is what the run's rows report, and given back after.
"""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass

import torch

from workbench.core.common import in_wsl
from workbench.core.memory.allocator import CachingAllocator
from workbench.core.memory.live_bytes import LiveBytes, MiB
from workbench.core.memory.monitor import indexed

ALLOCATORS = ("live", "cuda")
# What a process may hold on its card between runs without a word: the cuBLAS workspaces it keeps
# (32 MiB per handle from sm_90, one per thread and stream that ran a matmul), not a model
HELD_BYTES = 256 * MiB


class PlayedCudaAllocator(LiveBytes):
    """LiveBytes that feeds each storage to the caching-allocator model; the budget caps the
    model's reserved bytes (OutOfMemoryError from the model), not the live bytes.
    `events`: set to a list to record (serial, nbytes) mallocs and (serial, -1) frees, the
    timeline `allocator.replay` takes."""

    def __init__(self, device: str | torch.device = "cpu", budget_bytes: int | None = None):
        super().__init__(device)
        self.model = CachingAllocator(limit=budget_bytes)
        self.events: list | None = None
        self._blocks: dict[int, tuple] = {}
        self._serial = 0
        self._window = (0, 0)  # the allocated and reserved peaks since take_window_peak_mib (a training step)
        self.window_reserved_mib = 0.0

    def _add(self, st) -> bool:
        if id(st) in self._live:
            return False
        if not st.nbytes():  # a card's allocator makes no block for 0 bytes (allocate: `if (size != 0)`)
            return super()._add(st)
        with self._lock:
            block = self.model.malloc(st.nbytes())  # raises past the budget: st is never counted
            self._window = (max(self._window[0], self.model.allocated), max(self._window[1], self.model.reserved))
            self._serial += 1
            self._blocks[id(st)] = (self._serial, block)
            if self.events is not None:
                self.events.append((self._serial, st.nbytes()))
        return super()._add(st)

    def _forgotten(self, key: int, nbytes: int) -> None:
        if not nbytes:  # 0 bytes: no block was made
            return
        serial, block = self._blocks.pop(key)
        self.model.free(block)
        if self.events is not None:
            self.events.append((serial, -1))

    def reset_peak(self) -> None:
        super().reset_peak()
        self.model.peak_allocated, self.model.peak_reserved = self.model.allocated, self.model.reserved

    def take_window_peak_mib(self) -> float:
        """The modelled allocator's allocated peak since the previous call (a training step's row: of the kind
        the run's peak is); `window_reserved_mib` is then its reserved peak over the same window."""
        with self._lock:
            allocated, reserved = self._window
            self.window_reserved_mib = max(reserved, self.model.reserved) / MiB
            self._window = (self.model.allocated, self.model.reserved)
        return max(allocated, self.model.allocated) / MiB

    # The figures a budget reports are the modelled allocator's (as torch.cuda's are a card's).
    @property
    def current_mib(self) -> float:
        return self.model.allocated / MiB

    @property
    def peak_mib(self) -> float:
        return self.model.peak_allocated / MiB

    @property
    def peak_reserved_mib(self) -> float:
        return self.model.peak_reserved / MiB


@dataclass
class DeviceBudget:
    device: torch.device
    budget_mib: float | None
    live: LiveBytes | None = None
    ooms_before: int = 0  # CUDA: the allocator's count of out-of-memory errors when the budget began

    def ooms(self) -> int:
        """How many out-of-memory errors the device raised since the budget began: the card's allocator
        (its `num_ooms`) or the played budget, counting those a library caught and replaced by an error of
        its own (transformers' loader logs a weight's failed quantization and ends the load with a
        RuntimeError that says nothing of memory)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_stats(self.device).get("num_ooms", 0) - self.ooms_before
        return self.live.ooms if self.live is not None else 0

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

    def step_peak_mib(self) -> float:
        """The peak of the step that just ended (the training loop calls this once per step): live
        tensor bytes since the previous call on the CPU; on CUDA torch's peak counter, the running
        peak of the run so far (torch has one counter, and the budget reads it when the run ends)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / MiB
        return self.live.take_window_peak_mib() if self.live else float("nan")

    def step_memory(self) -> dict[str, float]:
        """A training step's memory columns (the training loop's memory_probe): `mem_mib` (step_peak_mib); a
        played card's also `modelled_reserved_mib`, the reserved peak its budget caps, beside the allocated one."""
        columns = {"mem_mib": self.step_peak_mib()}
        if isinstance(self.live, PlayedCudaAllocator):
            columns["modelled_reserved_mib"] = self.live.window_reserved_mib
        return columns

    @property
    def peak_reserved_mib(self) -> float:
        """The allocator's reserved peak: real on CUDA, modelled with allocator="cuda", else NaN."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_reserved(self.device) / MiB
        return getattr(self.live, "peak_reserved_mib", float("nan"))  # live bytes have no allocator

    def track_module(self, module: torch.nn.Module) -> None:
        """Count tensors made outside the budget's view (weights loaded by C++ code)."""
        if self.live is not None:
            self.live.track_module(module)


class device_budget:
    """Context manager enforcing an optional memory budget on `device` and measuring its peak.
    `allocator`: on the CPU, "live" (default) caps live bytes, "cuda" the modelled CUDA caching
    allocator's reserved bytes; a real CUDA device always uses its own allocator."""

    def __init__(self, device: str | torch.device, budget_mib: float | None = None, allocator: str = "live"):
        if budget_mib is not None and budget_mib <= 0:
            raise ValueError(f"budget_mib must be positive, got {budget_mib}")
        if allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
        self.allocator = allocator
        self.device = indexed(device)  # set_per_process_memory_fraction (unlike the statistics) needs the index
        self.budget_mib = budget_mib
        self._fraction = 1.0  # CUDA: the process's memory fraction before the budget's
        self._capped = False  # CUDA: whether the budget (or WSL2's room) set a fraction
        self._state: DeviceBudget | None = None

    def __enter__(self) -> DeviceBudget:
        if self.device.type == "cuda":
            # garbage an earlier run left in reference cycles still holds its blocks, and
            # max_memory_allocated would count it in this run's peak (an H200 measured +1 GB)
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            if (held := torch.cuda.memory_allocated(self.device)) > HELD_BYTES:
                # the same text for every run: Python shows it once, not once per attempt and budget
                warnings.warn(f"{self.device} already holds {held / MiB:,.0f} MiB of this process's memory (a model "
                              "an earlier cell left there?): it counts in every run's peak and against a CUDA "
                              "budget; free it (del the model, then torch.cuda.empty_cache()) or restart the kernel",
                              stacklevel=2)
            cap = None if self.budget_mib is None else self.budget_mib * MiB
            total = torch.cuda.get_device_properties(self.device).total_memory
            # the fraction a notebook set before (torchtune's way) comes back after
            self._fraction = torch.cuda.get_per_process_memory_fraction(self.device)
            if in_wsl():  # WSL2's driver (Windows') spills past the card into shared system memory, many times
                # slower, instead of running out: the cap is the card's room now, so that torch raises first
                # (and never wider than the notebook's own fraction when there is no budget)
                free, _ = torch.cuda.mem_get_info(self.device)
                room = free + torch.cuda.memory_reserved(self.device)
                cap = min(cap, room) if cap is not None else min(room, self._fraction * total)
            if cap is not None:
                torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), self.device)
                self._capped = True
            self._state = DeviceBudget(self.device, self.budget_mib,
                                       ooms_before=torch.cuda.memory_stats(self.device).get("num_ooms", 0))
        else:
            budget = int(self.budget_mib * MiB) if self.budget_mib is not None else None
            if self.allocator == "cuda":
                live = PlayedCudaAllocator(self.device, budget_bytes=budget)
            else:
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
            if self._capped:
                torch.cuda.set_per_process_memory_fraction(self._fraction, self.device)
            torch.cuda.empty_cache()
