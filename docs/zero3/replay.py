"""Replay a probe's recorded coordinator event sequence through DeepSpeed's real
PartitionedParameterCoordinator, with fake parameters carrying REAL model numels.

The hook order (which module is fetched/released when, forward or backward) does not depend on the
sizes, only the coordinator's keep/release/prefetch decisions do; so replaying the tiny run's events
with Qwen2-0.5B / Qwen2-7B numels and DeepSpeed's default thresholds gives the device-resident
parameter set of the real model at each event (INFLIGHT counts: the device copy is made at issue,
partition_parameters.py:105-106).

usage: replay.py OUT.json tiny|q05|q7b [json_out]
  tiny: numels/thresholds of the probe itself (validation against the recorded residency)
"""
import json, os, sys, types, socket
import torch

for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
    os.environ.setdefault(k, v)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); os.environ["MASTER_PORT"] = str(s.getsockname()[1])
import deepspeed
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator, InflightParamRegistry
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
# (deepspeed.init_distributed's env:// rendezvous would leave a TCPStore listening on every interface)

d = json.load(open(sys.argv[1]))
mode = sys.argv[2]
info, events = d["info"], d["events"]

SHAPES = {"q05": dict(H=896, I=4864, V=151936, KV=128), "q7b": dict(H=3584, I=18944, V=152064, KV=512)}


def real_numel(name):
    if mode == "tiny":
        return info["param_numel"][name]
    s = SHAPES[mode]
    H, I, V, KV = s["H"], s["I"], s["V"], s["KV"]
    last = name.split(".")
    leaf, kind = last[-2], last[-1]
    if leaf in ("embed_tokens", "lm_head"):
        return V * H
    if leaf in ("input_layernorm", "post_attention_layernorm", "norm"):
        return H
    if leaf == "q_proj":
        return H * H if kind == "weight" else H
    if leaf in ("k_proj", "v_proj"):
        return KV * H if kind == "weight" else KV
    if leaf == "o_proj":
        return H * H
    if leaf in ("gate_proj", "up_proj", "down_proj"):
        return H * I
    raise KeyError(name)


if mode == "tiny":
    cfg = info["zero_cfg_effective"]
    thr = dict(persist=cfg["param_persistence_threshold"], live=cfg["max_live"], reuse=cfg["max_reuse"], prefetch=cfg["prefetch_bucket_size"])
else:  # DeepSpeed defaults, config.py:222-251
    thr = dict(persist=100_000, live=1_000_000_000, reuse=1_000_000_000, prefetch=50_000_000)
for key in ("live", "reuse", "prefetch"):  # optional what-if overrides
    if os.environ.get("THR_" + key.upper()):
        thr[key] = int(float(os.environ["THR_" + key.upper()]))


class H:  # mirrors NoGatherCoalescedHandle (partition_parameters.py:89-119): only the first wait() acts
    def __init__(self, ps):
        self.ps = ps
        self.complete = False

    def wait(self, **k):
        if self.complete:
            return
        for p in self.ps:
            p.ds_status = ZeroParamStatus.AVAILABLE
        self.complete = True


def all_gather_coalesced(params, safe_mode=False, quantize=False):
    params = list(params)
    for p in params:
        assert p.ds_status == ZeroParamStatus.NOT_AVAILABLE
        p.ds_status = ZeroParamStatus.INFLIGHT
    return H(params)


params = {}
for i, name in enumerate(list(info["param_numel"])):  # model.parameters() order = Init ds_id order
    p = torch.nn.Parameter(torch.empty(1))
    n = real_numel(name)
    p.ds_numel = n
    p.ds_shape = (n,)
    p.ds_id = i
    p.ds_persist = n <= thr["persist"]  # parameter_offload.py:325 (model_persistence_threshold = maxsize)
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE
    p.ds_active_sub_modules = set()
    p.ds_tensor = types.SimpleNamespace(ds_numel=n, final_location=None)
    p.ds_secondary_tensor = None
    p.nvme_swapper = None
    p.is_external_param = False
    p.partition_numel = (lambda n=n: n)
    p.all_gather_coalesced = all_gather_coalesced

    def partition(param_list=None, hierarchy=0, has_been_updated=False, free_data=True, p=p):
        for q in (param_list or [p]):
            q.ds_status = ZeroParamStatus.NOT_AVAILABLE
    p.partition = partition
    p.ds_summary = (lambda use_debug_name=False, name=name: {"name": name})
    p._name = name
    params[name] = p

modules = {}
for mname, plist in info["module_direct_params"].items():
    m = torch.nn.Module()
    for j, pname in enumerate(plist):
        m.register_parameter(f"p{j}", params[pname])
    m.ds_id = info["module_ds_id"][mname]
    m.ds_recompute_parameters = set()
    m.ds_external_parameters = (lambda: [])
    m._name = mname
    modules[mname] = m

C = PartitionedParameterCoordinator(prefetch_bucket_sz=thr["prefetch"], max_reuse_distance_in_numel=thr["reuse"],
                                    max_available_parameters_in_numel=thr["live"], allgather_stream=None,
                                    inflight_param_registry=InflightParamRegistry())
persistent = [p for p in params.values() if p.ds_persist]
root = modules["<root>"]
allp = list(params.values())


def resident():
    return sum(p.ds_numel for p in allp if p.ds_status in (ZeroParamStatus.AVAILABLE, ZeroParamStatus.INFLIGHT))


out = []
mismatch = 0
for ev in events:
    k = ev["kind"]
    if k == "fetch_sub_module":
        m = modules[ev["module"]]
        # parameter_offload.py:539-543 / 578-582: trace_prologue, record_module (RECORD mode), then fetch
        C.trace_prologue(m)
        if C.is_record_trace():
            C.record_module(m)
        C.fetch_sub_module(m, forward=ev["forward"])
    elif k == "release_sub_module":
        mr = C._PartitionedParameterCoordinator__most_recent_step_id_param_fetched_for
        pre_mr = {p._name: mr.get(p, None) for p in modules[ev["module"]].parameters(recurse=False)}
        if mode == "tiny" and ev.get("pre_most_recent") is not None and pre_mr != ev["pre_most_recent"]:
            print("MR differs at", ev["seq"], ev["module"], "rec", ev["pre_most_recent"], "rep", pre_mr)
        C.release_sub_module(modules[ev["module"]], forward=ev["forward"])
    elif k == "reset_step":
        C.reset_step()
    elif k == "release_and_reset_all":
        # stage3.step -> _partition_all_parameters (parameter_offload.py:238-242); iterates the whole model
        for p in allp:
            p.ds_active_sub_modules.clear()
            if p.ds_status == ZeroParamStatus.AVAILABLE:
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE
    elif k == "_post_step:post":
        for p in persistent:  # stage3.py:2840-2841 gathers persistent params after the step
            p.ds_status = ZeroParamStatus.AVAILABLE
    elif k == "release_backward_leftovers":
        C.release_backward_leftovers()
    elif k.startswith("after_") or k.endswith(":pre") or k.endswith(":post"):
        pass
    else:
        raise KeyError(k)
    r = resident()
    rec = {"seq": ev["seq"], "step": ev["step"], "phase": ev["phase"], "kind": k, "module": ev.get("module"),
           "forward": ev.get("forward"), "resident_numel": r, "n_available": C._PartitionedParameterCoordinator__n_available_params,
           "step_id": C._PartitionedParameterCoordinator__step_id, "queue_len": len(C._PartitionedParameterCoordinator__param_queue or []),
           "n_most_recent": len(C._PartitionedParameterCoordinator__most_recent_step_id_param_fetched_for),
           "resident_nonpersist": sorted(p._name for p in allp if not p.ds_persist and p.ds_status != ZeroParamStatus.NOT_AVAILABLE)}
    if mode == "tiny" and ev.get("n_available") is not None and mismatch == 0:
        for f in ("n_available", "step_id", "queue_len", "n_most_recent"):
            if rec[f] != ev.get(f):
                print("STATE differs first at", ev["seq"], k, ev.get("module"), f, "rec", ev.get(f), "rep", rec[f])
                mismatch += 1
                break
    if mode == "tiny" and r != ev["avail_numel"]:
        mismatch += 1
        if mismatch <= 3:
            rec_set = set(ev["avail_nonpersist"]); rep_set = set(rec["resident_nonpersist"])
            print("MISMATCH", ev["seq"], ev["step"], ev["phase"], k, ev.get("module"), "recorded", ev["avail_numel"], "replay", r,
                  "only_recorded", sorted(rec_set - rep_set)[:5], "only_replay", sorted(rep_set - rec_set)[:5], "persist rec/rep", ev["avail_persist_n"])
    out.append(rec)

if mode == "tiny":
    print("replay vs recorded residency mismatches:", mismatch, "of", len(out))
total = sum(p.ds_numel for p in allp)
print("mode", mode, "total numel", total, "persistent numel", sum(p.ds_numel for p in persistent), "thresholds", thr)
for st in (1, 2, 3):
    for ph in ("fwd", "bwd", "step"):
        e = [x for x in out if x["step"] == st and x["phase"] == ph]
        if not e:
            continue
        mx = max(e, key=lambda x: x["resident_numel"])
        print(f"  step{st} {ph}: peak resident {mx['resident_numel']:,} numel = {mx['resident_numel']*2/2**20:,.1f} MiB bf16 "
              f"({mx['resident_numel']/total:.3f} of model) at {mx['kind']} {mx['module']}")
    for x in out:
        if x["step"] == st and x["kind"] in ("independent_gradient_partition_epilogue:pre", "after_fwd"):
            print(f"     {x['kind']}: resident {x['resident_numel']:,} ({x['resident_numel']*2/2**20:,.1f} MiB) non-persistent: {x['resident_nonpersist'][:6]}{'...' if len(x['resident_nonpersist'])>6 else ''}")
if len(sys.argv) > 3:
    json.dump(out, open(sys.argv[3], "w"))
if mode == "tiny":
    po = [[p.param._name, p.step_id_last_used_at] for p in C._PartitionedParameterCoordinator__param_order]
    so = [m._name for m in C._PartitionedParameterCoordinator__submodule_order]
    print("submodule order equal:", so == info["trace_submodules"], "param order equal:", po == info["trace_params"])
    for i, (a, b) in enumerate(zip(po, info["trace_params"])):
        if a != b:
            print("first param-order diff at", i, a, b); break
