"""`workbench estimate`: will this fine-tune fit? Memory prediction from a config, no GPU needed.

    workbench estimate --model data/configs/qwen2-0.5b.json --batch 1 --seq 512 --rung bf16_ckpt
    workbench estimate --model data/configs/qwen2-0.5b.json --rung all --json
    workbench estimate --model data/configs/qwen2-0.5b.json --auto-fit --budget-mib 6144

MODEL is a hub id, a local model directory or a config.json file (the hub may be unreachable:
a config file always works). The breakdown is printed as a table, or as JSON with bytes.
"""

from __future__ import annotations

import argparse
import json
import sys

from workbench.config import ConfigError
from workbench.memory.ladder import RUNGS

MiB = 2**20


def register(sub) -> None:
    rung_lines = "\n".join(f"  {n:<20} tier {p.tier}: {p.help}" for n, p in RUNGS.items())
    p = sub.add_parser(
        "estimate",
        help="predict the peak device memory of a training step (no GPU, no weights needed)",
        description="Predict the steady-state peak device memory of a fine-tuning step by running the "
        "real training step on fake tensors, per category (weights, gradients, optimizer state, "
        "activations, temporaries).",
        epilog=f"rungs (--rung):\n{rung_lines}\n  {'all':<20} every rung",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="hub id, model directory or config.json file")
    p.add_argument("--batch", type=int, default=1, help="sequences per optimizer step (default 1)")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence (default 512)")
    p.add_argument("--rung", default="fp32", metavar="RUNG", help="a rung name (listed below) or 'all'")
    p.add_argument("--steps", type=int, default=2, help="steps to simulate; the last is reported (>= 2)")
    p.add_argument("--budget-mib", type=float, default=None, help="device budget in MiB: say whether it fits")
    p.add_argument("--auto-fit", action="store_true", help="pick the fastest rung predicted to fit --budget-mib")
    p.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")
    p.set_defaults(func=_estimate)


def _check(args) -> list[str]:
    if args.rung != "all" and args.rung not in RUNGS:
        raise ConfigError(f"unknown rung {args.rung!r}; known rungs: {', '.join(RUNGS)}, all")
    for name in ("batch", "seq"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if args.steps < 2:
        raise ConfigError(f"--steps must be at least 2 (the steady state starts at step 2), got {args.steps}")
    if args.budget_mib is not None and not args.budget_mib > 0:
        raise ConfigError(f"--budget-mib must be a positive number of MiB, got {args.budget_mib}")
    if args.auto_fit and args.budget_mib is None:
        raise ConfigError("--auto-fit needs --budget-mib")
    return list(RUNGS) if (args.rung == "all" or args.auto_fit) else [args.rung]


def _estimate(args) -> int:
    from workbench.memory.predict import model_config, predict
    from workbench.models import ModelNotFoundError

    names = _check(args)
    try:
        config = model_config(args.model)
    except ModelNotFoundError as e:
        print(f"workbench estimate: {e}", file=sys.stderr)
        return 2
    preds = {n: predict(config, n, batch=args.batch, seq=args.seq, steps=args.steps) for n in names}
    budget = int(args.budget_mib * MiB) if args.budget_mib else None
    choice = None
    if args.auto_fit:
        from workbench.memory.ladder import auto_fit

        choice = auto_fit(config, batch=args.batch, seq=args.seq, budget_mib=args.budget_mib, predictions=preds)
    if args.json:
        out = {
            "model": args.model, "batch": args.batch, "seq": args.seq, "budget_bytes": budget,
            "predictions": [
                {**{k: v for k, v in p.row().items() if k != "model"},
                 "breakdown_bytes": p.breakdown, "peak_bytes": p.peak_bytes,
                 "fits": None if budget is None else p.fit_bytes <= budget}
                for p in preds.values()
            ],
        }
        if choice is not None:
            out["auto_fit"] = choice.rung
        print(json.dumps(out, indent=2))
        return 0
    print(f"model {args.model}  batch {args.batch} x seq {args.seq}"
          + (f"  budget {args.budget_mib:.0f} MiB" if budget else ""))
    if len(preds) == 1:
        p = next(iter(preds.values()))
        print(f"rung {p.rung}: {p.method} peak {p.peak_mib:,.1f} MiB ({p.peak_bytes:,} bytes) at {p.where}"
              f"  [{p.seconds:.1f} s]")
        for c, b in p.breakdown.items():
            print(f"  {c:<16} {b / MiB:>12,.1f} MiB")
        if p.note:
            print(f"  note: {p.note}")
        if budget:
            print(f"  fits {args.budget_mib:.0f} MiB: {'yes' if p.fit_bytes <= budget else 'no'}")
        return 0
    head = f"{'rung':<20} {'method':<10} {'peak MiB':>10} " + " ".join(f"{c[:10]:>10}" for c in p_cats())
    print(head + ("   fits" if budget else ""))
    for p in preds.values():
        line = f"{p.rung:<20} {p.method:<10} {p.peak_mib:>10,.1f} " + " ".join(
            f"{p.breakdown.get(c, 0) / MiB:>10,.1f}" for c in p_cats())
        if budget:
            line += f"   {'yes' if p.fit_bytes <= budget else 'no'}"
        print(line)
    notes = [f"  {p.rung}: {p.note}" for p in preds.values() if p.note]
    if notes:
        print("notes:\n" + "\n".join(notes))
    if choice is not None:
        print(f"auto-fit: {choice.rung or 'nothing fits'}"
              + (" (the fastest rung predicted to fit; on a real OOM, step down in this order: "
                 + " -> ".join(choice.order()) + ")" if choice.rung else ""))
    return 0


def p_cats():
    from workbench.memory.accounting import CATEGORIES

    return CATEGORIES
