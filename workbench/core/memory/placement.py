"""The offload rungs simulated: which tensors live on the card and which in host memory, op by op.

    from workbench.core.memory.placement import simulate_placed
    r = simulate_placed(config, RUNGS["device_map"], batch=1, seq=512)
    r.device.steady_peak_bytes, r.host.steady_peak_bytes, r.summary

The step is the same fake-tensor simulation as the device rungs (workbench.core.memory.predict),
with one more fact per storage: its *place*, the card ("device") or host memory ("host").
`PlacedAccounting` keeps the categories, phases and peaks of each place as MemoryAccounting keeps
them for all bytes. An op's outputs live where its inputs live (as a real op's do: torch runs it on
its inputs' device), a factory op's where the running module executes, and a copy between places
is made where the library makes one. What each library does is replayed from its source:

- accelerate `device_map` (the rung's measurement, workbench.studies.ladder.rungs.measure_offloaded):
  accelerate's own `infer_auto_device_map` places whole decoder layers under `max_memory` (the card
  gets half the weights' bytes); `dispatch_model(main_device="cpu")` then attaches an
  `AlignDevicesHook` to each placed module that copies its inputs to its execution device
  (accelerate/hooks.py `pre_forward`), and one to the whole model whose execution device is the
  host and which copies the outputs back to where the inputs came from (`io_same_device`). Each
  layer trains where it lives: its weights, gradients, AdamW moments and activations.
- DeepSpeed ZeRO-2 with `offload_optimizer` (deepspeed 0.19, runtime/zero/stage_1_and_2.py): the
  weights become bf16 on the card (engine `_configure_distributed_model`); the fp32 master, its
  gradient partition, the AdamW moments and a bf16 staging copy are in host memory (`__init__`,
  `initialize_optimizer_states`), with one largest-parameter buffer on each side
  (`temp_grad_buffer_for_cpu_offload` / `_for_gpu_offload`). In backward, `setup_buckets` allocates
  the reduce bucket (`reduce_bucket_size` elements, 5e8 by default) on the card at the first
  gradient; each gradient is copied into it and freed (`reduce_independent_p_g_buckets_and_remove_grads`);
  when the bucket is full and when backward ends (`_release_ipg_buffers`) each bucketed gradient's
  norm is taken in fp64 (`set_norm_for_param_grad_in_gpu`), and it is cast to fp32 on the card and
  copied to the host partition (`async_inplace_copy_grad_to_fp32_buffer_from_gpu`). The step is
  DeepSpeedCPUAdam: in place, in host memory, then fp32 -> bf16 staging -> the card's weights.

What is not replayed is said where it is skipped: the world-size-1 all-reduce (no copy), the flat
buffer's alignment padding (at most a few elements per parameter), and, with gradient
accumulation, DeepSpeed's host-side accumulation through the card's largest-parameter buffer
(preallocated, so it adds no allocation). ZeRO-3 with offloaded parameters is not simulated: its
parameter fetching depends on a trace of module order and reuse distances (predict.py estimates it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from workbench.core.memory import cuda_model
from workbench.core.memory.accounting import MemoryAccounting, MemoryReport, PeakSnapshot, model_tensors
from workbench.core.memory.fake import fakeify, unpacked_for_fake_inputs
from workbench.core.memory.live_bytes import _storages
from workbench.core.memory.meta import build_meta_model, model_label
from workbench.core.memory.plan import Plan, apply_trainable, make_plan_optimizer
from workbench.core.models import check_seq_len
from workbench.core.training import train

DEVICE, HOST = "device", "host"
PLACES = (DEVICE, HOST)
# DeepSpeed's defaults (deepspeed/runtime/zero/config.py), which the ladder's zero_config keeps
REDUCE_BUCKET_SIZE = 500_000_000
# the share of the weights' bytes the device_map rung gives the card (the rest goes to the host)
DEVICE_MAP_GPU_SHARE = 0.5


def device_map_max_memory(weights_bytes: int, gpu_index: Any = 0, *, gpu_share: float = DEVICE_MAP_GPU_SHARE) -> dict[Any, int]:
    """accelerate's `max_memory` for the device_map rung: the card gets `gpu_share` of the weights'
    bytes, the host the rest and room to train them (so about half the decoder layers run on the CPU)."""
    return {gpu_index: max(1, int(weights_bytes * gpu_share)), "cpu": 4 * weights_bytes + 2**30}


def infer_device_map(model: torch.nn.Module, *, gpu_share: float = DEVICE_MAP_GPU_SHARE) -> dict[str, Any]:
    """accelerate's `infer_auto_device_map` for `model` (real or meta) as the device_map rung calls it."""
    from accelerate import infer_auto_device_map

    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    log = logging.getLogger("accelerate.utils.modeling")  # GPU 0 may not exist here: it warns, then places
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return infer_auto_device_map(model, max_memory=device_map_max_memory(weights, 0, gpu_share=gpu_share),
                                     no_split_module_classes=list(getattr(model, "_no_split_modules", None) or []))
    finally:
        log.setLevel(level)


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
        # State lives with its parameter; the step counter of the foreach and single-tensor loops
        # is a CPU scalar (torch/optim/adamw.py), the fused kernel's is on the parameter's device.
        for p, state in optimizer.state.items():
            group = next((g for g in optimizer.param_groups if any(q is p for q in g["params"])), {})
            on_host = not (group.get("fused") or group.get("capturable"))
            for k, t in state.items():
                if isinstance(t, torch.Tensor):
                    self.preset([t], HOST if k == "step" and on_host else (self.place_of(p) or self.exec_places[0]))

    # -- reports ------------------------------------------------------------------------------
    def place_report(self, place: str) -> MemoryReport:
        """The MemoryReport of one place: its peaks, and its allocations' timeline for the
        allocator model."""
        r = MemoryReport(place, self.place_peak[place], dict(self.place_phase_peaks[place]), self.step)
        full = self.report()
        if full.timeline is not None:
            keep = [i for i, (serial, _) in enumerate(full.timeline) if self.serial_place.get(serial) == place]
            r.timeline = [full.timeline[i] for i in keep]
            r.timeline_steps = [full.timeline_steps[i] for i in keep]
            r.timeline_ops = [full.timeline_ops[i] for i in keep]
            r.timeline_roles = {s: role for s, role in full.timeline_roles.items() if self.serial_place.get(s) == place}
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


def _move(x: Any, acc: PlacedAccounting, dst: str) -> Any:
    if not isinstance(x, torch.Tensor) or acc.place_of(x) in (None, dst):
        return x
    if x.requires_grad:
        return _Move.apply(x, acc, dst)
    with acc.placing(dst):
        return x.clone()


def _move_output(out: Any, acc: PlacedAccounting, dst: str) -> Any:
    if hasattr(out, "items") and hasattr(out, "__setitem__"):  # a transformers ModelOutput
        for k, v in list(out.items()):
            out[k] = _move(v, acc, dst)
        return out
    return tree_map(lambda t: _move(t, acc, dst), out)


# ------------------------------------------------------------------------------------------------
# accelerate device_map

def dispatch_like_accelerate(model: torch.nn.Module, dmap: dict[str, Any], acc: PlacedAccounting, *,
                             main_place: str = HOST) -> list:
    """What `dispatch_model(model, dmap, main_device="cpu")` does to where tensors live: each mapped
    module computes at its place and copies its inputs there; the whole model runs at the main
    place and copies its outputs back to its inputs' place. Returns the hook handles."""
    places = {name: (HOST if dev in ("cpu", "disk") else DEVICE) for name, dev in dmap.items()}
    handles = []
    for name, module in model.named_modules():
        if name not in places and name != "":
            continue
        place = places.get(name, main_place) if name else main_place
        top = name == ""

        def pre(mod, args, kwargs, place=place, top=top):
            if top:
                mod._wb_input_place = next((acc.place_of(t) for t in tree_flatten((args, kwargs))[0]
                                            if isinstance(t, torch.Tensor) and acc.place_of(t)), place)
            acc.exec_places.append(place)
            return tree_map(lambda t: _move(t, acc, place), (args, kwargs))

        def post(mod, args, out, top=top):
            acc.exec_places.pop()
            return _move_output(out, acc, mod._wb_input_place) if top else out

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    for name, p in [*model.named_parameters(remove_duplicate=True), *model.named_buffers()]:
        owner = max((k for k in places if k == "" or name == k or name.startswith(k + ".")), key=len, default=None)
        acc.preset([p], places.get(owner, main_place) if owner is not None else main_place)
    return handles


# ------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-2 with the optimizer offloaded

class ZeroOffloadStep(torch.optim.Optimizer):
    """DeepSpeed ZeRO-2 + offload_optimizer, as its buffers and copies (see the module docstring).

    Built inside the accounting (its buffers are counted at their places). The training loop calls
    `step()` and `zero_grad()` as for any optimizer; backward moves each gradient through the
    card's reduce bucket to the host's fp32 partition."""

    def __init__(self, model: torch.nn.Module, acc: PlacedAccounting, *, reduce_bucket_size: int = REDUCE_BUCKET_SIZE,
                 dtype: torch.dtype = torch.bfloat16):
        self.params = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
        if not self.params:
            raise ValueError("nothing to train: no parameter requires a gradient")
        self.acc, self.dtype, self.bucket_size = acc, dtype, int(reduce_bucket_size)
        n = sum(p.numel() for p in self.params)
        largest = max(p.numel() for p in self.params)
        self.offset, o = {}, 0
        for p in self.params:
            self.offset[p] = o
            o += p.numel()
        with acc.placing(HOST):
            master = torch.empty(n, dtype=torch.float32)  # single_partition_of_fp32_groups
            master.requires_grad_(True)
            master.grad = torch.zeros(n, dtype=torch.float32)  # initialize_optimizer_states
            self.staging = torch.zeros(n, dtype=dtype)  # param_buffer_of_bit16_for_cpu_offload_groups
            self.host_temp = torch.zeros(largest, dtype=dtype)  # temp_grad_buffer_for_cpu_offload
        with acc.placing(DEVICE):
            self.device_temp = torch.zeros(largest, dtype=dtype)  # temp_grad_buffer_for_gpu_offload
        super().__init__([master], {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0})
        with acc.placing(HOST):  # DeepSpeed builds the state at init (initialize_optimizer_states steps once)
            self.state[master] = {"exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)}
        acc.set_role([master], "weights")
        acc.set_role([master.grad, self.host_temp, self.device_temp], "gradients")
        acc.set_role([self.staging], "weights")
        acc.set_role(list(self.state[master].values()), "optimizer_state")
        self.master = master
        self.bucket: torch.Tensor | None = None
        self.in_bucket: list[torch.nn.Parameter] = []
        self.elements = 0
        self.handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]

    # backward: reduce_independent_p_g_buckets_and_remove_grads, reduce_ipg_grads, copy_grads_in_partition
    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        if self.bucket is None:  # setup_buckets, at the first gradient of each backward
            with self.acc.placing(DEVICE):
                self.bucket = torch.empty(self.bucket_size, dtype=self.dtype)
            self.acc.set_role([self.bucket], "gradients")
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        n = p.numel()
        if self.elements + n > self.bucket_size:
            self._reduce()
        if n <= self.bucket_size:  # an oversized gradient bypasses the bucket
            view = self.bucket.narrow(0, self.elements, n)
            view.copy_(p.grad.reshape(-1))
            p.grad = view.view_as(p)
            self.elements += n
        self.in_bucket.append(p)

    def _reduce(self) -> None:
        for p in self.in_bucket:
            g = p.grad.reshape(-1)
            g.to(torch.float64).norm(2)  # set_norm_for_param_grad_in_gpu (fp64 on the card)
            torch.amax(g), torch.amin(g)  # has_inf_or_nan
            o = self.offset[p]
            self.master.grad.narrow(0, o, g.numel()).copy_(g.to(torch.float32))  # cast on the card, copy to host
            p.grad = None
        self.in_bucket.clear()
        self.elements = 0

    def _backward_done(self) -> None:
        self._reduce()
        self.bucket = None  # _release_ipg_buffers

    @torch.no_grad()
    def step(self, closure=None):
        m, g, s = self.master, self.master.grad, self.state[self.master]
        # DeepSpeedCPUAdam: one fused C++ loop over the host partition, in place, no temporaries
        s["exp_avg"].mul_(0.9).add_(g)
        s["exp_avg_sq"].mul_(0.999).addcmul_(g, g)
        m.addcdiv_(s["exp_avg"], s["exp_avg_sq"], value=-1e-5)
        self.staging.copy_(m)  # fp32 -> bf16 in host memory
        for p in self.params:  # ... -> the card's weights
            p.data.reshape(-1).copy_(self.staging.narrow(0, self.offset[p], p.numel()))
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The host's fp32 gradient partition is kept between steps (DeepSpeed overwrites it)."""

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# ------------------------------------------------------------------------------------------------
# the simulation

@dataclass
class PlacedReport:
    device: MemoryReport
    host: MemoryReport
    combined: MemoryReport
    summary: dict[str, Any] = field(default_factory=dict)
    kernels: dict[str, int] = field(default_factory=dict)


SIMULATED_PLACEMENTS = ("device_map", "zero_offload")


def simulate_placed(config, plan: Plan, *, batch: int, seq: int, steps: int = 2, n_blocks: int | None = None,
                    target: str = "cpu", sm: int | None = None, gpu_share: float = DEVICE_MAP_GPU_SHARE,
                    reduce_bucket_size: int = REDUCE_BUCKET_SIZE) -> PlacedReport:
    """Simulate `steps` training steps of an offload rung over fake tensors, each storage at its place.

    `target`: "cuda" makes the step take CUDA's choices (workbench.core.memory.cuda_model); the
    card's timeline is then replayed through the allocator model by the caller. `gpu_share`
    (device_map): the card's share of the weights in accelerate's `max_memory`.
    `reduce_bucket_size` (ZeRO): DeepSpeed's reduce bucket, in elements.
    """
    if plan.placement not in SIMULATED_PLACEMENTS:
        raise ValueError(f"{plan.placement} is not simulated by placement (only {', '.join(SIMULATED_PLACEMENTS)})")
    if steps < 2:
        raise ValueError("simulate at least two steps: the steady state starts at the second")
    check_seq_len(config, seq, model_label(config))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    cpu = torch.device("cpu")
    zero = plan.placement == "zero_offload"
    meta = build_meta_model(config)
    summary: dict[str, Any] = {}
    if zero:
        # ZeRO trains the bf16 (or fp16) weights without autocast; the fp32 master is on the host.
        half = plan.half_dtype or torch.bfloat16
        model = apply_trainable(meta, plan.compose(plan.name, plan.help, placement="device"))
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(half)
        settings = dataclasses.replace(plan.settings(batch, steps), precision="fp32")
        dmap = None
    else:
        dmap = infer_device_map(meta, gpu_share=gpu_share)
        model = apply_trainable(meta, plan.compose(plan.name, plan.help, placement="device"))
        settings = plan.settings(batch, steps)
        on_card = [k for k, v in dmap.items() if v not in ("cpu", "disk")]
        summary = {"modules_on_device": len(on_card), "modules_on_host": len(dmap) - len(on_card),
                   "device_map": {k: (DEVICE if v not in ("cpu", "disk") else HOST) for k, v in dmap.items()}}
    fakeify(model, fake_mode)
    with fake_mode:
        blocks = torch.zeros((n_blocks or batch * steps, seq), dtype=torch.long)
    cuda = torch.device(target).type == "cuda"
    choices = cuda_model.cuda_step(sm or cuda_model.DEFAULT_SM) if cuda else contextlib.nullcontext()
    real = [t for t in model_tensors(model) if not isinstance(t, FakeTensor)]
    twins = [fake_mode.from_tensor(t) for t in real]
    handles: list = []
    optimizer = None
    if not zero:
        # where params span the card and the host, torch.optim.AdamW() picks the single-tensor loop
        optimizer = make_plan_optimizer(model, plan, settings, cpu, target=cpu if plan.optimizer == "adamw_torch" else target)
    with unpacked_for_fake_inputs(), fake_mode, PlacedAccounting(cpu, stub_scalars=True, timeline=True) as acc:
        if dmap is not None:
            handles = dispatch_like_accelerate(model, dmap, acc)
        else:
            acc.preset(model_tensors(model), DEVICE)
        acc.watch(model)
        acc.alias(twins)
        if zero:
            optimizer = ZeroOffloadStep(model, acc, reduce_bucket_size=reduce_bucket_size, dtype=plan.half_dtype or torch.bfloat16)
            summary = {"reduce_bucket_elements": int(reduce_bucket_size), "offloaded_parameters": sum(p.numel() for p in optimizer.params)}
        try:
            with choices as mode:
                train(model, blocks, settings, device=cpu, optimizer=optimizer)
        finally:
            for h in handles:
                h.remove()
            if zero:
                optimizer.remove()
    kernels = dict(mode.kernels) if cuda else {}
    return PlacedReport(acc.place_report(DEVICE), acc.place_report(HOST), acc.report(), summary, kernels)
