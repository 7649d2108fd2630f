"""Is an engine moved from k=0 to k=1 slower per step than one at k=1 from the start?

    .venv/bin/python benchmarks/split_moved_k.py               # about 2 min on 2 cores
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/split_moved_k.py

docs/card-records.md (study 3, 2026-11-26) reports that on this machine's two cores a
CPU engine moved from k=0 to k=1 at its fourth step ran 1.37x slower per step than one at k=1 from
the start (steps 7-12), and no slower with OMP_NUM_THREADS=1. That was measured once, by hand. This
script repeats the measurement so that it can be checked: study 3's `SplitEngine` on the small
random Qwen2 of `split_adaptive.py`, batch 4 x 128, fp32. "moved" runs every update on the host
(k=0) until `--move-at`, then `set_k(1.0)` (every update on the accelerator, here the CPU too);
"fresh" runs at k=1 throughout. Each figure is the median of the engine's own `iteration_ms` over
steps `--from-step` onward. The runs alternate, one round moved first and the next fresh first,
and each ratio is a median over the rounds.

Last line: `split_moved_k: VALUE` (moved ms a step over fresh ms a step; 1.0 = no slowdown).
A row goes to results/benchmarks.csv with versions, hardware and OMP_NUM_THREADS.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks.split_adaptive import SHAPE  # noqa: E402
from workbench.core.results import append_benchmark_row  # noqa: E402
from workbench.studies.split.adam import AdamHP  # noqa: E402
from workbench.studies.split.engine import SplitEngine  # noqa: E402

NAME = "split_moved_k"
VERSION = 1


def one_run(base, batches, *, moved: bool, move_at: int, from_step: int) -> float:
    """Median ms a step of one engine over steps `from_step` on."""
    eng = SplitEngine(copy.deepcopy(base), hp=AdamHP(lr=1e-4), k=0.0 if moved else 1.0)
    try:
        for i, b in enumerate(batches):
            if moved and i == move_at:
                eng.set_k(1.0)
            eng.step(b)
        eng.finish()
        rows = eng.rows[from_step:]
        if not all(r["k_actual"] == 1.0 for r in rows):  # a check that `python -O` does not drop
            raise RuntimeError(f"the timed steps must all be at k=1, got {[r['k_actual'] for r in rows]}")
    finally:
        eng.close()
    return statistics.median(r["iteration_ms"] for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds of the two runs (order reversed every round)")
    ap.add_argument("--steps", type=int, default=13, help="steps per run")
    ap.add_argument("--move-at", type=int, default=3, help="the step (from 0) at which 'moved' goes to k=1")
    ap.add_argument("--from-step", type=int, default=7, help="the first step timed")
    args = ap.parse_args()
    if not (0 < args.move_at < args.from_step < args.steps) or args.rounds < 1:
        print("split_moved_k: need 0 < --move-at < --from-step < --steps and --rounds >= 1", file=sys.stderr)
        return 2
    sys.stdout.reconfigure(line_buffering=True)
    torch.manual_seed(0)
    base = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, SHAPE["vocab_size"], (4, 128), generator=g) for _ in range(args.steps)]
    omp = os.environ.get("OMP_NUM_THREADS", "unset")
    print(f"{NAME} v{VERSION}: {sum(p.numel() for p in base.parameters()) / 1e6:.1f}M params, {args.rounds} round(s) "
          f"x {args.steps} steps (moved at {args.move_at}, timed from {args.from_step}), "
          f"{torch.get_num_threads()} thread(s), OMP_NUM_THREADS {omp}, load average {os.getloadavg()[0]:.2f}")
    ms: dict[str, list[float]] = {"moved": [], "fresh": []}
    for rnd in range(args.rounds):
        for name in (("moved", "fresh") if rnd % 2 == 0 else ("fresh", "moved")):
            ms[name].append(one_run(base, batches, moved=name == "moved", move_at=args.move_at,
                                    from_step=args.from_step))
            print(f"  round {rnd + 1} {name:<6} {ms[name][-1]:>7.1f} ms a step")
    ratio = statistics.median(m / f for m, f in zip(ms["moved"], ms["fresh"]))
    print(f"  median ms a step: moved {statistics.median(ms['moved']):.1f}, fresh {statistics.median(ms['fresh']):.1f};"
          f" moved / fresh {ratio:.3f} (per round: {', '.join(f'{m / f:.2f}' for m, f in zip(ms['moved'], ms['fresh']))})"
          f"; load average {os.getloadavg()[0]:.2f}")
    append_benchmark_row({"benchmark": NAME, "version": VERSION, "value": ratio,
                          "unit": "ratio (ms a step at k=1 after a move from k=0, over ms a step at k=1 throughout)",
                          "detail": f"rounds={args.rounds} steps={args.steps} move_at={args.move_at} "
                                    f"from_step={args.from_step} omp_num_threads={omp} "
                                    f"moved_ms={[round(m, 1) for m in ms['moved']]} "
                                    f"fresh_ms={[round(f, 1) for f in ms['fresh']]}",
                          "load_avg": os.getloadavg()[0]})
    print(f"{NAME}: {ratio:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
