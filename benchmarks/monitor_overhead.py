"""What does sampling memory on a background thread cost a training loop?

    .venv/bin/python benchmarks/monitor_overhead.py            # ~30 s idle; minutes when the cores are shared
    .venv/bin/python benchmarks/monitor_overhead.py --rounds 3 # shorter
    .venv/bin/python benchmarks/monitor_overhead.py --device cuda   # on a card (also: workbench gpu-check --only monitor)

What it counts: the wall time of `workbench.core.training.train` on a small random Qwen2 (hidden
128, 4 layers, vocab 2048; batch 8 x 128, fused AdamW; `gpu_programs.monitor_workload`, lengthened
to last about `--run-s` a run, as gpu-check's) on `--device` without and with a MemoryMonitor
sampling every `--interval` s (process RSS via psutil; on a card also NVML and torch's CUDA
counters) and sending each row to a sink. Each run is timed the same way, from outside
(`memory.monitor.overhead`): time.perf_counter around the whole `train` call (with the monitor, its
start and stop included; on CUDA after a synchronize), after gc.collect(). The order alternates ABBA
(off, on | on, off | ...), so neither side always runs second and a linear drift of load from other
processes hits both alike; one untimed warm-up run of each comes first. Threads: by default what a
real study run gets (torch's threads = the cores this process may use, as `workbench sweep` gives a
single worker; study 1 and 2 runs leave torch's default), because the monitor's thread competes with
torch's for the cores. The ratio is the total time with the monitor over the total without, from
this one run. Target: at most 1.01.

Last line: `monitor_overhead: VALUE`.
A row goes to results/benchmarks.csv with versions and hardware.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from workbench.core.fallback import device_problem  # noqa: E402
from workbench.core.memory.monitor import overhead  # noqa: E402
from workbench.core.results import append_benchmark_row  # noqa: E402
from workbench.front.gpu_programs import MONITOR_TARGET, RUN_S, monitor_workload, workload_lasting  # noqa: E402
from workbench.front.sweep import threads_per_worker  # noqa: E402

NAME = "monitor_overhead"
VERSION = 4  # bump when the method changes (2: default interval 0.5 s; 3: ABBA order, a real run's threads;
# 4: each run lengthened to about --run-s, as gpu-check's)
TARGET = MONITOR_TARGET  # at most 1% of a run's time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="off/on pairs (order reversed every round)")
    ap.add_argument("--steps", type=int, default=15, help="training steps per run, at least (see --run-s)")
    ap.add_argument("--run-s", type=float, default=RUN_S, help="lengthen a run to about this many seconds (0: "
                    "--steps as given); 15 steps took 0.3 s on an H200, timing the monitor's start and stop")
    ap.add_argument("--interval", type=float, default=0.5, help="monitor sampling interval (s); at 0.1 s it cost about 4%% here")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the monitor adds NVML and torch's CUDA counters)")
    ap.add_argument("--threads", type=int, default=threads_per_worker(1),
                    help="torch threads (default: what a real run gets, all usable cores)")
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 1 or args.interval <= 0 or args.threads < 1 or args.run_s < 0:
        print(f"{NAME}: --rounds, --steps and --threads must be at least 1, --interval positive and --run-s "
              "0 or more", file=sys.stderr)
        return 2
    if why := device_problem(args.device):
        print(f"{NAME}: --device {args.device}: {why}", file=sys.stderr)
        return 2
    sys.stdout.reconfigure(line_buffering=True)  # keep our lines in order with libraries' stderr warnings
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    params = monitor_workload("meta", 1)[1]
    run, steps = workload_lasting(device, args.steps, args.run_s)  # a run of seconds, not its start and stop
    print(f"{NAME} v{VERSION}: {params / 1e6:.1f}M params, "
          f"{steps} steps x {args.rounds} off/on pairs, interval {args.interval} s, {device}, "
          f"{args.threads} thread(s), load average {os.getloadavg()[0]:.2f}")

    result = overhead(run, device, rounds=args.rounds, interval_s=args.interval, say=print)
    off, on, samples, ratios, ratio = result["off_s"], result["on_s"], result["samples"], result["round_ratios"], result["ratio"]
    print(f"  total off {off:.2f} s, on {on:.2f} s, {samples} samples; median of the rounds' on/off "
          f"{statistics.median(ratios):.3f}; load average {os.getloadavg()[0]:.2f}; target <= {TARGET}: "
          f"{'met' if ratio <= TARGET else 'NOT met'}; the monitor opened, started and stopped around nothing: "
          f"{1e3 * result['start_stop_s']:.1f} ms")
    append_benchmark_row({"benchmark": NAME, "version": VERSION, "value": ratio, "unit": "ratio (with / without monitor)",
                "median_round_ratio": statistics.median(ratios), "threads": args.threads,
                "start_stop_ms": 1e3 * result["start_stop_s"],
                "detail": f"rounds={args.rounds} steps={steps} interval={args.interval} threads={args.threads} order=ABBA "
                          f"device={device.type}",
                "load_avg": os.getloadavg()[0]})
    print(f"{NAME}: {ratio:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
