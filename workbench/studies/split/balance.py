"""Which share k of the parameters should the accelerator update, given measured times?

The accelerator runs backward (t_B) and then updates a share k of the parameters, taking
k * alpha * t_U (alpha = t_update_accelerator / t_update_host per parameter, t_U the host
time to update all parameters). Meanwhile the host side handles the other 1 - k: gradients
to the host (t_D for all parameters), the host Adam (t_U), weights back (t_W). Balance:

    t_B + k * alpha * t_U = (1 - k) * T_host
    k = (T_host - t_B) / (T_host + alpha * t_U),   clipped to [0, 1]

T_host is t_U in the seed's formula, k = (t_U - t_B) / ((1 + alpha) * t_U), which leaves the
transfers out. With transfers, T_host depends on whether the copies run beside the host Adam:
on CUDA they do (copy engines, side streams), layer after layer, so the slowest of the three
stages sets the pace, T_host = max(t_U, t_D, t_W); when one thread copies and updates in turn
(the CPU-only engine), they add up, T_host = t_U + t_D + t_W. The performance model's per-layer
simulation (perf_model.simulate) checks the formula against a schedule.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rates:
    """Measured (or modelled) times of one iteration, in seconds, for ALL parameters."""

    t_backward_s: float  # accelerator backward (t_B)
    t_update_host_s: float  # host Adam of all parameters (t_U)
    alpha: float  # accelerator update time / host update time, per parameter
    t_to_host_s: float = 0.0  # all gradients to the host (t_D)
    t_to_accel_s: float = 0.0  # all weights back to the accelerator (t_W)
    copies_overlap: bool = True  # copies run beside the host Adam (CUDA) or in turn with it

    @property
    def t_transfer_s(self) -> float:
        return self.t_to_host_s + self.t_to_accel_s

    def host_side_s(self, include_transfer: bool = True) -> float:
        """T_host: the host side's time for all parameters."""
        if not include_transfer:
            return self.t_update_host_s
        if self.copies_overlap:
            return max(self.t_update_host_s, self.t_to_host_s, self.t_to_accel_s)
        return self.t_update_host_s + self.t_transfer_s



def balance_k(r: Rates, include_transfer: bool = True) -> float:
    """The share of parameters to update on the accelerator (0: host only, 1: all)."""
    t_h = r.host_side_s(include_transfer)
    denom = t_h + r.alpha * r.t_update_host_s
    if denom <= 0:
        return 0.0
    return min(1.0, max(0.0, (t_h - r.t_backward_s) / denom))

