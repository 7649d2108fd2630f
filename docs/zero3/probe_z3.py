"""ZeRO-3 + offload_param + offload_optimizer (cpu) probe on DeepSpeed's CPU accelerator.

Verifies logic (not placement): param residency per coordinator event in step 1/2/3, the gradient
path (ipg bucket, reduce, partition_grads, norms) and the buffers ZeRO-3 allocates.

usage: PYTHONPATH=$PWD .venv/bin/python docs/zero3/probe_z3.py q05|q7b  OUT.json
  q05: tiny Qwen2 shaped like Qwen2-0.5B (24 layers, tied), thresholds scaled by N_tiny/494,032,768
  q7b: tiny Qwen2 with 28 layers, untied, thresholds scaled by N_tiny/7.6e9 (a 7B-class model)
"""
import json, os, sys, time, collections
import torch

variant = sys.argv[1]
out_path = sys.argv[2]
t0 = time.time()

for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
    os.environ.setdefault(k, v)
import socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); os.environ["MASTER_PORT"] = str(s.getsockname()[1])

import deepspeed
from deepspeed.runtime.zero import partitioned_param_coordinator as ppc
from deepspeed.runtime.zero import stage3 as s3
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
import transformers as T

torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
# (deepspeed.init_distributed's env:// rendezvous would leave a TCPStore listening on every interface)

if variant == "q05":
    cfg = T.Qwen2Config(vocab_size=9500, hidden_size=56, intermediate_size=304, num_hidden_layers=24,
                        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                        max_position_embeddings=64)
    REAL_N = 494_032_768
elif variant == "q7b":
    cfg = T.Qwen2Config(vocab_size=9500, hidden_size=56, intermediate_size=304, num_hidden_layers=28,
                        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=False,
                        max_position_embeddings=64)
    REAL_N = 7_615_616_512
else:
    raise SystemExit(variant)

torch.manual_seed(0)
model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
N = sum(p.numel() for p in model.parameters())
s = N / REAL_N


def sc(x):
    return max(1, int(round(x * s)))


zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "reduce_bucket_size": sc(5e8),
        "stage3_param_persistence_threshold": 400,  # norms (56) and q/k/v biases (56, 8) persist; k/v weights (448) not,
        # as in Qwen2-0.5B with the default 1e5 (norm 896, biases 896/128 <= 1e5 < k/v weight 114,688)
        "stage3_max_live_parameters": sc(1e9), "stage3_max_reuse_distance": sc(1e9),
        "stage3_prefetch_bucket_size": sc(5e7), "sub_group_size": sc(1e9),
        "log_trace_cache_warnings": True}
conf = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "bf16": {"enabled": True}, "zero_optimization": zero, "steps_per_print": 10**9,
        "zero_force_ds_cpu_optimizer": False}

mod_name = {id(m): n or "<root>" for n, m in model.named_modules()}
param_name = {}
for n, p in model.named_parameters(remove_duplicate=False):
    param_name.setdefault(id(p), n)
all_params = list({id(p): p for p in model.parameters()}.values())

events = []
phase = {"step": 0, "phase": "init"}


SEQ = [0]


def nxt():
    SEQ[0] += 1
    return SEQ[0]


def avail():
    # on a GPU a param's device copy exists from issue (INFLIGHT: NoGather(Coalesced)Handle.__init__ sets
    # param.data = ds_tensor.to(device)) until release, so count INFLIGHT as resident too
    a = [p for p in all_params if hasattr(p, "ds_status") and p.ds_status in (ZeroParamStatus.AVAILABLE, ZeroParamStatus.INFLIGHT)]
    return a


def snap(kind, module=None, forward=None, extra=None):
    a = avail()
    ev = {"seq": nxt(), "step": phase["step"], "phase": phase["phase"], "kind": kind}
    if module is not None:
        ev["module"] = mod_name.get(id(module), "?")
    if forward is not None:
        ev["forward"] = forward
    ev["avail_numel"] = sum(p.ds_numel for p in a)
    ev["inflight_numel"] = sum(p.ds_numel for p in a if p.ds_status == ZeroParamStatus.INFLIGHT)
    ev["avail_nonpersist"] = sorted(param_name[id(p)] for p in a if not p.ds_persist)
    ev["avail_persist_n"] = sum(1 for p in a if p.ds_persist)
    if extra:
        ev.update(extra)
    events.append(ev)


C = ppc.PartitionedParameterCoordinator


def coord_extra(self):
    mr = getattr(self, "_PartitionedParameterCoordinator__most_recent_step_id_param_fetched_for")
    return {"step_id": getattr(self, "_PartitionedParameterCoordinator__step_id"),
            "queue_len": len(getattr(self, "_PartitionedParameterCoordinator__param_queue") or []),
            "n_most_recent": len(mr),
            "n_available": getattr(self, "_PartitionedParameterCoordinator__n_available_params"),
            "trace": getattr(self, "_PartitionedParameterCoordinator__trace_mode").name}


def _unused():
    return {"n_available": getattr(self, "_PartitionedParameterCoordinator__n_available_params"),
            "trace": getattr(self, "_PartitionedParameterCoordinator__trace_mode").name}


def wrap_coord(name):
    orig = getattr(C, name)

    def w(self, *a, **k):
        pre_mr = None
        if name == "release_sub_module":
            mr = getattr(self, "_PartitionedParameterCoordinator__most_recent_step_id_param_fetched_for")
            pre_mr = {param_name[id(p)]: mr.get(p, None) for p in a[0].parameters(recurse=False)}
        r = orig(self, *a, **k)
        mod = a[0] if a and isinstance(a[0], torch.nn.Module) else None
        fwd = k.get("forward", a[1] if len(a) > 1 else None) if name in ("fetch_sub_module", "release_sub_module") else None
        ex = coord_extra(self)
        if pre_mr is not None:
            ex["pre_most_recent"] = pre_mr
        snap(name, mod, fwd, ex)
        return r
    setattr(C, name, w)


for n in ("fetch_sub_module", "release_sub_module", "reset_step", "release_and_reset_all", "release_backward_leftovers"):
    wrap_coord(n)

Z = s3.DeepSpeedZeroOptimizer_Stage3
gradlog = []


def wrapm(cls, name, fn_log):
    orig = getattr(cls, name)

    def w(self, *a, **k):
        pre = fn_log(self, "pre", a, k, None)
        if pre is not None:
            pre.update(seq=nxt(), when="pre", step=phase["step"], phase=phase["phase"], fn=name)
            gradlog.append(pre)
        r = orig(self, *a, **k)
        post = fn_log(self, "post", a, k, r)
        if post is not None:
            post.update(seq=nxt(), when="post", step=phase["step"], phase=phase["phase"], fn=name)
            gradlog.append(post)
        return r
    setattr(cls, name, w)


def log_add(self, when, a, k, r):
    p = a[0]
    b = self.ipg_buckets[self.get_param_comm_dtype(p)]
    if when == "pre":
        return {"param": param_name.get(id(p)), "grad_numel": p.grad.numel(), "grad_dtype": str(p.grad.dtype),
                "bucket_elements_before": b.elements}
    buf = b.buffer
    in_buf = buf is not None and buf.data_ptr() <= p.grad.data_ptr() < buf.data_ptr() + buf.numel() * buf.element_size()
    return {"param": param_name.get(id(p)), "grad_is_view_into_ipg_buffer": bool(in_buf),
            "bucket_elements_after": b.elements}


def log_reduce(self, when, a, k, r):
    b = self.ipg_buckets[a[0]]
    if when == "pre":
        return {"comm_dtype": str(a[0]), "bucket_elements": b.elements, "n_params": len(b.params)}
    return None


def log_partition_grads(self, when, a, k, r):
    if when == "pre":
        params, parts = a[0], a[1]
        bases = {(id(g._base) if g._base is not None else id(g)) for g in parts}
        base_numels = sorted({(g._base.numel() if g._base is not None else g.numel()) for g in parts})
        return {"n": len(params), "numel": sum(g.numel() for g in parts), "dtypes": sorted({str(g.dtype) for g in parts}),
                "distinct_bases": len(bases), "base_numels": base_numels[-3:],
                "micro_step_id": self.micro_step_id, "boundary": self.is_gradient_accumulation_boundary()}
    return None


def log_norm(self, when, a, k, r):
    if when == "pre":
        x = a[0]
        from deepspeed.runtime.zero.utils import get_norm_dtype
        return {"input_numel": x.numel(), "input_dtype": str(x.dtype), "norm_dtype": str(get_norm_dtype()),
                "chunk": k.get("buffer_size", 250000000)}
    return {"result_dtype": str(r.dtype), "result_numel": r.numel()}


def log_offload_at_boundary(self, when, a, k, r):
    if when == "pre":
        p, gb = a[0], a[1]
        i, off, _ = self.grad_position[self.get_param_id(p)]
        return {"param": param_name.get(id(p)), "grad_buffer_numel": gb.numel(), "grad_buffer_dtype": str(gb.dtype),
                "fp32_grad_dtype": str(self.fp32_partitioned_groups_flat[i].grad.dtype), "sub_group": i}
    return None


wrapm(Z, "_DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket", log_add)
wrapm(Z, "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads", log_reduce)
wrapm(Z, "partition_grads", log_partition_grads)
wrapm(Z, "_constant_buffered_norm2", log_norm)
wrapm(Z, "_offload_grad_partition_at_boundary", log_offload_at_boundary)
for nm in ("independent_gradient_partition_epilogue", "_post_step", "_partition_all_parameters", "backward_epilogue",
           "_reassign_or_swap_out_partitioned_parameters", "_optimizer_step"):
    def _lg(self, when, a, k, r, nm=nm):
        snap(nm + ":" + when)
        return {"when": when}
    wrapm(Z, nm, _lg)

orig_rsc = s3.reduce_scatter_coalesced


def rsc(tensors, group=None):
    out = orig_rsc(tensors, group)
    bases = {(id(o._base) if o._base is not None else id(o)) for o in out}
    base = out[0]._base if out[0]._base is not None else out[0]
    shares_input = any(base.data_ptr() == t.data_ptr() for t in tensors)
    gradlog.append({"seq": nxt(), "step": phase["step"], "phase": phase["phase"], "fn": "reduce_scatter_coalesced",
                    "n_in": len(tensors), "in_numel": sum(t.numel() for t in tensors),
                    "in_dtype": str(tensors[0].dtype), "out_distinct_bases": len(bases),
                    "out_base_numel": base.numel(), "out_base_dtype": str(base.dtype),
                    "out_is_new_buffer(cat)": not shares_input})
    return out


s3.reduce_scatter_coalesced = rsc

engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=conf)
zo = engine.optimizer
phase["phase"] = "after_init"
snap("after_init")

info = {"variant": variant, "N_tiny": N, "scale": s, "zero_cfg_effective": {
    "overlap_comm": engine.zero_overlap_comm(), "contiguous_gradients": engine.zero_contiguous_gradients(),
    "reduce_scatter": engine.zero_reduce_scatter(), "reduce_bucket_size": engine.zero_reduce_bucket_size(),
    "prefetch_bucket_size": engine.zero_prefetch_bucket_size(),
    "param_persistence_threshold": engine.zero_param_persistence_threshold(),
    "max_live": engine.zero_max_live_parameters(), "max_reuse": engine.zero_max_reuse_distance(),
    "sub_group_size": engine.zero_sub_group_size(), "partial_offload": engine.zero_partial_offload(),
    "communication_data_type": str(engine.communication_data_type), "grad_accum_dtype": str(engine.get_data_types()[1])}}
info["optimizer_class"] = type(zo).__name__
info["self.device"] = str(zo.device)
info["dtype"] = str(zo.dtype)
info["gradient_accumulation_dtype"] = str(zo.gradient_accumulation_dtype)
info["master_weights_and_grads_dtype"] = str(zo.master_weights_and_grads_dtype)
info["inf_or_nan_tracker"] = [str(zo.inf_or_nan_tracker.dtype), str(zo.inf_or_nan_tracker.device)]
info["ipg_buckets"] = {str(k): ([b.buffer.numel(), str(b.buffer.dtype), str(b.buffer.device)] if b.buffer is not None else None)
                       for k, b in zo.ipg_buckets.items()}
g = zo.grad_partitions_flat_buffer
info["grad_partitions_flat_buffer"] = [g.numel(), str(g.dtype), str(g.device)]
info["n_sub_groups"] = len(zo.fp16_groups)
info["fp16_partitioned_groups_flat"] = [[t.numel(), str(t.dtype), str(t.device)] for t in zo.fp16_partitioned_groups_flat]
info["param_groups_fp16_flat_cpu_memory"] = [[t.numel(), str(t.dtype)] for t in zo.param_groups_fp16_flat_cpu_memory]
info["fp32_partitioned_groups_flat"] = [[t.numel(), str(t.dtype), str(t.device), (t.grad.numel(), str(t.grad.dtype)) if t.grad is not None else None]
                                        for t in zo.fp32_partitioned_groups_flat]
info["subgroup_to_device"] = getattr(zo, "subgroup_to_device", None)
flat = zo.param_groups_fp16_flat_cpu_memory[0]
lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
info["ds_tensor_in_flat_cpu_buffer"] = sum(lo <= p.ds_tensor.data_ptr() < hi for p in all_params)
info["n_params"] = len(all_params)
info["persistent"] = sorted({param_name[id(p)].split(".")[-2] + "." + param_name[id(p)].split(".")[-1] for p in all_params if p.ds_persist})
info["persistent_numel"] = sum(p.ds_numel for p in all_params if p.ds_persist)
info["param_dtypes"] = sorted({str(p.dtype) for p in all_params})
info["ds_tensor_numel_eq_numel"] = all(p.ds_tensor.numel() == p.ds_numel for p in all_params)
info["buffers"] = [[n, list(b.shape), str(b.dtype)] for n, b in engine.module.named_buffers()]

x = torch.randint(0, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
for step in range(1, 4):
    phase["step"] = step
    phase["phase"] = "fwd"
    loss = engine(input_ids=x, labels=x).loss
    snap("after_fwd")
    phase["phase"] = "bwd"
    engine.backward(loss)
    snap("after_bwd")
    phase["phase"] = "step"
    engine.step()
    snap("after_step")
    info.setdefault("loss", []).append(float(loss))

co = zo.parameter_offload.get_param_coordinator()
info["trace_submodules"] = [mod_name.get(id(m), "?") for m in getattr(co, "_PartitionedParameterCoordinator__submodule_order")]
info["trace_params"] = [[param_name[id(t.param)], t.step_id_last_used_at] for t in getattr(co, "_PartitionedParameterCoordinator__param_order")]
info["param_numel"] = {param_name[id(p)]: p.ds_numel for p in all_params}
info["param_persist"] = {param_name[id(p)]: bool(p.ds_persist) for p in all_params}
info["module_direct_params"] = {n or "<root>": [param_name[id(p)] for p in m.parameters(recurse=False)] for n, m in model.named_modules()}
info["module_external_params"] = {n or "<root>": [param_name[id(p)] for _, p in m.ds_external_parameters()] for n, m in model.named_modules() if hasattr(m, "ds_external_parameters") and list(m.ds_external_parameters())}
info["param_ds_id"] = {param_name[id(p)]: p.ds_id for p in all_params}
info["module_ds_id"] = {n or "<root>": m.ds_id for n, m in model.named_modules() if hasattr(m, "ds_id")}
info["elapsed_s"] = time.time() - t0
json.dump({"info": info, "events": events, "gradlog": gradlog}, open(out_path, "w"), indent=0)
print("done", variant, round(time.time() - t0, 1), "s; events", len(events), "gradlog", len(gradlog))
