"""How long does predicting a rung's peak take, without a GPU, for a real model size?

    .venv/bin/python benchmarks/predict_ladder.py                      # Qwen2-0.5B config, 1 x 512, every rung (~2 min)
    .venv/bin/python benchmarks/predict_ladder.py --rungs fp32 lora    # a few rungs
    .venv/bin/python benchmarks/predict_ladder.py --device cuda --model data/configs/qwen2-7b.json --rungs bf16_true_lora
    .venv/bin/python benchmarks/predict_ladder.py --validate           # the validation table (~1.5 min)
    .venv/bin/python benchmarks/predict_ladder.py --cards              # re-predict the card records (~5 min)

What it counts: for each rung, the wall time of one `workbench.core.memory.predict.predict` call on
the Qwen2-0.5B config (data/configs/qwen2-0.5b.json) at batch 1 x seq 512: building the model on
the meta device, applying the rung, and simulating its training steps over fake tensors (two on the
CPU; three for CUDA, whose allocator replay then repeats the last until its cache is steady; for
estimated rungs: the simulation they start from plus the library estimate). One warm-up
prediction (imports, first-call caches) runs first and is not counted. Target: under 30 s each
for the 0.5B config, under 60 s for a 7B one (`--model data/configs/qwen2-7b.json`). `--device
cuda` times the CUDA-modelled prediction (CUDA's choices + the allocator replay).
`--validate` instead predicts every published GPU measurement in workbench.studies.ladder.validation and
writes results/ladder/validation.csv (prediction vs published, error %). `--cards` predicts again,
with this checkout's code, every rung of each committed gpu-check record (data/measured/*/) and
writes repredicted.json beside it, which auto-fit's reserved margin then reads.

Last line: `predict_ladder: VALUE`, the slowest prediction in seconds.
A row goes to results/benchmarks.csv with versions and hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from workbench.core.memory.meta import model_config
from workbench.core.memory.plan import RUNGS
from workbench.core.memory.predict import predict  # noqa: E402
from workbench.core.results import append_benchmark_row  # noqa: E402

NAME = "predict_ladder"
VERSION = 3  # bump when the method changes (2: --device, a 7B target; 3: CUDA simulates 3 steps, replays until steady)
TARGET_S = 30.0
TARGET_7B_S = 60.0



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "data" / "configs" / "qwen2-0.5b.json"), help="config to predict")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rungs", nargs="*", default=list(RUNGS), help="rungs (default: all)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="the device predicted for")
    ap.add_argument("--validate", action="store_true", help="write results/ladder/validation.csv instead")
    ap.add_argument("--cards", action="store_true", help="re-predict the committed card records instead")
    args = ap.parse_args()
    unknown = [r for r in args.rungs if r not in RUNGS]
    if not args.rungs or unknown or args.batch < 1 or args.seq < 1 or args.threads < 1:
        print(f"{NAME}: " + (f"unknown rung(s) {', '.join(unknown)}; known: {', '.join(RUNGS)}" if unknown else
                             "--rungs needs at least one rung" if not args.rungs else
                             "--batch, --seq and --threads must be at least 1"), file=sys.stderr)
        return 2
    sys.stdout.reconfigure(line_buffering=True)  # keep our lines in order with libraries' stderr warnings
    torch.set_num_threads(args.threads)
    if args.cards:
        from workbench.studies.ladder.card_records import CARD_RECORDS, repredict_card_record

        for summary in sorted(CARD_RECORDS.glob("*/summary.json")):
            print(f"{summary.parent.name}:")
            print(f"  wrote {repredict_card_record(summary.parent)}")
        return 0
    if args.validate:
        from workbench.core.results import results_root
        from workbench.studies.ladder.validation import validation_table, write_margins

        out = Path(results_root()) / "ladder" / "validation.csv"
        rows = validation_table(out=out)
        worst = max(abs(r["error_pct"]) for r in rows if r["error_pct"] is not None)  # out-of-memory rows: none
        wrong = [r for r in rows if r["published_gb"] is None and r["predicted_fits"]]
        if wrong:
            print(f"  {len(wrong)} run(s) published as out of memory predicted to fit")
        print(f"  wrote {out} and {write_margins(rows)}")
        print(f"{NAME}_validation: {worst:.1f}")
        return 0
    config = model_config(args.model)
    print(f"{NAME} v{VERSION}: {Path(args.model).name}, batch {args.batch} x seq {args.seq}, "
          f"{args.threads} thread(s), load average {os.getloadavg()[0]:.2f}")
    predict(config, "fp32", batch=1, seq=16, device=args.device)  # warm-up: imports and first-call caches (of
    # the device predicted for: a CUDA path's had fallen in the first rung's time), not counted
    rows = []
    print(f"  {'rung':<20} {'method':<10} {'peak MiB':>10} {'seconds':>8}  where")
    for name in args.rungs:
        t0 = time.perf_counter()
        p = predict(config, name, batch=args.batch, seq=args.seq, device=args.device)
        p.needed_reserved_bytes  # every figure `estimate` prints: the least cap is replayed when first read
        s = time.perf_counter() - t0
        rows.append({"rung": name, "method": p.method, "peak_bytes": p.peak_bytes, "seconds": s})
        print(f"  {name:<20} {p.method:<10} {p.peak_mib:>10,.1f} {s:>8.1f}  {p.where}")
    slowest = max(r["seconds"] for r in rows)
    target = TARGET_7B_S if "7b" in Path(args.model).name.lower() else TARGET_S
    print(f"  slowest prediction {slowest:.1f} s (target < {target:.0f} s): "
          f"{'met' if slowest < target else 'NOT met'}")
    append_benchmark_row({"benchmark": NAME, "version": VERSION, "value": slowest, "unit": "s (slowest prediction)",
                "model": Path(args.model).name, "batch": args.batch, "seq": args.seq, "device": args.device,
                "detail": json.dumps(rows), "load_avg": os.getloadavg()[0]})
    print(f"{NAME}: {slowest:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
