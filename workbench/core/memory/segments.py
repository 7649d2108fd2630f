"""Reserved memory by segment, in the shape `torch.cuda.memory_snapshot()` lists it ("stream",
"total_size" per segment), from a card or from the allocator model's replay alike: per stream,
by size, and where a prediction's segments differ from a card's.

    segment_sizes(torch.cuda.memory_snapshot())          # {"2": 31, "20": 4, "520": 1}: MiB -> count
    segment_difference(predicted, measured)              # "... predicted less measured: -1 x 520 MiB"
"""

from __future__ import annotations

from workbench.core.common import MiB


def reserved_by_stream(segments, names: dict[int, str] | None = None) -> dict:
    """Reserved bytes per stream from segments as `torch.cuda.memory_snapshot()` lists them (each
    with "stream" and "total_size"); `names`: stream -> a name for it (others keep their handle)."""
    out: dict = {}
    for seg in segments:
        key = (names or {}).get(seg["stream"], seg["stream"])
        out[key] = out.get(key, 0) + seg["total_size"]
    return out


def segment_sizes(segments) -> dict[str, int]:
    """{segment size in MiB: how many} from segments as `torch.cuda.memory_snapshot()` lists them
    (each with "total_size"): the reserved bytes by what made them, 2 MiB for small tensors, 20 MiB
    for 1-10 MiB ones, a tensor's own size above. Keys are strings (JSON), in ascending size."""
    out: dict[float, int] = {}
    for seg in segments:
        size = seg["total_size"] / MiB
        out[size] = out.get(size, 0) + 1
    return {f"{k:g}": out[k] for k in sorted(out)}


def segment_difference(predicted: dict[str, int] | None, measured: dict[str, int] | None, top: int = 4) -> str | None:
    """One line: where a reserved miss lies, by segment size (predicted less measured), the sizes
    whose bytes differ most first; sizes in MiB as `segment_sizes` gives them (None if one is missing)."""
    if not predicted or not measured:
        return None
    def total(d):
        return sum(float(k) * n for k, n in d.items())

    diff = {k: predicted.get(k, 0) - measured.get(k, 0) for k in {*predicted, *measured}}
    worst = sorted((k for k, n in diff.items() if n), key=lambda k: -abs(diff[k]) * float(k))[:top]
    head = (f"segments predicted {sum(predicted.values())} ({total(predicted):,.0f} MiB), "
            f"measured {sum(measured.values())} ({total(measured):,.0f} MiB)")
    return head + ("; the same sizes" if not worst else
                   "; predicted less measured: " + ", ".join(f"{diff[k]:+d} x {k} MiB" for k in worst))


def at_oom(trace) -> dict | None:
    """The cache at a run's out-of-memory error, from a `torch.cuda.memory._record_memory_history`
    trace (a snapshot's device_traces[0]); None without an "oom" event. Before it raises, torch gives
    back every wholly free cached segment (release_cached_blocks), so what is left is segments with
    something live in them: each one's size and the bytes live in it (trace events carry the bytes
    asked for, not the rounded blocks), biggest free room first. The question it answers: where a
    capped run failed with reserved memory to spare, which segments held the spare."""
    segs: dict[int, int] = {}
    live: dict[int, int] = {}
    oom = None
    for e in trace:
        act = e["action"]
        if act == "segment_alloc":
            segs[e["addr"]] = e["size"]
        elif act == "segment_free":
            segs.pop(e["addr"], None)
        elif act == "alloc":
            live[e["addr"]] = e["size"]
        elif act == "free_completed":
            live.pop(e["addr"], None)
        elif act == "oom":
            oom = e
            break
    if oom is None:
        return None
    rows = []
    for base, size in segs.items():
        used = sum(n for addr, n in live.items() if base <= addr < base + size)
        rows.append({"size": size, "live": used, "free": size - used})
    rows.sort(key=lambda r: -r["free"])
    return {"requested": oom["size"], "device_free": oom.get("device_free"), "reserved": sum(segs.values()),
            "live": sum(r["live"] for r in rows), "wholly_free": sum(r["size"] for r in rows if not r["live"]),
            "segments": rows}
