"""Which share k of the parameters should the accelerator update, given measured times?

The accelerator runs backward (t_B) and then updates a share k of the parameters, taking
alpha * t_U * k (alpha = t_update_accelerator / t_update_host per parameter, t_U the host
time to update all parameters). Meanwhile the host updates the other 1 - k, taking
(1 - k) * t_U, plus moving those gradients to the host and the new weights back: t_X per
all parameters (bytes x seconds per byte, both ways). Balance the two sides:

    t_B + k * alpha * t_U = (1 - k) * (t_U + t_X)
    k = (t_U + t_X - t_B) / ((1 + alpha) * t_U + t_X),   clipped to [0, 1]

With t_X = 0 this is the seed's formula, k = (t_U - t_B) / ((1 + alpha) * t_U). Counting the
transfers as if they did not overlap the host update is the pessimistic end; the performance
model's per-layer simulation (perf_model.simulate) says where the real optimum lies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Rates:
    """Measured (or modelled) times of one iteration, in seconds."""

    t_backward_s: float  # accelerator backward
    t_update_host_s: float  # host Adam of ALL parameters (t_U)
    alpha: float  # accelerator update time / host update time, per parameter
    t_transfer_s: float = 0.0  # moving all gradients to the host + all weights back (t_X)

    def as_dict(self) -> dict:
        return asdict(self)


def balance_k(r: Rates, include_transfer: bool = True) -> float:
    """The share of parameters to update on the accelerator (0: host only, 1: all)."""
    t_u, t_b, a = r.t_update_host_s, r.t_backward_s, r.alpha
    t_x = r.t_transfer_s if include_transfer else 0.0
    denom = (1.0 + a) * t_u + t_x
    if denom <= 0:
        return 0.0
    return min(1.0, max(0.0, (t_u + t_x - t_b) / denom))


def critical_path_s(r: Rates, k: float, include_transfer: bool = True) -> float:
    """The longer of the two sides for a given k (the balance model's iteration tail)."""
    t_x = r.t_transfer_s if include_transfer else 0.0
    accel = r.t_backward_s + k * r.alpha * r.t_update_host_s
    host = (1.0 - k) * (r.t_update_host_s + t_x)
    return max(accel, host)
