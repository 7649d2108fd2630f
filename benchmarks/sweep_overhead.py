"""What does one run of a papermill sweep cost beyond the notebook's own work?

    python benchmarks/sweep_overhead.py               # 8 runs of a trivial notebook, 1 worker
    python benchmarks/sweep_overhead.py --runs 4      # quicker

A trivial notebook (a parameters cell and one line of arithmetic) is swept over --runs points
through the whole sweep machinery (workbench.front.sweep.run_sweep: validation, a Dask LocalCluster
of --workers processes, papermill in those workers, a fresh kernel per run, status files, the runs
table), into a temporary folder. What it counts:
- wall: time.perf_counter around run_sweep, so it includes starting the Dask cluster and the
  workers' one-time papermill import, amortised over the runs (a sweep pays them once);
- compute: the sum of the executed notebooks' cell durations as papermill recorded them;
- per-run steady state: each run's own seconds (from its status.json) minus its compute: kernel
  start, kernel imports, papermill's execution and saving, the status write.

Last line: `sweep_overhead: VALUE` = (wall - compute) / runs, in seconds per run. Target: under 5 s
on this 2-core machine. Version 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

NAME, VERSION = "sweep_overhead", 2  # v2: worker-seconds, so a figure at 2 workers is not halved
TARGET_S = 5.0  # seconds of overhead per run


def trivial_notebook(path: Path) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("x = 0", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("y = x + 1")]
    nbformat.write(nb, path)
    return path


def cell_seconds(executed: Path) -> float:
    """The notebook's own compute: papermill's recorded duration of every cell."""
    nb = json.loads(executed.read_text())
    return sum(c.get("metadata", {}).get("papermill", {}).get("duration") or 0.0 for c in nb["cells"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=8, help="points of the sweep (default 8)")
    ap.add_argument("--workers", type=int, default=1, help="parallel workers (default 1: per-run cost)")
    args = ap.parse_args()
    if args.runs < 1 or args.workers < 1:
        print(f"{NAME}: --runs and --workers must be at least 1", file=sys.stderr)
        return 2
    sys.stdout.reconfigure(line_buffering=True)  # keep our lines in order with libraries' stderr warnings

    import papermill  # noqa: F401  (the sweeping process imports it once; not part of a run)

    from workbench.core.results import append_benchmark_row
    from workbench.front.sweep import run_sweep

    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):
        print(f"warning: load average {load:.1f} on {os.cpu_count()} cores; figures will be high", flush=True)
    with tempfile.TemporaryDirectory(prefix="sweep-overhead-") as tmp:
        tmp = Path(tmp)
        nb = trivial_notebook(tmp / "trivial.ipynb")
        points = [{"x": i} for i in range(args.runs)]
        t0 = time.perf_counter()
        df = run_sweep(nb, points, workers=args.workers, out=tmp / "sweep", progress=False)
        wall = time.perf_counter() - t0
        if (df.status != "ok").any():
            raise SystemExit(f"sweep runs failed: {df.error.dropna().tolist()}")
        compute = [cell_seconds(Path(p)) for p in df.notebook]
        steady = [s - c for s, c in zip(df.seconds, compute)]
    # seconds of a worker per run beyond the notebooks' own work: the wall time of every worker (with more
    # than one, runs overlap, and wall less summed compute had read about halved at 2 workers)
    overhead = (wall * args.workers - sum(compute)) / args.runs
    print(f"{args.runs} runs, {args.workers} worker(s): wall {wall:.2f} s, notebook compute {sum(compute):.3f} s")
    print(f"per run: wall {wall / args.runs:.2f} s; steady state (kernel start + papermill) median "
          f"{statistics.median(steady):.2f} s, min {min(steady):.2f} s, max {max(steady):.2f} s")
    print(f"one-time and between runs (Dask cluster start and stop, papermill import, tables), in worker-seconds: "
          f"{wall * args.workers - sum(df.seconds):.2f} s")
    append_benchmark_row({"benchmark": NAME, "version": VERSION, "value": overhead,
                          "unit": "s per run" if args.workers == 1 else f"worker-s per run ({args.workers} workers)",
                          "engine": "dask LocalCluster", "runs": args.runs, "workers": args.workers,
                          "wall_s": wall, "steady_median_s": statistics.median(steady), "load_avg": load,
                          "target": TARGET_S, "target_met": overhead < TARGET_S})
    print(f"target < {TARGET_S:g} s per run: {'met' if overhead < TARGET_S else 'NOT met'}")
    print(f"{NAME}: {overhead:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
