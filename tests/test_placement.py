"""The offload rungs simulated with each tensor at its place (issue 10 item 3).

workbench.core.memory.placement and .offload: accelerate's device_map (its own placement, its hooks' copies)
and DeepSpeed ZeRO-2 with the optimizer offloaded (its buffers, bucket and copies), on the card
("device") and in host memory ("host").
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import subprocess_env, tiny_config, unavailable_here
from workbench.core.memory import allocator
from workbench.core.memory.accounting import EMPTY_CACHE
from workbench.core.memory.meta import build_meta_model
from workbench.core.memory.offload import dispatch_like_accelerate, infer_device_map, simulate_placed
from workbench.core.memory.placement import DEVICE, HOST, PlacedAccounting
from workbench.core.memory.plan import RUNGS
from workbench.core.memory.predict import predict, simulate
from workbench.core.memory.snapshot import predicted_snapshot

SEQ, BATCH = 32, 2


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in params}.values())


# ------------------------------------------------------------------------------------------------
# the placement rules, on real tensors

def test_ops_run_where_their_inputs_live_and_copies_cross_as_accelerate_makes_them():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    dmap = {"0": 0, "1": 0, "2": "cpu"}
    x = torch.randn(8, 64)
    with PlacedAccounting("cpu") as acc:
        handles = dispatch_like_accelerate(model, dmap, acc)
        acc.watch(model)
        acc.preset([x], DEVICE)
        acc.track([x])
        hidden = []
        model[2].register_forward_pre_hook(lambda m, a: hidden.append(a[0]))
        y = model(x)
        # layer 2 runs on the host: its input was copied there, its output copied back to the input's place
        assert acc.place_of(hidden[0]) == HOST and acc.place_of(y) == DEVICE
        assert acc.place_bytes[HOST] >= 64 * 32 * 4 + 8 * 64 * 4  # its weights + the copied input
        y.sum().backward()
        assert acc.place_of(model[0].weight.grad) == DEVICE and acc.place_of(model[2].weight.grad) == HOST
        for h in handles:
            h.remove()
    # the weights are where accelerate's map puts them
    assert acc.place_peak[DEVICE].by_category["weights"] == _bytes(model[0].parameters())
    assert acc.place_peak[HOST].by_category["weights"] == _bytes(model[2].parameters())


# ------------------------------------------------------------------------------------------------
# accelerate device_map

@pytest.fixture(scope="module")
def llama():
    return tiny_config("llama")


def test_device_map_places_the_weights_where_accelerate_does_and_loses_no_bytes(llama):
    plan = RUNGS["device_map"]
    r = simulate_placed(llama, plan, batch=BATCH, seq=SEQ)
    meta = build_meta_model(llama)
    dmap = infer_device_map(meta)
    on_card = [k for k, v in dmap.items() if v == 0]
    assert 0 < len(on_card) < len(dmap), dmap  # the rung splits the model
    card_params = [p for n, p in meta.named_parameters() if any(n == k or n.startswith(k + ".") for k in on_card)]
    dev, host = r.device.breakdown(), r.host.breakdown()
    assert r.device.peak.by_category["weights"] == _bytes(card_params)
    everything = _bytes([*meta.parameters(), *meta.buffers()])  # buffers (rotary frequencies) are weights too
    assert r.device.peak.by_category["weights"] + r.host.peak.by_category["weights"] == everything
    # each side keeps the AdamW moments of its own weights (and the fused kernel's 4-byte step counters)
    host_params = [p for p in meta.parameters() if not any(p is q for q in card_params)]
    assert dev["optimizer_state"] == 2 * _bytes(card_params) + 4 * len(card_params)
    assert host["optimizer_state"] == 2 * _bytes(host_params) + 4 * len(host_params)
    # torch's AdamW without fused (adamw_torch) keeps every step counter on the host, the card's parameters' too
    loop = simulate_placed(llama, plan.compose("loop", "", optimizer="adamw_torch"), batch=BATCH, seq=SEQ)
    assert loop.device.breakdown()["optimizer_state"] == 2 * _bytes(card_params)
    assert loop.host.breakdown()["optimizer_state"] == 2 * _bytes(host_params) + 4 * len(card_params + host_params)
    # all bytes together: the plain step's, plus only the copies across (hidden states, not weights)
    plain = simulate(llama, RUNGS["bf16_ckpt"], batch=BATCH, seq=SEQ).steady_peak_bytes
    hidden = BATCH * SEQ * llama.hidden_size * 4
    assert plain <= r.combined.steady_peak_bytes <= plain + 8 * hidden


def test_device_map_host_layers_keep_their_activations_on_the_host(llama):
    few = simulate_placed(llama, RUNGS["device_map"], batch=BATCH, seq=SEQ, gpu_share=0.2)
    many = simulate_placed(llama, RUNGS["device_map"], batch=BATCH, seq=SEQ, gpu_share=0.8)
    act = lambda rep: max(p.by_category["activations"] for p in rep.phase_peaks.values())  # noqa: E731
    assert act(few.device) < act(many.device) and act(few.host) > act(many.host)
    assert few.summary["modules_on_device"] < many.summary["modules_on_device"]


def test_device_map_places_the_model_as_it_trains_lora_included(llama):
    plan = RUNGS["device_map"].compose("device_map_lora", "", trainable="lora", lora_targets=("q_proj", "v_proj"))
    r = simulate_placed(llama, plan, batch=BATCH, seq=SEQ)
    assert all(k.startswith("base_model.model.") for k in r.summary["device_map"])  # peft's module names
    assert r.summary["modules_on_device"] > 0 and r.summary["modules_on_host"] > 0
    assert r.device.breakdown()["optimizer_state"] > 0 and r.host.breakdown()["optimizer_state"] > 0


def test_device_map_host_layers_run_outside_cudas_autocast(llama):
    """The rung trains under CUDA autocast: the layers accelerate keeps on the host compute in fp32."""
    act = lambda rep: max(p.by_category["activations"] for p in rep.phase_peaks.values())  # noqa: E731
    all_host = simulate_placed(llama, RUNGS["device_map"], batch=BATCH, seq=SEQ, gpu_share=0.01)
    assert set(all_host.summary["device_map"].values()) == {HOST}
    fp32 = act(simulate(llama, RUNGS["bf16_ckpt"].compose("fp32_ckpt", "", precision="fp32"), batch=BATCH, seq=SEQ))
    bf16 = act(simulate(llama, RUNGS["bf16_ckpt"], batch=BATCH, seq=SEQ))
    assert fp32 != bf16 and abs(act(all_host.host) - fp32) <= 8  # a scalar or two


def test_device_map_host_layers_make_the_cpus_kernel_choices_in_a_cuda_prediction(llama):
    """Only the layers on the card run CUDA's attention kernel; a host layer's step is the CPU's."""
    r = simulate_placed(llama, RUNGS["device_map"], batch=BATCH, seq=SEQ, target="cuda")
    on_card = sum(1 for k, v in r.summary["device_map"].items() if v == DEVICE and ".layers." in k)
    calls = 2 * (2 if RUNGS["device_map"].grad_checkpointing else 1)  # two steps (a checkpointed layer's recompute too)
    assert 0 < on_card < llama.num_hidden_layers and sum(r.kernels.values()) == on_card * calls
    all_host = simulate_placed(llama, RUNGS["device_map"], batch=BATCH, seq=SEQ, gpu_share=0.01, target="cuda")
    cpu = simulate_placed(llama, RUNGS["device_map"], batch=BATCH, seq=SEQ, gpu_share=0.01, target="cpu")
    assert not all_host.kernels and all_host.host.steady_peak_bytes == cpu.host.steady_peak_bytes


# ------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-2, optimizer offloaded

def test_zero2_offload_keeps_bf16_weights_and_the_reduce_bucket_on_the_card(llama):
    plan = RUNGS["zero_offload"]
    n = sum(p.numel() for p in {id(p): p for p in build_meta_model(llama).parameters()}.values())
    largest = max(p.numel() for p in build_meta_model(llama).parameters())
    buffers = _bytes(build_meta_model(llama).buffers())  # DeepSpeed keeps buffers in fp32
    seq = 24  # no activation of this size matches a largest-parameter copy
    big = simulate_placed(llama, plan, batch=BATCH, seq=seq, reduce_bucket_size=4 * n)
    small = simulate_placed(llama, plan, batch=BATCH, seq=seq, reduce_bucket_size=2 * n)
    assert big.device.breakdown()["weights"] == 2 * n + buffers  # bf16 on the card
    # the host: fp32 master + bf16 staging; fp32 gradient partition + one largest-parameter buffer; AdamW moments
    host = big.host.peak.by_category
    assert host["weights"] == 6 * n and host["gradients"] == 4 * n + 2 * largest and host["optimizer_state"] == 8 * n
    # the bucket is allocated at its full size whatever the model: the card's peak moves with it, byte for byte
    assert big.device.steady_peak_bytes - small.device.steady_peak_bytes == 2 * (4 * n - 2 * n)
    assert big.device.breakdown()["gradients"] == 2 * 4 * n + 2 * largest  # bucket + the card's offload buffer
    # each gradient's norm is taken in fp64 on the card (the largest parameter's copy is the biggest)
    assert 8 * largest in {n for _, n in big.device.timeline if n > 0}
    assert 8 * largest not in {n for _, n in big.host.timeline if n > 0}


def test_zero2_offload_with_a_bucket_smaller_than_the_model_reduces_as_it_goes(llama):
    n = sum(p.numel() for p in {id(p): p for p in build_meta_model(llama).parameters()}.values())
    r = simulate_placed(llama, RUNGS["zero_offload"], batch=BATCH, seq=SEQ, reduce_bucket_size=n // 4)
    full = simulate_placed(llama, RUNGS["zero_offload"], batch=BATCH, seq=SEQ, reduce_bucket_size=4 * n)
    assert r.device.steady_peak_bytes < full.device.steady_peak_bytes
    assert r.host.steady_peak_bytes == full.host.steady_peak_bytes  # the host partition does not depend on it


def test_zero2_flattens_the_weights_where_deepspeed_does_and_the_card_keeps_their_old_blocks():
    import transformers as T

    # weights large enough to take segments of their own (the 16 MiB embedding, 2 MiB projections)
    config = T.LlamaConfig(vocab_size=16384, hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=8)
    n = sum(p.numel() for p in build_meta_model(config).parameters())
    plan = RUNGS["zero_offload"]
    roomy = simulate_placed(config, plan, batch=1, seq=SEQ, target="cuda", reduce_bucket_size=n)
    tight = simulate_placed(config, plan, batch=1, seq=SEQ, target="cuda", reduce_bucket_size=n, card_bytes=3 * n)
    assert roomy.summary["flattened_on"] == DEVICE and tight.summary["flattened_on"] == HOST
    # room for the flat copy's elements beside the weights, not for its bf16 bytes: on the host (a room check
    # in elements found room at half the real size; a fault audit)
    between = simulate_placed(config, plan, batch=1, seq=SEQ, target="cuda", reduce_bucket_size=n,
                              card_bytes=int(3.5 * n))
    assert between.summary["flattened_on"] == HOST
    for r in (roomy, tight):
        made = [nb for nb, op in zip((nb for _, nb in r.device.timeline), r.device.timeline_ops) if op == "setup"]
        assert made.count(2 * n) == 1  # one flat bf16 buffer on the card holds every weight
    # DeepSpeed empties the cache before it looks for room, and again after moving the weights off
    assert [nb for _, nb in roomy.device.timeline].count(EMPTY_CACHE) == 1
    assert [nb for _, nb in tight.device.timeline].count(EMPTY_CACHE) == 2
    # flattened on the host, the weights were copied there (their copies and the host's flat buffer)
    setup_host = max(p.bytes for (s, ph), p in tight.host.phase_peaks.items() if ph == "setup")
    assert setup_host >= 2 * (2 * n)
    def replay(r, setup_only=False):
        events = r.device.timeline
        if setup_only:
            events = events[:next(i for i, op in enumerate(r.device.timeline_ops) if op.startswith("forward"))]
        return allocator.replay(events, r.device.timeline_roles)

    # flattened on the card, both copies of the weights were on it at once; on the host, never
    assert replay(roomy, True).reserved_peak_bytes >= 2 * (2 * n) > replay(tight, True).reserved_peak_bytes
    # training reuses some of them: the same live bytes, a higher reserved peak
    a_roomy, a_tight = replay(roomy), replay(tight)
    assert a_roomy.steady_allocated_peak_bytes == a_tight.steady_allocated_peak_bytes
    assert a_roomy.steady_reserved_peak_bytes > a_tight.steady_reserved_peak_bytes


# ------------------------------------------------------------------------------------------------
# through predict and the command line's setups

@pytest.mark.parametrize("name", ["device_map", "zero_offload", "zero_offload_params"])
def test_predict_simulates_the_offload_rungs_with_host_memory_beside(llama, name):
    p = predict(llama, name, batch=BATCH, seq=SEQ)
    assert p.method == "predicted" and "simulated placement" in p.note
    assert p.host_bytes > 0 and p.host_breakdown and p.placement
    c = predict(llama, name, batch=BATCH, seq=SEQ, device="cuda", card=8)
    assert c.allocated_peak_bytes >= c.peak_bytes and c.reserved_peak_bytes >= c.allocated_peak_bytes
    assert c.fits is True


def test_placement_rejects_rungs_it_does_not_simulate(llama):
    with pytest.raises(ValueError, match="not simulated"):
        simulate_placed(llama, RUNGS["bf16_ckpt"], batch=BATCH, seq=SEQ)


# ------------------------------------------------------------------------------------------------
# the ZeRO-2 replay against DeepSpeed's own objects (real DeepSpeed on the CPU, in a subprocess)

_DEEPSPEED_INVENTORY = r"""
import json, os, sys, torch
import deepspeed
from tests.conftest import tiny_config
from transformers import AutoModelForCausalLM
from workbench.core.memory.plan import RUNGS
from workbench.studies.ladder.rungs import zero_config
from workbench.core.common import single_process_group
try:  # the one step a machine may lack (a process group); what follows is the code under test, whose
    # errors fail the test (they had been caught with this one and reported as a skip)
    single_process_group("cpu")  # as the ladder makes it: an in-memory store, loopback sockets
except Exception as e:
    print(json.dumps({"unavailable": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}))
    sys.exit(0)
model = AutoModelForCausalLM.from_config(tiny_config("llama"))
plan = RUNGS["zero_offload"].compose("z2", "", precision=sys.argv[2])
conf = zero_config(plan, plan.settings(2, 2))
conf["zero_optimization"]["reduce_bucket_size"] = int(sys.argv[1])
# torch's AdamW instead of DeepSpeedCPUAdam (no op to build): the ZeRO buffers are the same
conf.pop("optimizer")
conf["zero_force_ds_cpu_optimizer"] = False
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=conf)
zo = engine.optimizer
size = lambda ts: [[t.numel(), str(t.dtype)] for t in ts]
flat = zo.bit16_groups_flat[0]
out = {"params": sorted({str(p.dtype) for p in engine.module.parameters()}),
       "params_in_flat": all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                             for p in engine.module.parameters()),
       "buffers": sorted({str(b.dtype) for b in engine.module.buffers()}),
       "flat": size(zo.bit16_groups_flat), "master": size(zo.single_partition_of_fp32_groups),
       "master_grad": size([t.grad for t in zo.single_partition_of_fp32_groups]),
       "staging": size(zo.param_buffer_of_bit16_for_cpu_offload_groups),
       "host_temp": size([zo.temp_grad_buffer_for_cpu_offload]), "device_temp": size([zo.temp_grad_buffer_for_gpu_offload])}
seen = []
for p in engine.module.parameters():
    p.register_post_accumulate_grad_hook(lambda p: seen.append(size(b for bk in zo.ipg_buckets.values() for b in bk.buffer)))
x = torch.randint(0, 128, (2, 32))
engine.backward(engine(input_ids=x, labels=x).loss)
out["bucket_in_backward"] = seen[-1]
out["bucket_after"] = size(b for bk in zo.ipg_buckets.values() for b in bk.buffer)
engine.step()
out["model_grads_after"] = [p.grad is None for p in engine.module.parameters()]
out["state"] = sorted([k, v.numel(), str(v.dtype)] for s in zo.optimizer.state.values() for k, v in s.items() if v.dim())
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("precision,size", [("bf16", 2), ("fp32", 4)])  # fp32: DeepSpeed trains fp32 weights
def test_zero2_replay_holds_the_buffers_deepspeed_allocates(llama, precision, size):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    bucket = 100_000
    proc = subprocess.run([sys.executable, "-c", _DEEPSPEED_INVENTORY, str(bucket), precision], cwd=root,
                          capture_output=True, text=True, timeout=600, env=subprocess_env(root))
    assert proc.returncode == 0, proc.stderr[-2000:]
    ds = json.loads(proc.stdout.strip().splitlines()[-1])
    if "unavailable" in ds:
        unavailable_here("deepspeed", f"DeepSpeed cannot initialise here: {ds['unavailable']}")
    meta = build_meta_model(llama)
    n = sum(p.numel() for p in meta.parameters())
    largest = max(p.numel() for p in meta.parameters())
    # what the replay allocates (ZeroOffloadStep) is what DeepSpeed holds, tensor for tensor
    dtype = {2: "torch.bfloat16", 4: "torch.float32"}[size]
    assert ds["params"] == [dtype] and ds["buffers"] == ["torch.float32"]
    assert ds["flat"] == [[n, dtype]] and ds["params_in_flat"]  # every weight a view of it
    assert ds["master"] == ds["master_grad"] == [[n, "torch.float32"]]
    assert ds["staging"] == [[n, dtype]]
    assert ds["host_temp"] == ds["device_temp"] == [[largest, dtype]]
    assert ds["bucket_in_backward"] == [[bucket, dtype]] and ds["bucket_after"] == []
    assert all(ds["model_grads_after"])  # the gradients went to the host partition
    assert ds["state"] == [["exp_avg", n, "torch.float32"], ["exp_avg_sq", n, "torch.float32"]]
    # and the simulation's books agree: the same bytes on each side
    r = simulate_placed(llama, RUNGS["zero_offload"].compose("z2", "", precision=precision), batch=BATCH, seq=SEQ,
                        reduce_bucket_size=bucket)
    buffers = _bytes(meta.buffers())
    host = r.host.peak.by_category
    assert r.device.breakdown()["weights"] == size * n + buffers
    assert r.summary["flattened_on"] == DEVICE and r.device.timeline.count((max(s for s, _ in r.device.timeline if s), -1)) <= 1
    assert host["weights"] == 4 * n + size * n and host["gradients"] == 4 * n + size * largest
    assert host["optimizer_state"] == 8 * n
    assert max(p.by_category["gradients"] for p in r.device.phase_peaks.values()) >= size * (bucket + largest)


def test_an_offload_rungs_snapshot_is_the_cards_share(llama):
    snap = predicted_snapshot(llama, "zero_offload", batch=BATCH, seq=SEQ)
    sizes = [e["size"] for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert max(sizes) >= 2 * 500_000_000  # DeepSpeed's reduce bucket, on the card
    n = sum(p.numel() for p in build_meta_model(llama).parameters())
    assert 4 * n not in sizes  # the fp32 master partition is host memory: not in the card's timeline
    snap = predicted_snapshot(llama, "zero_offload_params", batch=BATCH, seq=SEQ)  # ZeRO-3: weights gathered one by one
    sizes = [e["size"] for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert max(sizes) >= 2 * 500_000_000 and 4 * n not in sizes
