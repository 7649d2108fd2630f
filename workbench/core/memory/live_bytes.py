"""How many bytes of tensors are alive on a device right now, and what was the peak?

    with LiveBytes("cpu", budget_bytes=64 * 2**20) as lb:
        lb.track_module(model)            # tensors made before the mode was entered
        loss = model(x).loss; loss.backward()
    lb.peak_bytes

A TorchDispatchMode sees every tensor an op returns. Each tensor's *storage* is counted once
(views share it) and subtracted by a weakref callback when the storage dies, so the count is the
live-bytes curve of the program, not the sum of allocations. A view or an in-place op's result is
never new memory: a tensor made before the mode is counted only when tracked (track_module), not
when sliced (a slice of the held-out tokens counted their whole storage, host memory on a card).
Measured here: on real CPU tensors and on FakeTensorMode tensors this gives the same peak to the byte,
per phase.

With a budget, an op whose result pushes the count past it raises `torch.OutOfMemoryError`,
exactly the exception CUDA's allocator raises, so code that falls back on OOM cannot tell a CPU
playing a small GPU from a real one. The tensor that broke the budget is released as the
exception unwinds, so the count returns to where it was.

A storage's weakref callback can run in the middle of a change to the books: a garbage collection
that an allocation there sets off frees a storage held in a reference cycle, on the same thread.
The books' lock is reentrant and such a death is recorded when the change is done, so no change is
seen half made. (With a plain lock the thread waited on itself for ever, inside the gc, which then
ran no more in that process: the played CUDA allocator, whose model allocates under the lock, did
so within a few thousand counted tensors when collections were frequent.)
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Callable, Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from workbench.core.common import MiB


def _storages(t: torch.Tensor, device_type: str | None = None):
    """The tensor's storage, if it lives on `device_type` (the tensor's device: a FakeTensor's
    storage reports the meta device, so the storage's own device cannot be used)."""
    if not isinstance(t, torch.Tensor) or (device_type is not None and t.device.type != device_type):
        return ()
    try:
        return (t.untyped_storage(),)
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some subclasses)
        return ()


@functools.cache
def _aliases_inputs(func) -> bool:
    """The op returns (part of) an input's storage: a view or an in-place result (its schema says so)."""
    return any(r.alias_info is not None for r in func._schema.returns)


def _metadata_only_parameter(x) -> bool:
    """A Parameter subclass that adds attributes but no dispatch of its own (bitsandbytes' Params4bit)."""
    t = type(x)
    return (isinstance(x, torch.nn.Parameter) and t is not torch.nn.Parameter and not isinstance(x, FakeTensor)
            and t.__torch_dispatch__ is torch.Tensor.__torch_dispatch__)


def fake_parameters(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A real metadata-only Parameter subclass in an op under a fake mode becomes its fake twin, as
    FakeTensorMode itself does for a plain Parameter (the op may see only that parameter: `view`
    of the 4-bit weight).

    FakeTensorMode from torch 2.13 converts such a parameter (bitsandbytes' 4-bit weight in a
    simulated QLoRA step) to its memoized fake twin; torch 2.11 (the H200's) calls it an unrecognized
    subclass and returns NotImplemented, so the op fails ("Multiple dispatch failed for
    aten.view"). The twin comes from the same memo, so the step and its bytes are the same on
    every torch; an op on real tensors only is left alone.
    """
    fake_mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)  # one C call per op
    if fake_mode is None or not any(_metadata_only_parameter(x) for x in leaves((args, kwargs))):
        return args, kwargs
    return tree_map(lambda x: fake_mode.from_tensor(x) if _metadata_only_parameter(x) else x, (args, kwargs))


def leaves(x, out: list | None = None) -> list:
    """What pytree's `tree_flatten(x)[0]` gives for an op's operands or results (tensors, scalars,
    and lists, tuples, return-type structs and kwargs dicts of them), in the same order, without
    its per-node bookkeeping, which made a simulated step about 10% slower (Qwen2-0.5B, bf16-mixed at
    4 x 512 on CUDA: 7.9 s against 7.1, the medians of three pairs run alternately; the same bytes)."""
    out = [] if out is None else out
    if isinstance(x, (list, tuple)):
        for y in x:
            leaves(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            leaves(y, out)
    else:
        out.append(x)
    return out


class BooksLock:
    """The lock over a LiveBytes' books (reentrant). A storage that dies while this thread is
    changing the books is forgotten as the outermost change ends, not in the middle of it."""

    def __init__(self, owner: "LiveBytes"):
        self._owner, self._lock, self.depth = owner, threading.RLock(), 0

    def __enter__(self) -> None:
        self._lock.acquire()
        self.depth += 1

    def __exit__(self, *exc) -> None:
        try:
            if self.depth == 1:
                self._owner._forget_deferred()
        finally:
            self.depth -= 1
            self._lock.release()


# bitsandbytes ops whose CPU kernel is Python over torch's own ops (bitsandbytes 0.50's backends/cpu and
# backends/default): the 8-bit optimizer update dequantizes both states to fp32 and makes an fp32 gradient and
# more (about 20 bytes an element of the parameter it updates), the 32-bit one an fp32 gradient, and the 4-bit
# matmul dequantizes the whole weight before its linear. A dispatch mode sees an op, not what its kernel does
# inside, so these are run under the mode (`opened`). Their leaves, the (de)quantize ops, call C code that
# makes only their outputs, and stay closed: their fake kernels are exact, and fake tensors have no data for C.
OPENED_ON_CPU = frozenset({"optimizer_update_8bit_blockwise", "optimizer_update_32bit", "gemm_4bit"})
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _on_the_cpu(args: tuple, kwargs: dict) -> bool:
    return all(t.device.type == "cpu" for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor))


class LiveBytes(TorchDispatchMode):
    """Counts live tensor-storage bytes on one device type; optional budget raises OOM.

    `cpu_kernels` (default: when counting the CPU): the step runs bitsandbytes' CPU kernels, so what
    they make inside is counted (OPENED_ON_CPU). A prediction of a CUDA step, whose fake tensors are
    CPU tensors too, turns it off: the CUDA kernels update in place."""

    def __init__(
        self,
        device: str | torch.device = "cpu",
        budget_bytes: int | None = None,
        on_change: Callable[[int], None] | None = None,
        *,
        cpu_kernels: bool | None = None,
    ):
        super().__init__()
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.device_type = torch.device(device).type
        self.cpu_kernels = self.device_type == "cpu" if cpu_kernels is None else cpu_kernels
        self.budget_bytes = budget_bytes
        self.on_change = on_change
        self.current_bytes = 0
        self.peak_bytes = 0
        self.window_peak_bytes = 0  # the peak since the last take_window_peak_mib() (a training step)
        self._live: dict[int, tuple[int, weakref.ref]] = {}
        self._lock = BooksLock(self)
        self._deferred: list[tuple[int, weakref.ref]] = []  # deaths during a change, forgotten after it
        self.ooms = 0  # out-of-memory errors raised (a library may catch one and raise its own error instead)

    # -- counting -------------------------------------------------------------------------
    def _forget(self, key: int, ref: weakref.ref) -> None:
        """A counted storage died (its weakref callback: any thread, any moment, a gc included)."""
        with self._lock:
            if self._lock.depth > 1:  # this thread was changing the books: finish that first
                self._deferred.append((key, ref))
            else:
                self._forget_now(key, ref)

    def _forget_deferred(self) -> None:
        while self._deferred:  # a gc inside one of these defers more, taken in the same loop
            self._forget_now(*self._deferred.pop(0))

    def _forget_now(self, key: int, ref: weakref.ref) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[1] is ref:
            del self._live[key]
            self.current_bytes -= entry[0]
            self._forgotten(key, entry[0])

    def _forgotten(self, key: int, nbytes: int) -> None:
        """Called (under the lock) when a counted storage dies; subclasses keep their own books."""

    def _add(self, st) -> bool:
        key = id(st)
        if key in self._live:
            return False
        nbytes = st.nbytes()
        ref = weakref.ref(st, lambda r, k=key: self._forget(k, r))
        with self._lock:
            self._live[key] = (nbytes, ref)
            self.current_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
            self.window_peak_bytes = max(self.window_peak_bytes, self.current_bytes)
        return True

    def track(self, tensors: Iterable) -> None:
        """Count these tensors' storages (if not counted yet), then enforce the budget."""
        added = False
        try:
            for t in tensors:
                for st in _storages(t, self.device_type):
                    added |= self._add(st)  # PlayedCudaAllocator's raises past its budget
            if added:
                if self.on_change is not None:
                    self.on_change(self.current_bytes)
                if self.budget_bytes is not None and self.current_bytes > self.budget_bytes:
                    raise torch.OutOfMemoryError(
                        f"workbench device budget exceeded on {self.device_type}: "
                        f"{self.current_bytes / MiB:.1f} MiB live > budget {self.budget_bytes / MiB:.1f} MiB"
                    )
        except torch.OutOfMemoryError:
            self.ooms += 1
            raise

    def track_module(self, module: torch.nn.Module) -> None:
        """Count a module's tensors made before the mode was entered: parameters, gradients, buffers and
        bitsandbytes' quantization state (on a card it is device memory beside the 4-bit weights)."""
        self.track([*model_tensors(module), *(p.grad for p in module.parameters() if p.grad is not None)])

    def take_window_peak_mib(self) -> float:
        """The most bytes alive since the previous call (the training loop calls it once per step, so
        each step's row carries that step's peak); the next window starts from the bytes alive now."""
        with self._lock:
            peak = max(self.window_peak_bytes, self.current_bytes)
            self.window_peak_bytes = self.current_bytes
        return peak / MiB

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    @property
    def current_mib(self) -> float:
        return self.current_bytes / MiB

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / MiB

    # -- dispatch ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        args, kwargs = fake_parameters(args, kwargs or {})
        if (self.cpu_kernels and getattr(func, "namespace", None) == "bitsandbytes"
                and func._opname in OPENED_ON_CPU and _on_the_cpu(args, kwargs)):
            out = self.opened(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if not _aliases_inputs(func):
            self.track(leaves(out))
        return out

    def opened(self, func, args: tuple, kwargs: dict):
        """`func`'s CPU kernel run with this mode on again (torch takes a mode off while it handles an
        op), so every op inside it is counted. Pushed as a plain dispatch mode: a subclass's own
        __enter__ (MemoryAccounting's hooks) is not entered twice."""
        TorchDispatchMode.__enter__(self)
        try:
            return func.redispatch(_CPU_KEYS, *args, **kwargs)
        finally:
            TorchDispatchMode.__exit__(self, None, None, None)


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters, buffers and bitsandbytes' quantization state of `model`: each 4-bit weight's
    absmax and code, and with double quantization the absmax's offset and its own absmax and code."""
    out = [*model.parameters(), *model.buffers()]
    for m in model.modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        while qs is not None:
            out += [t for t in (getattr(qs, k, None) for k in ("absmax", "code", "offset")) if isinstance(t, torch.Tensor)]
            qs = getattr(qs, "state2", None)
    return out
