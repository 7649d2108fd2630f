"""Study 3's check before each measured run on a CPU: a run that cannot fit in the memory this
machine has free is a skipped row with the reason, not the study killed by the kernel (a CPU run
past the free memory raises no OutOfMemoryError; the OOM killer takes the process).

    hold = MemoryHold(cfg, model.config)    # predicts when first asked, on fake tensors
    hold.reason("reference")                # None, or why the plain AdamW run is not run
    hold.reason("engine")                   # the same for an engine run (and ZeRO-Offload)

What is predicted is the plain training step (fused AdamW, everything on one device), simulated
on fake tensors as study 2 does (workbench.core.memory.predict.simulate): exact for the reference
run, which is that step in fp32. The engine has no prediction of its own (its threads and staging
rings do not run on fake tensors), so it is held to a floor: the plain step at the engine's
precision, in 16 bits a pure half-precision step (bf16-true). The engine holds at least that much:
the same batch's activations, its training copy, and an fp32 master, an fp32 gradient buffer and
Adam state (16 bytes a parameter) where the plain step holds its gradients and state (8-16).
A run near the limit can still be killed; one over the floor surely would be.

On a card a run that does not fit raises torch.OutOfMemoryError (the plain step, or the weights
alone, on a card too small: the case study 3 is for); `failure(e)` makes it the run's row, and
`release(device)` gives back the memory it held, so the runs after it have the card.
"""

from __future__ import annotations

import gc

import torch

from workbench.core.common import MiB, one_line, past_free_memory
from workbench.core.memory.plan import rung
from workbench.core.memory.predict import simulate
from workbench.studies.split.config import SplitConfig

# the plain step each kind of run is held to, by the engine's precision (pure 16 bits: no autocast copies)
PLAIN = {"fp32": "fp32", "bf16": "bf16_true", "fp16": "fp16_true"}


class MemoryHold:
    """The predicted peaks (MiB) a study 3 run on this CPU is held to, and the free memory then."""

    def __init__(self, cfg: SplitConfig, config):
        self.cfg, self.config = cfg, config  # `config`: the model's (the loaded base's), no weights read
        self._mib: dict[str, float] = {}  # by precision of the plain step, predicted when first asked

    def need_mib(self, kind: str) -> float:
        """The predicted peak a run of `kind` ("reference" or "engine") is held to, in MiB."""
        precision = "fp32" if kind == "reference" else PLAIN[self.cfg.precision]
        if precision not in self._mib:
            plan = rung("fp32").compose(f"split-{precision}", "the plain step", precision=precision)
            report = simulate(self.config, plan, batch=self.cfg.micro_batch, seq=self.cfg.seq_len)
            self._mib[precision] = report.run_peak_bytes(self.cfg.steps) / MiB
        return self._mib[precision]

    def reason(self, kind: str) -> str | None:
        """Why a run of `kind` is not run here now; None: it may run."""
        short = past_free_memory(self.need_mib(kind))
        if not short:
            return None
        what = ("predicted peak" if kind == "reference" else
                "at least the plain step's predicted peak at this precision,")
        return f"{what} {short}: not run"


def failure(e: BaseException) -> dict:
    """A measured run that raised: its row's status ("oom" for an out-of-memory error, else
    "error") and reason."""
    return {"status": "oom" if isinstance(e, torch.OutOfMemoryError) else "error", "reason": one_line(e)}


def release(device: torch.device) -> None:
    """Give back the device memory of a run that raised, once the caller has dropped its model and
    engine and left the `except` block (the error's frames hold the run's tensors until then)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
