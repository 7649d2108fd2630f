"""How does training run when the host updates most parameters while backward is still going?

    engine = SplitEngine(model, hp=AdamHP(lr=1e-3), k=0.25)       # or adaptive=True
    for batch in batches:
        engine.step(batch)                  # forward, backward, updates on both sides
    engine.finish()                         # wait for the host; weights are current again
    engine.rows                             # one plain dict per iteration (also sent to sinks)

Layout (what lives where):
- host: the fp32 master copy, an fp32 gradient buffer and the Adam state of every parameter the
  host updates, all in ordinary (pageable) memory; plus two small rings of staging chunks in the
  training dtype (gradients in, weights out; `staging_chunks` x `staging_chunk_mib` each), the
  only page-locked memory on CUDA: the pinned budget does not grow with the model (rows report
  `pinned_bytes`). Every copy goes through a chunk: device -> chunk (DMA) -> fp32 buffer (upcast
  on the host), and fp32 master -> chunk (downcast) -> device;
- accelerator: the training copy in the training dtype (the model itself); for the share k of
  parameters it updates, their fp32 master (the parameter itself when training in fp32) and
  Adam state.

One iteration:
1. forward under autocast; each module waits (forward pre-hook) only for its own weights, so
   the next forward starts while the host is still finishing the layers it needs last;
2. backward; a post-accumulate-grad hook fires once per parameter when its gradient is final
   (a tied weight: at the very end of backward). The hook runs on the thread that runs
   backward: the main thread on the CPU, autograd's device thread on CUDA (while the main thread
   waits in `backward()`). It only appends to per-iteration lists (under `_lock`) and submits
   jobs: a copy thread brings the gradient to the host through the gradient ring (side stream
   on CUDA), and a host worker runs the host Adam on it and sends the new weights back through
   the weight ring, while backward continues;
3. after backward the accelerator updates its share k: the layers whose gradients arrived
   last, i.e. the ones the next forward needs first;
4. measurements (backward time, per-parameter update times on both sides, seconds per byte
   moved) give the next k (balance.balance_k) every `k_every` iterations when adaptive. Backward
   itself slows down as the host does more beside it, so it is fitted against k over the recent
   iterations (balance.backward_fit; the last fit is kept while k stays put, for REFIT_AFTER
   iterations). Until two k's have been measured, and again when the kept fit has aged, k is
   moved once by K_PROBE or more to measure it (the row says `k_probe`). After any move, k stays
   put until the row of its first iteration at the new k is in: a decision made before it would
   rest on the old k's rows only. Until the row of a backward after the first iteration is in, k
   stays where it started: before it, the rates hold no backward time (0) or only the first
   iteration's, which pays for warm-up (on an H200 the first two decisions made on them sent k to
   0.777 and back to 0).

Decisions known only after backward (fp16 overflow, global-norm gradient clipping) are made by
SPECULATION, so that the host updates keep overlapping backward: until backward has ended, a
host update takes a snapshot of its master and Adam state (pageable; at most `speculation_mib`
at a time, past that the remaining updates wait for the verdict, i.e. lose overlap), then
updates as if the step were clean and unclipped. After backward the main thread decides once:
- commit (no overflow; global norm <= max_grad_norm): snapshots are dropped, nothing redone;
- skip (fp16 overflow): every speculated layer is restored from its snapshot and its old
  weights are sent back; layers not yet updated skip; no layer's weights change;
- clip (global norm > max_grad_norm): every speculated layer is restored and updated again with
  its gradient times the clip coefficient; later layers use the coefficient directly.
The result is exact on the CPU: the same bits as `clip_grad_norm_` + `torch.optim.AdamW` in fp32
(the norm is computed as `clip_grad_norm_` computes it: per-tensor norms, stacked in
`model.parameters()` order; on CUDA `clip_grad_norm_` takes them with one fused `_foreach_norm`,
summed in another order, so there the norm may differ in its last bits). The trade-off: a clipped step redoes the host's speculated updates
after backward (serial: a clipped step is about as slow as no overlap at all), and every step
copies 12 bytes per speculated parameter. With clipping off and bf16/fp32, nothing is speculated.

On a CPU-only machine the "accelerator" is the CPU as well: the engine then shows correctness
(parity with torch.optim.AdamW), scheduling and overlap, not GPU speed. Every row of an
iteration is emitted once that iteration's host work has finished (during the next forward, or
in `finish()`), so rows lag `step()` by one call.

Why one module over 400 lines: the gradient hook, the host workers, the staging rings and the
fp16/clipping speculation share one step's state and one lock discipline; split apart, each piece
would need the others' internals.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from workbench.core.memory.monitor import bf16_emulated
from workbench.studies.split import _cuda
from workbench.studies.split.adam import AdamHP, BackendUnavailable, ParamAdam, backend_status
from workbench.studies.split.balance import Rates, backward_fit, balance_k
from workbench.studies.split.layers import guessed_arrival_order, last_arriving, probe_k, split_layers

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# adaptive k: backward is measured at the last BACKWARD_OBS iterations' k; while they all lie within
# K_SPREAD of each other and the balance would not move k that far, k moves once by K_PROBE (farther
# where whole layers round the share back within K_SPREAD: layers.probe_k) to measure how backward
# depends on it
BACKWARD_OBS, K_SPREAD, K_PROBE = 8, 0.2, 0.25
# a fit kept this many iterations after the last row that gave one is measured again (a probe): one made on
# a few noisy iterations (on the CPU twin, a probe in a slow spell gave "no slowdown" and k stayed at 0)
# would otherwise stand for the rest of the run
REFIT_AFTER = 4 * BACKWARD_OBS
HOST, ACCEL = "host", "accelerator"
# abort(): how long the host updates already running may take to end (one layer's Adam and its copy back)
ABORT_WAIT_S = 60.0


def busy_ms(spans: list[tuple[float, float]]) -> float:
    """How long at least one of the (start, end) spans was running: their union's length."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def kept_busy_ms(events: list[tuple]) -> float:
    """The host side's time on the updates kept, from (lane, name, start, end, ..., redo) events: a
    speculation the verdict undid (its update and its weights sent back) is not counted, as in
    host_update_ms; the redo is, and so is the gradient's one copy in."""
    redone = {e[1] for e in events if e[-1]}
    return busy_ms([(e[2], e[3]) for e in events if e[-1] or e[0] == "to host" or e[1] not in redone])


def first_decision(k_every: int) -> int:
    """The first iteration at which an adaptive engine can move k: the row of iteration 1 (the first
    backward after warm-up) is in when step 3 starts (rows lag step() by one call), and k is
    recomputed on the iterations that are multiples of `k_every`."""
    return -(-3 // k_every) * k_every


@dataclass(eq=False)  # hashable by identity: slots key the speculation journal
class _Slot:
    """One trainable parameter's bookkeeping."""

    name: str
    layer: str
    param: nn.Parameter  # the training copy (on the accelerator, training dtype)
    host_master: torch.Tensor  # fp32 on the host, pageable (kept allocated whichever side updates)
    host_grad: torch.Tensor  # fp32 gradient buffer on the host, pageable
    side: str = HOST
    opt: ParamAdam | None = None
    accel_master: torch.Tensor | None = None
    future: Future | None = None  # host work of the last iteration (update + weights sent back)
    copied: Future | None = None  # the copy of its gradient to the host that the update waits for
    redone: Future | None = None  # after a skip or clip verdict: the speculated update the redo waits for
    ready: object = None  # CUDA event: the weights are back on the device (None on the CPU)

    @property
    def numel(self) -> int:
        return self.param.numel()


@dataclass
class _Iter:
    """What one iteration measured; turned into a row once its host work is done."""

    index: int
    k_target: float
    k_actual: float
    tokens: int
    marks: dict = field(default_factory=dict)  # accelerator timeline marks (Clock marks)
    # (lane, slot name, start mark, end mark, numel, bytes, redo: made by _redo after a skip / clip verdict)
    host_events: list = field(default_factory=list)
    arrivals: list = field(default_factory=list)  # layer of each gradient, in arrival order
    waits: list = field(default_factory=list)  # (start, end) marks: forward waiting for weights
    wait_ms: float = 0.0  # their total (accelerator idle), filled in by _finalize
    norms: dict = field(default_factory=dict)  # parameter -> its gradient's 2-norm (clipping only)
    gate: "_Gate | None" = None  # fp16 / clipping: the verdict on this step
    loss: float = float("nan")
    skipped: bool = False  # fp16 overflow: no update
    grad_norm: float = float("nan")  # global gradient norm (clipping only; unscaled)
    clip_coef: float = 1.0
    redone_numel: int = 0  # host parameters whose speculated update was undone (skip or clip)
    probe: bool = False  # adaptive: k was moved to measure backward at another k, not by the balance
    host_numel: int = 0
    accel_numel: int = 0
    accel_peak_bytes: int | None = None  # CUDA: the allocator's peak over this step's forward, backward, update


class SplitEngine:
    """Train `model` with the update split between the accelerator and the host (see module doc).

    max_grad_norm: global-norm clipping, exact (speculate unclipped, redo when clipped; 0 = off).
    staging_chunks, staging_chunk_mib: each ring's chunks (rounded up to a power of two); pinned
        memory on CUDA is 2 x chunks x chunk size, whatever the model (`pinned_bytes`).
    speculation_mib: fp16 / clipping snapshot budget (12 bytes per speculated host parameter,
        pageable); past it, host updates wait for the verdict instead of speculating.
    pin_memory: page-lock the staging rings (default: on CUDA only).
    On CUDA each step resets torch's peak-memory counters to read its own peak (`accel_peak_mib`):
    a caller reading `torch.cuda.max_memory_allocated()` across a run gets the last step's.
    device: where training runs (default: where the model is). A model given on the CPU in fp32
        keeps its fp32 weights here as the masters, and only the training copy of each trained
        parameter goes to `device`, one at a time in the training dtype: in 16 bits the card holds
        2 bytes a parameter of weights, not the fp32 copy's 4 (the masters of the share k it
        updates go there by design; parameters not trained and buffers move as they are).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        hp: AdamHP = AdamHP(),
        precision: str = "fp32",
        backend: str = "torch_fused",
        k: float = 0.0,
        adaptive: bool = False,
        k_every: int = 1,
        include_transfer: bool = True,
        host_workers: int = 1,
        sinks: Iterable[Callable[[dict], None]] = (),
        loss_scale: float = 2.0**16,
        max_grad_norm: float = 0.0,
        staging_chunks: int = 4,
        staging_chunk_mib: float = 8.0,
        speculation_mib: float = 4096.0,
        pin_memory: bool | None = None,
        device: torch.device | str | None = None,
    ):
        if precision not in DTYPES:
            raise ValueError(f"precision must be one of {list(DTYPES)}")
        if k_every < 1:
            raise ValueError(f"k_every must be at least 1, got {k_every}")
        if backend_status(backend) != "ok":
            raise BackendUnavailable(backend_status(backend))
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.cuda = self.device.type == "cuda"
        self.hp, self.precision, self.backend = hp, precision, backend
        self.dtype = DTYPES[precision]
        if self.dtype == torch.bfloat16 and (note := bf16_emulated(self.device)):
            warnings.warn(note, stacklevel=2)
        self.adaptive, self.k_every, self.include_transfer = adaptive, k_every, include_transfer
        self.sinks = list(sinks)
        self.scale = loss_scale if precision == "fp16" else 1.0
        self._good_steps = 0
        self.max_grad_norm = float(max_grad_norm)
        self.speculation_bytes = int(speculation_mib * 2**20)
        self.clock = _cuda.Clock(self.device)
        # the only pinned memory (on CUDA): two rings of fixed chunks, whatever the model's size
        self.copier = _cuda.Copier(self.device, staging_chunks, int(staging_chunk_mib * 2**20), self.dtype,
                                   pinned=pin_memory)
        self.pinned_bytes, self.staging_bytes = self.copier.pinned_bytes, self.copier.staging_bytes
        self.copy_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="to-host")
        self.pool = ThreadPoolExecutor(max_workers=host_workers, thread_name_prefix="host-adam")
        self._lock = threading.Lock()  # per-iteration lists appended from the hook and the workers

        # ---- masters from the fp32 weights, then the model becomes the training copy
        self.layers = split_layers(model)
        self.slots: dict[nn.Parameter, _Slot] = {}
        for layer in self.layers:
            for name, p in layer.params:
                master = _cuda.host_empty_like(p, torch.float32, pinned=False).copy_(p.detach())
                host_grad = _cuda.host_empty_like(p, torch.float32, pinned=False)
                s = _Slot(name, layer.name, p, master, host_grad)
                s.opt = ParamAdam(master, hp, backend)
                self.slots[p] = s
                # then at once its training copy to the device: the card never holds more than the
                # training copies, nor the host more than the fp32 weights given plus their gradients
                p.data = p.data.to(self.device, self.dtype)
        model.to(self.device)  # what is not trained here (buffers: rotary tables, masks)
        self.host_bytes = 8 * sum(s.numel for s in self.slots.values())  # master + gradient, pageable
        self._norm_order = [p for p in model.parameters() if p in self.slots]  # clip_grad_norm_'s order
        self.sizes = {l.name: l.numel for l in self.layers}
        self.total_numel = sum(self.sizes.values())
        self.order = guessed_arrival_order(self.layers)
        self.order_measured = False
        self._backward_obs: collections.deque = collections.deque(maxlen=BACKWARD_OBS)  # (k_actual, backward s)
        self._moved_at: int | None = None  # adaptive: the first iteration at a new k, until its row is in
        self._fit: tuple[float, float] | None = None  # the last (t_B, I) fitted; kept while k stays put
        self._fit_at = 0  # the iteration of the last row that gave a fit
        self.decisions: list[int] = []  # adaptive: the iterations at which k was recomputed (moved or not)

        # ---- hooks: gradients out as they become final; weights waited for module by module
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.slots]
        for mod in model.modules():
            own = [p for p in mod.parameters(recurse=False) if p in self.slots]
            if own:
                self._handles.append(mod.register_forward_pre_hook(self._make_wait(own)))

        try:  # on a card, k=1 puts every master and Adam state there: out of memory is likely here
            self.rates = self.calibrate()
            self.k_target, self.k_actual = 0.0, 0.0
            self.set_k(k)
        except BaseException:
            self.abort()
            raise
        self.iteration = 0
        self.rows: list[dict] = []
        self.events: list[dict] = []  # timeline of every iteration (lane, start/end ms)
        self._cur: _Iter | None = None
        self._pending: _Iter | None = None  # previous iteration, host work maybe still running
        self._inf = None

    # ------------------------------------------------------------------ placement
    def set_k(self, k: float) -> None:
        """Put the last-arriving layers holding a share ~k of the parameters on the accelerator."""
        accel_layers, share = last_arriving(self.order, self.sizes, k)
        for s in self.slots.values():
            want = ACCEL if s.layer in accel_layers else HOST
            if want != s.side:
                self._move(s, want)
        self.k_target, self.k_actual = float(k), share

    def _move(self, s: _Slot, side: str) -> None:
        """Move one parameter's master and Adam state to the other side (k changed)."""
        if s.future is not None:
            s.future.result()  # its last host update must be finished
            self._wait_ready(s)
        state = s.opt.export_state()
        if side == ACCEL:
            if self.dtype == torch.float32:
                s.param.data.copy_(s.host_master)  # the training copy is the master
                s.accel_master = s.param
            else:
                s.accel_master = s.host_master.to(self.device, copy=True)
            s.opt = ParamAdam(s.accel_master, self.hp, "torch_fused")
        else:
            s.host_master.copy_(s.accel_master.detach())
            s.accel_master = None
            s.opt = ParamAdam(s.host_master, self.hp, self.backend)
        s.opt.import_state(state)
        s.side = side

    # ------------------------------------------------------------------ calibration
    def calibrate(self, reps: int = 3) -> dict:
        """Seed the rates before any iteration: update and copy scratch tensors shaped like the
        largest layer's parameters on each side (seconds per element / per byte, best of `reps`;
        per-parameter call overheads included, as the engine pays them too)."""
        import time

        big = max(self.layers, key=lambda l: l.numel)
        shapes = [p.shape for _, p in big.params if p.numel() <= 1 << 22] or [(1 << 22,)]
        n = sum(torch.Size(s).numel() for s in shapes)

        def best(fn) -> float:
            times = []
            for _ in range(reps):
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                t = time.perf_counter()
                fn()
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                times.append(time.perf_counter() - t)
            return min(times)

        def adam_time(device, backend) -> float:
            opts = []
            for shape in shapes:
                x = torch.zeros(shape, device=device)
                x.grad = torch.randn(shape, device=device)
                opts.append(ParamAdam(x, self.hp, backend))
            steps = lambda: [o.step() for o in opts]
            steps()  # state allocation outside the timing
            return best(steps) / n

        host_buf = self.copier.grads.chunks[0]  # copies go through staging chunks
        dev_buf = torch.empty(host_buf.numel(), dtype=self.dtype, device=self.device)
        nbytes = dev_buf.numel() * dev_buf.element_size()
        return {
            "host_s_per_elem": adam_time("cpu", self.backend),
            "accel_s_per_elem": adam_time(self.device, "torch_fused"),
            "d2h_s_per_byte": best(lambda: host_buf.copy_(dev_buf)) / nbytes,
            "h2d_s_per_byte": best(lambda: dev_buf.copy_(host_buf)) / nbytes,
        }

    # ------------------------------------------------------------------ hooks
    def _make_wait(self, params: list[nn.Parameter]):
        slots = [self.slots[p] for p in params]

        def wait(module, args):
            pending = [s for s in slots if s.future is not None]
            if not pending:
                return
            # marks on the compute stream (on CUDA): the device reaches the first when the kernels
            # queued before the wait are done, the second once the weights' copy it waits on has
            # landed, so the span is the device's idle time (a host clock would count the queue too)
            t0 = self.clock.mark()
            for s in pending:
                s.future.result()  # host update + the copy back have been issued
                self._wait_ready(s)
                s.future = None
            if self._cur is not None:  # outside step() (an eval forward) it still waits, unrecorded
                self._cur.waits.append((t0, self.clock.mark()))

        return wait

    def _wait_ready(self, s: _Slot) -> None:
        if s.ready is not None:
            self.copier.wait(s.ready)
            s.ready = None

    def _on_grad(self, p: nn.Parameter) -> None:
        """The gradient of `p` is final. Runs on the thread running backward (the main thread on
        the CPU, autograd's device thread on CUDA): it touches only this iteration's lists (under
        `_lock`), device-side flags read after backward, and thread-safe executors."""
        it, s = self._cur, self.slots[p]
        if it is None:
            return
        with self._lock:
            it.arrivals.append(s.layer)
        if self.max_grad_norm > 0:  # this tensor's norm, as clip_grad_norm_ computes it (on the device)
            g = p.grad
            it.norms[p] = (torch.linalg.vector_norm(g, 2) if g.dtype == torch.float32
                           else torch.linalg.vector_norm(g, 2, dtype=torch.float32))
        if self.dtype == torch.float16:  # overflow flag, summed on the device, read once after backward
            bad = (~torch.isfinite(p.grad)).any()
            self._inf = bad if self._inf is None else self._inf | bad
        if s.side == ACCEL:
            return  # updated after backward (these layers arrive last anyway)
        grad = p.grad
        p.grad = None  # the copy job holds the gradient until it is on the host
        ready = self.copier.ready_event()
        s.copied = self.copy_pool.submit(self._to_host, it, s, grad, ready)
        s.future = self.pool.submit(self._host_update, it, s, s.copied)

    # ------------------------------------------------------------------ host side (worker threads)
    def _event(self, it: _Iter, *e) -> None:
        with self._lock:
            it.host_events.append(e)

    @torch.no_grad()
    def _to_host(self, it: _Iter, s: _Slot, grad: torch.Tensor, ready) -> None:
        """Copy thread: the gradient into the pageable fp32 buffer, through the gradient ring. The
        transfer's span starts when the copies could (the job may be picked up before backward has
        produced the gradient: that wait is not the link's time) and ends when the host holds it."""
        picked_up = self.clock.host_mark()
        started = self.copier.to_host(grad, ready, s.host_grad)
        del grad  # the device's gradient memory can go now
        self._event(it, "to host", s.name, picked_up if started is None else started, self.clock.host_mark(),
                    s.numel, s.numel * self.dtype.itemsize, False)

    @torch.no_grad()
    def _host_update(self, it: _Iter, s: _Slot, copied: Future) -> None:
        copied.result()
        gate = it.gate
        if gate is None:
            self._apply(it, s, None)
            return
        if gate.scale != 1.0:
            s.host_grad.mul_(1.0 / gate.scale)  # undo the fp16 loss scale (once; a redo reuses it)
        with gate.lock:
            if gate.decided.is_set():
                mode = "final"
            elif gate.used + 12 * s.numel <= gate.budget:
                mode, gate.used = "speculate", gate.used + 12 * s.numel
                gate.journal[s] = None  # registered under the lock: the verdict will see it
            else:
                mode = "wait"  # over the speculation budget: this one waits for the verdict
        if mode == "speculate":
            snap = s.opt.snapshot()
            with gate.lock:
                if s in gate.journal:  # still wanted (a commit drops the journal)
                    gate.journal[s] = snap
            self._apply(it, s, None)
            return
        if mode == "wait":
            gate.decided.wait()
        if not gate.skip:
            self._apply(it, s, gate.coef)

    @torch.no_grad()
    def _redo(self, it: _Iter, s: _Slot, old: Future, gate: "_Gate") -> None:
        """After a skip or clip verdict: undo a speculated update, then skip it or redo it clipped."""
        old.result()
        with gate.lock:
            snap = gate.journal.pop(s)
        s.opt.restore(snap)
        if gate.skip:
            t = self.clock.host_mark()
            s.ready = self.copier.to_device(s.host_master, s.param.data)  # the old weights, again
            self._event(it, "to accelerator", s.name, t, s.ready if s.ready is not None else self.clock.host_mark(),
                        s.numel, s.numel * self.dtype.itemsize, True)
        else:
            self._apply(it, s, gate.coef, redo=True)

    def _apply(self, it: _Iter, s: _Slot, coef: torch.Tensor | None, redo: bool = False) -> None:
        """Host Adam on the gradient in host_grad (times the clip coefficient), weights back (redo:
        called by _redo, its events are labelled so)."""
        t1 = self.clock.host_mark()
        if coef is not None:
            s.host_grad.mul_(coef)  # clip_grad_norm_'s own op: the same bits
        s.host_master.grad = s.host_grad
        s.opt.step()
        s.host_master.grad = None
        t2 = self.clock.host_mark()
        self._event(it, "host update", s.name, t1, t2, s.numel, s.numel * 4, redo)
        s.ready = self.copier.to_device(s.host_master, s.param.data)  # downcast through the weight ring
        end = s.ready if s.ready is not None else self.clock.host_mark()  # CUDA: when the last chunk landed
        self._event(it, "to accelerator", s.name, t2, end, s.numel, s.numel * self.dtype.itemsize, redo)

    # ------------------------------------------------------------------ one iteration
    def _autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> float:
        """Run one training iteration on a (batch, seq) block of token ids; returns the loss."""
        probe = False
        # after a move, the next decision waits for a row at the new k: until then the rows are the old
        # k's, which the move was decided on (rows lag step() by one call)
        if self.adaptive and self._backward_obs and self._moved_at is None and self.iteration % self.k_every == 0:
            self.decisions.append(self.iteration)
            k = balance_k(self.current_rates(), self.include_transfer)
            unspread = all(abs(self.k_actual - k_obs) < K_SPREAD for k_obs, _ in self._backward_obs)
            stale = self._fit is None or self.iteration - self._fit_at > REFIT_AFTER
            if stale and unspread and abs(k - self.k_actual) < K_SPREAD:
                k, probe = probe_k(self.order, self.sizes, self.k_actual, K_PROBE, K_SPREAD), True
            before = self.k_actual
            self.set_k(k)
            if self.k_actual != before:
                self._moved_at = self.iteration
        it = _Iter(self.iteration, self.k_target, self.k_actual, input_ids.numel())
        it.probe = probe
        it.host_numel = sum(s.numel for s in self.slots.values() if s.side == HOST)
        it.accel_numel = self.total_numel - it.host_numel
        if self.dtype == torch.float16 or self.max_grad_norm > 0:
            it.gate = _Gate(self.scale, self.speculation_bytes)
        self._cur = it
        self._inf = None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        it.marks["start"] = self.clock.mark()

        with self._autocast():  # forward: waits for weights module by module
            out = self.model(input_ids=input_ids, labels=input_ids if labels is None else labels)
        loss = out.loss
        del out  # free the logits before backward (one vocabulary-sized tensor less at the peak)
        it.marks["forward_end"] = self.clock.mark()
        self._finalize(self._pending)  # every weight was waited for: last iteration's host work is done
        # backward is timed from here: the last row's bookkeeping and sinks just above are not backward
        # (0.3-0.5 ms a step against 10-28 ms here, more with a slow sink), and a card idles through them
        it.marks["backward_start"] = self.clock.mark()

        try:
            (loss * self.scale if self.scale != 1.0 else loss).backward()
        except BaseException:
            if it.gate is not None:  # no verdict will come: let waiting workers skip
                it.gate.decide(skip=True, coef=None)
            raise
        it.marks["backward_end"] = self.clock.mark()
        it.loss = float(loss.detach())
        coef = self._verdict(it) if it.gate is not None else None
        # the update's own time starts here: the verdict (norm, overflow read, redo submissions) is not the
        # accelerator's update; counted in it, it raised accel_s_per_elem, alpha and so k (tiny Qwen2 on the
        # CPU, clipping: a verdict of 0.3-7 ms beside an update of 2-7 ms)
        it.marks["verdict_end"] = self.clock.mark()

        with torch.no_grad():  # the accelerator's share (fp32 master on the accelerator)
            for s in self.slots.values():
                if s.side != ACCEL or s.param.grad is None:
                    continue
                if not it.skipped:
                    g = s.param.grad
                    if s.accel_master is not s.param:
                        g = g.float().mul_(1.0 / it.gate.scale) if self.dtype == torch.float16 else g.float()
                        s.accel_master.grad = g
                    if coef is not None:
                        g.mul_(coef.to(g.device))
                    s.opt.step()
                    if s.accel_master is not s.param:
                        s.param.data.copy_(s.accel_master)
                    s.accel_master.grad = None
                s.param.grad = None
        it.marks["accel_update_end"] = self.clock.mark()
        if self.cuda:
            it.accel_peak_bytes = torch.cuda.max_memory_allocated(self.device)
        if not self.order_measured:
            self._measure_order(it)
        self._pending, self._cur = it, None
        self.iteration += 1
        return it.loss

    def _verdict(self, it: _Iter) -> torch.Tensor | None:
        """After backward: skip (fp16 overflow), clip (returns the coefficient) or commit; undo
        and redo the host's speculated updates where the verdict is not commit."""
        gate = it.gate
        found = bool(self._inf) if self._inf is not None else False  # one device->host read
        coef = None
        if self.max_grad_norm > 0 and not found and it.norms:
            # clip_grad_norm_: the norm of the per-tensor norms, in model.parameters() order
            total = torch.linalg.vector_norm(torch.stack([it.norms[p] for p in self._norm_order if p in it.norms]), 2)
            if self.dtype == torch.float16:
                total = total / gate.scale
            clamped = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
            it.grad_norm, it.clip_coef = float(total), float(clamped)
            if it.clip_coef < 1.0:
                coef = clamped
        it.skipped = found
        redo = gate.decide(skip=found, coef=None if coef is None else coef.cpu())
        for s in redo:
            s.redone = s.future
            s.future = self.pool.submit(self._redo, it, s, s.redone, gate)
        it.redone_numel = sum(s.numel for s in redo)
        if self.dtype == torch.float16:
            self._update_scale(found)
        return coef

    def _update_scale(self, found_inf: bool) -> None:
        # torch.amp.GradScaler's defaults: halve on overflow, double after 2000 good steps
        if found_inf:
            self.scale, self._good_steps = self.scale * 0.5, 0
        else:
            self._good_steps += 1
            if self._good_steps == 2000:
                self.scale, self._good_steps = self.scale * 2.0, 0

    def _measure_order(self, it: _Iter) -> None:
        """Replace the guessed layer order by the order gradients really became complete."""
        last: dict[str, int] = {}
        for i, layer in enumerate(it.arrivals):
            last[layer] = i
        if set(last) == set(self.sizes):
            self.order = sorted(last, key=last.get)
            self.order_measured = True
            self.set_k(self.k_target)

    def finish(self) -> None:
        """Wait for all host work and emit the last iteration's row; weights are current after."""
        for s in self.slots.values():
            if s.future is not None:
                s.future.result()
                self._wait_ready(s)
                s.future = None
        if self.cuda:
            torch.cuda.synchronize(self.device)
        ran = self._pending is not None  # iterations since the last finish() (close() calls it again)
        self._finalize(self._pending, end=self.clock.mark())
        self._pending = None
        if ran and self.adaptive and not self.decisions:
            warnings.warn(f"adaptive k was never recomputed: {self.iteration} iterations ran, and the first decision "
                          f"comes at iteration {first_decision(self.k_every)} (k_every={self.k_every}); k stayed at "
                          f"{self.k_actual:.3g} (run more iterations or lower k_every)", stacklevel=2)

    def close(self) -> None:
        self.finish()
        for h in self._handles:
            h.remove()
        self._handles = []
        self.pool.shutdown(wait=True)
        self.copy_pool.shutdown(wait=True)

    def abort(self) -> None:
        """After an error (out of memory on a card) or ^C: the hooks removed, the host work not begun
        cancelled, and the host updates already running waited for (at most ABORT_WAIT_S), then the
        card's queue drained. The hooks on the parameters hold the engine, and through it the model,
        in a cycle through autograd that the garbage collector cannot see: without this, a failed
        run's weights, masters and state stay in memory for good. A running update goes on to copy
        its weights onto the card: not waited for, the engine stayed alive until it ended (a notebook
        reading its memory after ^C saw it), and on a card that copy could land in memory the
        allocator had handed to the next run. A verdict not given yet (an interrupt after backward,
        before it) is given as skip: a worker waiting on it would never end."""
        for h in self._handles:
            h.remove()
        self._handles = []
        cur = getattr(self, "_cur", None)  # (none yet when the constructor's calibration failed)
        gate = cur.gate if cur is not None else None
        if gate is not None and not gate.decided.is_set():
            gate.decide(skip=True, coef=None)
        jobs = [f for s in getattr(self, "slots", {}).values() for f in (s.future, s.copied, s.redone) if f is not None]
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.copy_pool.shutdown(wait=False, cancel_futures=True)
        # a job cancelled off the queue is never marked done for wait(), which would take its whole timeout
        if wait([f for f in jobs if not f.cancelled()], timeout=ABORT_WAIT_S).not_done:
            warnings.warn(f"the split engine's host updates had not ended {ABORT_WAIT_S:g} s after the run stopped: "
                          "the engine and its model stay in memory until they do", stacklevel=2)
            return
        self.pool.shutdown(wait=True)  # every job ended or cancelled: the threads only exit
        self.copy_pool.shutdown(wait=True)
        if self.cuda:
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError as e:  # an earlier CUDA error (sticky): the run's own error says more
                warnings.warn(f"the split engine could not drain the card's queue: {e}", stacklevel=2)

    # ------------------------------------------------------------------ measurements
    def _finalize(self, it: _Iter | None, end=None) -> None:
        """Turn an iteration's marks into a row (its period ends when the next one starts). Every
        time is a Clock mark: one time base (see _cuda.Clock)."""
        if it is None:
            return
        ms = self.clock.ms
        m = {k: ms(v) for k, v in it.marks.items()}
        end = ms(self._cur.marks["start"] if self._cur is not None else end)
        t0 = m["start"]
        with self._lock:
            ev = [(lane, name, ms(a), ms(b), n, nb) for lane, name, a, b, n, nb, _ in it.host_events]
            redo_ends = {}  # a redone parameter: when its redo ended (the clipped update, or the old weights sent back)
            for lane, name, a, b, n, nb, redo in it.host_events:
                if redo and (lane == "host update" or name not in redo_ends):
                    redo_ends[name] = (ms(b), n)
        it.wait_ms = sum(ms(b) - ms(a) for a, b in it.waits)
        bwd_end = m["backward_end"]
        fwd = m["forward_end"] - t0
        bwd = bwd_end - m["backward_start"]
        verdict = m["verdict_end"] - bwd_end
        acc_upd = m["accel_update_end"] - m["verdict_end"]
        period = end - t0
        # host updates: the ones kept (run once, or a redo) and the speculations a verdict undid
        upd, undone = [], []
        for e, (*_, redo) in zip(ev, it.host_events):
            if e[0] == "host update":
                (upd if redo or e[1] not in redo_ends else undone).append(e)
        # their wall time: with host_workers > 1 updates run side by side, and a sum of their spans had
        # counted the host's time up to that many times over (a slower host, k pushed up)
        host_upd_s = busy_ms([(e[2], e[3]) for e in upd]) / 1e3
        # done when backward ended: the update that was kept (an undone speculation is not done; its redo is)
        done_before = (sum(e[4] for e in upd if e[1] not in redo_ends and e[3] <= bwd_end)
                       + sum(n for b, n in redo_ends.values() if b <= bwd_end))
        to_host = [e for e in ev if e[0] == "to host"]
        to_acc = [e for e in ev if e[0] == "to accelerator"]
        # forward (less its waits), backward, verdict, update: not the bookkeeping between forward and backward
        busy = m["accel_update_end"] - t0 - it.wait_ms - (m["backward_start"] - m["forward_end"])
        host_end = max((e[3] for e in ev), default=bwd_end)
        host_busy = kept_busy_ms([(*e, redo) for e, (*_, redo) in zip(ev, it.host_events)])
        row = {
            "iteration": it.index,
            "loss": it.loss,
            "k_target": it.k_target,
            "k_actual": it.k_actual,
            "k_probe": it.probe,  # adaptive: k moved to measure backward at another k
            "host_params": it.host_numel,
            "accel_params": it.accel_numel,
            "tokens": it.tokens,
            "iteration_ms": period,
            "tokens_per_s": it.tokens / (period / 1e3) if period > 0 else float("nan"),
            "forward_ms": fwd,
            "forward_wait_ms": it.wait_ms,
            "backward_ms": bwd,
            "verdict_ms": verdict,  # after backward: fp16 overflow / clipping verdict (and the loss read)
            "accel_update_ms": acc_upd,  # the accelerator's Adam on its share k only (accel_s_per_elem)
            # the host's Adam on the updates kept (host_s_per_elem); a speculation the verdict undid
            # (fp16 overflow, clipping) is host_undone_ms: time spent, not an update made
            "host_update_ms": host_upd_s * 1e3,
            "host_undone_ms": sum(e[3] - e[2] for e in undone),
            "to_host_ms": sum(e[3] - e[2] for e in to_host),
            "to_accel_ms": sum(e[3] - e[2] for e in to_acc),
            "to_host_bytes": sum(e[5] for e in to_host),
            "to_accel_bytes": sum(e[5] for e in to_acc),
            "host_tail_ms": max(0.0, host_end - bwd_end),
            # the host side's own time: how long at least one of its stages (copy in, Adam, copy out) was at
            # work on the updates kept, overlaps counted once, waits for gradients not at all (the balance's T_host)
            "host_busy_ms": host_busy,
            # the question the notebook plots: how much host update was done when backward ended
            "host_done_before_bwd_end_share": done_before / it.host_numel if it.host_numel else float("nan"),
            "accel_idle_share": max(0.0, 1.0 - busy / period) if period > 0 else float("nan"),
            "skipped_overflow": it.skipped,
            # the scale this step's backward ran at; the next step's (halved after an overflow, doubled
            # after 2000 good steps) is next_loss_scale (this row is written after the verdict set it)
            "loss_scale": it.gate.scale if it.gate is not None else self.scale,
            "next_loss_scale": self.scale,
            "grad_norm": it.grad_norm,
            "clip_coef": it.clip_coef,
            "redone_host_params": it.redone_numel,  # speculated updates undone (skip) or redone (clip)
            "pinned_bytes": self.pinned_bytes,  # page-locked host memory (CUDA only): the staging rings
            "staging_bytes": self.staging_bytes,  # the rings' size on any device
            "host_pageable_bytes": self.host_bytes,  # fp32 masters + gradients (Adam state not counted)
            "accel_peak_mib": None if it.accel_peak_bytes is None else it.accel_peak_bytes / 2**20,
        }
        self._learn(row)
        rates = self.current_rates()
        row.update({"alpha": rates.alpha, "t_backward_s": rates.t_backward_s,
                    # None until backward has been measured at two k (0 would read as "no slowdown")
                    "t_interference_s": rates.t_interference_s if self._fit else None,
                    "t_update_host_s": rates.t_update_host_s, "t_transfer_s": rates.t_transfer_s,
                    "t_host_side_s": rates.host_side_s(self.include_transfer),
                    # the k the balance asks for on these rates; the next decision may hold k (a row at a
                    # new k is to come), probe instead, or not come (k_every; not adaptive)
                    "k_next": balance_k(rates, self.include_transfer)})
        self.rows.append(row)
        self._timeline(it, m, ev)
        for sink in self.sinks:
            sink(row)

    def _learn(self, row: dict) -> None:
        """Blend this iteration's rates into the running ones (halfway: quick but not jumpy)."""
        r = self.rates

        def blend(key, value):
            if value > 0 and value == value:
                r[key] = 0.5 * r[key] + 0.5 * value if key in r else value

        # an fp16 step skipped for overflow ran no update: its near-zero update times are no rate (they had
        # lowered alpha from 0.94 to 0.66 in six such steps of a tiny Qwen2, pushing k towards 1)
        updated = not row.get("skipped_overflow")
        if row["host_params"] and updated:
            blend("host_s_per_elem", row["host_update_ms"] / 1e3 / row["host_params"])
            if row["iteration"] > 0:  # the first iteration's host Adam also makes its state (no calibrated seed)
                blend("host_busy_s_per_elem", row["host_busy_ms"] / 1e3 / row["host_params"])
        if row["to_host_bytes"]:
            blend("d2h_s_per_byte", row["to_host_ms"] / 1e3 / row["to_host_bytes"])
        if row["to_accel_bytes"]:
            blend("h2d_s_per_byte", row["to_accel_ms"] / 1e3 / row["to_accel_bytes"])
        if row["accel_params"] and row["accel_update_ms"] > 0 and updated:
            blend("accel_s_per_elem", row["accel_update_ms"] / 1e3 / row["accel_params"])
        r["backward_s"] = row["backward_ms"] / 1e3
        if row["iteration"] > 0:  # the first iteration also pays for warm-up
            self._backward_obs.append((row["k_actual"], r["backward_s"]))
            # backward without host work and its slowdown, once measured at two k (kept while k stays put)
            fit = backward_fit(list(self._backward_obs), K_SPREAD)
            if fit is not None:
                self._fit, self._fit_at = fit, row["iteration"]
        if self._moved_at is not None and row["iteration"] >= self._moved_at:
            self._moved_at = None  # a row at the new k is in: the next decision can use it

    def current_rates(self) -> Rates:
        """alpha, t_B, t_U and the transfer times as the engine knows them now (for balance_k)."""
        r, n, b = self.rates, self.total_numel, self.dtype.itemsize
        # until backward has been measured at two k: the last backward as it was (the formula's fixed t_B)
        t_b, interference = self._fit or (r.get("backward_s", 0.0), 0.0)
        return Rates(
            t_backward_s=t_b,
            t_update_host_s=r["host_s_per_elem"] * n,
            alpha=r["accel_s_per_elem"] / r["host_s_per_elem"],
            t_to_host_s=r["d2h_s_per_byte"] * b * n,
            t_to_accel_s=r["h2d_s_per_byte"] * b * n,
            copies_overlap=self.cuda,  # the stage model's (used only until the host side is measured whole)
            t_interference_s=interference,
            # measured once the host has updated a share: how its stages overlapped, not assumed
            t_host_busy_s=r["host_busy_s_per_elem"] * n if "host_busy_s_per_elem" in r else None,
        )

    def _timeline(self, it: _Iter, m: dict, ev: list) -> None:
        t0 = m["start"]
        spans = [("accelerator", "forward", m["start"], m["forward_end"]),
                 ("accelerator", "backward", m["backward_start"], m["backward_end"]),
                 ("accelerator", "accelerator update", m["verdict_end"], m["accel_update_end"])]
        if it.gate is not None:  # fp16 / clipping: the verdict between backward and the update
            spans.insert(2, ("accelerator", "verdict", m["backward_end"], m["verdict_end"]))
        for lane, name, a, b in spans:
            self.events.append({"iteration": it.index, "lane": lane, "activity": name, "what": name,
                                "start_ms": a - t0, "end_ms": b - t0})
        lanes = {"to host": "transfer to host", "host update": "host", "to accelerator": "transfer to accelerator"}
        for lane, name, a, b, _, _ in ev:
            self.events.append({"iteration": it.index, "lane": lanes[lane], "activity": lane, "what": name,
                                "start_ms": a - t0, "end_ms": b - t0})

    # ------------------------------------------------------------------ results
    @torch.no_grad()
    def master_weights(self) -> dict[str, torch.Tensor]:
        """fp32 master weights by parameter name, on the CPU (call after finish())."""
        out = {}
        for s in self.slots.values():
            src = s.host_master if s.side == HOST else s.accel_master
            out[s.name] = src.detach().float().cpu().clone()
        return out

    def placement(self) -> dict[str, str]:
        return {s.name: s.side for s in self.slots.values()}


class _Gate:
    """fp16 overflow / gradient clipping: the verdict on one step, known only after backward.

    Until `decide()`, host updates speculate (journal: slot -> snapshot, within `budget` bytes);
    after it, they read `skip` and `coef`. All fields are read and written under `lock`."""

    def __init__(self, scale: float, budget: int):
        self.scale, self.budget, self.used = scale, budget, 0
        self.lock = threading.Lock()
        self.decided = threading.Event()
        self.skip, self.coef = False, None
        self.journal: dict = {}

    def decide(self, skip: bool, coef) -> list:
        """Set the verdict; returns the slots whose speculated update must be undone (and redone)."""
        with self.lock:
            self.skip, self.coef = skip, coef
            self.decided.set()
            redo = list(self.journal) if (skip or coef is not None) else []
            if not redo:
                self.journal.clear()  # commit: the snapshots are not needed
        return redo
