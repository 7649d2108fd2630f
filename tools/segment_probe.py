"""Where does a fresh process's first run put the cuBLAS workspaces, and which segments does it make?

    python3 tools/segment_probe.py RUNG OUT_DIR     # on a CUDA machine, from the checkout's root

Runs one ladder rung (Qwen2-0.5B, batch 1 x 512, 3 steps, as gpu-check's ladder check) in this
process under torch's memory history, writes OUT_DIR/RUNG_snapshot.pickle.gz (the snapshot, for
pytorch.org/memory_viz) and prints every segment of 100 MiB or more as it is made and freed, every
32 MiB allocation (the cuBLAS workspaces on sm_90) with the segment it landed in, and every
allocation of 500 MiB or more. Its output on the H200 of 2026-11-26 is
data/measured/h200-2026-11-26/segment_probe.log: the evidence for cuda_model.workspaces_in.
"""
import gzip
import pickle
import sys

import torch
from workbench.studies.ladder.config import LadderConfig
from workbench.studies.ladder.runner import model_at_hand
from workbench.studies.ladder.rungs import measure

rung, out = sys.argv[1], sys.argv[2]
cfg = LadderConfig(model="data/configs/qwen2-0.5b.json", base_size="default", micro_batch=1, seq_len=512, steps=3,
                   reference_model="")
config, load, blocks, _ = model_at_hand(cfg)
torch.cuda.memory._record_memory_history(max_entries=400000)
m = measure(rung, load, blocks, batch=1, steps=3, device=torch.device("cuda", 0), counted=False)
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
with gzip.open(f"{out}/{rung}_snapshot.pickle.gz", "wb") as f:
    pickle.dump(snap, f)
MiB = 2**20
print(rung, "allocated", m.get("cuda_max_allocated_bytes", 0) / MiB,
      "reserved", m.get("cuda_max_reserved_bytes", 0) / MiB)
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
