"""Where each tensor of a simulated step lives: on the card ("device") or in host memory ("host").

    with PlacedAccounting("cpu", stub_scalars=True) as acc:
        acc.preset(weights_on_host, HOST)
        ...                                     # the step
    acc.place_report(DEVICE).steady_peak_bytes, acc.place_report(HOST).steady_peak_bytes

MemoryAccounting (workbench.core.memory.accounting) counts every live storage with its category,
phase and peak; `PlacedAccounting` keeps the same books per place. An op's outputs live where its
inputs live (torch runs an op on its inputs' device; a foreach op's i-th output with its i-th
input), a factory op's where the running module executes (`exec_places`), and a copy across places
is made only where a library makes one (`placing`, `move`). Optimizer state lives with its
parameter, except the CPU step counter of torch's foreach and single-tensor loops.
The libraries' placements are replayed with it in workbench.core.memory.offload.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from workbench.core.memory.accounting import EMPTY_CACHE, MemoryAccounting, MemoryReport, PeakSnapshot
from workbench.core.memory.live_bytes import _storages
from workbench.core.memory.plan import host_step_counters

DEVICE, HOST = "device", "host"
PLACES = (DEVICE, HOST)


# ------------------------------------------------------------------------------------------------
# the accounting

class PlacedAccounting(MemoryAccounting):
    """MemoryAccounting that also knows where each storage lives (DEVICE or HOST) and keeps each
    place's running totals, peaks and allocation timeline."""

    def __init__(self, *args: Any, default_place: str = DEVICE, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.where: dict[int, str] = {}
        self.place_bytes = dict.fromkeys(PLACES, 0)
        self.place_by_category = {p: dict.fromkeys(self.by_category, 0) for p in PLACES}
        self.place_peak = {p: PeakSnapshot() for p in PLACES}
        self.place_phase_peaks: dict[str, dict[tuple[int, str], PeakSnapshot]] = {p: {} for p in PLACES}
        self.serial_place: dict[int, str] = {}
        self.exec_places = [default_place]  # the running module's execution place (a stack)
        self._preset: dict[int, str] = {}
        self._forced: str | None = None
        self._placing: str | None = None
        self._call: tuple | None = None
        self.stream = 0  # the stream the library allocates on (0: the default; see on_stream)
        self.serial_stream: dict[int, int] = {}

    # -- where things are -------------------------------------------------------------------
    def place_of(self, t: Any) -> str | None:
        for st in _storages(t, self.device_type):
            return self.where.get(id(st)) or self._preset.get(id(st))
        return None

    def preset(self, tensors, place: str) -> None:
        """These storages live at `place` (for tensors made before they are counted: the weights)."""
        for t in tensors:
            for st in _storages(t, self.device_type):
                key = id(st)
                if key in self._live:
                    self._move(key, place)
                else:
                    self._preset[key] = place

    def _move(self, key: int, place: str) -> None:
        with self._lock:
            old = self.where.get(key, place)
            if old == place:
                return
            n, role = self._live[key][0], self._role[key]
            self._count(key, role, -n)
            self.where[key] = place
            self._count(key, role, n)

    @contextlib.contextmanager
    def placing(self, place: str):
        """Every storage made inside lives at `place` (a copy the library makes across places)."""
        before, self._forced = self._forced, place
        try:
            yield
        finally:
            self._forced = before

    @contextlib.contextmanager
    def on_stream(self, stream: int):
        """Every storage made inside is allocated on `stream` (a library's side stream, whose freed
        blocks the card's caching allocator keeps for that stream alone)."""
        before, self.stream = self.stream, stream
        try:
            yield
        finally:
            self.stream = before

    # -- counting -----------------------------------------------------------------------------
    def _add(self, st, role: str | None = None) -> bool:
        key = id(st)
        if key in self._live:
            return False
        self.where[key] = self._preset.pop(key, None) or self._forced or self._placing or self.exec_places[-1]
        added = super()._add(st, role)
        serial = self._serial.get(key)
        if serial is not None:
            self.serial_place[serial] = self.where[key]
            if self.stream:
                self.serial_stream[serial] = self.stream
        return added

    def _count(self, key: int, role: str, nbytes: int) -> None:
        super()._count(key, role, nbytes)
        place = self.where.get(key, self.exec_places[0])
        self.place_by_category[place][role] += nbytes
        self.place_bytes[place] += nbytes

    def _forgotten(self, key: int, nbytes: int) -> None:
        super()._forgotten(key, nbytes)
        self.where.pop(key, None)

    def _snapshot(self) -> None:
        super()._snapshot()
        for place in PLACES:
            cur = self.place_bytes[place]
            if cur > self.place_peak[place].bytes:
                self.place_peak[place] = PeakSnapshot(cur, dict(self.place_by_category[place]), self.step, self.phase, self._op)
            k = (self.step, self.phase)
            snap = self.place_phase_peaks[place].get(k)
            if snap is None or cur > snap.bytes:
                self.place_phase_peaks[place][k] = PeakSnapshot(cur, dict(self.place_by_category[place]), self.step,
                                                                self.phase, self._op)

    def _output_places(self, n: int) -> list[str]:
        """Where an op's `n` outputs live: a foreach op's i-th output with its i-th input, any
        other op's with its first placed tensor input that has dimensions, else the running module's."""
        if self._forced:
            return [self._forced] * n
        func, args, kwargs = self._call or (None, (), {})
        name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
        if name.startswith("_foreach_") and args and isinstance(args[0], (list, tuple)) and len(args[0]) == n:
            return [self.place_of(a) or self.exec_places[-1] for a in args[0]]
        best = None
        for a in tree_flatten((args, kwargs))[0]:
            p = self.place_of(a) if isinstance(a, torch.Tensor) else None
            if p is not None:
                if a.dim() > 0:
                    return [p] * n
                best = best or p
        return [best or self.exec_places[-1]] * n

    def track(self, tensors) -> None:
        tensors = list(tensors)
        for t, place in zip(tensors, self._output_places(len(tensors))):
            for st in _storages(t, self.device_type):
                self._placing = place
                try:
                    self._add(st)
                finally:
                    self._placing = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._call = (func, args, kwargs or {})
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._call = None

    def _after_step(self, optimizer, args, kwargs) -> None:
        super()._after_step(optimizer, args, kwargs)
        # State lives with its parameter, but for the step counter of the foreach and single-tensor loops
        # (a CPU scalar: plan.host_step_counters); the fused kernel's is on the parameter's device.
        counters = {id(t) for t in host_step_counters(optimizer)}
        for p, state in optimizer.state.items():
            for t in state.values():
                if isinstance(t, torch.Tensor):
                    self.preset([t], HOST if id(t) in counters else (self.place_of(p) or self.exec_places[0]))

    # -- reports ------------------------------------------------------------------------------
    def place_report(self, place: str, full: MemoryReport | None = None) -> MemoryReport:
        """The MemoryReport of one place: its peaks, and its allocations' timeline for the
        allocator model (split from `full`, this accounting's `report()`, when given)."""
        r = MemoryReport(place, self.place_peak[place], dict(self.place_phase_peaks[place]), self.step)
        full = full or self.report()
        if full.timeline is not None:
            # an empty_cache is the card's allocator's
            keep = [i for i, (serial, n) in enumerate(full.timeline)
                    if self.serial_place.get(serial) == place or (n == EMPTY_CACHE and place == DEVICE)]
            r.timeline = [full.timeline[i] for i in keep]
            r.timeline_steps = [full.timeline_steps[i] for i in keep]
            r.timeline_ops = [full.timeline_ops[i] for i in keep]
            r.timeline_roles = {s: role for s, role in full.timeline_roles.items() if self.serial_place.get(s) == place}
            r.timeline_streams = {s: st for s, st in self.serial_stream.items() if self.serial_place.get(s) == place}
        return r


class _Move(torch.autograd.Function):
    """A copy to another place, as `tensor.to(device)`: its gradient is copied back."""

    @staticmethod
    def forward(ctx, x, acc: PlacedAccounting, dst: str):
        ctx.acc, ctx.src = acc, acc.place_of(x) or acc.exec_places[-1]
        with acc.placing(dst):
            return x.clone()

    @staticmethod
    def backward(ctx, g):
        with ctx.acc.placing(ctx.src):
            return g.clone(), None, None


def move(x: Any, acc: PlacedAccounting, dst: str) -> Any:
    if not isinstance(x, torch.Tensor) or acc.place_of(x) in (None, dst):
        return x
    if x.requires_grad:
        return _Move.apply(x, acc, dst)
    with acc.placing(dst):
        return x.clone()


def move_output(out: Any, acc: PlacedAccounting, dst: str) -> Any:
    if hasattr(out, "items") and hasattr(out, "__setitem__"):  # a transformers ModelOutput
        for k, v in list(out.items()):
            out[k] = move(v, acc, dst)
        return out
    return tree_map(lambda t: move(t, acc, dst), out)
