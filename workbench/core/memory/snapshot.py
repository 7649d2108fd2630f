"""A memory snapshot without a GPU: a step's allocation timeline in the format pytorch.org/memory_viz reads.

    from workbench.core.memory.snapshot import predicted_snapshot, dump
    dump(predicted_snapshot("data/configs/qwen2-0.5b.json", "bf16", batch=1, seq=512), "step.pickle")
    # or: workbench estimate --model ... --snapshot step.pickle

The file is what `torch.cuda.memory._dump_snapshot` writes (a pickled dict with `segments` and
`device_traces`; torch/cuda/_memory_viz.py reads it, and so does the web viewer). Every allocation
and free of the accounted step is replayed through the caching-allocator model
(workbench.core.memory.allocator.CachingAllocator), which gives each block its segment and address;
each event's frame names the phase, the aten op and the category (weights, gradients, ...).
As on a card, trace events and blocks' `requested_size` carry the bytes asked for and blocks their
rounded size (CUDACachingAllocator records `orig_size`): the viewer's timeline peaks at the bytes
asked for, a little below `max_memory_allocated`, and shows each block's rounding loss.
The addresses are the model's, not a card's. A measured CPU step exports the same
(`snapshot_from_report` of a `MemoryAccounting(..., timeline=True)` report): its tensors were real,
the addresses still come from the allocator model.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any


from workbench.core.config import ConfigError
from workbench.core.files import atomic_write_bytes
from workbench.core.memory import cuda_model
from workbench.core.memory.accounting import EMPTY_CACHE, MemoryReport
from workbench.core.memory.allocator import CachingAllocator
from workbench.core.memory.meta import model_config
from workbench.core.memory.offload import SIMULATED_PLACEMENTS, simulate_placed
from workbench.core.memory.plan import rung
from workbench.core.memory.predict import CUDA_STEPS, simulate


def snapshot_from_report(report: MemoryReport, extra_allocs=()) -> dict[str, Any]:
    """The `_dump_snapshot` dict of an accounted run's timeline (device 0; the default stream, and
    a library's side streams where the report names them: `timeline_streams`). `extra_allocs`: as
    allocator.replay takes them, (name, bytes) made before the step or (name, bytes, i) made right
    after timeline event i (a fresh process's cuBLAS workspaces: cuda_model.workspaces_in)."""
    if report.timeline is None:
        raise ValueError("this report has no timeline: account the step with MemoryAccounting(timeline=True)")
    a = CachingAllocator()
    trace: list[dict[str, Any]] = []
    live: dict[Any, tuple] = {}  # key -> (block, frames, the bytes asked for: the block is rounded up)
    streams = report.timeline_streams or {}

    def alloc(key, nbytes, frames):
        stream = streams.get(key, 0)
        b = a.malloc(nbytes, stream)
        if a.new_segment:
            trace.append({"action": "segment_alloc", "addr": a.bases[b.seg], "size": a.new_segment, "stream": stream,
                          "frames": frames})
        live[key] = (b, frames, nbytes)
        # as the card's trace does: events carry the size asked for, the block its rounded size
        trace.append({"action": "alloc", "addr": a.address(b), "size": nbytes, "stream": stream, "frames": frames})

    after: dict[int, list] = {}
    for j, (name, nbytes, *at) in enumerate(extra_allocs):
        frames = [{"filename": "workspace", "line": 0, "name": name}]
        if at and at[0] is not None:
            after.setdefault(at[0], []).append((("extra", j), nbytes, frames))
        else:
            alloc(("extra", j), nbytes, frames)
    roles, ops = report.timeline_roles or {}, report.timeline_ops or [""] * len(report.timeline)
    outside = report.host_serials | report.paged_serials  # not the card's allocator's (as allocator.replay's `outside`)
    for i, ((serial, nbytes), op, step) in enumerate(zip(report.timeline, ops, report.timeline_steps)):
        if nbytes == EMPTY_CACHE:
            before = [(seg, base, total) for seg, base, total, _ in a.segment_blocks()]
            a.release_cached()
            kept = {seg for seg, *_ in a.segment_blocks()}
            trace.extend({"action": "segment_free", "addr": base, "size": total, "stream": seg[1], "frames": []}
                         for seg, base, total in before if seg not in kept)
        elif nbytes >= 0 and serial not in outside:
            frames = [{"filename": roles.get(serial, "temporaries"), "line": step + 1, "name": op or "setup"}]
            alloc(serial, nbytes, frames)
        elif serial in live:
            b, frames, asked = live.pop(serial)
            for action in ("free_requested", "free_completed"):
                trace.append({"action": action, "addr": a.address(b), "size": asked, "stream": b.seg[1],
                              "frames": frames})
            a.free(b)
        for key, n, frames in after.pop(i, ()):  # made right after this event, as replay makes them
            alloc(key, n, frames)
    held = {id(b): (frames, asked) for b, frames, asked in live.values()}
    segments = []
    for seg, base, total, blocks in a.segment_blocks():
        out_blocks = []
        for b in blocks:
            frames, asked = held.get(id(b), ([], 0))  # a free block: neither
            out_blocks.append({"address": base + b.offset, "size": b.size, "requested_size": asked,
                               "state": "inactive" if b.free else "active_allocated", "frames": frames})
        segments.append({"device": 0, "address": base, "total_size": total, "stream": seg[1],
                         "segment_type": "small" if seg[0] else "large",
                         "allocated_size": sum(x["size"] for x in out_blocks if x["state"] == "active_allocated"),
                         "active_size": sum(x["size"] for x in out_blocks if x["state"] == "active_allocated"),
                         "requested_size": sum(x["requested_size"] for x in out_blocks), "blocks": out_blocks})
    return {"segments": segments, "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "note": "modelled by workbench.core.memory.allocator"}}


def predicted_snapshot(model, plan, *, batch: int, seq: int, steps: int = CUDA_STEPS, card=None) -> dict[str, Any]:
    """Simulate `plan` for a CUDA card (the steps `predict` simulates for one) and return its snapshot
    (cuBLAS workspaces included, made where a fresh process makes them, as `predict` places them)."""

    c = cuda_model.card(card) or cuda_model.Card("", 0, cuda_model.DEFAULT_SM)
    plan = rung(plan)
    if plan.placement == "cpu":  # its step is predicted on the host, with no allocator: no card timeline
        raise ConfigError(f"a memory snapshot is the card's timeline, and the {plan.name} rung trains on the CPU with "
                          "nothing on the card; pick a setup that trains on the card")
    if plan.placement in SIMULATED_PLACEMENTS:  # the card's share of an offload rung
        report = simulate_placed(model_config(model), plan, batch=batch, seq=seq, steps=steps, target="cuda", sm=c.sm,
                                 card_bytes=c.usable_bytes if c.total_bytes else None).device
    else:
        report = simulate(model_config(model), plan, batch=batch, seq=seq, steps=steps, target="cuda", sm=c.sm)
    return snapshot_from_report(report, cuda_model.workspaces_in(c, report.timeline_ops))


def dump(snapshot: dict[str, Any], path: str | Path) -> Path:
    """Write it as `torch.cuda.memory._dump_snapshot` does (a pickle)."""
    return atomic_write_bytes(path, pickle.dumps(snapshot))  # a kill part-way left a torn pickle
