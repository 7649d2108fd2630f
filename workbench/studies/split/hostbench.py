"""How fast is a CPU Adam step on this machine, against what its memory can move in Adam's pattern?

    rates = measure_host(numel=16_000_000)   # the study's size; benchmarks/cpu_adam.py uses 50M

An Adam step is memory-bound: per fp32 parameter it reads weight, gradient and two moments
and writes weight and two moments: 7 streams, ADAM_BYTES = 28 bytes. Its effective rate
(28 * numel / step time) is compared with a bandwidth probe that has the same access pattern:
4 read streams (p, g, m, v) and 3 write streams (p, m, v) over the same element count, with
almost no arithmetic. Stock torch has no single elementwise kernel with 4 inputs and 3 outputs,
so the probe walks the arrays in cache-sized blocks and, per block, runs three in-place kernels
(m += g; v += g*g; p += m*v): the first touch of each block brings p, g, m, v from memory once,
the later kernels hit the cache, and each written block leaves once, so memory traffic is
exactly Adam's 16 bytes read + 12 written per element. Several block sizes are tried (small:
more per-call overhead; large: spills the cache) and the best is kept, so the probe is as
bandwidth-efficient as this setup allows. (A compiled single loop over the 7 streams was tried
too: 13.3 GB/s on one core here, no faster than the blocked probe's 13.5, and a 60 s build.)

The share (Adam bytes/s over probe bytes/s) is clipped to 1: a kernel cannot move Adam's bytes
faster than memory delivers them in that pattern, so a raw share above 1 means the probe was
the weaker kernel (its per-block call overhead), not a fast Adam. The raw figure is kept beside
it (`bandwidth_share_raw`) so that a weak probe stays visible.
Each figure is the best of `reps` timed runs after one warm-up run.
"""

from __future__ import annotations

import os
import time

import torch

from workbench.studies.split.adam import AdamHP, ParamAdam

ADAM_BYTES = 28  # fp32: read p, g, m, v (16) + write p, m, v (12), per parameter
ADAM_STREAMS = {"read": ("p", "g", "m", "v"), "write": ("p", "m", "v")}
BLOCKS = (1 << 15, 1 << 16, 1 << 18, 1 << 20)  # elements per block: 4 arrays x 128 KiB .. 4 x 4 MiB


def _best(fn, reps: int) -> float:
    fn()  # warm-up: page faults, state allocation, thread pool start
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _adam_pattern(p, g, m, v, block: int):
    """One pass over p, g, m, v in Adam's access pattern (4 reads, 3 writes per element)."""
    pb, gb, mb, vb = (t.split(block) for t in (p, g, m, v))

    def run():
        for pc, gc, mc, vc in zip(pb, gb, mb, vb):
            mc.add_(gc)  # reads m, g (from memory), writes m (to cache)
            vc.addcmul_(gc, gc)  # reads v (memory), g (cache), writes v
            pc.addcmul_(mc, vc, value=1e-30)  # reads p (memory), m, v (cache), writes p

    return run


def adam_pattern_bandwidth(numel: int, reps: int = 5) -> dict:
    """Bytes/s of the Adam-pattern probe over `numel` fp32 elements (far larger than any cache):
    the best block size, with every block size's figure."""
    # small values: nothing overflows or turns subnormal over many passes
    p, g, m, v = (torch.full((numel,), x) for x in (1.0, 1e-3, 1e-3, 1e-3))
    by_block = {b: ADAM_BYTES * numel / _best(_adam_pattern(p, g, m, v, b), reps) for b in BLOCKS}
    best = max(by_block, key=by_block.get)
    return {"bytes_per_s": by_block[best], "block": best, "by_block": by_block}


def adam_step_time(backend: str, numel: int, tensors: int = 50, reps: int = 5) -> float:
    """Seconds for one AdamW step of `numel` fp32 parameters in `tensors` equal tensors, one
    optimizer per tensor, as the engine steps them."""
    per = numel // tensors
    opts = []
    for i in range(tensors):
        p = torch.zeros(per)
        p.grad = torch.randn(per, generator=torch.Generator().manual_seed(i))
        opts.append(ParamAdam(p, AdamHP(), backend))
    return _best(lambda: [o.step() for o in opts], reps) * numel / (per * tensors)


def share_of(adam_bytes_per_s: float, probe_bytes_per_s: float) -> tuple[float, float]:
    """(share clipped to 1, raw share): see the module docstring for why it is clipped."""
    raw = adam_bytes_per_s / probe_bytes_per_s
    return min(1.0, raw), raw


def measure_host(numel: int = 8_000_000, backend: str = "torch_fused", reps: int = 3) -> dict:
    """This machine's host Adam rate and its Adam-pattern bandwidth, measured now, side by side,
    with the torch threads set by the caller (the study measures one thread: a per-core figure)."""
    probe = adam_pattern_bandwidth(numel, reps)
    t = adam_step_time(backend, numel, reps=reps)
    adam_bps = ADAM_BYTES * numel / t
    share, raw = share_of(adam_bps, probe["bytes_per_s"])
    threads = torch.get_num_threads()
    return {
        "backend": backend,
        "numel": numel,
        "threads": threads,
        "adam_step_s": t,
        "adam_s_per_param": t / numel,
        "adam_bytes_per_s": adam_bps,
        "memory_bytes_per_s": probe["bytes_per_s"],  # Adam-pattern probe (4 reads + 3 writes)
        "probe": "adam pattern (4 read + 3 write streams), best block of " + str(list(BLOCKS)),
        "probe_block": probe["block"],
        "per_core_bytes_per_s": probe["bytes_per_s"] / threads,
        "bandwidth_share": share,
        "bandwidth_share_raw": raw,
        # other processes on the same cores slow the compute-heavier Adam more than the probe
        "load_average_1min": os.getloadavg()[0],
    }
