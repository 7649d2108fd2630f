"""How fast is a CPU Adam step on this machine, against what its memory can move?

    rates = measure_host(numel=50_000_000)   # the benchmark's size; the study uses a smaller one

An Adam step is memory-bound: per fp32 parameter it reads weight, gradient and two moments
and writes weight and two moments, ADAM_BYTES = 28 bytes. Its effective rate (28 * numel /
step time) is compared with bandwidth probes that move memory the same way (in-place fp32
streaming kernels: copy, `a += b`, `a += b * c`), in the same process and thread setting.
Each figure is the best of `reps` timed runs after one warm-up run, and the bandwidth is the
best of the three probes (how many streams run at once changes what the cores can pull).
"""

from __future__ import annotations

import os
import time

import torch

from workbench.offload.adam import AdamHP, ParamAdam

ADAM_BYTES = 28  # fp32: read p, g, m, v (16) + write p, m, v (12), per parameter
ADD_BYTES = 12  # a += b: read a, read b, write a (4 + 4 + 4), per element


def _best(fn, reps: int) -> float:
    fn()  # warm-up: page faults, state allocation, thread pool start
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def memory_bandwidth(numel: int, reps: int = 5) -> float:
    """Bytes/s this machine's memory moves for in-place fp32 streaming kernels over `numel`
    elements (far larger than any cache): the best of three probes with 2, 3 and 4 streams
    (copy, a += b, a += b * c), since how many streams run at once changes what one core can
    pull from memory. The best is taken so that Adam's share of it is never flattered."""
    a, b, c = torch.ones(numel), torch.full((numel,), 1e-7), torch.full((numel,), 1.0)
    probes = {
        8: lambda: a.copy_(b),  # read b, write a
        ADD_BYTES: lambda: a.add_(b),  # read a, b, write a
        16: lambda: a.addcmul_(b, c),  # read a, b, c, write a
    }
    return max(nbytes * numel / _best(fn, reps) for nbytes, fn in probes.items())


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


def measure_host(numel: int = 8_000_000, backend: str = "torch_fused", reps: int = 3) -> dict:
    """This machine's host Adam rate and memory bandwidth, measured now, side by side."""
    bw = memory_bandwidth(numel, reps)
    t = adam_step_time(backend, numel, reps=reps)
    adam_bps = ADAM_BYTES * numel / t
    return {
        "backend": backend,
        "numel": numel,
        "threads": torch.get_num_threads(),
        "adam_step_s": t,
        "adam_s_per_param": t / numel,
        "adam_bytes_per_s": adam_bps,
        "memory_bytes_per_s": bw,
        "bandwidth_share": adam_bps / bw,
        # other processes on the same cores slow the compute-heavier Adam more than the probe
        "load_average_1min": os.getloadavg()[0],
    }
