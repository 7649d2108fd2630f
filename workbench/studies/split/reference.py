"""Study 3's reference run: torch.optim.AdamW (fused) with everything on the accelerator, the
same blocks from the same weights as the engine's runs, at the study's precision, measured the way
the engine measures itself.

    rows = plain_adamw(model, batches, AdamHP(lr=3e-4))      # one row per iteration
"""

from __future__ import annotations

import copy
import math

import torch

from workbench.core.common import one_line
from workbench.core.config import ConfigError
from workbench.core.training import autocast
from workbench.studies.split._cuda import Clock
from workbench.studies.split.adam import AdamHP


def plain_adamw(model, batches, hp: AdamHP, max_grad_norm: float = 0.0, precision: str = "fp32") -> list[dict]:
    """torch.optim.AdamW (fused), everything on the accelerator: the reference. `precision` bf16 or
    fp16: mixed precision (fp32 weights, the forward under autocast; fp16 with a GradScaler), the
    all-accelerator run a 16-bit study's engine is compared with (it had run in fp32 whatever the
    study's precision, under the study's label). k and the idle
    share are measured as for the engine: k from where the optimizer state lives after each step,
    idle from the accelerator's busy spans (forward, backward, step) within the iteration's period
    (from its start to the next one's)."""

    device = next(model.parameters()).device
    clock = Clock(device)
    opt = torch.optim.AdamW(model.parameters(), lr=hp.lr, betas=hp.betas, eps=hp.eps,
                            weight_decay=hp.weight_decay, fused=True)
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    marks = []
    for b in batches:
        m = {"start": clock.mark()}
        with autocast(device, precision):  # fp16 without CUDA: a ConfigError
            loss = model(input_ids=b, labels=b).loss
        m["forward_end"] = clock.mark()
        (loss if scaler is None else scaler.scale(loss)).backward()
        m["backward_end"] = clock.mark()
        if scaler is not None:
            scaler.unscale_(opt)  # clipped as the engine clips: the true gradient's norm
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        m["step_end"] = clock.mark()
        opt.zero_grad(set_to_none=True)
        m["loss"] = loss.item()
        on_accel = sum(p.numel() for p in params if opt.state[p]["exp_avg"].device == device)
        m["k"] = on_accel / total
        marks.append(m)
    end = clock.mark()
    rows = []
    for i, m in enumerate(marks):
        ms = {k: clock.ms(v) for k, v in m.items() if k not in ("loss", "k")}
        nxt = clock.ms(marks[i + 1]["start"]) if i + 1 < len(marks) else clock.ms(end)
        period = nxt - ms["start"]
        busy = ms["step_end"] - ms["start"]  # forward + backward + step: the accelerator's own work
        rows.append({"iteration": i, "loss": m["loss"], "iteration_ms": period, "tokens": batches[i].numel(),
                     "tokens_per_s": batches[i].numel() / (period / 1e3), "k_actual": m["k"],
                     "forward_ms": ms["forward_end"] - ms["start"], "backward_ms": ms["backward_end"] - ms["forward_end"],
                     "accel_update_ms": ms["step_end"] - ms["backward_end"],
                     "accel_idle_share": max(0.0, 1.0 - busy / period)})
    return rows


def reference_at(base, batches, hp: AdamHP, precision: str, warmup: int = 1) -> dict:
    """gpu-check's row of the reference trained at `precision` (a copy of `base` on the batches' device): ok
    when every loss is finite, with its tokens/s over the iterations after `warmup`; unavailable where
    that precision is (fp16 without CUDA), an error with its reason where it failed (out of memory, the
    copy to the card included)."""
    name = f"AdamW all on {batches[0].device.type}, {precision} mixed (the reference)"
    try:
        rows = plain_adamw(copy.deepcopy(base).to(batches[0].device), batches, hp, precision=precision)
    except ConfigError as e:
        return {"run": name, "status": "unavailable", "reason": one_line(e, 200), "precision": precision}
    except Exception as e:  # noqa: BLE001 - the check records it; the engine's runs are measured whatever it does
        return {"run": name, "status": "error", "reason": one_line(e, 200), "precision": precision}
    losses = [r["loss"] for r in rows]
    keep = rows[warmup:] or rows
    finite = all(math.isfinite(x) for x in losses)
    return {"run": name, "status": "ok" if finite else "error", "precision": precision, "iterations": len(rows),
            "reason": "" if finite else f"a loss that is not finite: {losses}", "final_loss": losses[-1],
            "tokens_per_s": sum(r["tokens"] for r in keep) / (sum(r["iteration_ms"] for r in keep) / 1e3),
            "k_actual": keep[-1]["k_actual"], "accel_idle_share": keep[-1]["accel_idle_share"]}
