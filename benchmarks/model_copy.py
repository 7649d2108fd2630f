"""What does gpu-check save by making its model once and copying it for each run?

    .venv/bin/python benchmarks/model_copy.py                  # Qwen2-0.5B's config: about 2 min here
    .venv/bin/python benchmarks/model_copy.py --model data/configs/gpt2.json --rounds 2

What it counts: the wall time of one load as gpu-check's checks made their model for each ladder rung,
cap trial and auto-fit try until 2026-11-30 (`model_at_hand(cfg)`: a random init from the config),
beside one load of the kept model they use since (`model_at_hand(cfg, keep=True)`: a deep copy of the
model made once, torch's random state restored), each after gc.collect(), in ABBA order (fresh, copy |
copy, fresh | ...) so that neither side always runs second. The kept model's making is timed once,
apart. The figure is a copy's time over a fresh load's (medians of the rounds); a check of N runs
saves about N x fresh - (made + N x copy). On 2026-11-30's card the cap check held 16 loads, the
ladder's 14 (docs/gpu-check.md, "Fitting one call, again").

Last line: `model_copy: VALUE`. A row goes to results/benchmarks.csv with versions and hardware.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from workbench.core.results import append_benchmark_row  # noqa: E402
from workbench.studies.ladder.config import LadderConfig  # noqa: E402
from workbench.studies.ladder.runner import model_at_hand  # noqa: E402

NAME = "model_copy"
VERSION = 1


def timed(load) -> float:
    gc.collect()
    t = time.perf_counter()
    model = load()
    took = time.perf_counter() - t
    del model
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="data/configs/qwen2-0.5b.json", help="a model config (.json): a random init")
    ap.add_argument("--rounds", type=int, default=4, help="fresh/copy pairs (order reversed every round)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.rounds < 1 or args.threads < 1:
        print(f"{NAME}: --rounds and --threads must be at least 1", file=sys.stderr)
        return 2
    if not args.model.endswith(".json") or not Path(args.model).is_file():
        print(f"{NAME}: --model must be a model config file (.json), got {args.model}", file=sys.stderr)
        return 2
    sys.stdout.reconfigure(line_buffering=True)
    torch.set_num_threads(args.threads)
    cfg = LadderConfig(model=args.model, reference_model="")
    fresh = model_at_hand(cfg)[1]
    kept = model_at_hand(cfg, keep=True)[1]
    made = timed(kept)  # the making, and the first copy with it
    if not kept.timings["kept"]:
        print(f"{NAME}: this host has no room for a copy beside the kept model: nothing to compare", file=sys.stderr)
        return 1
    print(f"{NAME} v{VERSION}: {args.model}, {args.rounds} fresh/copy pairs, {args.threads} thread(s), "
          f"load average {os.getloadavg()[0]:.2f}; the kept model made in {kept.timings['made_s']:.1f} s")
    times: dict[str, list[float]] = {"fresh": [], "copy": []}
    order = []
    for r in range(args.rounds):
        for side in (("fresh", "copy") if r % 2 == 0 else ("copy", "fresh")):
            times[side].append(timed(fresh if side == "fresh" else kept))
            order.append(side)
    f, c = statistics.median(times["fresh"]), statistics.median(times["copy"])
    ratio = c / f
    print(f"  fresh loads (s): {', '.join(f'{t:.2f}' for t in times['fresh'])}; median {f:.2f}")
    print(f"  copies (s): {', '.join(f'{t:.2f}' for t in times['copy'])}; median {c:.2f}")
    print(f"  measured in the order: {', '.join(order)}; load average {os.getloadavg()[0]:.2f}")
    print(f"  a check of 16 runs (2026-11-30's cap): {16 * f:.0f} s of loads fresh, "
          f"{kept.timings['made_s'] + 16 * c:.0f} s kept")
    append_benchmark_row({"benchmark": NAME, "version": VERSION, "value": ratio, "unit": "ratio (copy / fresh load)",
                          "fresh_s": f, "copy_s": c, "made_s": kept.timings["made_s"], "first_load_s": made,
                          "rounds": args.rounds, "threads": args.threads,
                          "copies": kept.timings["copies"],  # the kept model's own count: the first, then one a round
                          "detail": f"model={args.model} rounds={args.rounds} threads={args.threads} order=ABBA",
                          "load_avg": os.getloadavg()[0]})
    print(f"{NAME}: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
