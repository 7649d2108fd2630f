"""The offload rungs simulated: which tensors live on the card and which in host memory, op by op.

    from workbench.core.memory.offload import simulate_placed
    r = simulate_placed(config, RUNGS["device_map"], batch=1, seq=512)
    r.device.steady_peak_bytes, r.host.steady_peak_bytes, r.summary

The step is the same fake-tensor simulation as the device rungs (workbench.core.memory.predict),
with one more fact per storage: its *place*, the card ("device") or host memory ("host"), kept by
`PlacedAccounting` (workbench.core.memory.placement). What each library does is replayed from its source:

- accelerate `device_map` (the rung's measurement, workbench.studies.ladder.rungs.measure_offloaded):
  accelerate's own `infer_auto_device_map` places whole decoder layers under `max_memory` (the card
  gets half the weights' bytes); `dispatch_model(main_device="cpu")` then attaches an
  `AlignDevicesHook` to each placed module that copies its inputs to its execution device
  (accelerate/hooks.py `pre_forward`), and one to the whole model whose execution device is the
  host and which copies the outputs back to where the inputs came from (`io_same_device`). Each
  layer trains where it lives: its weights, gradients, AdamW moments and activations; the run's
  autocast is CUDA's, so the host layers compute in their weights' dtype (fp32), with the CPU's
  attention kernel and dropout (a CUDA-modelled prediction suspends CUDA's choices inside them).
- DeepSpeed ZeRO-2 with `offload_optimizer` (deepspeed 0.19, runtime/zero/stage_1_and_2.py): the
  weights become bf16 or fp16 on the card (engine `_configure_distributed_model`; an fp32 setup's
  stay fp32, and so do the buffers below that are bf16 for the others) and then one flat buffer,
  made on the card when there is room for it beside them (their own blocks are freed into the
  cache) or through host memory after an `empty_cache` when there is not (`flatten_on_accelerator`,
  `ZeroOffloadStep._flatten`); the fp32 master, its
  gradient partition, the AdamW moments and a 16-bit staging copy are in host memory (`__init__`,
  `initialize_optimizer_states`), with one largest-parameter buffer on each side
  (`temp_grad_buffer_for_cpu_offload` / `_for_gpu_offload`). In backward, `setup_buckets` allocates
  the reduce bucket (`reduce_bucket_size` elements, 5e8 by default) on the card at the first
  gradient; each gradient is copied into it and freed (`reduce_independent_p_g_buckets_and_remove_grads`);
  when the bucket is full and when backward ends (`_release_ipg_buffers`) each bucketed gradient's
  norm is taken in fp64 (`set_norm_for_param_grad_in_gpu`), and it is cast to fp32 on the card and
  copied to the host partition (`async_inplace_copy_grad_to_fp32_buffer_from_gpu`). The step is
  DeepSpeedCPUAdam: in place, in host memory, then fp32 -> bf16 staging -> the card's weights.

What is not replayed is said where it is skipped: the world-size-1 all-reduce (no copy), NCCL's
own device memory (outside the allocator; it lowers the free memory DeepSpeed sees), and, with gradient
accumulation, DeepSpeed's host-side accumulation through the card's largest-parameter buffer
(preallocated, so it adds no allocation).
- DeepSpeed ZeRO-3 with the parameters offloaded as well: workbench.core.memory.zero3 (DeepSpeed's own
  parameter coordinator and module hooks decide which weights are gathered on the card when).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from workbench.core.memory import cuda_model
from workbench.core.memory.accounting import MemoryReport
from workbench.core.memory.fake import check_step, fake_step, unpacked_for_fake_inputs
from workbench.core.memory.live_bytes import model_tensors
from workbench.core.memory.meta import build_meta_model
from workbench.core.memory.placement import DEVICE, HOST, PlacedAccounting, move, move_output
from workbench.core.memory.plan import Plan, apply_trainable, make_plan_optimizer
from workbench.core.memory.zero3 import ZeroParamOffloadStep, cpu_adam_in_place, deepspeed_stage3, stage3_settings
from workbench.core.training import train

# DeepSpeed's defaults (deepspeed/runtime/zero/config.py), which the ladder's zero_config keeps
REDUCE_BUCKET_SIZE = 500_000_000
# stage_1_and_2.py: nccl_start_alignment_factor (2) x the world size (1); parameter_alignment is off
FLAT_ALIGNMENT = 2
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
            if place == HOST and (not top or "" in places):
                # the run's autocast is CUDA's: it leaves the host layers' CPU ops in their own dtype,
                # and they run the CPU's kernels (attention, dropout), not the card's
                ctx = contextlib.ExitStack()
                ctx.enter_context(torch.autocast("cpu", enabled=False))
                ctx.enter_context(cuda_model.CudaChoices.host())
                mod.__dict__.setdefault("_wb_host_ctx", []).append(ctx)
            return tree_map(lambda t: move(t, acc, place), (args, kwargs))

        def post(mod, args, out, top=top):
            acc.exec_places.pop()
            if mod.__dict__.get("_wb_host_ctx"):
                mod._wb_host_ctx.pop().__exit__(None, None, None)
            return move_output(out, acc, mod._wb_input_place) if top else out

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
                 dtype: torch.dtype = torch.bfloat16, card_bytes: int | None = None):
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
        self._flatten(acc, card_bytes)
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

    def _flatten(self, acc: PlacedAccounting, card_bytes: int | None) -> None:
        """DeepSpeed's `__init__` makes the weights one flat buffer (`bit16_groups_flat`), each weight
        a view of it (`_update_model_bit16_weights`). After an `empty_cache`, it flattens on the card
        when the card has room for the flat copy beside the weights (`flatten_on_accelerator`, from
        NVML's free memory): the weights' own blocks are then freed into the caching allocator's
        cache, where later allocations only partly reuse them, so the card's reserved peak carries
        them. Without room it copies the weights to the host, gives the card's cache back, flattens
        there and moves the flat buffer to the card. `card_bytes`: what the allocator may use
        (the card less its CUDA context); None: a card with room (as on every card the rung fits
        unless its weights are over half of it)."""
        n = sum(p.numel() for p in self.params)
        numel = n + (-n) % FLAT_ALIGNMENT  # align_dense_tensors' padding
        dtype = self.params[0].dtype
        shapes = {p: p.shape for p in self.params}
        acc.empty_cache()
        room = card_bytes is None or card_bytes - acc.place_bytes[DEVICE] >= numel * dtype.itemsize
        if room:
            with acc.placing(DEVICE):
                flat = torch.empty(numel, dtype=dtype)
        else:
            with acc.placing(HOST):
                cpu_data = [p.data.clone() for p in self.params]  # param.cpu_data = param.data.cpu()
            with acc.placing(DEVICE):
                for p in self.params:
                    p.data = torch.empty(1)  # a placeholder on the card
            acc.empty_cache()
            with acc.placing(HOST):
                on_host = torch.empty(numel, dtype=dtype)
            del cpu_data
            with acc.placing(DEVICE):
                flat = torch.empty(numel, dtype=dtype)  # flattened_buffer.to(the card)
            del on_host
        acc.set_role([flat], "weights")
        for p in self.params:
            p.data = flat.narrow(0, self.offset[p], shapes[p].numel()).view(shapes[p])
        self.flat, self.flattened_on = flat, (DEVICE if room else HOST)

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
        m = self.master
        cpu_adam_in_place(m, self.state[m])
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


SIMULATED_PLACEMENTS = ("device_map", "zero_offload", "zero_offload_params")


def _cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """DeepSpeed's cast of the parameters (not the buffers). A function of its own, so that no loop
    variable outlives it: a meta parameter shares its storage with the fake one made from it, and a
    reference left behind would keep a weight's storage alive after ZeRO flattens it."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)


def simulate_placed(config, plan: Plan, *, batch: int, seq: int, steps: int = 2, n_blocks: int | None = None,
                    target: str = "cpu", sm: int | None = None, gpu_share: float = DEVICE_MAP_GPU_SHARE,
                    reduce_bucket_size: int = REDUCE_BUCKET_SIZE, instrumented: bool = False,
                    card_bytes: int | None = None, zero_settings: dict[str, Any] | None = None,
                    zero3_from: str = "host") -> PlacedReport:
    """Simulate `steps` training steps of an offload rung over fake tensors, each storage at its place.

    `target`: "cuda" makes the step take CUDA's choices (workbench.core.memory.cuda_model); the
    card's timeline is then replayed through the allocator model by the caller. `gpu_share`
    (device_map): the card's share of the weights in accelerate's `max_memory`.
    `reduce_bucket_size` (ZeRO): DeepSpeed's reduce bucket, in elements. `card_bytes` (ZeRO): what
    the card's allocator may use, which decides where DeepSpeed flattens the weights (None: room on
    the card). `zero3_from` (ZeRO-3): where the model is partitioned from, "host" (the workbench's
    run, rungs.partition_on_host) or "card" (a model handed to `deepspeed.initialize` unpartitioned,
    which the engine moves to the card whole first, as the workbench's card records of 2026-11-22 and -26 ran).
    `instrumented`: as `predict.simulate` (default: the plain step, autograd's in-place gradient sums).
    """
    if plan.placement not in SIMULATED_PLACEMENTS:
        raise ValueError(f"{plan.placement} is not simulated by placement (only {', '.join(SIMULATED_PLACEMENTS)})")
    if zero3_from not in ("host", "card"):
        raise ValueError(f"zero3_from is 'host' or 'card', not {zero3_from!r}")
    check_step(config, seq, steps)
    cpu = torch.device("cpu")
    zero = plan.placement in ("zero_offload", "zero_offload_params")
    zero3 = plan.placement == "zero_offload_params"
    model = apply_trainable(build_meta_model(config), plan.compose(plan.name, plan.help, placement="device"))
    summary: dict[str, Any] = {}
    if zero:
        # ZeRO trains the bf16 (or fp16) weights without autocast, a pure-half setup's too; the fp32
        # master is on the host. An fp32 setup trains fp32 weights (rungs.zero_config)
        if plan.half_dtype is not None:
            _cast_parameters(model, plan.half_dtype)
        settings = dataclasses.replace(plan.settings(batch, steps), precision="fp32")
        dmap = None
    else:
        dmap = infer_device_map(model, gpu_share=gpu_share)  # of the model as it trains (LoRA's names)
        settings = plan.settings(batch, steps)
        on_card = [k for k, v in dmap.items() if v not in ("cpu", "disk")]
        summary = {"modules_on_device": len(on_card), "modules_on_host": len(dmap) - len(on_card),
                   "device_map": {k: (DEVICE if v not in ("cpu", "disk") else HOST) for k, v in dmap.items()}}
    step = fake_step(model, n_blocks=n_blocks or batch * steps, seq=seq, target=target, sm=sm,
                     under_a_mode=instrumented)
    handles: list = []
    optimizer = None
    if not zero:
        # where params span the card and the host, torch.optim.AdamW() picks the single-tensor loop
        optimizer = make_plan_optimizer(model, plan, settings, cpu, target=cpu if plan.optimizer == "adamw_torch" else target)
    with (unpacked_for_fake_inputs(), step.fake_mode, contextlib.ExitStack() as stack,
          PlacedAccounting(cpu, stub_scalars=True, timeline=True, plain_engine=not instrumented,
                           cpu_kernels=not step.cuda) as acc):
        if dmap is not None:
            handles = dispatch_like_accelerate(model, dmap, acc)
        elif zero3 and zero3_from == "host":  # (rungs.partition_on_host) the weights there, the buffers on the card
            acc.preset(list(model.parameters()), HOST)
            acc.preset(list(model.buffers()), DEVICE)
        else:
            acc.preset(model_tensors(model), DEVICE)
        acc.watch(model)
        acc.alias(step.twins)
        if zero3:
            zero_config = stage3_settings(reduce_bucket_size, **(zero_settings or {}))
            stack.enter_context(deepspeed_stage3(zero_config))
            optimizer = ZeroParamOffloadStep(model, acc, zero_config=zero_config,
                                             grad_accum=settings.grad_accum, from_host=zero3_from == "host")
            summary = {"reduce_bucket_elements": int(reduce_bucket_size), "offloaded_parameters": len(optimizer.all_params),
                       "trained_parameters": sum(p.ds_numel for p in optimizer.params),
                       "persistent_parameters": len(optimizer.persistent), "reduces": optimizer.reduces}
        elif zero:
            optimizer = ZeroOffloadStep(model, acc, reduce_bucket_size=reduce_bucket_size,
                                        dtype=plan.half_dtype or torch.float32,
                                        card_bytes=card_bytes)
            summary = {"reduce_bucket_elements": int(reduce_bucket_size), "offloaded_parameters": sum(p.numel() for p in optimizer.params),
                       "flattened_on": optimizer.flattened_on}
        try:
            with step.choices as mode:
                train(model, step.blocks, settings, device=cpu, optimizer=optimizer)
        finally:
            for h in handles:
                h.remove()
            if zero:
                optimizer.remove()
    kernels = dict(mode.kernels) if step.cuda else {}
    full = acc.report()
    return PlacedReport(acc.place_report(DEVICE, full), acc.place_report(HOST, full), full, summary, kernels)
