"""What happens when a strategy does not fit on the device it was meant for?

Each strategy gets an ordered list of attempts, each a device with an optional memory budget:

    Attempt.parse("cuda"), Attempt.parse("cpu@48")   # 48 MiB budget: the CPU playing a small GPU
    Attempt.parse("cpu@48:cuda")                      # ... with the card's caching allocator modelled
    default_attempts(budget_mib=48)                   # GPU then CPU on a GPU machine; else cpu@48 then cpu

`run_with_fallback(attempts, job)` runs `job(attempt, budget, phase)` on each attempt in turn. On
running out of memory (`out_of_memory`: torch's OutOfMemoryError, or CUDA's own; or a RuntimeError
that follows, in the same phase, one the device's allocator or budget raised and a library caught) at
any point of the job (load, forward, backward, optimizer step, evaluation) it drops everything the attempt
held, records the device, the phase and the error, and goes on to the next attempt with a fresh
start. Any other error propagates. A pre-flight
check may skip an attempt whose predicted peak exceeds its budget (a CPU attempt without one: the
memory this machine has free, so an attempt too big for it is a row, not the whole process killed
by the kernel's OOM killer), and that is recorded too, and so is an attempt on a device this
machine does not have ('cuda' without a GPU, or on a card this torch build has no kernels for):
the next one runs.
When nothing fits, the outcome has status "oom" instead of raising; when no device named exists
here, "skipped".
"""

from __future__ import annotations

import gc
import traceback
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from workbench.core.common import host_free_mib, one_line
from workbench.core.config import ConfigError
from workbench.core.memory.budget import DeviceBudget, device_budget


@dataclass(frozen=True)
class Attempt:
    device: str
    budget_mib: float | None = None
    allocator: str = "live"  # CPU budgets: "live" caps live tensor bytes, "cuda" the modelled reserved bytes

    @classmethod
    def parse(cls, text: str) -> "Attempt":
        """'cuda', 'cuda:1', 'cpu', or any of them with '@MiB' for a memory budget; a CPU budget
        may end in ':cuda' ('cpu@48:cuda') to cap the modelled CUDA caching allocator's reserved
        bytes (rounding, segments, fragmentation) instead of live bytes, as a card's budget does."""
        dev, _, budget = text.partition("@")
        allocator = "live"
        if budget.endswith(":cuda"):
            budget, allocator = budget[: -len(":cuda")], "cuda"
            if not dev.startswith("cpu"):
                raise ConfigError(f"attempt {text!r}: ':cuda' models a card's allocator on the CPU; "
                                  f"a real GPU uses its own (drop ':cuda')")
        if device_kind(dev) is None:  # torch knows mps, xpu, meta...: the studies run on cpu and cuda
            raise ConfigError(f"attempt {text!r}: {dev!r} is not a device the workbench runs on; use cpu, cuda or "
                              f"cuda:N, each with an optional @MiB budget (e.g. cuda@8192)")
        if budget:
            try:
                mib = float(budget)
            except ValueError:
                raise ConfigError(f"attempt {text!r}: budget {budget!r} is not a number of MiB") from None
            if not (0 < mib < float("inf")):  # nan and inf as well: a budget is a finite number of MiB
                raise ConfigError(f"attempt {text!r}: the budget must be a positive, finite number of MiB "
                                  f"(e.g. {dev}@8192), or none ({dev})")
            return cls(dev, mib, allocator)
        return cls(dev)

    @property
    def on_cpu(self) -> bool:
        """Whether the attempt runs on the CPU, however the device is written ('cpu', 'cpu:0')."""
        return torch.device(self.device).type == "cpu"

    def peak_is(self) -> str:
        """What a run's peak on this attempt counts (the `peak_mem_mib` a finished run reports)."""
        if not self.on_cpu:
            return "measured: the CUDA allocator's peak allocated"
        if self.allocator == "cuda":  # (the played card's budget caps its reserved bytes, not these)
            return (f"modelled: the CUDA caching allocator's peak allocated (blocks rounded as on a card) of a played "
                    f"{self.budget_mib:g} MiB card, over a measured CPU run")
        played = f", the CPU playing a {self.budget_mib:g} MiB GPU" if self.budget_mib is not None else " on the CPU"
        return f"measured: peak live tensor bytes{played}"

    def __str__(self) -> str:
        if self.budget_mib is None:
            return self.device
        return f"{self.device}@{self.budget_mib:g}" + (":cuda" if self.allocator == "cuda" else "")


# out-of-memory errors that are not torch's OutOfMemoryError: memory CUDA takes outside the caching
# allocator, when the card is full. A cuBLAS handle, made on first use in each thread (autograd's
# backward thread makes its own at the first backward matmul), fails as "CUBLAS_STATUS_ALLOC_FAILED";
# a plain cudaMalloc (a library's, the context's) as "CUDA error: out of memory". Both RuntimeErrors.
# Left out: "CUBLAS_STATUS_NOT_INITIALIZED", which a full card gives too, but so does a device-side
# assert (an embedding index out of range): a bug is not to be fallen back from.
# CUDA's own failures outside torch's allocator (a cuBLAS handle), and the CPU allocator's: a CPU
# allocation the system refuses (one tensor larger than it will commit, a ulimit -v or a batch job's
# memory limit) is a RuntimeError from c10's alloc_cpu, not an OutOfMemoryError
OUT_OF_MEMORY_MESSAGES = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDA error: out of memory",
                          "DefaultCPUAllocator: can't allocate memory")


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is the device running out of memory (torch's OutOfMemoryError, CUDA's own, or the
    CPU allocator refusing an allocation)."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and any(m in str(e) for m in OUT_OF_MEMORY_MESSAGES))


def no_kernels(index: int = 0) -> str | None:
    """Why this torch build has no kernels for CUDA card `index` (None: it has, or torch does not say).

    torch only warns when it finds such a card (a GTX 1080 or a V100 under a CUDA 12.9 or 13 build,
    which start at sm_75): `is_available()` stays True and the first kernel fails with "no kernel
    image is available", an error no fallback catches. Read with torch's own compatibility table."""
    cuda = torch.cuda
    if torch.version.cuda is None:  # a CPU or ROCm build: nothing to check
        return None
    try:
        built = [cuda._extract_arch_version(a) for a in cuda.get_arch_list()]
        if not built:
            return None
        major, minor = cuda.get_device_capability(index)
        cc = 10 * major + minor
        if any(cuda._code_compatible_with_device(cc, b) for b in built):
            return None
        releases = _builds_for(cc)
    except (AttributeError, ValueError, IndexError):  # torch's private table moved: trust torch
        return None
    fix = _install(releases[-1]) if releases else "no torch build of this release has them"
    built_for = ", ".join(f"sm_{b}" for b in sorted(set(built)))
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) has no kernels for {cuda.get_device_name(index)} "
            f"(sm_{cc}; built for {built_for}): {fix}")


def _builds_for(cc: int) -> list[str]:
    """The CUDA versions of this torch release's builds (torch's table) with kernels for a card of
    compute capability `cc` (x 10) on this machine's architecture, oldest first."""
    cuda = torch.cuda
    return [v for v, by_arch in cuda.PYTORCH_RELEASES_CODE_CC.items()
            if any(cuda._code_compatible_with_device(cc, b) for b in by_arch.get(cuda._host_arch_key(), ()))]


def _install(cu: str) -> str:
    version = torch.__version__.split("+")[0]
    index_url = "https://download.pytorch.org/whl" + ("/nightly" if "dev" in version else "")
    return f"install torch {version} for CUDA {cu} (--index-url {index_url}/cu{cu.replace('.', '')})"


def _nvml_capability() -> int | None:
    """The lowest compute capability (x 10) among this machine's cards, read through NVML (no CUDA
    needed), or None where NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no NVML library or driver, or an old one
        return None
    try:
        ccs = [pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(i))
               for i in range(pynvml.nvmlDeviceGetCount())]
        return min(10 * major + minor for major, minor in ccs) if ccs else None
    except Exception:
        return None
    finally:  # NVML counts each init: one shutdown each (it had been left open)
        with suppress(Exception):
            pynvml.nvmlShutdown()


def driver_too_old() -> str | None:
    """Why CUDA finds no GPU where there is one: the NVIDIA driver is older than this torch build's
    CUDA (PyPI's CUDA 13 build on a driver before the 580 series: a notebook platform's, say). torch
    only warns, and is_available() says False. None: the driver suffices, or there is none."""
    if torch.version.cuda is None:  # a CPU or ROCm build
        return None
    try:
        if torch._C._cuda_isDriverSufficient():
            return None
        found = torch._C._cuda_getDriverVersion()  # the newest CUDA the driver runs, 12080 for 12.8; 0: no driver
        cc = _nvml_capability()
        releases = _builds_for(cc) if cc else list(torch.cuda.PYTORCH_RELEASES_CODE_CC)
    except (AttributeError, RuntimeError, ValueError, IndexError):  # torch's private names moved: trust torch
        return None
    if not found:
        return None
    have = (found // 1000, found % 1000 // 10)
    # a build runs on a driver of its CUDA major version, however old its minor (minor version compatibility);
    # of those, one with kernels for the card (a P100's newest is CUDA 12.6's)
    runs = [v for v in releases if int(v.split(".")[0]) <= have[0]]
    fix = f"{_install(runs[-1])} or a newer driver" if runs else "install a newer NVIDIA driver"
    return (f"the NVIDIA driver runs CUDA {have[0]}.{have[1]} at most, older than this build's "
            f"{torch.version.cuda}: {fix}")


def device_kind(text: str) -> str | None:
    """"cpu" or "cuda" for a device the studies run on (cpu, cuda, cuda:N), else None (mps, "gpu", "cuda:x")."""
    try:
        kind = torch.device(text).type
    except RuntimeError:  # "gpu": torch lists every device type it knows
        return None
    return kind if kind in ("cpu", "cuda") else None


def unavailable(device: str) -> str | None:
    """Why `device` does not exist on this machine, or torch cannot run on it (None: it can)."""
    dev = torch.device(device)  # cpu or cuda[:N] (Attempt.parse and SplitConfig allow no other)
    if dev.type == "cpu":
        return None
    if not torch.cuda.is_available():
        if old := driver_too_old():
            return f"CUDA cannot start on this machine's GPU (torch {torch.__version__}): {old}"
        why = "this torch build has no CUDA" if torch.version.cuda is None else "CUDA finds no GPU"
        return f"no CUDA device on this machine (torch {torch.__version__}: {why})"
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"{device} does not exist: this machine has {torch.cuda.device_count()} GPU(s), cuda:0 first"
    return no_kernels(torch.cuda.current_device() if dev.index is None else dev.index)  # 'cuda': the current card


def device_problem(device: str) -> str | None:
    """Why `device` (a script's --device) cannot be used here, in one line: not cpu, cuda or cuda:N, or
    not on this machine (`unavailable`); None where it can."""
    return f"{device!r} is not cpu, cuda or cuda:N" if device_kind(device) is None else unavailable(device)


def resolve_device(device: str) -> str:
    """The device a study's `device` setting runs on: 'auto' is the GPU where there is one torch can
    run on, else the CPU; a device this machine does not have (or this torch build has no kernels
    for) is a one-line error."""
    if device == "auto":
        return "cuda" if unavailable("cuda") is None else "cpu"
    missing = unavailable(device)
    if missing:
        raise ConfigError(f"device={device}: {missing}; use device=cpu or device=auto")
    return device


def default_attempts(budget_mib: float | None) -> tuple[Attempt, ...]:
    """GPU (under the budget, if any) then CPU on a GPU machine torch can run on; else the CPU
    playing a GPU, then the CPU."""
    if unavailable("cuda") is None:
        return (Attempt("cuda", budget_mib), Attempt("cpu"))
    if budget_mib is None:
        return (Attempt("cpu"),)
    return (Attempt("cpu", budget_mib), Attempt("cpu"))


@dataclass
class Outcome:
    status: str  # ok (first attempt here), fallback (a later one), oom (none fitted), skipped (no device here)
    attempt: Attempt | None
    value: Any
    history: list[dict] = field(default_factory=list)
    peak_mib: float | None = None

    def history_text(self) -> str:
        """One line: 'cpu@48: oom in backward -> cpu: ok'."""
        return " -> ".join(
            f"{h['attempt']}: {h['result']}" + (f" in {h['phase']}" if h.get("phase") else "")
            for h in self.history
        )


class Phase:
    """Where in the job we are, so an OOM can say where it happened; `ran_out()`: whether the device
    raised an out-of-memory error since this phase began (`count`: the budget's, set once it exists)."""

    def __init__(self):
        self.name = "start"
        self.count: Callable[[], int] = lambda: 0
        self._at = 0

    def __call__(self, name: str) -> None:
        self.name, self._at = name, self.count()

    def ran_out(self) -> bool:
        return self.count() > self._at


Job = Callable[[Attempt, DeviceBudget, Phase], Any]
Preflight = Callable[[Attempt], "tuple[float, str] | None"]


def release(device: str | torch.device) -> None:
    """Give back the device memory of a run that raised, once the caller has dropped what it held
    and left the `except` block (the error's frames hold the run's tensors until then)."""
    gc.collect()
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def freed_on_interrupt(device: str | torch.device) -> Iterator[None]:
    """On ^C (a notebook's interrupt: not an Exception, so no row, and the run ends), the finished
    frames of its traceback are cleared of their locals and the device's memory given back before
    it goes on. IPython keeps the last traceback (sys.last_traceback), and through its frames the
    interrupted run's model, optimizer and activations would stay on the card, counted in the next
    run's peak and against its budget. (The frame running the `with` is not cleared: executing.)"""
    try:
        yield
    except BaseException as e:
        if not isinstance(e, Exception):
            traceback.clear_frames(e.__traceback__)
            release(device)
        raise


def run_with_fallback(
    attempts: tuple[Attempt, ...],
    job: Job,
    *,
    preflight: Preflight | None = None,
    on_event: Callable[[dict], None] | None = None,
) -> Outcome:
    """Run `job` on each attempt until one completes without running out of memory."""
    if not attempts:
        raise ConfigError("at least one attempt (device) is needed")
    history: list[dict] = []

    def record(event: dict) -> None:
        history.append(event)
        if on_event:
            on_event(dict(event))

    for attempt in attempts:
        missing = unavailable(attempt.device)
        if missing is not None:
            record({"attempt": str(attempt), "result": "unavailable", "phase": None, "reason": missing})
            continue
        limit = _preflight_limit(attempt)
        if preflight is not None and limit is not None:
            predicted = preflight(attempt)
            if predicted is not None and predicted[0] > limit[0]:
                mib, how = predicted
                record({"attempt": str(attempt), "result": "skipped", "phase": "preflight",
                        "reason": f"predicted peak {mib:,.1f} MiB ({how}) > {limit[1]}"})
                continue
        phase = Phase()
        oom = None
        try:
            with freed_on_interrupt(attempt.device):
                value, peak = _run_one(attempt, job, phase)
        except Exception as e:
            if not out_of_memory(e):
                raise
            oom = (str(e).splitlines() or [type(e).__name__])[0][:300]  # a bare OutOfMemoryError() too
        if oom is not None:
            # Freed here, after the handler: inside it the exception (and through its traceback
            # the failed attempt's frames, model and activations) is still alive.
            release(attempt.device)
            record({"attempt": str(attempt), "result": "oom", "phase": phase.name, "reason": oom})
            continue
        record({"attempt": str(attempt), "result": "ok", "phase": None, "peak_mib": peak})
        # a device this machine lacks was not fallen back from: nothing ran out of memory there
        status = "ok" if all(h["result"] == "unavailable" for h in history[:-1]) else "fallback"
        return Outcome(status, attempt, value, history, peak)
    if all(h["result"] == "unavailable" for h in history):
        return Outcome("skipped", None, {"notes": "; ".join(h["reason"] for h in history)}, history)
    return Outcome("oom", None, None, history)


def _preflight_limit(attempt: Attempt) -> tuple[float, str] | None:
    """What a pre-flight prediction is held to: the attempt's budget; on a CPU without one, the
    memory the machine has free now (an overrun there is not an OutOfMemoryError but the process
    killed, or swapping); none on a card without one (its OOM is caught)."""
    if attempt.budget_mib is not None:
        return attempt.budget_mib, f"budget {attempt.budget_mib:g} MiB"
    if attempt.on_cpu:
        free = host_free_mib()
        return free, f"the {free:,.0f} MiB this machine has free (preflight=False runs it anyway)"
    return None


def _run_one(attempt: Attempt, job: Job, phase: Phase):
    # A function of its own, so that when an OOM unwinds, the attempt's frames (and the model,
    # optimizer and activations they hold) die with the traceback.
    with device_budget(attempt.device, attempt.budget_mib, allocator=attempt.allocator) as budget:
        phase.count = budget.ooms
        try:
            value = job(attempt, budget, phase)
        except Exception as e:
            if out_of_memory(e) or type(e) is not RuntimeError or not phase.ran_out():
                raise  # (a bug after an out-of-memory error a library recovered from is still a bug)
            # a library caught the out-of-memory error and raised its own (transformers' loader, when a
            # 4-bit weight's quantization fails): still this device running out, not a bug
            raise torch.OutOfMemoryError(f"ran out of memory, then {one_line(e)}") from e
        peak = budget.peak_mib
    return value, peak
