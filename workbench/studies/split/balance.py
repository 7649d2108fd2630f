"""Which share k of the parameters should the accelerator update, given measured times?

The accelerator runs backward (t_B) and then updates a share k of the parameters, taking
k * alpha * t_U (alpha = t_update_accelerator / t_update_host per parameter, t_U the host
time to update all parameters). Meanwhile the host side handles the other 1 - k: gradients
to the host (t_D for all parameters), the host Adam (t_U), weights back (t_W). Balance:

    t_B + k * alpha * t_U = (1 - k) * T_host
    k = (T_host - t_B) / (T_host + alpha * t_U),   clipped to [0, 1]

T_host is t_U in the seed's formula, k = (t_U - t_B) / ((1 + alpha) * t_U), which leaves the
transfers out. With transfers, a stage model: where the copies run beside the host Adam (copy
engines, side streams), layer after layer, the slowest of the three stages sets the pace, T_host =
max(t_U, t_D, t_W); where they run in turn with it, they add up, T_host = t_U + t_D + t_W. The
performance model (perf_model, the modelled GPUs) assumes the first, and its per-layer simulation
(perf_model.simulate) checks the formula against a schedule.

The engine assumes neither, once it has measured: it measures T_host whole (`t_host_busy_s`), as
how long at least one of the host's stages was at work on the updates kept in an iteration
(overlaps counted once, waits for gradients not at all; engine.kept_busy_ms), per parameter the
host updated. On an H200 (2026-11-30, the 32M-parameter model in
fp32) max(t_U, t_D, t_W) said the host about kept up with backward (the k = 0 run's balance asked
for k = 0.07), yet at k = 0 the host still had 55% of its share to do when backward ended and an
iteration took 2.7x as long as at k = 1: the stages had not overlapped as assumed (one cause the code
shows: the host worker stages each layer's weights for the copy back itself, after its Adam). The
adaptive run settled at k = 0, 16,877 tokens/s, where k = 1 ran 44,209.

Interference: the formula takes t_B as fixed, whatever k. Measured, it is not: with every update
on the host, backward took 3.8x as long on an H200 (2026-11-22, a 32M-parameter model: 95 ms at
k=0, 25 ms at k=1) and 1.6x as long on the CPU twin (two cores): the host's Adam, copies and
Python work compete with the thread that runs backward. Then the balance says "the host finishes before backward, give it
everything" (k = 0) exactly where k = 1 was twice as fast. So t_B is what backward takes with
no host work beside it, and I (`t_interference_s`) how much longer it takes with every parameter
updated beside it, measured at run time from backward at two or more k (`backward_fit`):

    accelerator: t_B + (1 - k) * I + k * alpha * t_U        host: (1 - k) * T_host

and k minimises the longer of the two (both lines: the minimum is at 0, 1 or where they cross;
with I = 0 it is the formula above).
"""

from __future__ import annotations

import math

from dataclasses import dataclass


@dataclass(frozen=True)
class Rates:
    """Measured (or modelled) times of one iteration, in seconds, for ALL parameters."""

    t_backward_s: float  # accelerator backward with no host work beside it (t_B)
    t_update_host_s: float  # host Adam of all parameters (t_U)
    alpha: float  # accelerator update time / host update time, per parameter
    t_to_host_s: float = 0.0  # all gradients to the host (t_D)
    t_to_accel_s: float = 0.0  # all weights back to the accelerator (t_W)
    copies_overlap: bool = True  # copies run beside the host Adam (CUDA) or in turn with it
    t_interference_s: float = 0.0  # backward's extra time with every parameter updated beside it (I)
    # the host side measured whole: how long its stages were at work, overlaps counted once (engine rows'
    # host_busy_ms); where given, it is T_host, and the stages' sums only say where the time went
    t_host_busy_s: float | None = None

    @property
    def t_transfer_s(self) -> float:
        return self.t_to_host_s + self.t_to_accel_s

    def host_side_s(self, include_transfer: bool = True) -> float:
        """T_host: the host side's time for all parameters."""
        if not include_transfer:
            return self.t_update_host_s
        if self.t_host_busy_s is not None:
            return self.t_host_busy_s
        if self.copies_overlap:
            return max(self.t_update_host_s, self.t_to_host_s, self.t_to_accel_s)
        return self.t_update_host_s + self.t_transfer_s



def balance_k(r: Rates, include_transfer: bool = True) -> float:
    """The share of parameters to update on the accelerator (0: host only, 1: all)."""
    times = (r.t_backward_s, r.t_update_host_s, r.alpha, r.t_to_host_s, r.t_to_accel_s, r.t_interference_s,
             0.0 if r.t_host_busy_s is None else r.t_host_busy_s)
    if not all(math.isfinite(t) for t in times):  # NaN compares false: min/max would quietly give k = 0
        raise ValueError(f"balance_k needs finite rates, got {r}")
    t_h = r.host_side_s(include_transfer)
    acc_upd = r.alpha * r.t_update_host_s
    i = max(0.0, r.t_interference_s)

    def longer(k: float) -> float:
        return max(r.t_backward_s + (1 - k) * i + k * acc_upd, (1 - k) * t_h)

    ks = [0.0, 1.0]
    denom = t_h + acc_upd - i
    if denom != 0:
        cross = (t_h - r.t_backward_s - i) / denom
        if 0.0 < cross < 1.0:
            ks.append(cross)
    return min(ks, key=lambda k: (longer(k), k))


def backward_fit(obs: list[tuple[float, float]], min_spread: float = 0.2) -> tuple[float, float] | None:
    """(t_B, I) from measured (k, backward seconds) pairs, by least squares on backward(k) =
    t_B + (1 - k) * I; None while the k's spread less than `min_spread` (one k says nothing about
    the slope). A backward that does not shrink as the host does less has no interference: its
    mean is t_B. A line that reaches zero before k = 1 is noise on a few points, not a backward
    that takes no time without host work: None (it was clipped to t_B = 0, seen on a busy machine)."""
    if len(obs) < 2:
        return None
    ks, bs = [k for k, _ in obs], [b for _, b in obs]
    if max(ks) - min(ks) < min_spread:
        return None
    mk, mb = sum(ks) / len(ks), sum(bs) / len(bs)
    slope = sum((k - mk) * (b - mb) for k, b in obs) / sum((k - mk) ** 2 for k in ks)
    if slope >= 0:
        return mb, 0.0
    t_b = mb + slope * (1 - mk)
    return (t_b, -slope) if t_b > 0 else None


def settled(rows: list[dict], warmup: int) -> dict:
    """An adaptive run after its last move of k: that k, the iteration it was first used in, and
    the tokens/s of those iterations (warm-up left out); the figures None where fewer than two
    measured iterations (after warm-up) ran at the last k."""
    start = 0
    for i in range(1, len(rows)):
        if rows[i]["k_actual"] != rows[i - 1]["k_actual"]:
            start = i
    keep = [r for r in rows[start:] if r["iteration"] >= warmup]
    ms = sum(r["iteration_ms"] for r in keep)
    if len(keep) < 2 or ms <= 0:
        return {"settled_k": None, "settled_from": None, "settled_tokens_per_s": None}
    return {"settled_k": keep[0]["k_actual"], "settled_from": rows[start]["iteration"],
            "settled_tokens_per_s": sum(r["tokens"] for r in keep) / (ms / 1e3)}
