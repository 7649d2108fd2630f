"""Study 3's reference run: torch.optim.AdamW (fused) with everything on the accelerator, the
same blocks from the same weights as the engine's runs, at the study's precision, measured the way
the engine measures itself.

    rows = plain_adamw(model, batches, AdamHP(lr=3e-4))      # one row per iteration
"""

from __future__ import annotations

import torch

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
