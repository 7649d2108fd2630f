"""How much device memory is in use right now, while a run goes? A background sampler.

    rows = []
    with MemoryMonitor("cpu", interval_s=0.5, sinks=[rows.append], live=budget.live):
        train(...)

A daemon thread wakes every `interval_s` and sends one plain row to the sinks (rows of their own:
no loss, so a LiveChart, which draws the training loop's rows, does not draw them):
- on a GPU: NVML's used memory for the device (nvidia-ml-py's `pynvml`; it sees every process
  and the CUDA context, which torch does not) and torch's allocated / reserved / peak bytes;
- on the CPU: the process's resident set (psutil) and, when a LiveBytes count is given, the
  live tensor bytes (the "device" memory of a CPU emulating a small GPU).
A missing NVIDIA driver is reported in one line on stderr and the monitor carries on with what
it can read.

The training loop takes the GPU figures per step as well (`step_memory`): on CUDA every training
row of studies 1 and 2 carries the run's peak allocated and reserved bytes so far and NVML's used
memory; on the CPU it adds no columns (a CPU has no allocator peak or NVML to report). Sampling
costs microseconds per row; `overhead` measures what it costs a run (benchmarks/monitor_overhead.py
on this machine, `workbench gpu-check --only monitor` on a card).

`bf16_emulated` says in one line when a card before sm_80 runs bf16 emulated (the training loop
and the split engine warn with it).
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import threading
import time
from typing import Any, Callable, Iterable

import torch

from workbench.core.common import MiB, Sink


def indexed(device: str | torch.device) -> torch.device:
    """`device`, a CUDA one with its card's index: "cuda" is the current card when this is called.
    torch's per-process memory fraction needs the index (it raises ValueError for "cuda"), and
    CUDA's current device is per thread, so a sampling thread reading "cuda" reads card 0."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def release_card() -> None:
    """Give the card back what a check left in this process's caching allocator before the next
    check: the notebooks check's kernels are other processes, and on a small card the blocks cached
    here would be their shortfall (its figures would count them too)."""
    if torch.cuda.is_initialized():  # (a collection costs a big process a second: not where CUDA never ran)
        gc.collect()
        torch.cuda.empty_cache()
        # and the page-locked host memory torch's host allocator keeps cached once freed: DeepSpeed's
        # offload buffers (pinned through it: ZeRO-Offload's fp32 master and gradient among them) stay locked
        # after the engine is gone, out of the host memory the next checks and kernels need
        accelerator = getattr(torch, "accelerator", None)  # torch 2.13's public call; the CUDA one before it
        (getattr(accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", lambda: None))()


def release_held(device) -> bool:
    """CUDA: give back what this process holds that a fresh one would not: garbage, the cuBLAS
    workspaces (torch's `_cuda_clearCublasWorkspaces`, which its test suite calls before a leak check)
    and then every wholly free cached segment, so the next run on `device` makes its workspaces as a
    fresh process does (cuda_model.workspaces_in). False where this torch cannot release them."""
    gc.collect()
    torch.cuda.synchronize(device)
    if can_release_workspaces():
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return can_release_workspaces()


def can_release_workspaces() -> bool:
    """Whether this torch can release the cuBLAS workspaces (`release_held`), asked without doing it."""
    return hasattr(torch._C, "_cuda_clearCublasWorkspaces")


def open_nvml(device: torch.device, *, say: Callable[[str], None] | None = None):
    """An NVML handle for the CUDA `device`, or None (and one line saying why) without a driver.
    NVML numbers every card of the machine, CUDA only those CUDA_VISIBLE_DEVICES names, in its
    order: the handle is found through torch's own mapping from one to the other (what
    torch.cuda.device_memory_used uses; like it, it assumes CUDA_DEVICE_ORDER=PCI_BUS_ID where the
    cards differ). Where the mapping fails (MIG instances named in CUDA_VISIBLE_DEVICES), the
    CUDA index is taken as NVML's, as before."""
    try:
        import pynvml

        pynvml.nvmlInit()
        index = indexed(device).index
        try:
            index = torch.cuda._get_nvml_device_index(index)
        except Exception:  # MIG UUIDs match no card's UUID ("device 0 is not visible"), or no UUIDs read
            pass
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError ...
        (say or _stderr)(f"workbench monitor: NVML unavailable ({type(e).__name__}: {e}); "
                         f"no driver-level GPU memory figures, sampling what torch and psutil can read")
        return None


def driver_reserved_mib(handle) -> float | None:
    """What the driver and firmware reserve on the card (NVML's v2 memory query), or None where
    the driver has no v2 query. NVML's v1 `used`, which the monitor reads, includes it; nvidia-smi's
    "used" on drivers with v2 leaves it out (both read here so that a card run shows the difference)."""
    try:
        import pynvml

        return pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).reserved / MiB
    except Exception:  # NVMLError_FunctionNotFound on drivers before R510, or a stand-in without it
        return None


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def bf16_emulated(device: str | torch.device) -> str | None:
    """On a CUDA card before sm_80 (T4, V100, RTX 20xx), one line saying that bf16 runs emulated
    there: no bf16 tensor cores, and torch runs it anyway (`is_bf16_supported()` counts emulation),
    at fp32's speed or slower. None on any other device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return bf16_emulated_on(torch.cuda.get_device_name(device), 10 * major + minor)


def bf16_native(sm: int) -> bool:
    """Whether a card of compute capability `sm` (x 10) has bf16 tensor cores (sm_80 up); before
    it torch emulates bf16. The one place the rule lives (auto-fit, gpu-check, the warnings)."""
    return sm >= 80


def bf16_emulated_on(card: str, sm: int) -> str | None:
    """That line for a card by name and compute capability (x 10); None from sm_80 up."""
    if bf16_native(sm):
        return None
    return (f"bf16 on {card} (sm_{sm}) is emulated (no bf16 tensor cores before sm_80): expect fp32's speed "
            "or slower; fp16 with a GradScaler is this card's fast half precision")


def step_memory(device: str | torch.device, *, nvml=None) -> Callable[[], dict[str, float]] | None:
    """Columns for the training loop's per-step rows on a GPU; None on any other device (no columns).

    cuda_peak_allocated_mib / cuda_peak_reserved_mib: torch's peak counters, the running peak of
    the run so far (whoever starts the run resets them: the device budget, the ladder's measure;
    they are not reset per step because those callers read them when the run ends).
    cuda_reserved_mib: the caching allocator's reserved bytes now (what a budget set with
    set_per_process_memory_fraction caps, fragmentation included). nvml_used_mib: the driver's
    figure for the whole card (every process, the CUDA context). `nvml`: a handle, or None to open one.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    handle = nvml if nvml is not None else open_nvml(device)

    def read() -> dict[str, float]:
        cols = {"cuda_peak_allocated_mib": torch.cuda.max_memory_allocated(device) / MiB,
                "cuda_peak_reserved_mib": torch.cuda.max_memory_reserved(device) / MiB,
                "cuda_reserved_mib": torch.cuda.memory_reserved(device) / MiB}
        if handle is not None:
            import pynvml

            cols["nvml_used_mib"] = pynvml.nvmlDeviceGetMemoryInfo(handle).used / MiB
        return cols

    return read


class MemoryMonitor:
    """Samples memory on a background thread and sends each sample to `sinks` as a row."""

    def __init__(
        self,
        device: str | torch.device = "cpu",
        *,
        interval_s: float = 0.5,
        sinks: Iterable[Sink] = (),
        live=None,
        nvml: bool | None = None,
        extra: dict[str, Any] | None = None,
    ):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.device = indexed(device)  # read from the sampling thread, whose current card is 0
        self.interval_s = interval_s
        self.sinks = list(sinks)
        self.live = live  # a LiveBytes (or anything with current_bytes), for CPU runs
        self.extra = dict(extra or {})
        self.rows: list[dict[str, Any]] = []
        self.peak: dict[str, float] = {}
        want_nvml = self.device.type == "cuda" if nvml is None else nvml
        self._nvml = open_nvml(self.device) if want_nvml else None
        import psutil

        self._proc = psutil.Process(os.getpid())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def sample(self) -> dict[str, Any]:
        """One row: what can be read now, in MiB."""
        row: dict[str, Any] = {**self.extra, "source": "monitor", "t_s": time.perf_counter() - self._t0,
                               "rss_mib": self._proc.memory_info().rss / MiB}
        if self.live is not None:
            row["live_mib"] = self.live.current_bytes / MiB
        if self.device.type == "cuda":
            row["cuda_allocated_mib"] = torch.cuda.memory_allocated(self.device) / MiB
            row["cuda_reserved_mib"] = torch.cuda.memory_reserved(self.device) / MiB
            row["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated(self.device) / MiB
            row["cuda_max_reserved_mib"] = torch.cuda.max_memory_reserved(self.device) / MiB
        if self._nvml is not None:
            import pynvml

            info = pynvml.nvmlDeviceGetMemoryInfo(self._nvml)
            row["nvml_used_mib"] = info.used / MiB
            row["nvml_total_mib"] = info.total / MiB
            if (reserved := driver_reserved_mib(self._nvml)) is not None:
                row["nvml_driver_reserved_mib"] = reserved
        for k, v in row.items():
            if k.endswith("_mib"):
                self.peak[k] = max(self.peak.get(k, 0.0), v)
        return row

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            row = self.sample()
            self.rows.append(row)
            for sink in self.sinks:
                sink(row)

    def start(self) -> "MemoryMonitor":
        self._t0 = time.perf_counter()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="workbench-memory-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        row = self.sample()  # one last row, so a short run has at least one
        self.rows.append(row)
        for sink in self.sinks:
            sink(row)

    def __enter__(self) -> "MemoryMonitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def overhead(run: Callable[[], Any], device: str | torch.device = "cpu", *, rounds: int = 4, interval_s: float = 0.5,
             say: Callable[[str], None] = lambda s: None,
             clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """What a MemoryMonitor around `run()` costs it: each call timed from outside (the monitor's start
    and stop included; on CUDA after a synchronize), after gc.collect(), in the order off, on | on,
    off | ... (ABBA: neither side always runs second, and a linear drift of the machine's load hits
    both alike), after one untimed warm-up of each. `ratio` is the total time with the monitor over
    the total without, from this one run; the monitor's rows are returned too (what it read).
    `start_stop_s`: what a monitor costs a run once, whatever the run's length (opened, started and
    stopped around nothing: NVML's handle, the thread, the last row), the median of five; a run much
    shorter than a real one measures this rather than the sampling. `clock`: seconds (a test's own
    clock; the monitor's sampling keeps real time)."""
    device = torch.device(device)

    def start_stop() -> float:
        t0 = clock()
        with MemoryMonitor(device, interval_s=interval_s):
            pass
        return clock() - t0

    def timed(monitor: bool) -> tuple[float, list[dict[str, Any]]]:
        rows: list[dict[str, Any]] = []
        gc.collect()  # the previous run's garbage is collected here, not inside the timed call
        t0 = clock()
        with MemoryMonitor(device, interval_s=interval_s, sinks=[rows.append]) if monitor else contextlib.nullcontext():
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the monitor stops after the card's work, not before
        return clock() - t0, rows

    timed(False), timed(True)  # warm-up: allocation, kernel selection, psutil, NVML
    if device.type == "cuda":  # the rows' peak counters are this workload's, not an earlier check's
        torch.cuda.reset_peak_memory_stats(device)
    off = on = 0.0
    ratios, rows = [], []
    for i in range(rounds):
        secs = {}
        for monitor in ((False, True) if i % 2 == 0 else (True, False)):
            secs[monitor], got = timed(monitor)
            rows += got
        off, on = off + secs[False], on + secs[True]
        ratios.append(secs[True] / secs[False])
        say(f"  round {i + 1} ({'off' if i % 2 == 0 else 'on'} first): off {secs[False]:.2f} s, "
            f"on {secs[True]:.2f} s, on/off {ratios[-1]:.3f}")
    fixed = statistics.median(start_stop() for _ in range(5))
    return {"ratio": on / off, "off_s": off, "on_s": on, "round_ratios": ratios, "start_stop_s": fixed,
            "median_round_ratio": statistics.median(ratios), "samples": len(rows), "rows": rows,
            "rounds": rounds, "interval_s": interval_s, "device": str(device)}
