"""Study 3's check before each measured run: a run that cannot fit in the memory this machine has
free is a skipped row with the reason, not the study killed by the kernel (a run past the host's
free memory raises no OutOfMemoryError; the OOM killer takes the process).

    hold = MemoryHold(cfg, model.config)    # on a CPU: predicts when first asked, on fake tensors
    hold = MemoryHold(cfg, model.config, device=torch.device("cuda"), n_params=n)   # a run on a card
    hold.reason("reference")                # None, or why the plain AdamW run is not run
    hold.reason("engine", k=0.5)            # the same for an engine run ("zero": ZeRO-Offload)

What is predicted is the plain training step (fused AdamW, everything on one device), simulated
on fake tensors as study 2 does (workbench.core.memory.predict.simulate): exact for the reference
run, which is that step at the study's precision (fp32, or autocast over fp32 weights). The engine has no prediction of its own (its threads and staging
rings do not run on fake tensors), so it is held to a floor: the plain step at the engine's
precision, in 16 bits a pure half-precision step (bf16-true). The engine holds at least that much:
the same batch's activations, its training copy, and an fp32 master, an fp32 gradient buffer and
Adam state (16 bytes a parameter) where the plain step holds its gradients and state (8-16).
A run near the limit can still be killed; one over the floor surely would be.

A run on a card holds the host too, where the card's out-of-memory error does not reach. What it
holds there at least, in bytes a parameter (`card_host_floor`): the reference, its fp32 copy of
the weights, made here before it moves to the card (4); an engine run, an fp32 master and an fp32
gradient of every parameter (8, whatever k) and, from its first step, the Adam state of the share
the host updates (8 x (1 - k)), plus, where it is compared with the reference, the copy of its
masters that comparison takes (4); ZeRO-Offload, DeepSpeed's fp32 master, gradient and Adam state
of every parameter (16). Not counted: the staging rings (64 MiB), the snapshots of fp16 or
clipping speculation (up to `speculation_mib`), DeepSpeed's buffers; an adaptive run may move k
below where it starts, and its host share's state with it.

On a card a run that does not fit raises torch.OutOfMemoryError (the plain step, or the weights
alone, on a card too small: the case study 3 is for); `failure(e)` makes it the run's row, and
`fallback.release(device)` gives back the memory it held, so the runs after it have the card.
"""

from __future__ import annotations

import torch

from workbench.core.common import MiB, one_line, past_free_memory
from workbench.core.fallback import out_of_memory
from workbench.core.memory.plan import rung
from workbench.core.memory.predict import simulate
from workbench.studies.split.config import SplitConfig

# the plain step each kind of run is held to, by the engine's precision (pure 16 bits: no autocast copies)
PLAIN = {"fp32": "fp32", "bf16": "bf16_true", "fp16": "fp16_true"}


def card_host_floor(kind: str, k: float = 0.0, compared: bool = False) -> tuple[float, str]:
    """(bytes a parameter, what they hold) a run of `kind` ("reference", "engine" at share `k`,
    "zero") on a card needs of this machine's memory at least (see the module doc)."""
    if kind == "reference":
        return 4.0, "the run's fp32 copy of the weights, made here before it moves to the card"
    if kind == "zero":
        return 16.0, "DeepSpeed's fp32 master, gradient and Adam state of every parameter"
    what = f"an fp32 master and gradient of every parameter, Adam state of the host's share {1 - k:g}"
    if compared:
        what += " and the masters' copy compared with AdamW"
    return 8.0 + 8.0 * (1.0 - k) + 4.0 * compared, what


class MemoryHold:
    """The memory (MiB) a study 3 run on `device` needs of this machine's at least, and the free
    memory then: on a CPU the predicted peaks, on a card `card_host_floor` for `n_params`."""

    def __init__(self, cfg: SplitConfig, config, device: torch.device = torch.device("cpu"), n_params: int = 0):
        self.cfg, self.config = cfg, config  # `config`: the model's (the loaded base's), no weights read
        self.device, self.n_params = device, n_params
        self._mib: dict[str, float] = {}  # by precision of the plain step, predicted when first asked

    def need_mib(self, kind: str, k: float = 0.0, compared: bool = False) -> float:
        """The host memory a run of `kind` ("reference", "engine" or "zero") is held to, in MiB
        (`k`, `compared`: an engine run's share and whether its masters are compared, on a card)."""
        if self.device.type != "cpu":
            return card_host_floor(kind, k, compared)[0] * self.n_params / MiB
        # the reference: AdamW over fp32 weights, the forward under autocast at the study's precision
        precision = self.cfg.precision if kind == "reference" else PLAIN[self.cfg.precision]
        if precision not in self._mib:
            plan = rung("fp32").compose(f"split-{precision}", "the plain step", precision=precision)
            report = simulate(self.config, plan, batch=self.cfg.micro_batch, seq=self.cfg.seq_len)
            self._mib[precision] = report.run_peak_bytes(self.cfg.steps) / MiB
        return self._mib[precision]

    def reason(self, kind: str, k: float = 0.0, compared: bool = False) -> str | None:
        """Why a run of `kind` is not run here now; None: it may run."""
        short = past_free_memory(self.need_mib(kind, k, compared))
        if not short:
            return None
        if self.device.type != "cpu":
            per, what = card_host_floor(kind, k, compared)
            return (f"host memory: at least {what} ({per:g} bytes x {self.n_params:,} parameters), {short}: "
                    f"not run")
        what = ("predicted peak" if kind == "reference" else
                "at least the plain step's predicted peak at this precision,")
        return f"{what} {short}: not run"


def failure(e: BaseException) -> dict:
    """A measured run that raised: its row's status ("oom" for an out-of-memory error, else
    "error") and reason."""
    return {"status": "oom" if out_of_memory(e) else "error", "reason": one_line(e)}
