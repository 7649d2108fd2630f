"""How much does the workbench's training loop cost over a bare PyTorch loop, and how much does
the live-bytes hook that every study 1 run carries on the CPU add on top?

    .venv/bin/python benchmarks/loop_overhead.py              # default: 4 rounds x 6 steps per run (~20 s idle; minutes when the cores are shared)
    .venv/bin/python benchmarks/loop_overhead.py --rounds 2   # quicker

Three loops train the same model (the embedded base's architecture, random weights) on the same
batches with the same fused AdamW and gradient clipping:
- bare:   the minimum (forward, backward, clip, step, zero_grad, loss.item());
- ours:   workbench.core.training.train, which also samples blocks, sets the learning rate,
          accumulates the loss and emits one row per step to a sink;
- hooked: `ours` inside `device_budget("cpu", --budget-mib)`, exactly as workbench.core.fallback runs a
          study 1 attempt on the CPU: a LiveBytes TorchDispatchMode sees every op, counts each
          storage once and checks the budget; the model is tracked first and each row reads the
          live count as its memory figure. (On the CPU the hook is there with or without a budget.)

Timing is the same for all three, from outside: time.perf_counter around the whole call of the
loop (optimizer creation and the first step's state allocation included, as a real run pays
them), with a fresh deep copy of one model and gc.collect() before each call, outside the timer.
The context's enter/exit (once per attempt, not per step) is outside the timer too. One
untimed run of each loop first absorbs one-time costs (lazy imports, kernel selection). Then in
each round the three run in order bare, ours, hooked and in the next round reversed (ABBA), so a
linear drift of this shared machine hits every pair alike. All loops run in this one process with
the same torch thread count: by default what a real study run gets (all cores this process may
use, as `workbench sweep` gives a single worker); CPU time, so no device sync is needed.

Figures (ratios of total seconds over all rounds; the median of the rounds' ratios is printed and
recorded beside each, a check on bursts of load from other processes):
    live_bytes_hook_overhead = hooked / ours   (the played budget's cost, printed second to last)
    loop_overhead            = ours / bare     (last line: `loop_overhead: VALUE`; target <= 1.03)
Both go to results/benchmarks.csv, one row each, with versions and hardware.
Version 3: both loops timed from outside around the whole call (v2 timed the bare loop per step
and read the workbench loop's own step_ms, and dropped 2 warm-up steps per run); the hook figure.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from workbench.core.memory.budget import device_budget  # noqa: E402
from workbench.core.models import EmbeddedSpec  # noqa: E402
from workbench.core.results import append_benchmark_row  # noqa: E402
from workbench.core.training import BlockSampler, TrainSettings, train  # noqa: E402
from workbench.front.sweep import threads_per_worker  # noqa: E402

VERSION = 3  # bump when the method changes (3: all loops timed from outside; live-bytes hook figure)
TARGET = 1.03
ARMS = ("bare", "ours", "hooked")


def build(spec: EmbeddedSpec):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                      num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                      num_key_value_heads=spec.num_kv_heads, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


def bare_loop(model, batches, lr) -> float:
    """The minimum loop; returns the last loss (to check that it did the same work as ours)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0, fused=True)
    model.train()
    for x in batches:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        last = loss.item()
    return last


def timed(fn) -> tuple[float, float]:
    """(seconds, last loss) of one whole call: the one timer every loop gets."""
    gc.collect()  # garbage of the previous run is collected here, not inside whichever loop comes next
    t0 = time.perf_counter()
    last = fn()
    return time.perf_counter() - t0, last


def run_arm(arm: str, base, blocks, batches, settings, budget_mib: float | None) -> tuple[float, float]:
    model = copy.deepcopy(base)  # outside the timer
    rows: list[dict] = []
    if arm == "bare":
        return timed(lambda: bare_loop(model, batches, settings.lr))
    if arm == "ours":
        return timed(lambda: train(model, blocks, settings, device="cpu", sinks=[rows.append]).final_loss)
    with device_budget("cpu", budget_mib) as budget:  # as workbench.core.fallback._run_one does
        budget.track_module(model)  # as workbench.studies.strategies.runner's job does after loading
        return timed(lambda: train(model, blocks, settings, device="cpu", sinks=[rows.append],
                                   memory_probe=lambda: budget.current_mib).final_loss)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per run (all timed)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of one run per loop (order reversed every round)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (study 1's micro_batch)")
    ap.add_argument("--budget-mib", type=float, default=4096.0,
                    help="played budget of the hooked loop: large enough never to trip (0 = none; the hook runs either way)")
    ap.add_argument("--threads", type=int, default=threads_per_worker(1),
                    help="torch threads for all loops (default: what a real run gets, all usable cores)")
    args = ap.parse_args()
    if min(args.steps, args.rounds, args.batch, args.threads) < 1 or args.budget_mib < 0:
        print("loop_overhead: --steps, --rounds, --batch and --threads must be at least 1, --budget-mib 0 or more",
              file=sys.stderr)
        return 2
    sys.stdout.reconfigure(line_buffering=True)  # keep our lines in order with libraries' stderr warnings
    torch.set_num_threads(args.threads)
    spec = EmbeddedSpec()
    base = build(spec)
    settings = TrainSettings(steps=args.steps, micro_batch=args.batch, lr=1e-3, schedule="constant", seed=0)
    budget_mib = args.budget_mib or None
    # The exact batches the workbench loop will draw, so all loops see the same data.
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, spec.vocab_size, (args.steps * args.batch, spec.seq_len), generator=g)
    sampler = BlockSampler(len(blocks), settings.seed)
    batches = [blocks[sampler.take(args.batch)] for _ in range(args.steps)]
    print(f"loop_overhead v{VERSION}: {sum(p.numel() for p in base.parameters()) / 1e6:.1f}M params, "
          f"batch {args.batch}x{spec.seq_len}, {args.steps} steps per run, {args.rounds} rounds, "
          f"{torch.get_num_threads()} torch thread(s), load average {os.getloadavg()[0]:.2f}")

    losses = {arm: run_arm(arm, base, blocks, batches, settings, budget_mib)[1] for arm in ARMS}  # warm-up, not counted
    spread = max(losses.values()) - min(losses.values())
    if spread > 1e-3:  # the loops must do the same work for the ratio to mean anything
        print(f"  WARNING: the loops' last losses differ by {spread:.2e}: {losses}")
    total = dict.fromkeys(ARMS, 0.0)
    per_round: dict[str, list[float]] = {"loop": [], "hook": []}  # for the median, a check on bursts of load
    for r in range(args.rounds):
        secs = {}
        for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):  # ABBA: bare, ours, hooked | hooked, ours, bare
            secs[arm] = run_arm(arm, base, blocks, batches, settings, budget_mib)[0]
            total[arm] += secs[arm]
        per_round["loop"].append(secs["ours"] / secs["bare"])
        per_round["hook"].append(secs["hooked"] / secs["ours"])
        print("  round {}: ".format(r + 1) + ", ".join(f"{a} {secs[a] / args.steps * 1e3:.1f}" for a in ARMS)
              + f" ms/step (ours/bare {secs['ours'] / secs['bare']:.3f}, hooked/ours {secs['hooked'] / secs['ours']:.3f})")
    ratio = total["ours"] / total["bare"]
    hook = total["hooked"] / total["ours"]
    steps = args.steps * args.rounds
    ms = {a: total[a] / steps * 1e3 for a in ARMS}
    load = os.getloadavg()[0]
    med = {k: statistics.median(v) for k, v in per_round.items()}
    print(f"  {steps} timed steps per loop: bare {ms['bare']:.1f}, ours {ms['ours']:.1f}, hooked {ms['hooked']:.1f} "
          f"ms/step; medians of the rounds' ratios: ours/bare {med['loop']:.3f}, hooked/ours {med['hook']:.3f}; "
          f"last losses agree to {spread:.1e}; load average {load:.2f}; "
          f"loop target <= {TARGET}: {'met' if ratio <= TARGET else 'NOT met'}")
    common = {"version": VERSION, "steps": steps, "rounds": args.rounds, "batch": args.batch, "threads": args.threads,
              "bare_ms_per_step": ms["bare"], "workbench_ms_per_step": ms["ours"], "hooked_ms_per_step": ms["hooked"],
              "load_avg": load}
    append_benchmark_row({"benchmark": "live_bytes_hook_overhead", "value": hook, "median_round_ratio": med["hook"],
                          "unit": "ratio (workbench loop with / without the LiveBytes hook)",
                          "detail": f"device_budget('cpu', {budget_mib}) around train, model tracked", **common})
    append_benchmark_row({"benchmark": "loop_overhead", "value": ratio, "median_round_ratio": med["loop"],
                          "unit": "ratio (workbench loop / bare loop)", **common})
    print(f"live_bytes_hook_overhead: {hook:.4f}")
    print(f"loop_overhead: {ratio:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
