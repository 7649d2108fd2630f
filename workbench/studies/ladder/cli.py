"""`workbench estimate`: will this fine-tune fit? Memory prediction from a config, no GPU needed.

    workbench estimate --model data/configs/qwen2-0.5b.json --batch 1 --seq 512 --rung bf16_ckpt
    workbench estimate --model data/configs/qwen2-0.5b.json --rung all --json
    workbench estimate --model data/configs/qwen2-0.5b.json --auto-fit --card "RTX 4060 Ti 8GB"
    workbench estimate --model data/configs/qwen2-0.5b.json --batch 4 --seq 1024 --precision bf16-true \
        --trainable lora --lora-targets q_proj,v_proj --checkpointing --card "RTX 4060 Ti 8GB"

MODEL: a hub id, a model directory or a config.json file (offline). A setup is a named rung (--rung) or
composed from flags (--precision, --optimizer, ...). --device cuda (the default): the step makes CUDA's
choices (simulated), the caching allocator and context are modelled (core/memory/cuda_model.py); cpu: exact.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from tqdm import tqdm

from workbench.core.common import MiB, check_writable_file, mib_text, stdout_to_stderr
from workbench.core.config import ConfigError
from workbench.core.memory.accounting import CATEGORIES
from workbench.core.memory.cuda_model import Card, card as cuda_card
from workbench.core.memory.meta import model_config
from workbench.core.memory.plan import CLI_OPTIMIZERS, CLI_PRECISIONS, OFFLOADS, RUNGS, TRAINABLES, plan_from_flags
from workbench.core.memory.predict import CUDA_STEPS, WeightsExceedCard, predict
from workbench.core.memory.snapshot import dump, predicted_snapshot
from workbench.core.models import ModelNotFoundError
from workbench.studies.ladder.autofit import prediction_margin, search
from workbench.studies.ladder.rungs import auto_fit


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
    p.add_argument("--rung", default=None, metavar="RUNG", help="a rung name (below) or 'all' (default fp32 "
                   "without setup flags; the rungs train with adamw_fused, as the workbench does)")
    p.add_argument("--device", default="cuda", help="cuda (default: CUDA's choices simulated, allocator "
                   "modelled) or cpu (a CPU step, exact)")
    p.add_argument("--precision", default=None, help=f"{' | '.join(CLI_PRECISIONS)} (-true: pure 16-bit weights, "
                   "grads and optimizer state)")
    p.add_argument("--optimizer", default=None, help=f"{' | '.join(CLI_OPTIMIZERS)} (default adamw_torch: what "
                   "torch.optim.AdamW() picks on the device, foreach on CUDA; not the fp32 rung's adamw_fused)")
    p.add_argument("--trainable", default=None, help=f"{' | '.join(TRAINABLES)} (default full; lora where "
                   "--lora-rank or --lora-targets is given)")
    p.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (default 8)")
    p.add_argument("--lora-targets", default=None, help="comma-separated module names LoRA wraps "
                   "(default: every decoder linear)")
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="gradient checkpointing (default off)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch; --batch / M "
                   "accumulation steps (default: the whole batch)")
    p.add_argument("--card", default=None, help="a card (e.g. 'RTX 4060 Ti 8GB', 'A100 80GB'), its GiB, or 'here' "
                   "(this machine's): fits or not, with the headroom (with --device cuda)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps to simulate, >= 2 (default: 2 on the CPU; 3 for CUDA, where the allocator model repeats "
                        "the last step until its cache is steady, which needs two like steps)")
    p.add_argument("--budget-mib", type=float, default=None, help="device budget in MiB, for what the allocator "
                   "reserves (the CUDA context not counted in it; --card takes it off): say whether it fits")
    p.add_argument("--auto-fit", action="store_true", help="pick the fastest rung predicted to fit --budget-mib or "
                   "--card")
    p.add_argument("--search", action="store_true",
                   help="from this setup, search micro-batch (same effective batch), checkpointing, precision, "
                        "optimizer and offload for the fastest setup predicted to fit --budget-mib or --card, with "
                        "a margin from the prediction's measured error")
    p.add_argument("--allow-lora", action="store_true", help="with --search: LoRA may replace full fine-tuning")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table (figures in bytes, but where "
                   "a key ends _mib; --search's are in MiB)")
    p.add_argument("--snapshot", default=None, metavar="PATH", help="also write the predicted step's allocation "
                   "timeline as a memory snapshot pickle (open it at pytorch.org/memory_viz); one setup only")
    p.set_defaults(func=_estimate)


_SHORT = {"optimizer_state": "optimizer"}  # the column's heading; the JSON keeps the category's name
_MODELLED = "modelled"  # a preset's or a size's context (a per-card constant), not what is in use on a card now
_FLAGS = ("precision", "optimizer", "trainable", "lora_rank", "lora_targets", "checkpointing", "micro_batch")


def _plan(args):
    """The composed plan when any setup flag is given (None: use --rung)."""

    given = [f for f in _FLAGS if getattr(args, f) is not None]
    if not given:
        return None
    if args.rung is not None:
        raise ConfigError(f"--rung and --{given[0].replace('_', '-')} both describe the setup; use one")
    precision = args.precision or "fp32"
    if precision == "fp16-mixed" and args.device == "cpu":
        raise ConfigError("fp16-mixed needs --device cuda (fp16 autocast with a GradScaler is CUDA-only); "
                          "use --precision bf16-mixed on the CPU")
    targets = None if args.lora_targets is None else tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    if targets == ():
        raise ConfigError(f"--lora-targets {args.lora_targets!r} names no module; give comma-separated names "
                          "(e.g. q_proj,v_proj), or leave it out for every linear layer of the decoder")
    lora = [f"--{n.replace('_', '-')}" for n in ("lora_rank", "lora_targets") if getattr(args, n) is not None]
    if lora and args.trainable not in (None, "lora", "qlora"):  # the rank had been dropped without a word
        raise ConfigError(f"{' and '.join(lora)}: LoRA's, not --trainable {args.trainable}'s; use lora or qlora")
    trainable = args.trainable or ("lora" if lora else "full")  # a LoRA flag alone means LoRA
    return plan_from_flags(precision=precision, optimizer=args.optimizer or "adamw_torch", trainable=trainable,
                           lora_rank=8 if args.lora_rank is None else args.lora_rank, lora_targets=targets,
                           checkpointing=bool(args.checkpointing), batch=args.batch, micro_batch=args.micro_batch)


def _check(args) -> list[str]:
    if args.device not in ("cuda", "cpu"):
        raise ConfigError(f"--device must be cuda or cpu, got {args.device!r}")
    if args.card is not None and args.device != "cuda":
        raise ConfigError("--card describes a CUDA card; drop it or use --device cuda")
    if args.rung is None:
        args.rung = "fp32" if args.precision is None and all(getattr(args, f) is None for f in _FLAGS) else None
    if args.rung is not None and args.rung != "all" and args.rung not in RUNGS:
        raise ConfigError(f"unknown rung {args.rung!r}; known rungs: {', '.join(RUNGS)}, all")
    if args.rung in RUNGS and RUNGS[args.rung].precision == "fp16" and args.device == "cpu":
        # as --precision fp16-mixed is refused there (a search from it offered fp16-mixed setups on the CPU)
        raise ConfigError(f"--rung {args.rung} needs --device cuda (fp16 autocast with a GradScaler is CUDA-only); "
                          "use --rung bf16 on the CPU")
    for name in ("batch", "seq"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if args.steps is not None and args.steps < 2:
        raise ConfigError(f"--steps must be at least 2 (the steady state starts at step 2), got {args.steps}")
    if args.budget_mib is not None and not (args.budget_mib > 0 and math.isfinite(args.budget_mib)):
        raise ConfigError(f"--budget-mib must be a positive number of MiB, got {args.budget_mib}")
    if args.auto_fit and args.budget_mib is None and args.card is None:
        raise ConfigError("--auto-fit needs --budget-mib or --card (the memory to fit)")
    if args.auto_fit and any(getattr(args, f) is not None for f in _FLAGS):
        raise ConfigError("--auto-fit picks among the named rungs; to search from a setup of your own, use --search "
                          "(it keeps the effective batch and searches micro-batch, checkpointing, precision, "
                          "optimizer and offload)")
    if args.search and args.budget_mib is None and args.card is None:
        raise ConfigError("--search needs --budget-mib or --card (the memory to fit)")
    if args.allow_lora and not args.search:  # it had been ignored without a word
        raise ConfigError("--allow-lora is an option of --search (LoRA may replace full fine-tuning): add --search")
    if args.search and args.auto_fit:
        raise ConfigError("--search and --auto-fit are two searches: pick one (--search keeps the batch and "
                          "searches more than the rungs)")
    if args.snapshot is not None:  # before the prediction's seconds, not after
        check_writable_file(args.snapshot, "--snapshot", "step.pickle")
    if args.device == "cpu" and args.rung in OFFLOADS:  # it read "fits" for the card's part of the process alone
        raise ConfigError(f"--rung {args.rung} splits a card's memory from the host's; with --device cpu they are one "
                          "memory: use --device cuda (it gives the host's memory beside the card's)")
    every = [n for n, r in RUNGS.items() if args.device == "cuda" or r.placement not in OFFLOADS]  # the CPU: no offload
    return every if (args.rung == "all" or args.auto_fit) else [args.rung] if args.rung else []


def _estimate(args) -> int:
    rung_given = args.rung is not None
    names = _check(args)
    plan = _plan(args) if not rung_given or args.rung is None else None
    if rung_given and any(getattr(args, f) is not None for f in _FLAGS):
        _plan(args)  # names the clash
    # stdout carries the result alone, the table or the JSON (printed after): DeepSpeed prints its accelerator
    # warning there when a ZeRO setup first imports it, which put a log line above the table's header
    with stdout_to_stderr():
        try:
            config = model_config(args.model)
        except ModelNotFoundError as e:
            print(f"workbench estimate: {e}", file=sys.stderr)
            return 2
        card_spec = args.card
        if args.card is not None:  # once: "here" reads what the card has free now
            args.card = cuda_card(args.card)
        kw = dict(batch=args.batch, seq=args.seq, steps=args.steps, device=args.device, card=args.card)
        too_big: dict[str, WeightsExceedCard] = {}  # rungs whose weights alone are more than the card
        if args.snapshot:
            if plan is None and len(names) != 1:
                raise ConfigError("--snapshot writes one setup's timeline: give one --rung or a setup from flags")
            if args.device != "cuda":
                raise ConfigError("--snapshot models the CUDA allocator: use it with --device cuda")
            snapshot = predicted_snapshot(config, plan or names[0], batch=args.batch, seq=args.seq,
                                          steps=args.steps or CUDA_STEPS, card=args.card)
            try:  # past the check above: a full disk, a read-only file system
                path = dump(snapshot, args.snapshot)
            except OSError as e:
                raise ConfigError(f"--snapshot {args.snapshot}: cannot write it ({e.strerror})") from None
            print(f"memory snapshot (modelled allocator, simulated step): {path}", file=sys.stderr)
        budget_from = "--budget-mib"
        if (args.search or args.auto_fit) and args.budget_mib is None:
            card = args.card
            if card.usable_bytes <= 0:
                raise ConfigError(f"--card {card_spec}: its {mib_text(card.total_bytes / MiB)} MiB do not hold the "
                                  f"CUDA context ({mib_text(card.context_bytes / MiB)} MiB, modelled); give a larger "
                                  "card, or --budget-mib for a budget of your own" if card.context_source.startswith(_MODELLED)
                                  else f"--card {card_spec}: nothing is free on {card.name} now "
                                  f"({mib_text(card.context_bytes / MiB)} MiB in use, {card.context_source})")
            args.budget_mib = card.usable_bytes / MiB  # what the card leaves after its context
            reserve = f", and the driver's reserve, {mib_text(card.driver_reserved_bytes / MiB)} MiB" * bool(card.driver_reserved_bytes)
            budget_from = (f"{card.name}'s {mib_text(card.total_bytes / MiB)} MiB less its CUDA context, "
                           f"{mib_text(card.context_bytes / MiB)} MiB modelled{reserve}" if card.context_source.startswith(_MODELLED) else
                           f"{card.name}'s {mib_text(card.total_bytes / MiB)} MiB less "
                           f"{mib_text(card.context_bytes / MiB)} MiB in use there, {card.context_source}")
        if args.search:
            budget_mib = args.budget_mib
            setup = plan or RUNGS[names[0]]
            found = search(config, setup, batch=args.batch, seq=args.seq, budget_mib=budget_mib, device=args.device,
                           card=args.card, allow_lora=args.allow_lora, progress=True)
        elif plan is not None or len(names) == 1:  # no bar for one: a 7B model's is 20-25 s, said in a terminal
            name = plan.name if plan else names[0]
            if sys.stderr.isatty():
                print(f"estimate: simulating {name} on fake tensors (no weights read): seconds, tens of them for "
                      "billions of parameters", file=sys.stderr, flush=True)
            preds = {name: predict(config, plan or name, **kw)}
        else:  # each rung is a simulated step or more: 10-60 s for a 0.5B model here
            preds = {}
            for n in tqdm(names, desc="estimate", unit="rung", disable=len(names) < 2, file=sys.stderr):
                try:
                    preds[n] = predict(config, n, **kw)
                except WeightsExceedCard as e:  # one rung that does not fit the card, among others
                    too_big[n] = e
            if too_big and not preds:
                raise next(iter(too_big.values()))
        choice = None
        if args.auto_fit:
            choice = auto_fit(config, batch=args.batch, seq=args.seq, budget_mib=args.budget_mib, predictions=preds,
                              rungs=tuple(preds), device=args.device,
                              sm=args.card.sm if args.card is not None else None)
    if args.search:
        return _print_search(args, found, budget_mib, setup, budget_from)
    budget = int(args.budget_mib * MiB) if args.budget_mib else None
    plans = {plan.name: plan} if plan is not None else {n: RUNGS[n] for n in names}

    def fits(p) -> tuple[bool, float]:
        """Within the budget with the prediction's measured margin, as auto-fit judges it."""
        margin = prediction_margin(plans[p.rung], device=p.device)[0]
        return (p.fit_bytes if p.device == "cuda" else p.peak_bytes) * (1 + margin) <= budget, margin

    if args.json:
        out = {
            "model": args.model, "batch": args.batch, "seq": args.seq, "budget_bytes": budget, "device": args.device,
            "labels": {"peak_bytes": "simulated (live tensor bytes)", "allocated_peak_bytes": "modelled (allocator)",
                       "reserved_peak_bytes": "modelled (allocator, on a card with room: what fits compares)",
                       "needed_reserved_bytes": "modelled (allocator, the least cap it runs under; up to 23% low "
                                                "on the H200 (zero_offload), not compared)",
                       "nvidia_smi_bytes": "modelled (reserved + context + paged optimizer state on the card, "
                                           "at most the room left on --card)",
                       "fits_card": "the fit figure + the CUDA context within --card, no margin (null: no card)",
                       "fits_budget": "the fit figure + the prediction's measured margin within the budget "
                                      "(--budget-mib, or --auto-fit's: the card less its context; null: none)"},
            "predictions": [
                {**{k: v for k, v in p.row().items() if k not in ("model", "fits")},  # two verdicts: named
                 "breakdown_bytes": p.breakdown, "peak_bytes": p.peak_bytes,
                 "allocated_breakdown_bytes": p.allocated_breakdown, "kernels": p.kernels,
                 "host_breakdown_bytes": p.host_breakdown, "placement": p.placement,
                 "fits_card": p.fits,
                 **dict(zip(("fits_budget", "margin"), fits(p) if budget else (None, None)))}
                for p in preds.values()
            ],
        }
        if too_big:
            out["weights_exceed_card"] = {n: str(e) for n, e in too_big.items()}
        if choice is not None:
            out["auto_fit"] = choice.rung
            out["auto_fit_margins"] = {r["rung"]: r["margin"] for r in choice.table}
        print(json.dumps(out, indent=2))
        return 0
    print(f"model {args.model}  batch {args.batch} x seq {args.seq}"
          + (f"  budget {mib_text(args.budget_mib)} MiB" if budget else "")
          + (f" ({budget_from})" if budget and budget_from != "--budget-mib" else ""))
    if len(preds) == 1 and not too_big:  # one setup asked for (rungs that do not fit the card: the table, with notes)
        p = next(iter(preds.values()))
        setup = p.rung if plan is None else f"{p.rung} ({plan.help})"
        cpu_only = (plan or RUNGS[p.rung]).placement == "cpu"  # nothing on the device: the peak is the host's
        _ = p.needed_reserved_bytes  # the least cap, replayed when first read: in the seconds printed next
        if cpu_only:
            print(f"{setup} on {args.device}: {p.method} peak 0 MiB on the device (CPU only); host memory "
                  f"{p.host_bytes / MiB:,.1f} MiB ({p.host_bytes:,} bytes) at {p.where}  [{p.seconds:.1f} s]")
        else:
            print(f"{setup} on {args.device}: {p.method} peak{' of live tensors' * bool(p.reserved_peak_bytes)} "
                  f"{p.peak_mib:,.1f} MiB ({p.peak_bytes:,} bytes) at {p.where}  [{p.seconds:.1f} s]")  # not the fit
        if p.device == "cuda" and p.reserved_peak_bytes:
            print(f"  {'':<16} {'live (simulated)':>18} {'allocated (modelled)':>22}")
            for c, b in p.breakdown.items():
                print(f"  {c:<16} {b / MiB:>14,.1f} MiB {p.allocated_breakdown.get(c, 0) / MiB:>18,.1f} MiB")
            print(f"  {'cuBLAS workspace':<16} {'':>18} {p.allocated_breakdown.get('workspace', 0) / MiB:>18,.1f} MiB")
            print(f"  allocated peak   {p.allocated_peak_bytes / MiB:>12,.1f} MiB  modelled (max_memory_allocated)")
            print(f"  reserved peak    {p.reserved_peak_bytes / MiB:>12,.1f} MiB  modelled (max_memory_reserved "
                  "on a card with room; what fits compares)")
            print(f"  reserved needed  {p.needed_reserved_bytes / MiB:>12,.1f} MiB  modelled (the least cap it runs "
                  "under, cached blocks given back; a card needed up to 23% more, so fits does not use it)")
            if p.replayed_steps:
                print(f"  allocator        {p.replayed_steps} steps replayed, "
                      + ("until its cache repeated (a long run's peaks)" if p.steady else
                         "its cache still changing (peaks of those steps)" if p.steady is False else "as asked"))
            print(f"  CUDA context     {p.context_bytes / MiB:>12,.1f} MiB  {p.context_source}")
            on = p.nvidia_smi_bytes - p.reserved_peak_bytes - p.context_bytes  # of the paged state: on the card, out
            paged = f" + paged optimizer state: {on / MiB:,.1f} MiB on the card, {(p.pageable_bytes - on) / MiB:,.1f} out"
            print(f"  nvidia-smi       {p.nvidia_smi_bytes / MiB:>12,.1f} MiB  modelled (reserved + context"
                  f"{paged * bool(p.pageable_bytes)})")
            print(f"  attention kernel {', '.join(f'{k} x{n}' for k, n in p.kernels.items()) or 'none'}  simulated")
            if p.host_bytes:
                print(f"  host memory      {p.host_bytes / MiB:>12,.1f} MiB  simulated ({p.placement})")
        elif cpu_only:  # what the host holds at its peak
            for c, b in p.host_breakdown.items():
                print(f"  {c:<16} {b / MiB:>12,.1f} MiB  host")
        else:  # the CPU step's live bytes at its peak, each category
            for c, b in p.breakdown.items():
                print(f"  {c:<16} {b / MiB:>12,.1f} MiB  {'simulated' if p.method == 'predicted' else p.method}")
        if p.card:
            print(f"  card {p.card} ({p.card_bytes / MiB:,.0f} MiB): " + ("fits" if p.fits else "does not fit")
                  + f", headroom {p.headroom_bytes / MiB:,.1f} MiB" + (" (nothing of this setup is on the card)" if cpu_only
                                                                      else " with no margin (the fit figure + the CUDA "
                                                                      "context; --budget-mib adds the measured one)"))
        if p.note:
            print(f"  note: {p.note}")
        if budget:
            ok, margin = fits(p)
            print(f"  fits {mib_text(args.budget_mib)} MiB with the prediction's measured margin ({margin:.1%}): "
                  f"{'yes' if ok else 'no'}")
        return 0
    cuda = args.device == "cuda"
    # whole category names: cut at 10 characters they read "optimizer_", "activation", "temporarie"
    head = f"{'rung':<20} {'method':<10} {'peak MiB':>10} " + " ".join(f"{_SHORT.get(c, c):>11}" for c in CATEGORIES)
    on_card = cuda and args.card is not None
    if cuda:
        head += f" {'alloc MiB':>10} {'reserved MiB':>12} {'smi MiB':>10}"
    if on_card:
        head += f" {'fit MiB':>10}  {'card: fits, headroom MiB':>24}"
    print(head + ("   fits (with margin)" if budget else ""))
    for p in preds.values():
        line = f"{p.rung:<20} {p.method:<10} {p.peak_mib:>10,.1f} " + " ".join(
            f"{p.breakdown.get(c, 0) / MiB:>11,.1f}" for c in CATEGORIES)
        if cuda:
            line += f" {p.allocated_peak_bytes / MiB:>10,.1f} {p.reserved_peak_bytes / MiB:>12,.1f} {p.nvidia_smi_bytes / MiB:>10,.1f}"
        if on_card:
            line += f" {p.fit_bytes / MiB:>10,.1f}  {'yes' if p.fits else 'no':>13} {p.headroom_bytes / MiB:>+10,.1f}"
        if budget:
            ok, margin = fits(p)
            line += f"   {'yes' if ok else 'no'} ({margin:.1%})"
        print(line)
    if cuda:
        print("peak and categories (MiB): live tensor bytes (simulated); alloc, reserved: the caching allocator (modelled); "
              "smi: reserved + the CUDA context (modelled; with --card here, all in use on the card now, measured); "
              "device_map, zero_offload and zero_offload_params: the card's share (simulated placement, host memory in the note)")
    if on_card:
        first = next(iter(preds.values()))
        print(f"card: {first.card} ({first.card_bytes / MiB:,.0f} MiB) less the CUDA context ({first.context_source}) "
              "and the fit figure (the reserved peak, what a card with room keeps cached; a paged optimizer's "
              "state left out, as it pages out), with no margin; --budget-mib adds the prediction's measured "
              "margin, on the budget as given (the CUDA context not taken off)")
    notes = [f"  {p.rung}: {p.note}" for p in preds.values() if p.note] + [
        f"  {n}: does not fit ({str(e).split('; use')[0]})" for n, e in too_big.items()]
    if notes:
        print("notes:\n" + "\n".join(notes))
    if choice is not None:
        m = {r["rung"]: r["margin"] for r in choice.table}
        print(f"auto-fit: {choice.rung or 'nothing fits'}"
              + (f" (the fastest rung predicted to fit with the prediction's measured margin, {m[choice.rung]:.1%} "
                 "for it; on a real OOM, step down in this order: " + " -> ".join(choice.order()) + ")"
                 if choice.rung else " with the prediction's measured margin"))
    return 0


def _print_search(args, choice, budget_mib: float, setup, budget_from: str) -> int:
    """`--search`'s result (the joint auto-fit, workbench.studies.ladder.autofit) with its reasons."""
    if args.json:
        print(json.dumps({"model": args.model, "batch": args.batch, "seq": args.seq, "budget_mib": budget_mib,
                          "chosen": choice.plan.name if choice.plan else None, "micro_batch": choice.micro_batch,
                          "why": choice.why, "margin": choice.margin, "margin_source": choice.margin_source,
                          "step_down": [p.name for p in choice.fitting], "tried": choice.table}, indent=2))
        return 0 if choice.plan else 1
    print(f"model {args.model}  effective batch {args.batch} x seq {args.seq}  budget {mib_text(budget_mib)} MiB "
          f"({budget_from})\nsearched from your setup: {setup.name} ({setup.help})")
    w = max([34] + [len(r["setup"]) for r in choice.table])  # whole names: cut at 62, one hid its ZeRO stage
    print(f"{'setup tried (cheapest prior first)':<{w}} {'prior':>6} {'need MiB':>9} {'margin':>7} {'+margin MiB':>11}  fits")
    for r in choice.table:
        if r["need_mib"] is not None:
            need, with_margin = f"{r['need_mib']:>9,.1f}", f"{r['with_margin_mib']:>11,.1f}"
        else:  # the weights alone exceed the card (WeightsExceedCard), or a bound of the need the budget
            bound = "> card" if r["floor_mib"] is None else f">={math.floor(r['floor_mib']):,}"  # a bound: down
            need, with_margin = f"{bound:>9}", f"{'':>11}"
        print(f"{r['setup']:<{w}} {r['prior_cost']:>6.3f} {need} {r['margin']:>7.1%} {with_margin}  "
              f"{'yes' if r['fits'] else '-' if r['fits'] is None else 'no'}"
              + ("  (changes what trains)" if r["changes_what_trains"] else "")
              + (f"  (only with its {mib_text(r['paged_mib'])} MiB of paged state paged out)"
                 if r["fits_only_paged_out"] else "")
              + (f"  (not predicted: {r['not_predicted']})" if r["not_predicted"] else ""))
    print("prior: step time relative to fp32 AdamW, the product of each mechanism's assumed cost (autofit.py COSTS, "
          f"not measured); need: the predicted {'reserved peak' if args.device == 'cuda' else 'peak'} it is compared with")
    if any(r["not_predicted"] for r in choice.table):
        print("not predicted: what a prediction made above showed for a setup holding the same weights and optimizer "
              "state (it differs only in micro-batch and checkpointing); --json names which")
    print(f"auto-fit: {choice.why}")
    if len(choice.fitting) > 1:
        print("on a real out-of-memory error, step down (same effective batch): "
              + " -> ".join(p.name for p in choice.fitting))
    return 0 if choice.plan else 1
