"""What does sampling memory on a background thread cost a training loop?

    .venv/bin/python benchmarks/monitor_overhead.py            # ~40 s
    .venv/bin/python benchmarks/monitor_overhead.py --rounds 3 # shorter

What it counts: the wall time of `workbench.training.train` on a small random Qwen2 (hidden
128, 4 layers, vocab 2048; batch 8 x 128, fused AdamW, CPU) without and with a MemoryMonitor
sampling every `--interval` s (process RSS via psutil; NVML too where a driver exists) and
sending each row to a sink. Runs alternate (off, on, off, on, ...) so that load from other
processes hits both alike; one warm-up run is excluded. The ratio is the total time with the
monitor over the total without, from this one run. Target: at most 1.01.

Last line: `monitor_overhead: VALUE`.
A row goes to results/benchmarks.csv with versions and hardware.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from workbench.memory.monitor import MemoryMonitor  # noqa: E402
from workbench.results import append_benchmark_row  # noqa: E402
from workbench.training import TrainSettings, train  # noqa: E402

NAME = "monitor_overhead"
VERSION = 2  # bump when the method changes (2: default interval 0.5 s)
TARGET = 1.01



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="off/on pairs")
    ap.add_argument("--steps", type=int, default=15, help="training steps per run")
    ap.add_argument("--interval", type=float, default=0.5, help="monitor sampling interval (s); at 0.1 s it cost about 4%% here")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # keep our lines in order with libraries' stderr warnings
    torch.set_num_threads(args.threads)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    blocks = torch.randint(0, 2048, (256, 128), generator=torch.Generator().manual_seed(0))
    settings = TrainSettings(steps=args.steps, micro_batch=8, lr=1e-4)
    print(f"{NAME} v{VERSION}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{args.steps} steps x {args.rounds} off/on pairs, interval {args.interval} s, "
          f"{args.threads} thread(s), load average {os.getloadavg()[0]:.2f}")
    train(model, blocks, settings)  # warm-up: allocation, kernel selection; not counted
    off, on, samples = 0.0, 0.0, 0
    for i in range(args.rounds):
        t0 = time.perf_counter()
        train(model, blocks, settings)
        a = time.perf_counter() - t0
        rows = []
        t0 = time.perf_counter()
        with MemoryMonitor("cpu", interval_s=args.interval, sinks=[rows.append]):
            train(model, blocks, settings)
        b = time.perf_counter() - t0
        off, on, samples = off + a, on + b, samples + len(rows)
        print(f"  round {i + 1}: off {a:.2f} s, on {b:.2f} s ({len(rows)} samples)")
    ratio = on / off
    print(f"  total off {off:.2f} s, on {on:.2f} s, {samples} samples; target <= {TARGET}: "
          f"{'met' if ratio <= TARGET else 'NOT met'}")
    append_benchmark_row({"benchmark": NAME, "version": VERSION, "value": ratio, "unit": "ratio (with / without monitor)",
                "detail": f"rounds={args.rounds} steps={args.steps} interval={args.interval}",
                "load_avg": os.getloadavg()[0]})
    print(f"{NAME}: {ratio:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
