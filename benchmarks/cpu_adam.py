"""How close does each CPU Adam backend come to this machine's memory bandwidth?

    .venv/bin/python benchmarks/cpu_adam.py                 # 50M parameters, all cores (~20 s)
    .venv/bin/python benchmarks/cpu_adam.py --numel 8000000 # smaller

What it counts: one AdamW step over `numel` fp32 parameters held in 50 equal tensors, one
optimizer per tensor, exactly as the split engine steps them (workbench.offload.adam.ParamAdam).
Effective bytes/s = 28 bytes per parameter (read weight, gradient, two moments; write weight,
two moments) / step time. The bandwidth beside it is the best of three in-place fp32 streaming
kernels over `numel` elements (copy, a += b, a += b * c: 8, 12, 16 bytes per element; see
workbench.offload.hostbench), measured in the same run before and after the backends; the
higher is used, so the share is not flattered by a slow probe.
Every time is the best of `--reps` runs after one warm-up run (state allocation excluded).
Other processes on the same cores slow Adam (compute-heavier) more than the probe: the load
average is printed and recorded.

Last line: `cpu_adam_bandwidth_share: VALUE`, the default backend's (torch_fused) share.
A row goes to results/benchmarks.csv with versions and hardware.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from workbench.offload.adam import backend_status  # noqa: E402
from workbench.offload.hostbench import ADAM_BYTES, adam_step_time, memory_bandwidth  # noqa: E402
from workbench.results import append_benchmark_row  # noqa: E402

NAME = "cpu_adam_bandwidth_share"
VERSION = 2  # bump when the method changes (2: best of three bandwidth probes)
BACKENDS = ("torch_fused", "deepspeed", "torch_single", "torch_foreach")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=50_000_000, help="parameters (default 50M)")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per figure (best is kept)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.numel
    print(f"cpu_adam v{VERSION}: {n / 1e6:.0f}M fp32 parameters in 50 tensors, {args.threads} threads, "
          f"best of {args.reps}; load average {os.getloadavg()[0]:.2f}")

    bw_before = memory_bandwidth(n, args.reps)
    results = {}
    for b in BACKENDS:
        status = backend_status(b)
        if status != "ok":
            print(f"  {b:<14} skipped: {status}")
            results[b] = {"status": status}
            continue
        t = adam_step_time(b, n, reps=args.reps)
        results[b] = {"status": "ok", "step_ms": t * 1e3, "bytes_per_s": ADAM_BYTES * n / t}
        gc.collect()
    bw = max(bw_before, memory_bandwidth(n, args.reps))

    print(f"  memory bandwidth (best streaming probe): {bw / 1e9:.1f} GB/s "
          f"(before {bw_before / 1e9:.1f})")
    print(f"  {'backend':<14} {'step ms':>9} {'GB/s':>7} {'share':>6}")
    for b, r in results.items():
        if r["status"] == "ok":
            r["share"] = r["bytes_per_s"] / bw
            print(f"  {b:<14} {r['step_ms']:9.1f} {r['bytes_per_s'] / 1e9:7.1f} {r['share']:6.2f}")
    share = results["torch_fused"]["share"]
    row = {"benchmark": "cpu_adam", "version": VERSION, "metric": NAME, "value": share,
           "numel": n, "threads": args.threads, "memory_bytes_per_s": bw,
           "load_average_1min": os.getloadavg()[0], "details": json.dumps(results)}
    try:
        import deepspeed

        row["env_deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    if row["load_average_1min"] > (os.cpu_count() or 1) - 0.5:
        print(f"  warning: the machine was busy (load {row['load_average_1min']:.1f} on {os.cpu_count()} cores); "
              "multi-threaded Adam kernels slow down far more than the probe: rerun when idle")
    print(f"  row appended to {append_benchmark_row(row)}")
    print(f"{NAME}: {share:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
