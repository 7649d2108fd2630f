"""Which Adam runs on the host, and how is one parameter's optimizer state moved between sides?

The engine keeps one small optimizer per parameter, so that a worker thread can update a
parameter the moment its gradient arrives, and so that a parameter can move between the host
and the accelerator (when k changes) with its Adam state. The maths is always a library's:

- `torch_fused`: `torch.optim.AdamW(fused=True)` (the default; measured on these machines at the
  CPU's memory-bandwidth limit). The accelerator side always uses it too, so with fp32 the two
  sides are the same kernel and the engine matches plain AdamW bit for bit.
- `deepspeed`: `deepspeed.ops.adam.DeepSpeedCPUAdam` (C++/SIMD, the seed's choice). Its op is
  JIT-built with ninja the first time (about a minute); if the build fails the backend says so
  in `backend_status()` and is never chosen silently.
- `torch_foreach`, `torch_single`: torch's other AdamW paths, for the benchmark only.

State is exchanged in one neutral form, {"step": int, "exp_avg": T, "exp_avg_sq": T}.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch

from workbench.core.common import clear_stale_build_lock, one_line


@dataclass(frozen=True)
class AdamHP:
    """AdamW hyper-parameters shared by every side (the parity test relies on it)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01


HOST_BACKENDS = ("torch_fused", "deepspeed", "torch_foreach", "torch_single")


@functools.lru_cache(maxsize=None)
def backend_status(name: str) -> str:
    """'ok', or why the backend cannot run here (a DeepSpeed build failure, a missing package)."""
    if name not in HOST_BACKENDS:
        return f"unknown backend {name!r}"
    if name != "deepspeed":
        return "ok"
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        clear_stale_build_lock("cpu_adam")
        CPUAdamBuilder().load(verbose=False)  # JIT build on first use (~1 min), cached after
    except Exception as e:  # ImportError, ninja/compiler failures, ...
        return f"DeepSpeedCPUAdam unavailable: {one_line(e, 200)}"
    return "ok"


class BackendUnavailable(RuntimeError):
    """The chosen host Adam backend cannot run on this machine."""


@functools.lru_cache(maxsize=1)
def _deepspeed_kernel():
    """One DeepSpeedCPUAdam per process, used as a kernel: building one costs ~1.4 s here
    (CPU detection, op load), too much per parameter. Hyper-parameters go with every call."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam([torch.zeros(1)], adamw_mode=True), threading.Lock()


class ParamAdam:
    """AdamW over one master tensor, on whichever device that tensor lives."""

    def __init__(self, master: torch.Tensor, hp: AdamHP, backend: str):
        if backend_status(backend) != "ok":
            raise BackendUnavailable(backend_status(backend))
        self.master, self.backend, self.hp = master, backend, hp
        kw = dict(lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay)
        if backend == "deepspeed":
            if master.device.type != "cpu":
                raise ValueError("DeepSpeedCPUAdam updates host tensors only")
            self.opt = None
            self.state: dict = {}
        else:
            fused = backend == "torch_fused"
            foreach = True if backend == "torch_foreach" else False if backend == "torch_single" else None
            self.opt = torch.optim.AdamW([master], fused=fused or None, foreach=None if fused else foreach, **kw)

    @torch.no_grad()
    def step(self) -> None:
        if self.opt is not None:
            self.opt.step()
            return
        p, st, hp = self.master, self.state, self.hp
        if p.grad is None:
            return
        if not st:
            st.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        st["step"] += 1
        ds, lock = _deepspeed_kernel()
        with lock:  # the C++ optimizer keeps the step's bias corrections in shared fields
            # the very call DeepSpeedCPUAdam.step makes for each parameter
            ds.ds_opt_adam.adam_update(ds.opt_id, st["step"], hp.lr, hp.betas[0], hp.betas[1], hp.eps,
                                       hp.weight_decay, True, p.data, p.grad.data,
                                       st["exp_avg"], st["exp_avg_sq"])

    # ---- speculation (fp16 overflow, gradient clipping): a copy taken before an update, put back
    def snapshot(self) -> dict:
        """Copies of the master and the Adam state (12 bytes per element, pageable host memory)."""
        st = self.export_state()
        return {"master": self.master.detach().clone(),
                "state": {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}}

    @torch.no_grad()
    def restore(self, snap: dict) -> None:
        """Undo the updates made since `snapshot()`: the same bits as before."""
        self.master.copy_(snap["master"])
        if self.opt is None:
            self.state = {}
        else:
            self.opt.state.pop(self.master, None)
        self.import_state(snap["state"])

    # ---- state moves (k changed): neutral form in, neutral form out
    def export_state(self) -> dict:
        st = self.state if self.opt is None else self.opt.state.get(self.master, {})
        if not st:
            return {}
        return {"step": int(float(st["step"])), "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}

    def import_state(self, state: dict) -> None:
        if not state:
            return
        dev = self.master.device
        st = {
            "exp_avg": state["exp_avg"].to(dev, torch.float32).clone(),
            "exp_avg_sq": state["exp_avg_sq"].to(dev, torch.float32).clone(),
        }
        if self.opt is None:
            st["step"] = int(state["step"])
            self.state = st
            return
        # torch keeps `step` as a float32 scalar tensor: on the param's device when fused,
        # on the CPU otherwise (see torch.optim.Optimizer._process_value_according_to_param_policy)
        fused = self.opt.param_groups[0].get("fused", False)
        st["step"] = torch.tensor(float(state["step"]), dtype=torch.float32, device=dev if fused else "cpu")
        self.opt.state[self.master] = st
