"""Does the adaptive split pick a fast k? Study 3's engine at fixed k beside its adaptive run.

    .venv/bin/python benchmarks/split_adaptive.py              # about 20 s on 2 cores
    .venv/bin/python benchmarks/split_adaptive.py --device cuda --iterations 12   # on a card

What it counts: tokens/s of `SplitEngine` on a small random Qwen2 (hidden 256, 6 layers, vocab
4096; batch 4 x 128, fp32, the default torch fused AdamW on the host) at k = 0, k = 1, adaptive and
"adaptive, stages" (the balance as it was until 2026-11-30: the host side taken from its stages'
times, not measured whole as the union of their spans; balance.py). Each adaptive run starts at
k = 0; from the fourth iteration on (index 3), when a backward after warm-up has been measured, k
is recomputed from measured rates, waiting after each move for a row at the new k. Each run takes
`--iterations` steps; the first `--warmup` are left out. The runs go in alternating order, one
round forward and the next reversed (k0, k1, adaptive, stages | stages, adaptive, k1, k0 | ...),
so that a drift of load from other processes hits every run alike; each figure is the median over
the rounds.
It prints, per run, tokens/s and backward time, and for the adaptive run the k it settled on (its
last iteration's k), its tokens/s relative to the faster fixed k, backward's slowdown with every
update on the host as the engine fitted it, and the tokens/s of its measured iterations after its
last move of k (the search left out; the headline ratio keeps it in).

On a CPU-only machine the "accelerator" is the CPU too: this shows what the balance chooses when
the host's work slows backward (here it must, with two cores), not GPU speed. On two cores an
engine whose host worker has run torch's parallel CPU ops stays slower after k reaches 1 (1.37x a
step, measured 2026-11-26; none with OMP_NUM_THREADS=1): the adaptive run's tokens/s after its last
move trail k=1's for that reason too, not only for the k it chose (docs/card-records.md,
2026-11-26).

Last line: `split_adaptive: VALUE` (adaptive tokens/s over the best fixed k's; 1.0 = as fast).
A row goes to results/benchmarks.csv with versions and hardware.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402

from workbench.core.fallback import device_problem  # noqa: E402
from workbench.core.results import append_benchmark_row  # noqa: E402
from workbench.studies.split.adam import AdamHP  # noqa: E402
from workbench.studies.split.engine import SplitEngine  # noqa: E402
from workbench.studies.split.gpu_check import settled  # noqa: E402

NAME = "split_adaptive"
VERSION = 2  # 2: beside the adaptive run, the same with the host side from its stages (the balance until 2026-11-30)
SHAPE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True)


class StagesEngine(SplitEngine):
    """The balance as it was until 2026-11-30: the host side from its stages' sums (the slowest of
    the three where copies run beside the host Adam, all three added on the CPU), not measured whole."""

    def current_rates(self):
        return dataclasses.replace(super().current_rates(), t_host_busy_s=None)


RUNS = {"k=0": dict(k=0.0), "k=1": dict(k=1.0), "adaptive": dict(k=0.0, adaptive=True),
        "adaptive, stages": dict(k=0.0, adaptive=True, engine=StagesEngine)}
ADAPTIVE = ("adaptive", "adaptive, stages")


def one_run(base, batches, warmup: int, engine=None, **kw) -> dict:
    eng = (engine or SplitEngine)(copy.deepcopy(base), hp=AdamHP(lr=1e-4), **kw)
    try:
        for b in batches:
            eng.step(b)
        eng.finish()
        rows = eng.rows[warmup:]
        after = settled(eng.rows, warmup)  # the iterations after the last move of k (adaptive)
    finally:
        eng.close()
    ms = sum(r["iteration_ms"] for r in rows)
    return {"tokens_per_s": sum(r["tokens"] for r in rows) / (ms / 1e3),
            "backward_ms": statistics.median(r["backward_ms"] for r in rows),
            "k_last": rows[-1]["k_actual"], "interference_ms": (rows[-1].get("t_interference_s") or float("nan")) * 1e3,
            "probes": sum(bool(r.get("k_probe")) for r in eng.rows),
            "settled_tokens_per_s": after["settled_tokens_per_s"], "settled_from": after["settled_from"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the four runs (order reversed every round)")
    ap.add_argument("--iterations", type=int, default=10, help="steps per run")
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out (the adaptive run's k settles there)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda")
    args = ap.parse_args()
    if args.iterations <= args.warmup or args.warmup < 0 or args.rounds < 1:
        print("split_adaptive: --iterations must exceed --warmup, --warmup be 0 or more and --rounds at least 1",
              file=sys.stderr)
        return 2
    if why := device_problem(args.device):
        print(f"split_adaptive: --device {args.device}: {why}", file=sys.stderr)
        return 2
    sys.stdout.reconfigure(line_buffering=True)
    device = torch.device(args.device)
    torch.manual_seed(0)
    base = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE))
    base.to(device)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, SHAPE["vocab_size"], (4, 128), generator=g).to(device) for _ in range(args.iterations)]
    print(f"{NAME} v{VERSION}: {sum(p.numel() for p in base.parameters()) / 1e6:.1f}M params, {device}, "
          f"{args.rounds} round(s) x {args.iterations} steps ({args.warmup} warm-up), "
          f"{torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.2f}")
    got: dict[str, list[dict]] = {n: [] for n in RUNS}
    for rnd in range(args.rounds):
        order = list(RUNS) if rnd % 2 == 0 else list(reversed(RUNS))
        for name in order:
            got[name].append(one_run(base, batches, args.warmup, **RUNS[name]))
            r = got[name][-1]
            print(f"  round {rnd + 1} {name:<16} {r['tokens_per_s']:>9,.0f} tokens/s  backward {r['backward_ms']:>7.1f} ms"
                  + (f"  k settled at {r['k_last']:.2f} ({r['probes']} probe(s)); backward's slowdown "
                     f"{r['interference_ms']:.1f} ms; after its last move "
                     + (f"(iteration {r['settled_from']} on) {r['settled_tokens_per_s']:,.0f} tokens/s"
                        if r["settled_tokens_per_s"] else "(not settled)") if name in ADAPTIVE else ""))
    med = {n: statistics.median(r["tokens_per_s"] for r in rs) for n, rs in got.items()}
    best_fixed = max(("k=0", "k=1"), key=med.get)
    ratio = med["adaptive"] / med[best_fixed]
    k_last = [r["k_last"] for r in got["adaptive"]]
    print("  median tokens/s: " + ", ".join(f"{n} {v:,.0f}" for n, v in med.items())
          + f"; adaptive settled at k = {', '.join(f'{k:.2f}' for k in k_last)}; "
          f"{ratio:.3f}x the faster fixed k ({best_fixed}); with the host side from its stages, settled at k = "
          + ", ".join(f"{r['k_last']:.2f}" for r in got["adaptive, stages"])
          + f", {med['adaptive, stages'] / med[best_fixed]:.3f}x; load average {os.getloadavg()[0]:.2f}")
    append_benchmark_row({"benchmark": NAME, "version": VERSION, "value": ratio,
                          "unit": "ratio (adaptive tokens/s over the faster of k=0 and k=1)",
                          "detail": f"rounds={args.rounds} iterations={args.iterations} warmup={args.warmup} "
                                    f"device={device.type} k_last={k_last} best_fixed={best_fixed} "
                                    + " ".join(f"{n}={v:.0f}" for n, v in med.items()),
                          # what each round printed: backward per run, the adaptive run's probes, its slowdown
                          # of backward and its tokens/s after the last move of k (None: it never settled)
                          "rounds_json": json.dumps({n: [{k: r[k] for k in ("tokens_per_s", "backward_ms", "k_last",
                                                                           "probes", "interference_ms",
                                                                           "settled_tokens_per_s", "settled_from")}
                                                         for r in rs] for n, rs in got.items()}),
                          "load_avg": os.getloadavg()[0]})
    print(f"{NAME}: {ratio:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
