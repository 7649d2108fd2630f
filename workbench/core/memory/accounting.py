"""Where do a training step's bytes go: which category, which phase, and where is the peak?

    with MemoryAccounting("cpu") as acc:
        acc.watch(model)                       # weights now; gradients as they are accumulated
        train(model, blocks, settings)         # the real loop, unchanged
    report = acc.report()
    report.steady_peak_bytes, report.where(), report.breakdown()

The count is LiveBytes' (each storage once, subtracted when it dies); on top of it every live
storage carries a role, and the bytes of each role are kept as running totals:

- weights: the model's parameters, buffers and bitsandbytes quantization state (`watch`),
  counted when watching starts;
- gradients: a parameter's `.grad`, from the moment autograd accumulates it (a
  post-accumulate-grad hook re-labels the storage; before that it is a backward temporary);
- optimizer_state: the tensors in `optimizer.state`, re-labelled after each optimizer step (a
  global optimizer step hook; in the first step the state being created counts as temporaries
  until the step ends, which is why the steady-state step is the figure that matters);
- activations: tensors made in the forward pass that autograd saves for backward (a
  saved-tensors pack hook), plus every other forward-made tensor still alive when backward
  starts (the loss, the inputs a checkpointed layer keeps);
- temporaries: everything else (forward intermediates that die in forward, backward's
  intermediates and recomputed activations, the optimizer's scratch tensors).

Phases: `forward` starts at the watched model's forward pre-hook, `backward` while autograd's engine runs a graph
task, `optimizer` from the end of backward to the next forward (clipping, the update, zeroing). Steps are counted by
the optimizer step hook. At every new peak (overall and per step x phase) the five running totals and the op that
allocated are copied: a few integers, cheap.

With `stub_scalars=True` (FakeTensorMode runs, predict.py) an op that would read a tensor's value into
Python (`.item()`, `float(loss)`) returns 1.0 instead of failing: the unchanged loop runs over fake tensors.

The count changes what it counts in one place. When a tensor feeds several ops, autograd's engine sums its gradients
in an input buffer (torch/csrc/autograd/input_buffer.cpp `accumulate`): in place (`old.add_(new)`) when the buffer's
tensor is dense and nothing else holds its storage, else out of place (`old + new`, one more tensor of that size). A
Python dispatch mode (this one, and FakeTensorMode) makes `isTensorSubclassLike` true, so under it the sum is always
out of place: a tied embedding's two gradients then hold a third vocab x hidden tensor at the end of backward. With
`plain_engine=True` (fake tensors only) the accounting makes the choice the engine makes without a mode, by the
engine's own rule, so the simulated step is the plain step a user runs; every sum is listed in `sums` ((in_place,
shape), in order). The real-tensor count is always the instrumented step.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

from workbench.core.memory.live_bytes import LiveBytes, MiB, model_tensors

CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "temporaries")
PHASES = ("setup", "forward", "backward", "optimizer")
# a timeline event (EMPTY_CACHE_SERIAL, EMPTY_CACHE): the caching allocator's cache given back
# (torch.cuda.empty_cache), which a library under simulation calls
EMPTY_CACHE_SERIAL, EMPTY_CACHE = 0, -2


@dataclass
class PeakSnapshot:
    """The live bytes at one peak, split by category, and where it happened."""

    bytes: int = 0
    by_category: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    step: int = 0  # 0-based optimizer step the peak fell in
    phase: str = "setup"
    op: str = ""  # the aten op whose output made the peak

    def row(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "phase": self.phase,
            "peak_bytes": self.bytes,
            "peak_mib": self.bytes / MiB,
            "peak_op": self.op,
            **{f"{c}_bytes": b for c, b in self.by_category.items()},
        }


@dataclass
class MemoryReport:
    """What one accounted run found: the overall peak, per-step-per-phase peaks, categories."""

    device: str
    peak: PeakSnapshot
    phase_peaks: dict[tuple[int, str], PeakSnapshot]
    steps: int
    timeline: list[tuple[int, int]] | None = None  # (serial, nbytes) allocations, (serial, -1) frees, (0, -2) empty_cache
    timeline_steps: list[int] | None = None  # the step of each timeline event
    timeline_roles: dict[int, str] | None = None  # each allocation's category (when it died, or at the end)
    kernels: dict[str, int] | None = None  # CUDA-modelled runs: the attention kernels used
    timeline_ops: list[str] | None = None  # the phase and op of each timeline event
    sums: list[tuple[bool, tuple[int, ...]]] = field(default_factory=list)  # autograd's gradient sums (in place, shape)
    timeline_streams: dict[int, int] | None = None  # the stream of each allocation off the default one (placed runs)
    timeline_casts: tuple = ()  # what a load converts on the card (card_load.loaded_on_card)
    paged_serials: frozenset = frozenset()  # a paged optimizer's state (CUDA managed memory): its allocations
    paged_bytes: int = 0  # and their bytes
    host_serials: frozenset = frozenset()  # a card's step made these on the host (torch's foreach AdamW's step counters)

    @property
    def peak_bytes(self) -> int:
        return self.peak.bytes

    @property
    def steady(self) -> PeakSnapshot:
        """The peak of the last step counted: the optimizer state exists before it starts."""
        last = max((s for s, _ in self.phase_peaks), default=0)
        snaps = [p for (s, _), p in self.phase_peaks.items() if s == last]
        return max(snaps, key=lambda p: p.bytes, default=self.peak)

    @property
    def steady_peak_bytes(self) -> int:
        return self.steady.bytes

    @property
    def first_step_peak_bytes(self) -> int:
        """The first step's peak: its backward runs before any optimizer state exists."""
        return max((p.bytes for (s, _), p in self.phase_peaks.items() if s == 0), default=0)

    def run_peak_bytes(self, steps: int) -> int:
        """The peak of a run of `steps` optimizer steps: the steady state's from two on (every later
        step repeats the second); a one-step run peaks in its only step (study 1 with a small token
        budget)."""
        return self.steady_peak_bytes if steps >= 2 else self.first_step_peak_bytes

    def where(self) -> str:
        s = self.steady
        return f"step {s.step + 1}, {s.phase} ({s.op})"

    def breakdown(self) -> dict[str, int]:
        """Bytes per category at the steady-state peak."""
        return dict(self.steady.by_category)

    def rows(self) -> list[dict[str, Any]]:
        """One row per (step, phase): its peak and the categories at that moment."""
        order = {p: i for i, p in enumerate(PHASES)}
        keys = sorted(self.phase_peaks, key=lambda k: (k[0], order.get(k[1], 9)))
        return [self.phase_peaks[k].row() for k in keys]


class MemoryAccounting(LiveBytes):
    """LiveBytes with a role per storage, phases, steps and a snapshot at every peak."""

    def __init__(
        self,
        device: str | torch.device = "cpu",
        budget_bytes: int | None = None,
        *,
        stub_scalars: bool = False,
        timeline: bool = False,
        plain_engine: bool = False, cpu_kernels: bool | None = None,  # LiveBytes': bitsandbytes' CPU kernels opened
    ):
        super().__init__(device, budget_bytes, cpu_kernels=cpu_kernels)
        self.stub_scalars = stub_scalars
        self.plain_engine = plain_engine
        self.sums: list[tuple[bool, tuple[int, ...]]] = []  # autograd's gradient sums: (in place, shape)
        # With `timeline`, every allocation (serial, nbytes) and free (serial, -1) in order, the
        # step each happened in, and each storage's role when it died (the CUDA allocator model
        # replays it: workbench.core.memory.allocator.replay).
        self.timeline: list[tuple[int, int]] | None = [] if timeline else None
        self.timeline_steps: list[int] = []
        self.timeline_ops: list[str] = []  # the op that made each allocation ("" for frees)
        self._serial: dict[int, int] = {}
        self._serials = 0
        self.roles_at_death: dict[int, str] = {}
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self._role: dict[int, str] = {}
        self._forward_made: set[int] = set()  # storages made in the current forward pass
        self.phase = "setup"
        self.step = 0
        self._op = ""
        self._in_backward = False
        self.peak = PeakSnapshot()
        self.phase_peaks: dict[tuple[int, str], PeakSnapshot] = {}
        self._handles: list = []
        self._saved_hooks = None

    # -- roles ------------------------------------------------------------------------------
    def _add(self, st, role: str | None = None) -> bool:
        key = id(st)
        if key in self._live:
            return False
        nbytes = st.nbytes()
        ref = weakref.ref(st, lambda r, k=key: self._forget(k, r))
        if role is None:
            role = "temporaries"
            if self.phase == "forward":
                self._forward_made.add(key)
        with self._lock:
            self._live[key] = (nbytes, ref)
            self._role[key] = role
            if self.timeline is not None and nbytes:
                self._serials += 1
                self._serial[key] = self._serials
                self.timeline.append((self._serials, nbytes))
                self.timeline_steps.append(self.step)
                self.timeline_ops.append(f"{self.phase}: {self._op}" if self.phase != "setup" else "setup")
            self._count(key, role, nbytes)
            self.current_bytes += nbytes
            self._snapshot()
        return True

    def _count(self, key: int, role: str, nbytes: int) -> None:
        """Add `nbytes` (negative: take away) to `role`'s running total, for storage `key`."""
        self.by_category[role] += nbytes

    def _forgotten(self, key: int, nbytes: int) -> None:
        role = self._role.pop(key)
        self._count(key, role, -nbytes)
        if self.timeline is not None and key in self._serial:
            serial = self._serial.pop(key)
            self.timeline.append((serial, -1))
            self.timeline_steps.append(self.step)
            self.timeline_ops.append("")
            self.roles_at_death[serial] = role
        self._forward_made.discard(key)

    def set_role(self, tensors, role: str, only_from: tuple[str, ...] | None = None, add: bool = True) -> None:
        """Label these tensors' storages `role` (counting them first if they are new and `add`)."""
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = id(st)
            with self._lock:
                if key not in self._live:
                    if add:
                        self._add(st, role)
                    continue
                old = self._role[key]
                if old == role or (only_from is not None and old not in only_from):
                    continue
                nbytes = self._live[key][0]
                self._count(key, old, -nbytes)
                self._count(key, role, nbytes)
                self._role[key] = role

    def alias(self, twins) -> None:
        """Count these storages as already counted (0 bytes): fake twins of real tensors whose
        bytes are counted under the real tensor (FakeTensorMode converts real inputs to fakes)."""
        with self._lock:
            for t in twins:
                for st in (t.untyped_storage(),):
                    key = id(st)
                    if key not in self._live:
                        self._live[key] = (0, weakref.ref(st, lambda r, k=key: self._forget(k, r)))
                        self._role[key] = "weights"

    def _snapshot(self) -> None:
        cur = self.current_bytes
        self.window_peak_bytes = max(self.window_peak_bytes, cur)
        if cur > self.peak_bytes:
            self.peak_bytes = cur
            self.peak = PeakSnapshot(cur, dict(self.by_category), self.step, self.phase, self._op)
        k = (self.step, self.phase)
        snap = self.phase_peaks.get(k)
        if snap is None or cur > snap.bytes:
            self.phase_peaks[k] = PeakSnapshot(cur, dict(self.by_category), self.step, self.phase, self._op)

    # -- phases ------------------------------------------------------------------------------
    def _enter_phase(self, phase: str) -> None:
        if phase == self.phase:
            return
        if phase == "backward":
            # Forward-made tensors still alive now are what backward needs (or holds): activations.
            with self._lock:
                for key in list(self._forward_made):
                    if key in self._live and self._role.get(key) == "temporaries":
                        self._role[key] = "activations"
                        n = self._live[key][0]
                        self._count(key, "temporaries", -n)
                        self._count(key, "activations", n)
                self._forward_made.clear()
        self.phase = phase
        # The new phase's peak starts from what is live when it begins.
        with self._lock:
            self._snapshot()

    def watch(self, model: torch.nn.Module) -> "MemoryAccounting":
        """Count `model`'s weights, label gradients when accumulated, and mark forward passes."""
        self.set_role(model_tensors(model), "weights")
        self.set_role([p.grad for p in model.parameters() if p.grad is not None], "gradients")

        def grad_ready(p):
            if p.grad is not None:
                self.set_role([p.grad], "gradients")

        seen = set()
        for p in model.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(grad_ready))
        self._handles.append(model.register_forward_pre_hook(lambda m, a: self._enter_phase("forward")))
        return self

    def empty_cache(self) -> None:
        """Mark where the simulated code calls `torch.cuda.empty_cache()` (the timeline's replay
        through the allocator model gives back the segments that are wholly free there)."""
        if self.timeline is not None:
            with self._lock:
                self.timeline.append((EMPTY_CACHE_SERIAL, EMPTY_CACHE))
                self.timeline_steps.append(self.step)
                self.timeline_ops.append("empty_cache")

    def _after_step(self, optimizer, args, kwargs) -> None:
        state = [t for s in optimizer.state.values() for t in _tensors(s)]
        self.set_role(state, "optimizer_state")
        self.step += 1

    def _pack(self, t: torch.Tensor):
        if self.phase == "forward":
            # Relabel only: a saved tensor this mode never counted came from outside the step
            # (under fake mode: a real tensor's fake twin, whose bytes are counted as the real one).
            self.set_role([t], "activations", only_from=("temporaries",), add=False)
        return t

    # -- mode ---------------------------------------------------------------------------------
    def __enter__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles.append(register_optimizer_step_pre_hook(lambda o, a, k: self._enter_phase("optimizer")))
        self._handles.append(register_optimizer_step_post_hook(self._after_step))
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved_hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._saved_hooks is not None:
                self._saved_hooks.__exit__(*exc)
                self._saved_hooks = None
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.stub_scalars and func is torch.ops.aten._local_scalar_dense.default:
            return 1.0  # fake tensors have no values; the loop logs them, AdamW divides by 1 - beta**step
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward:
            self._enter_phase("backward")
            self._in_backward = True
        elif self._in_backward:
            self._in_backward = False
            self._enter_phase("optimizer")  # backward has ended: clipping, the step, zeroing
        self._op = func.__name__ if hasattr(func, "__name__") else str(func)
        if in_backward and func is torch.ops.aten.add.Tensor and is_engine_sum(args, kwargs):
            in_place = self.plain_engine and sums_in_place(args[0])
            self.sums.append((in_place, tuple(args[0].shape)))
            if in_place:
                self._op = "add_.Tensor (autograd's in-place gradient sum)"
                super().__torch_dispatch__(torch.ops.aten.add_.Tensor, types, args, {})
                return args[0]
        return super().__torch_dispatch__(func, types, args, kwargs)

    def serials_of(self, tensors) -> list[int]:  # the timeline serials of these tensors' storages
        return [self._serial[id(t.untyped_storage())] for t in tensors if id(t.untyped_storage()) in self._serial]

    def report(self) -> MemoryReport:
        r = MemoryReport(self.device_type, self.peak, dict(self.phase_peaks), self.step, sums=list(self.sums))
        if self.timeline is not None:
            roles = dict(self.roles_at_death)
            roles.update({serial: self._role[key] for key, serial in self._serial.items() if key in self._role})
            r.timeline, r.timeline_steps, r.timeline_roles = list(self.timeline), list(self.timeline_steps), roles
            r.timeline_ops = list(self.timeline_ops)
        return r


def is_engine_sum(args, kwargs) -> bool:
    """Could this `add.Tensor` in backward be autograd's input-buffer sum (`old + new`: two tensors
    of one shape, dtype and device, no alpha, grad mode off)? A derivative formula calling `add.Tensor`
    itself would be taken for one; tests/test_memory.py holds every sum of a Qwen2-style step (fp32,
    bf16) to a profiled real step, where none did."""
    return (not kwargs and len(args) == 2 and all(isinstance(a, torch.Tensor) for a in args)
            and args[0].shape == args[1].shape and args[0].dtype == args[1].dtype
            and args[0].device == args[1].device and not torch.is_grad_enabled())


def sums_in_place(old: torch.Tensor) -> bool:
    """The engine's `can_accumulate_inplace(old)` without a dispatch mode: dense, and its storage
    held by this tensor alone (the storage's use count less the reference `untyped_storage()` makes)."""
    return (is_non_overlapping_and_dense_or_false(old)
            and torch._C._storage_Use_Count(old.untyped_storage()._cdata) - 1 == 1)


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []
