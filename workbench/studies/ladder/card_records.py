"""The ladder's card records: what `make gpu-check` measured on real cards, and the reserved-peak
margin auto-fit keeps because of it.

    .venv/bin/python benchmarks/predict_ladder.py --cards   # writes repredicted.json beside each record

A record is a gpu-check summary committed under data/measured/<card>-<date>/summary.json.
`repredict_card_record` predicts every rung it measured again with this checkout's code (the
measured figures stay the record's own); `card_reserved_errors` reads the current prediction's
reserved-peak error per rung from it, and `reserved_shortfall` turns those into a margin per
placement (workbench.studies.ladder.autofit). The published allocated-peak validation is
workbench.studies.ladder.validation.
"""

from __future__ import annotations

import json
from pathlib import Path

from workbench.core.common import MiB, PROJECT_ROOT
from workbench.core.config import ConfigError
from workbench.core.memory import cuda_model
from workbench.core.memory.plan import RUNGS
from workbench.core.memory.predict import predict
from workbench.core.results import atomic_write_json, git_commit, now

# A CUDA budget caps reserved bytes, so auto-fit compares them with the card; their error is the
# allocator model's on top of the bytes'. The reserved error comes from this project's own card
# records (`make gpu-check` summaries, committed under data/measured/<card>-<date>/), per placement,
# since each library allocates differently (DeepSpeed's reduce bucket and flattening, accelerate's
# host layers), and from the published reserved peaks of one on-card program (GPT-2's Trainer runs,
# workbench.studies.ladder.validation_trainer), which autofit adds to these rows.
CARD_RECORDS = PROJECT_ROOT / "data" / "measured"
REPREDICTED = "repredicted.json"  # beside a record's summary.json: the current prediction against it
# the ladder check's settings where a record does not state them: records written before they were
# (the H200's of 2026-11-22, at b73d754) ran gpu-check's defaults of that commit (3 steps per rung)
GPU_CHECK_DEFAULTS = {"model": "data/configs/qwen2-0.5b.json", "batch": 1, "seq": 512, "steps": 3}


def _read_record(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not a gpu-check summary ({e}); remove it or copy it again") from None


def card_reserved_errors(root: str | Path = CARD_RECORDS) -> list[dict]:
    """Every ladder row of the committed card records whose reserved peak was both predicted
    (simulated, not estimated) and measured: rung, placement, error in %, card, record.

    Where a record has been re-predicted (`repredict_card_record`), the current prediction's error
    is used: post hoc, since the model was revised against these records. So each card's latest
    record's errors as predicted on the day, before the card ran it (the last test the model did not see),
    are rows too: a margin takes the worse (its fp32 was -5.5% on 2026-11-26, re-predicted -0.0%).
    Older records' day errors measured models that later records tested again. A ZeRO-3 row's
    placement names where its run partitioned the model: the records' ran it on the card, the
    workbench partitions it from the host now, a path no card has measured."""
    rows = []
    records = {path: _read_record(path) for path in sorted(Path(root).glob("*/summary.json"))}
    cards = {path: record.get("environment", {}).get("gpu", "?") for path, record in records.items()}
    latest = {}  # each card's latest record, by the date its folder ends in (<card>-<YYYY-MM-DD>)
    for path, card in cards.items():
        latest[card] = max(latest.get(card, path), path, key=lambda p: p.parent.name[-10:])
    for path, record in records.items():
        card, label = cards[path], path.parent.name
        day = record.get("results", {}).get("ladder", {}).get("rows", [])
        ladder = ([{**r, "record": f"{label}, predicted before the card ran it"} for r in day]
                  if latest[card] == path else [])
        if (path.parent / REPREDICTED).exists():
            again = _read_record(path.parent / REPREDICTED)
            ladder += [{**r, "record": f"{label}, re-predicted at {again.get('git_commit', '?')} (post hoc)"}
                       for r in again.get("rows", [])]
        else:
            ladder = [{**r, "record": label} for r in day]
        partitioned = {r["rung"]: r.get("zero3_partitioned_from") or "card" for r in day}
        batch = record.get("results", {}).get("ladder", {}).get("options", {}).get("batch", 1)
        for r in ladder:
            if r.get("method") != "predicted" or r.get("error_vs_reserved_pct") is None:
                continue
            # a rung that accumulates, run at a batch it could not split (gpu-check's --batch 1 until 2026-12-02):
            # another rung's step (bf16_ckpt's), not evidence of its own
            if r["rung"] in RUNGS and RUNGS[r["rung"]].split(r.get("batch") or batch)[1] < RUNGS[r["rung"]].accum:
                continue
            if r["rung"] not in RUNGS:
                raise ConfigError(f"{path}: rung {r['rung']!r} is not a rung of the ladder; remove the record or "
                                  "rename the rung in it")
            placement = RUNGS[r["rung"]].placement
            if placement == "zero_offload_params" and partitioned.get(r["rung"]) != "host":
                placement += " (partitioned on the card)"
            rows.append({"rung": r["rung"], "placement": placement, "card": card,
                         "error_pct": float(r["error_vs_reserved_pct"]), "record": r["record"]})
    return rows


def repredict_card_record(record_dir: str | Path, log=print) -> Path:
    """Predict again, with this checkout's code, every rung a card record measured (allocated and
    reserved), with the record's settings and card; write `repredicted.json` beside it. The
    measured figures are the record's own; only the prediction is new, so a margin read from it is
    the current prediction's error. A rung measured under the live-bytes count (`--counted`) is
    predicted as that instrumented step; a ZeRO-3 rung from where its run partitioned the model (a
    record written before the workbench partitioned it from the host: the card, whole first); a
    rung loaded as its run loaded it (before the workbench converted the weights on the host: in
    fp32, converted on the card)."""
    record_dir = Path(record_dir)
    record = _read_record(record_dir / "summary.json")
    ladder, env = record.get("results", {}).get("ladder", {}), record.get("environment", {})
    opts = {**GPU_CHECK_DEFAULTS, **ladder.get("options", {})}
    if not env.get("gpu") or not env.get("gpu_total_mib") or not ladder.get("sm"):
        raise ConfigError(f"{record_dir}/summary.json names no card (environment.gpu, gpu_total_mib, ladder sm)")
    card = cuda_model.card_of(env["gpu"], int(env["gpu_total_mib"] * MiB), int(ladder["sm"]))
    # how its runs loaded the weights (measure()'s rows say; an offloaded one does not): the record's first
    # rung, replayed before a later one (after=), was loaded so too
    load = next((x["load"] for x in ladder.get("rows", []) if x.get("load")), "card")
    model = opts["model"] if Path(opts["model"]).is_absolute() else str(PROJECT_ROOT / opts["model"])
    rows = []
    for k, r in enumerate(ladder.get("rows", [])):
        measured_alloc, measured_res = r.get("cuda_max_allocated_mib"), r.get("cuda_max_reserved_mib")
        if r.get("status") != "ok" or not measured_alloc or not measured_res or r["rung"] not in RUNGS:
            continue
        counted = r.get("accounted_peak_mib") is not None and RUNGS[r["rung"]].placement == "device"
        ws = workspaces_of(opts, k)
        # held: the workspaces where the record's first rung made them (its run came first in the process)
        first = ladder["rows"][0]["rung"] if ws == "held" else None
        first_counted = ladder["rows"][0].get("accounted_peak_mib") is not None  # it ran under the count or not
        batch = r.get("batch") or opts["batch"]  # the batch the rung ran at (gpu-check's accumulation rung: 4)
        p = predict(model, r["rung"], batch=batch, seq=opts["seq"], device="cuda", card=card,
                    instrumented=counted, replay_steps=opts["steps"],  # the allocator replays the steps the card ran
                    # how measure() loaded the weights: a record from before it converted them on the host
                    # moved the fp32 model to the card and converted it there
                    workspaces=ws, load=load, after=first, after_instrumented=first_counted,
                    # ZeRO-3: a record from before the workbench partitioned the model from the host ran it
                    # whole on the card
                    zero3_from=r.get("zero3_partitioned_from") or "card")
        # an estimated rung has no allocator replay: its one figure stands for allocated, none for reserved
        alloc, res = (p.allocated_peak_bytes or p.peak_bytes) / MiB, p.reserved_peak_bytes / MiB
        row = {"rung": r["rung"], "batch": batch, "method": p.method, "counted": counted, "workspaces": ws, "after": first,
               "predicted_allocated_mib": round(alloc, 1), "cuda_max_allocated_mib": measured_alloc,
               "error_vs_allocated_pct": round(100 * (alloc / measured_alloc - 1), 2),
               "predicted_reserved_mib": round(res, 1) if res else None, "cuda_max_reserved_mib": measured_res,
               "error_vs_reserved_pct": round(100 * (res / measured_res - 1), 2) if res else None,
               "recorded_error_vs_reserved_pct": r.get("error_vs_reserved_pct")}
        rows.append(row)
        log(f"  {r['rung']:<20} {p.method:<10} allocated {alloc:>8.1f} MiB ({row['error_vs_allocated_pct']}%)  "
            + (f"reserved {res:>8.1f} MiB ({row['error_vs_reserved_pct']}%)" if res else "no reserved figure"))
    out = record_dir / REPREDICTED
    atomic_write_json(out, {"record": record_dir.name, "card": card.name, "options": opts, "git_commit": git_commit(),
                            "written": now(), "rows": rows})
    return out


def workspaces_of(options: dict, k: int) -> str:
    """How the process held the cuBLAS workspaces when the record's k-th ladder rung ran: "fresh" where
    gpu-check released them before each rung (its options say so, from 2026-11-26 on), else fresh
    for the first rung only (no earlier check of gpu-check makes them) and held after it."""
    if options.get("workspaces") == "released before each rung":
        return "fresh"
    return "fresh" if k == 0 else "held"


def reserved_shortfall(placement: str, rows: list[dict]) -> tuple[float, str]:
    """(the margin the reserved peak needs, in %, and why) for a setup of `placement`: how far below
    the card's reserved peak the prediction fell at worst (over-predictions need no margin). A
    placement never measured on a card takes the worst shortfall of any placement."""
    if not rows:
        return 0.0, "no reserved peak measured on a card yet"
    own = [r for r in rows if r["placement"] == placement]
    pool = own or rows
    worst = min(pool, key=lambda r: r["error_pct"])
    pct = max(0.0, -worst["error_pct"])
    where = (f"{len(own)} {placement} rung(s)" if own else f"no {placement} rung measured, so any of {len(rows)} rungs")
    shown = f"{pct:.1f}" if pct >= 0.1 else f"{pct:.2f}"  # device_map's 0.04% read "0.0% below"
    return pct, (f"reserved peak {shown}% below the card's at worst ({where}; {worst['rung']} on the "
                 f"{worst['card']}, {worst['record']})" if pct else f"reserved peak never below the card's ({where})")
