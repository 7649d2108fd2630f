"""Where does a fresh process's first run put the cuBLAS workspaces, and which segments does it make?

    python3 tools/segment_probe.py RUNG OUT_DIR     # on a CUDA machine, from the checkout's root
    python3 tools/segment_probe.py RUNG OUT_DIR --cap MIB     # the same run under a cap, as the cap check's
    python3 tools/segment_probe.py fp32 OUT_DIR --after bf16_true_lora     # after another rung's run

Runs one ladder rung (Qwen2-0.5B, batch 1 x 512, 3 steps, as gpu-check's ladder check) in this
process under torch's memory history, writes OUT_DIR/RUNG_snapshot.pickle.gz (the snapshot, for
pytorch.org/memory_viz) and prints every segment of 100 MiB or more as it is made and freed, every
32 MiB allocation (the cuBLAS workspaces on sm_90) with the segment it landed in, and every
allocation of 500 MiB or more. Its output on the H200 of 2026-11-26 is
data/measured/h200-2026-11-26/segment_probe.log: the evidence for cuda_model.workspaces_in.

With --cap, the run is made as the cap check makes a trial: one run uncapped first (kernels
chosen, libraries' lazy state made), then what a fresh process would not hold given back
(monitor.release_held), then the run under `set_per_process_memory_fraction` with CAP_MIB above
what the process holds (MIB). If it runs out of memory, it prints the cache at that moment
(segments.at_oom): the request, and every segment with its free room. On the H200 of 2026-11-26
bf16_true_lora failed under a cap of 3,440 MiB though it reserved 3,446 uncapped and allocated
2,925 at most, where the model's replay runs under 3,270: this shows which segments held the spare.

With --after, another rung runs first in the process, then garbage is collected and the cache
emptied (the cuBLAS workspaces kept where that run made them), as gpu-check's ladder ran its rungs
before it released the workspaces between them; the memory history is recorded from before that
run, so the segments it leaves are in the trace. On that H200, fp32 after bf16_true_lora reserved
9,792 MiB (139 segments of 18 MiB, against 180 in a fresh process, which reserved 10,378); the
model, with bf16_true_lora cast on the card as the ladder loaded it then (predict(load="card")),
predicts 9,790. measure() now casts on the host (predict(load="host")): the model predicts 10,352
for this run, pre-registered (the figure the direct load gave before the old path was modelled).
"""
import argparse
import gc
import gzip
import pickle
import sys
from pathlib import Path

import torch
from workbench.core.fallback import unavailable
from workbench.core.memory.monitor import release_held
from workbench.core.memory.plan import RUNGS
from workbench.core.memory.segments import at_oom
from workbench.studies.ladder.config import LadderConfig
from workbench.studies.ladder.runner import model_at_hand
from workbench.studies.ladder.rungs import measure

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("rung")
ap.add_argument("out")
ap.add_argument("--cap", type=float, default=None, help="MiB above what the process holds")
ap.add_argument("--after", default=None, help="a rung run first in this process")
args = ap.parse_args()
rung, out, cap_mib = args.rung, args.out, args.cap
# what would end the run after the card's time is spent, said before it (a device call is minutes)
for name in (rung, args.after):
    if name is not None and name not in RUNGS:
        sys.exit(f"segment_probe: {name!r} is not a rung; one of {', '.join(RUNGS)}")
if why := unavailable("cuda"):
    sys.exit(f"segment_probe: needs a CUDA GPU: {why}")
Path(out).mkdir(parents=True, exist_ok=True)
MiB = 2**20
dev = torch.device("cuda", 0)
cfg = LadderConfig(model="data/configs/qwen2-0.5b.json", base_size="default", micro_batch=1, seq_len=512, steps=3,
                   reference_model="")
config, load, blocks, _ = model_at_hand(cfg)
if args.after:  # recorded from here: the segments the first run leaves are made in the trace
    torch.cuda.memory._record_memory_history(max_entries=400000)
    first = measure(args.after, load, blocks, batch=1, steps=3, device=dev, counted=False)
    gc.collect()
    torch.cuda.empty_cache()
    print(f"after {args.after} ({first.get('status')}, reserved {first.get('cuda_max_reserved_bytes', 0) / MiB:,.0f} "
          f"MiB): {torch.cuda.memory_reserved(dev) / MiB:,.1f} MiB still reserved")
if cap_mib is not None:  # as the cap check's trials
    measure(rung, load, blocks, batch=1, steps=3, device=dev, counted=False)
    release_held(dev)
    held = torch.cuda.memory_reserved(dev)
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (held + cap_mib * MiB) / total), dev)
    print(f"cap {cap_mib:,.0f} MiB above {held / MiB:,.1f} MiB held")
if not args.after:  # (with --after it records already)
    torch.cuda.memory._record_memory_history(max_entries=400000)
m = measure(rung, load, blocks, batch=1, steps=3, device=dev, counted=False)
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
name = rung + (f"_after_{args.after}" if args.after else "") + (f"_cap{cap_mib:.0f}" if cap_mib is not None else "")
partial = Path(out) / f"{name}_snapshot.pickle.gz.partial"  # a kill while writing leaves no torn snapshot
with gzip.open(partial, "wb") as f:
    pickle.dump(snap, f)
partial.replace(Path(out) / f"{name}_snapshot.pickle.gz")
print(rung, m.get("status"), "allocated", m.get("cuda_max_allocated_bytes", 0) / MiB,
      "reserved", m.get("cuda_max_reserved_bytes", 0) / MiB)
state = at_oom(snap["device_traces"][0])
if state:
    print(f"out of memory asking {state['requested'] / MiB:,.2f} MiB: reserved {state['reserved'] / MiB:,.1f}, "
          f"live {state['live'] / MiB:,.1f}, wholly free {state['wholly_free'] / MiB:,.1f} MiB; "
          f"CUDA free {(state['device_free'] or 0) / MiB:,.0f} MiB")
    for r in state["segments"][:40]:
        print(f"  segment {r['size'] / MiB:9.1f} MiB  live {r['live'] / MiB:9.2f}  free {r['free'] / MiB:9.2f}")
segs = {}
trace = snap["device_traces"][0]
def where(e):
    fr = [f"{x['filename'].split('/')[-1]}:{x['line']}:{x['name']}" for x in e.get("frames", [])
          if "torch/" not in x["filename"] or "nn/modules" in x["filename"]]
    return " < ".join(fr[:4])
for i, e in enumerate(trace):
    a, addr, size = e["action"], e["addr"], e["size"]
    if a == "segment_alloc":
        segs[addr] = size
        if size >= 100 * MiB:
            print(f"[{i}] segment_alloc {size / MiB:.1f} MiB  {where(e)}")
    elif a == "segment_free":
        if size >= 100 * MiB:
            print(f"[{i}] segment_free {size / MiB:.1f} MiB")
        segs.pop(addr, None)
    elif a == "alloc" and size in (32 * MiB, 8 * MiB + 128 * 1024) or (a == "alloc" and size >= 500 * MiB):
        seg = next(((s, n) for s, n in segs.items() if s <= addr < s + n), (None, 0))
        print(f"[{i}] alloc {size / MiB:.2f} MiB in a {seg[1] / MiB:.1f} MiB segment "
              f"(offset {(addr - (seg[0] or 0)) / MiB:.1f})  {where(e)}")
    elif a == "free_completed" and size >= 500 * MiB:
        print(f"[{i}] free {size / MiB:.1f} MiB")
print("segments at the end:",
      sorted(round(s["total_size"] / MiB, 1) for s in snap["segments"] if s["total_size"] >= 100 * MiB))
