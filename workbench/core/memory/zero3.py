"""DeepSpeed ZeRO-3 with the parameters and the optimizer offloaded, simulated: which parameters
are on the card at each moment, and what the gradient path allocates there.

    from workbench.core.memory.offload import simulate_placed
    r = simulate_placed(config, RUNGS["zero_offload_params"], batch=1, seq=512, target="cuda")

What DeepSpeed 0.19 allocates for this setup (stage 3, `offload_param` and `offload_optimizer` on
the CPU, world size 1) is inventoried from its source in docs/zero3-offload-param.md; this module
replays it inside the fake-tensor step of workbench.core.memory.offload, each storage at its place:

- *When a parameter is on the card* is not modelled here: it is decided by DeepSpeed's own
  `PartitionedParameterCoordinator` (trace recording in the first step, prefetch, the reuse and
  live-parameter limits, persistent small parameters) driven by DeepSpeed's own module hooks
  (`DeepSpeedZeRoOffload._register_deepspeed_module`: forward pre/post hooks and the autograd
  functions that fire before and after each module's backward). This module supplies only what the
  coordinator calls on a parameter: the gather (world size 1: `NoGatherCoalescedHandle`, one
  exact-size copy of the host partition to the card, partition_parameters.py) and the release
  (`free_param`: the card's copy is dropped).
- *The init* (stage3.py, partition_parameters.py): the model, on the host, is partitioned weight by
  weight (`zero.Init(module=...)`, as the workbench runs it before the engine: each weight copied to
  the card alone, then to pinned host memory) and moved into one flat host buffer; the fp32 master, its
  fp32 gradient, the gradient partitions in the weights' dtype (bf16, fp16 or fp32) and CPU Adam's
  moments are host memory; the reduce
  bucket (`reduce_bucket_size` elements) is allocated on the card for good; each trainable
  parameter is gathered once and released (`create_reduce_and_remove_grad_hooks`).
- *The gradient path* (stage3.py `reduce_independent_p_g_buckets_and_remove_grads`,
  `__reduce_and_partition_ipg_grads`, `partition_grads`, `_offload_grad_partition_at_boundary`;
  comm/coalesced_collectives.py `reduce_scatter_coalesced`): each gradient is copied into the
  bucket and freed (one larger than the bucket keeps its own tensor); a full bucket, and what is
  left at the end of backward, is concatenated into a new buffer (`torch.cat`, skipped for a
  lone tensor), and each parameter's part is copied to the host partition, copied back to the
  card, its norm taken in fp64 chunks of 2.5e8 elements and cast to fp32 on the card for the copy
  into the host's fp32 gradient. Then the engine's `backward_epilogue` releases what the
  post-backward hooks left gathered (the embedding, whose input needs no gradient).
- *The step*: every parameter is released (`_partition_all_parameters`), CPU Adam updates the host
  fp32 master in place and writes the host bf16 partitions, and the persistent parameters are
  gathered again (`_post_step`).

DeepSpeed runs here as it runs on one GPU (`deepspeed_stage3`, undone afterwards): linear layers run
through DeepSpeed's own `zero3_linear_wrap`, as zero.Init installs it; its CPU accelerator stands in
for CUDA's (streams and events are no-ops: no allocation changes); without a process group, the rank
is 0 and the cross-rank consistency checks are skipped. DeepSpeed's side streams are replayed with
their own caching-allocator pools (the gathers on its allgather stream, the gradients' reduction on
its reduce stream; `reserved_by_stream` reports each). What is not replayed: NCCL's own device
memory, and NVMe offload.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any
from unittest import mock

import torch

from workbench.core.memory.placement import DEVICE, HOST, PlacedAccounting

# stage3.py `_constant_buffered_norm2`: a gradient's norm is taken in fp64 chunks of this many elements
NORM_CHUNK = 250_000_000
# DeepSpeed's side streams (overlap_comm, on by default for stage 3): the coordinator gathers on its
# allgather stream (partitioned_param_coordinator.py `__all_gather_params_`), the optimizer reduces
# and partitions gradients on its reduce_and_partition_stream (stage3.py); the rest runs on the default
ALLGATHER_STREAM, REDUCE_STREAM = 1, 2
STREAM_NAMES = {0: "default", ALLGATHER_STREAM: "allgather", REDUCE_STREAM: "reduce"}


def stage3_settings(reduce_bucket_size: int | None = None, **overrides: Any) -> Any:
    """DeepSpeed's own ZeRO-3 config object (deepspeed.runtime.zero.config) with its defaults, as the
    ladder's rung leaves them (it sets only the reduce bucket). `overrides`: other `zero_optimization`
    keys, by DeepSpeed's names (e.g. stage3_prefetch_bucket_size)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    extra = {} if reduce_bucket_size is None else {"reduce_bucket_size": int(reduce_bucket_size)}
    return DeepSpeedZeroConfig(**{"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                  "offload_optimizer": {"device": "cpu", "pin_memory": True}, **extra, **overrides})


@contextlib.contextmanager
def deepspeed_stage3(zero_config: Any):
    """Run DeepSpeed's stage-3 parameter code in this process as at world size 1: rank 0, no
    cross-rank checks, and its CPU accelerator (no CUDA stream or event is made, on any machine).
    And as its engine does (zero.Init with `memory_efficient_linear`, on by default):
    `torch.nn.functional.linear` is DeepSpeed's `zero3_linear_wrap`, whose one autograd function
    saves the weight itself and hands back the weight's and bias's gradients together."""
    from deepspeed import comm
    from deepspeed.accelerator import real_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    with contextlib.ExitStack() as stack:
        if zero_config.memory_efficient_linear:
            stack.enter_context(mock.patch.object(torch.nn.functional, "linear", zero3_linear_wrap))
        stack.enter_context(mock.patch.object(comm, "get_rank", lambda group=None: 0))
        stack.enter_context(mock.patch.object(coordinator, "assert_ints_same_as_other_ranks", lambda ints: None))
        stack.enter_context(mock.patch.object(real_accelerator, "ds_accelerator", CPU_Accelerator()))
        yield


def cpu_adam_in_place(master: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
    """DeepSpeedCPUAdam's update of the host's fp32 partition, as its memory goes: one fused C++
    loop, in place, no temporaries (ZeRO-2 and ZeRO-3 offload both run it)."""
    g = master.grad
    state["exp_avg"].mul_(0.9).add_(g)
    state["exp_avg_sq"].mul_(0.999).addcmul_(g, g)
    master.addcdiv_(state["exp_avg"], state["exp_avg_sq"], value=-1e-5)


class _Gathered:
    """deepspeed's NoGatherCoalescedHandle: the copy exists from the gather's issue; `wait` marks
    the parameters available (the first call only)."""

    def __init__(self, params: list, available: Any):
        self.params, self.available, self.complete = params, available, False

    def wait(self, **kwargs: Any) -> None:
        if not self.complete:
            for p in self.params:
                p.ds_status = self.available
            self.complete = True


class ZeroParamOffloadStep(torch.optim.Optimizer):
    """DeepSpeed ZeRO-3 + offload_param + offload_optimizer, as its buffers, gathers and copies (see
    the module docstring). Built inside the accounting, the model's weights on the host, its buffers
    on the card (rungs.partition_on_host; `from_host` False: all of it on the card); the training
    loop calls `step()` and `zero_grad()` as for any optimizer. `grad_accum`: micro-batches per step
    (the last one is DeepSpeed's accumulation boundary)."""

    def __init__(self, model: torch.nn.Module, acc: PlacedAccounting, *, zero_config: Any, grad_accum: int = 1,
                 from_host: bool = True):
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, _init_external_params
        from deepspeed.runtime.zero.partitioned_param_coordinator import (InflightParamRegistry,
                                                                          PartitionedParameterCoordinator)

        self.all_params = list({id(p): p for p in model.parameters()}.values())  # ds_id order (Init's)
        self.params = [p for p in self.all_params if p.requires_grad]
        if not self.params:
            raise ValueError("nothing to train: no parameter requires a gradient")
        self.model, self.acc, self.status = model, acc, ZeroParamStatus
        self.dtype = self.all_params[0].dtype
        self.bucket_size, self.grad_accum, self.micro = int(zero_config.reduce_bucket_size), max(1, grad_accum), 0
        n_all = sum(p.numel() for p in self.all_params)
        n = sum(p.numel() for p in self.params)
        self.flat_offset, self.offset = self._offsets(self.all_params), self._offsets(self.params)

        # zero.Init(module=...), weight by weight: from the host (`from_host`, the workbench's
        # rungs.partition_on_host) each is copied to the card (the host's copy let go), then to its partition
        # in pinned host memory, and the card's copy freed; else the engine moved the whole model to the card
        # first, and each is partitioned from there. The optimizer then moves the partitions into one flat
        # host buffer
        partitions = []
        for i, p in enumerate(self.all_params):
            if from_host:
                with acc.placing(DEVICE):
                    p.data = torch.empty(p.shape, dtype=p.dtype)  # param.data.to(local_device)
                acc.set_role([p.data], "weights")
            self._describe(p, i)
            with acc.placing(HOST):
                partitions.append(torch.empty(p.numel(), dtype=p.dtype))  # ds_tensor
            self._free(p)
        with acc.placing(HOST):
            self.host_flat = torch.empty(n_all, dtype=self.dtype)  # param_groups_fp16_flat_cpu_memory
        del partitions
        with acc.placing(HOST):
            master = torch.empty(n, dtype=torch.float32)  # fp32_partitioned_groups_flat
            master.requires_grad_(True)
            master.grad = torch.zeros(n, dtype=torch.float32)
            self.grad_partitions = torch.zeros(n, dtype=self.dtype)  # grad_partitions_flat_buffer
        with acc.placing(DEVICE):
            self.bucket = torch.empty(self.bucket_size, dtype=self.dtype)  # the ipg bucket, kept
        acc.set_role([self.host_flat], "weights")
        acc.set_role([master], "weights")
        acc.set_role([master.grad, self.grad_partitions, self.bucket], "gradients")
        for p in self.params:  # create_reduce_and_remove_grad_hooks: gather each, then partition
            self._all_gather(p)
            with acc.placing(DEVICE):
                temp = torch.empty(p.ds_numel, dtype=p.dtype)  # ds_tensor.to(device) inside the gather
            del temp
            self._partition(p)

        super().__init__([master], {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0})
        self.master = master
        self.in_bucket: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.elements = 0
        self.callback_queued = False
        self.norms: dict[int, torch.Tensor] = {}
        self.reduces: list[tuple[int, int, bool]] = []  # (gradients, elements, concatenated) per bucket reduce

        # DeepSpeed's own hooks and parameter coordinator, with the stage-3 thresholds
        offload = DeepSpeedZeRoOffload.__new__(DeepSpeedZeRoOffload)
        offload.module, offload.zenflow, offload.forward_hooks, offload.backward_hooks = model, False, [], []
        offload.param_coordinator = PartitionedParameterCoordinator(
            prefetch_bucket_sz=int(zero_config.prefetch_bucket_size),
            max_reuse_distance_in_numel=int(zero_config.max_reuse_distance),
            max_available_parameters_in_numel=int(zero_config.max_live_parameters),
            allgather_stream=None, inflight_param_registry=InflightParamRegistry())
        for m in model.modules():
            _init_external_params(m)
        self.persistent = offload.mark_persistent_parameters(int(zero_config.param_persistence_threshold),
                                                             int(zero_config.model_persistence_threshold))
        offload.setup_zero_stage3_hooks()
        self.offload = offload
        self.handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]

    @staticmethod
    def _offsets(params: list) -> dict:
        out, o = {}, 0
        for p in params:
            out[p] = o
            o += p.numel()
        return out

    # -- what the coordinator calls on a parameter -------------------------------------------------
    def _describe(self, p: torch.nn.Parameter, ds_id: int) -> None:
        """The attributes zero.Init gives a parameter, with this simulation's gather and release."""
        n = p.numel()
        p.ds_id, p.ds_numel, p.ds_shape, p.ds_persist, p.ds_dtype = ds_id, n, tuple(p.shape), False, p.dtype
        p.ds_status, p.ds_active_sub_modules = self.status.NOT_AVAILABLE, set()
        p.ds_tensor = types.SimpleNamespace(ds_numel=n, final_location=None)
        p.ds_secondary_tensor, p.nvme_swapper, p.is_external_param = None, None, False
        p.partition_numel = lambda n=n: n
        p.all_gather_coalesced = self._gather_coalesced
        p.all_gather = functools.partial(self._all_gather, p)
        p.partition = functools.partial(self._partition, p)
        p.ds_summary = lambda use_debug_name=False, p=p: {"id": p.ds_id, "status": p.ds_status.name, "numel": p.ds_numel}

    def _free(self, p: torch.nn.Parameter) -> None:
        with self.acc.placing(DEVICE):
            p.data = torch.empty(0, dtype=p.ds_dtype)  # free_param

    def _gather_coalesced(self, params, safe_mode: bool = False, quantize: bool = False, *,
                          stream: int = ALLGATHER_STREAM) -> _Gathered:
        """The coordinator's gather (on the allgather stream); `stream` 0: a blocking `all_gather`.
        In ds_id order: the coordinator hands over a set of parameters (`fetch_sub_module`'s
        `params_to_fetch`, the prefetch's), whose order follows their addresses, which differ from run to
        run; the order of the gathers decides where the caching allocator puts them, so a real run's
        reserved peak can differ by a segment from another's, and this prediction takes one order."""
        params = sorted(params, key=lambda q: q.ds_id)
        for p in params:
            p.ds_status = self.status.INFLIGHT
            with self.acc.placing(DEVICE), self.acc.on_stream(stream):  # ds_tensor.data.to(device).view(ds_shape)
                p.data = torch.empty(p.ds_shape, dtype=p.ds_dtype)
            self.acc.set_role([p.data], "weights")
        return _Gathered(params, self.status.AVAILABLE)

    def _all_gather(self, p: torch.nn.Parameter, param_list=None, **kwargs: Any) -> None:
        params = [q for q in (param_list or [p]) if q.ds_status == self.status.NOT_AVAILABLE]
        if params:
            self._gather_coalesced(params, stream=0).wait()

    def _partition(self, p: torch.nn.Parameter, param_list=None, hierarchy: int = 0, has_been_updated: bool = False,
                   free_data: bool = True) -> None:
        for q in (param_list or [p]):
            q.ds_status = self.status.NOT_AVAILABLE
            self._free(q)

    # -- backward: the reduce bucket and the gradient partitions -----------------------------------
    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        if not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            self.callback_queued = True
        n = p.ds_numel
        if self.elements + n > self.bucket_size and self.elements > 0:
            self._reduce()
        grad, p.grad = p.grad.reshape(-1), None
        if self.elements + n <= self.bucket_size:  # contiguous_gradients: into the bucket, then freed
            view = self.bucket.narrow(0, self.elements, n)
            view.copy_(grad)
            grad = view
        self.in_bucket.append((p, grad))
        self.elements += n
        del grad

    def _reduce(self) -> None:
        """`__reduce_and_partition_ipg_grads` at world size 1, on the reduce stream:
        reduce_scatter_coalesced's flat copy, then `partition_grads` parameter by parameter in ds_id order."""
        if not self.in_bucket:
            return
        with self.acc.on_stream(REDUCE_STREAM):
            self._reduce_and_partition()

    def _reduce_and_partition(self) -> None:
        items = sorted(self.in_bucket, key=lambda x: x[0].ds_id)
        self.in_bucket, self.elements = [], 0
        grads = [g for _, g in items]
        flat = grads[0] if len(grads) == 1 else torch.cat(grads)  # a lone tensor is reduced in place
        self.reduces.append((len(grads), flat.numel(), len(grads) > 1))
        del grads
        flat.div_(1)  # pre-divide by the world size
        boundary = self.micro == self.grad_accum - 1
        o = 0
        for p, _ in items:
            n = p.ds_numel
            part = flat.narrow(0, o, n)
            o += n
            host = self.grad_partitions.narrow(0, self.offset[p], n)
            if self.micro == 0:
                host.copy_(part)  # device -> pinned host
                with self.acc.placing(DEVICE):
                    buffer = host.clone()  # grad_buffer.to(device)
            else:
                with self.acc.placing(DEVICE):
                    buffer = host.clone()  # accumulate on the card, copy back
                buffer.add_(part)
                host.copy_(buffer)
            if boundary:  # _offload_grad_partition_at_boundary
                norm = None
                for chunk in buffer.split(NORM_CHUNK):
                    sq = chunk.to(torch.float64).norm(2) ** 2.0
                    norm = sq if norm is None else norm + sq
                self.norms[p.ds_id] = norm ** 0.5
                del norm, sq, chunk
                self.master.grad.narrow(0, self.offset[p], n).copy_(buffer.to(torch.float32))
            del part, buffer
        del items, flat

    def _backward_done(self) -> None:
        self.callback_queued = False
        self._reduce()  # independent_gradient_partition_epilogue
        self.offload.release_backward_leftovers()  # the engine's optimizer.backward_epilogue()
        self.micro += 1

    # -- the step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        self.offload.get_param_coordinator().release_and_reset_all(self.model)  # _partition_all_parameters
        m = self.master
        if not self.state[m]:
            with self.acc.placing(HOST):  # DeepSpeedCPUAdam's moments, made at the first step
                self.state[m] = {"exp_avg": torch.zeros_like(m), "exp_avg_sq": torch.zeros_like(m)}
            self.acc.set_role(list(self.state[m].values()), "optimizer_state")
        cpu_adam_in_place(m, self.state[m])
        for p in self.params:  # fp32 -> the bf16 partitions in pinned host memory
            self.host_flat.narrow(0, self.flat_offset[p], p.ds_numel).copy_(m.narrow(0, self.offset[p], p.ds_numel))
        self.norms.clear()
        for p in self.persistent:  # _post_step
            p.all_gather()
        self.micro = 0
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The host's gradient partitions are overwritten at the next boundary (nothing to free)."""

    def remove(self) -> None:
        from deepspeed.runtime.zero import parameter_offload

        for h in self.handles:
            h.remove()
        self.offload._remove_module_hooks()
        if parameter_offload.FWD_MODULE_STACK and parameter_offload.FWD_MODULE_STACK[-1] is self.model:
            parameter_offload.FWD_MODULE_STACK.pop()
