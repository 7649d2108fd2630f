"""How does training run when the host updates most parameters while backward is still going?

    engine = SplitEngine(model, hp=AdamHP(lr=1e-3), k=0.25)       # or adaptive=True
    for batch in batches:
        engine.step(batch)                  # forward, backward, updates on both sides
    engine.finish()                         # wait for the host; weights are current again
    engine.rows                             # one plain dict per iteration (also sent to sinks)

Layout (what lives where):
- host: the fp32 master copy and the Adam state of every parameter the host updates (pinned
  on CUDA machines), plus staging buffers for gradients and weights in the training dtype;
- accelerator: the training copy in the training dtype (the model itself); for the share k of
  parameters it updates, their fp32 master (the parameter itself when training in fp32) and
  Adam state.

One iteration:
1. forward under autocast; each module waits (forward pre-hook) only for its own weights, so
   the next forward starts while the host is still finishing the layers it needs last;
2. backward; a post-accumulate-grad hook fires once per parameter when its gradient is final
   (a tied weight: at the very end of backward). Host parameters: the gradient is copied to
   the host (a side stream on CUDA, the worker thread on CPU) and a worker thread runs the
   host Adam on it, then copies the new weights back, while backward continues;
3. after backward the accelerator updates its share k: the layers whose gradients arrived
   last, i.e. the ones the next forward needs first;
4. measurements (backward time, per-parameter update times on both sides, seconds per byte
   moved) give the next k (balance.balance_k) every `k_every` iterations when adaptive.

On a CPU-only machine the "accelerator" is the CPU as well: the engine then shows correctness
(parity with torch.optim.AdamW), scheduling and overlap, not GPU speed. Every row of an
iteration is emitted once that iteration's host work has finished (during the next forward, or
in `finish()`), so rows lag `step()` by one call.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from workbench.offload import _cuda
from workbench.offload.adam import AdamHP, ParamAdam, backend_status, BackendUnavailable
from workbench.offload.balance import Rates, balance_k
from workbench.offload.layers import guessed_arrival_order, last_arriving, split_layers

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HOST, ACCEL = "host", "accelerator"


@dataclass
class _Slot:
    """One trainable parameter's bookkeeping."""

    name: str
    layer: str
    param: nn.Parameter  # the training copy (on the accelerator, training dtype)
    host_master: torch.Tensor  # fp32 on the host (kept allocated whichever side updates)
    host_grad: torch.Tensor  # fp32 gradient buffer on the host
    g_stage: torch.Tensor  # gradient as it arrives (training dtype, pinned on CUDA)
    w_stage: torch.Tensor  # new weights before they go back (training dtype, pinned on CUDA)
    side: str = HOST
    opt: ParamAdam | None = None
    accel_master: torch.Tensor | None = None
    future: Future | None = None  # host work of the last iteration
    ready: object = None  # CUDA event: the weights are back on the device

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
    marks: dict = field(default_factory=dict)  # accelerator timeline marks (floats or events)
    host_events: list = field(default_factory=list)  # (lane, slot name, start_ms, end_ms, numel, bytes)
    arrivals: list = field(default_factory=list)  # layer of each gradient, in arrival order
    wait_ms: float = 0.0  # forward time spent waiting for weights (accelerator idle)
    loss: float = float("nan")
    skipped: bool = False  # fp16 overflow: no update
    host_numel: int = 0
    accel_numel: int = 0


class SplitEngine:
    """Train `model` with the update split between the accelerator and the host (see module doc)."""

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
    ):
        if precision not in DTYPES:
            raise ValueError(f"precision must be one of {list(DTYPES)}")
        if backend_status(backend) != "ok":
            raise BackendUnavailable(backend_status(backend))
        self.model = model
        self.device = next(model.parameters()).device
        self.cuda = self.device.type == "cuda"
        self.hp, self.precision, self.backend = hp, precision, backend
        self.dtype = DTYPES[precision]
        self.adaptive, self.k_every, self.include_transfer = adaptive, k_every, include_transfer
        self.sinks = list(sinks)
        self.scale = loss_scale if precision == "fp16" else 1.0
        self._good_steps = 0
        self.clock = _cuda.Clock(self.device)
        self.copier = _cuda.Copier(self.device) if self.cuda else None
        self.pool = ThreadPoolExecutor(max_workers=host_workers, thread_name_prefix="host-adam")

        # ---- masters from the fp32 weights, then the model becomes the training copy
        self.layers = split_layers(model)
        self.slots: dict[nn.Parameter, _Slot] = {}
        for layer in self.layers:
            for name, p in layer.params:
                master = _cuda.host_empty_like(p, torch.float32, self.cuda).copy_(p.detach())
                host_grad = _cuda.host_empty_like(p, torch.float32, self.cuda)
                same = self.dtype == torch.float32 and not self.cuda  # no separate staging needed
                g_stage = host_grad if same else _cuda.host_empty_like(p, self.dtype, self.cuda)
                w_stage = master if same else _cuda.host_empty_like(p, self.dtype, self.cuda)
                s = _Slot(name, layer.name, p, master, host_grad, g_stage, w_stage)
                s.opt = ParamAdam(master, hp, backend)
                self.slots[p] = s
        if self.dtype != torch.float32:
            for p in self.slots:
                p.data = p.data.to(self.dtype)
        self.sizes = {l.name: l.numel for l in self.layers}
        self.total_numel = sum(self.sizes.values())
        self.order = guessed_arrival_order(self.layers)
        self.order_measured = False

        # ---- hooks: gradients out as they become final; weights waited for module by module
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.slots]
        for mod in model.modules():
            own = [p for p in mod.parameters(recurse=False) if p in self.slots]
            if own:
                self._handles.append(mod.register_forward_pre_hook(self._make_wait(own)))

        self.rates = self.calibrate()
        self.k_target, self.k_actual = 0.0, 0.0
        self.set_k(k)
        self.iteration = 0
        self.rows: list[dict] = []
        self.events: list[dict] = []  # timeline of every iteration (lane, start/end ms)
        self._cur: _Iter | None = None
        self._pending: _Iter | None = None  # previous iteration, host work maybe still running
        self._gate: threading.Event | None = None
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

        dev_buf = torch.empty(n, dtype=self.dtype, device=self.device)
        host_buf = _cuda.host_empty_like(dev_buf, self.dtype, self.cuda)
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
            t0 = self.clock.host_ms()
            for s in pending:
                s.future.result()  # host update + the copy back have been issued
                self._wait_ready(s)
                s.future = None
            if self._cur is not None:  # outside step() (an eval forward) it still waits, unrecorded
                self._cur.wait_ms += self.clock.host_ms() - t0

        return wait

    def _wait_ready(self, s: _Slot) -> None:
        if s.ready is not None:
            self.copier.wait(s.ready)
            s.ready = None

    def _on_grad(self, p: nn.Parameter) -> None:
        """The gradient of `p` is final (post-accumulate-grad hook, main thread)."""
        it, s = self._cur, self.slots[p]
        if it is None:
            return
        it.arrivals.append(s.layer)
        if self.dtype == torch.float16:  # overflow flag, summed on the device, read once after backward
            bad = (~torch.isfinite(p.grad)).any()
            self._inf = bad if self._inf is None else self._inf | bad
        if s.side == ACCEL:
            return  # updated after backward (these layers arrive last anyway)
        grad = p.grad
        p.grad = None  # the accelerator's copy of this gradient is no longer needed
        copied = self.copier.to_host(grad, s.g_stage) if self.cuda else None
        s.future = self.pool.submit(self._host_update, it, s, None if self.cuda else grad, copied, self._gate)

    # ------------------------------------------------------------------ host side (worker threads)
    @torch.no_grad()
    def _host_update(self, it: _Iter, s: _Slot, grad, copied, gate) -> None:
        ms = self.clock.host_ms
        nbytes = s.numel * self.dtype.itemsize
        t0 = ms()
        if copied is None:
            s.g_stage.copy_(grad)  # "device -> host" when the device is the CPU
            del grad
            t1 = ms()
            it.host_events.append(("to host", s.name, t0, t1, s.numel, nbytes))
        else:
            copied[1].synchronize()
            t1 = ms()
            it.host_events.append(("to host", s.name, ("ev", copied[0]), ("ev", copied[1]), s.numel, nbytes))
        if gate is not None:  # fp16: wait until backward has said whether any gradient overflowed
            gate.wait()
            if gate.skip:
                return
            t1 = ms()
        if s.g_stage is not s.host_grad:
            s.host_grad.copy_(s.g_stage)  # upcast to fp32 (part of the host update's cost)
        if gate is not None:
            s.host_grad.mul_(1.0 / gate.scale)  # undo the fp16 loss scale
        s.host_master.grad = s.host_grad
        s.opt.step()
        s.host_master.grad = None
        if s.w_stage is not s.host_master:
            s.w_stage.copy_(s.host_master)  # downcast to the training dtype
        t2 = ms()
        it.host_events.append(("host update", s.name, t1, t2, s.numel, s.numel * 4))
        if self.cuda:
            start, end = self.copier.to_device(s.w_stage, s.param.data)
            s.ready = end
            it.host_events.append(("to accelerator", s.name, ("ev", start), ("ev", end), s.numel, nbytes))
        else:
            s.param.data.copy_(s.w_stage)  # "host -> device" when the device is the CPU
            it.host_events.append(("to accelerator", s.name, t2, ms(), s.numel, nbytes))

    # ------------------------------------------------------------------ one iteration
    def _autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> float:
        """Run one training iteration on a (batch, seq) block of token ids; returns the loss."""
        if self.adaptive and self.iteration > 0 and self.iteration % self.k_every == 0:
            self.set_k(balance_k(self.current_rates(), self.include_transfer))
        it = _Iter(self.iteration, self.k_target, self.k_actual, input_ids.numel())
        it.host_numel = sum(s.numel for s in self.slots.values() if s.side == HOST)
        it.accel_numel = self.total_numel - it.host_numel
        self._cur = it
        self._gate = _Gate(self.scale) if self.dtype == torch.float16 else None
        self._inf = None
        it.marks["start"] = self.clock.mark()

        with self._autocast():  # forward: waits for weights module by module
            out = self.model(input_ids=input_ids, labels=input_ids if labels is None else labels)
        loss = out.loss
        del out  # free the logits before backward (one vocabulary-sized tensor less at the peak)
        it.marks["forward_end"] = self.clock.mark()
        self._finalize(self._pending)  # every weight was waited for: last iteration's host work is done

        (loss * self.scale if self.scale != 1.0 else loss).backward()
        it.marks["backward_end"] = self.clock.mark()
        it.loss = float(loss.detach())

        if self._gate is not None:  # fp16 loss scaling: one device->host read of the overflow flag
            found = bool(self._inf) if self._inf is not None else False
            it.skipped = found
            self._gate.release(skip=found)
            self._update_scale(found)

        with torch.no_grad():  # the accelerator's share (fp32 master on the accelerator)
            for s in self.slots.values():
                if s.side != ACCEL or s.param.grad is None:
                    continue
                if not it.skipped:
                    g = s.param.grad
                    if s.accel_master is not s.param:
                        s.accel_master.grad = g.float().mul_(1.0 / self._gate.scale) if self._gate else g.float()
                    s.opt.step()
                    if s.accel_master is not s.param:
                        s.param.data.copy_(s.accel_master)
                    s.accel_master.grad = None
                s.param.grad = None
        it.marks["accel_update_end"] = self.clock.mark()
        if not self.order_measured:
            self._measure_order(it)
        self._pending, self._cur = it, None
        self.iteration += 1
        return it.loss

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
        self._finalize(self._pending, end_ms=self.clock.host_ms())
        self._pending = None

    def close(self) -> None:
        self.finish()
        for h in self._handles:
            h.remove()
        self._handles = []
        self.pool.shutdown(wait=True)

    # ------------------------------------------------------------------ measurements
    def _finalize(self, it: _Iter | None, end_ms: float | None = None) -> None:
        """Turn an iteration's marks into a row (its period ends when the next one starts)."""
        if it is None:
            return
        ms = self.clock.ms
        m = {k: ms(v) for k, v in it.marks.items()}
        nxt = self._cur.marks["start"] if self._cur is not None else None
        end = ms(nxt) if nxt is not None else end_ms
        t0 = m["start"]
        ev = [(lane, name, self._ev_ms(a), self._ev_ms(b), n, nb) for lane, name, a, b, n, nb in it.host_events]
        bwd_end = m["backward_end"]
        fwd = m["forward_end"] - t0
        bwd = bwd_end - m["forward_end"]
        acc_upd = m["accel_update_end"] - bwd_end
        period = end - t0
        upd = [e for e in ev if e[0] == "host update"]
        host_upd_s = sum(e[3] - e[2] for e in upd) / 1e3
        done_before = sum(e[4] for e in upd if e[3] <= bwd_end)
        to_host = [e for e in ev if e[0] == "to host"]
        to_acc = [e for e in ev if e[0] == "to accelerator"]
        busy = fwd - it.wait_ms + bwd + acc_upd
        host_end = max((e[3] for e in ev), default=bwd_end)
        row = {
            "iteration": it.index,
            "loss": it.loss,
            "k_target": it.k_target,
            "k_actual": it.k_actual,
            "host_params": it.host_numel,
            "accel_params": it.accel_numel,
            "tokens": it.tokens,
            "iteration_ms": period,
            "tokens_per_s": it.tokens / (period / 1e3) if period > 0 else float("nan"),
            "forward_ms": fwd,
            "forward_wait_ms": it.wait_ms,
            "backward_ms": bwd,
            "accel_update_ms": acc_upd,
            "host_update_ms": host_upd_s * 1e3,
            "to_host_ms": sum(e[3] - e[2] for e in to_host),
            "to_accel_ms": sum(e[3] - e[2] for e in to_acc),
            "to_host_bytes": sum(e[5] for e in to_host),
            "to_accel_bytes": sum(e[5] for e in to_acc),
            "host_tail_ms": max(0.0, host_end - bwd_end),
            # the question the notebook plots: how much host update was done when backward ended
            "host_done_before_bwd_end_share": done_before / it.host_numel if it.host_numel else float("nan"),
            "accel_idle_share": max(0.0, 1.0 - busy / period) if period > 0 else float("nan"),
            "skipped_overflow": it.skipped,
            "loss_scale": self.scale,
        }
        self._learn(row)
        rates = self.current_rates()
        row.update({"alpha": rates.alpha, "t_backward_s": rates.t_backward_s,
                    "t_update_host_s": rates.t_update_host_s, "t_transfer_s": rates.t_transfer_s,
                    "k_next": balance_k(rates, self.include_transfer)})
        self.rows.append(row)
        self._timeline(it, m, ev)
        for sink in self.sinks:
            sink(row)

    def _ev_ms(self, v) -> float:
        return self.clock.ms(v[1]) if isinstance(v, tuple) else v

    def _learn(self, row: dict) -> None:
        """Blend this iteration's rates into the running ones (halfway: quick but not jumpy)."""
        r = self.rates

        def blend(key, value):
            if value > 0 and value == value:
                r[key] = 0.5 * r[key] + 0.5 * value

        if row["host_params"]:
            blend("host_s_per_elem", row["host_update_ms"] / 1e3 / row["host_params"])
        if row["to_host_bytes"]:
            blend("d2h_s_per_byte", row["to_host_ms"] / 1e3 / row["to_host_bytes"])
        if row["to_accel_bytes"]:
            blend("h2d_s_per_byte", row["to_accel_ms"] / 1e3 / row["to_accel_bytes"])
        if row["accel_params"] and row["accel_update_ms"] > 0:
            blend("accel_s_per_elem", row["accel_update_ms"] / 1e3 / row["accel_params"])
        r["backward_s"] = row["backward_ms"] / 1e3

    def current_rates(self) -> Rates:
        """alpha, t_B, t_U and the transfer times as the engine knows them now (for balance_k)."""
        r, n, b = self.rates, self.total_numel, self.dtype.itemsize
        return Rates(
            t_backward_s=r.get("backward_s", 0.0),
            t_update_host_s=r["host_s_per_elem"] * n,
            alpha=r["accel_s_per_elem"] / r["host_s_per_elem"],
            t_to_host_s=r["d2h_s_per_byte"] * b * n,
            t_to_accel_s=r["h2d_s_per_byte"] * b * n,
            copies_overlap=self.cuda,  # on the CPU one worker copies and updates in turn
        )

    def _timeline(self, it: _Iter, m: dict, ev: list) -> None:
        t0 = m["start"]
        spans = [("accelerator", "forward", m["start"], m["forward_end"]),
                 ("accelerator", "backward", m["forward_end"], m["backward_end"]),
                 ("accelerator", "accelerator update", m["backward_end"], m["accel_update_end"])]
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


class _Gate(threading.Event):
    """fp16 only: host updates wait here until backward has said whether to skip the step."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale, self.skip = scale, False

    def release(self, skip: bool) -> None:
        self.skip = skip
        self.set()
