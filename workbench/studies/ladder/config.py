"""Study 2's settings: the model at hand, the rungs, the budget, the reference config.

    cfg = LadderConfig.from_dict({"base_size": "tiny", "steps": 3})

Field names map 1:1 onto notebook 02's parameters cell (generated from this class) and onto
`workbench ladder NAME=VALUE ...`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from workbench.core.common import PROJECT_ROOT
from workbench.core.config import Config, ConfigError, check_no_repeats, param, setting
from workbench.core.fallback import resolve_device
from workbench.core.memory.plan import RUNGS
from workbench.core.models import TINY_SPEC, EmbeddedSpec

STUDY = "ladder"


ROOT = PROJECT_ROOT


@dataclass(frozen=True)
class LadderConfig(Config):
    model: str = setting("model", "embedded", "the model at hand; a config.json also works (random init)")
    base_size: Literal["default", "tiny"] = setting("base_size", "default")
    rungs: tuple[str, ...] = param(tuple(RUNGS), "rungs to predict and measure, top of the ladder first",
                                   choices=tuple(RUNGS))
    micro_batch: int = setting("micro_batch", 8, "of the model at hand; the accumulation rung splits it into "
                               "4 smaller micro-batches with 4x accumulation (or the fewest more that divide "
                               "it), keeping the batch per step")
    seq_len: int = setting("seq_len", 128, "of the model at hand")
    steps: int = setting("steps", 6, "measured per rung; the first is warm-up, left out of timings")
    lr: float = setting("lr", 1e-4, "of the measured runs")
    budget_mib: float = param(100.0, "device budget to fit (MiB): on a card it caps the allocator's reserved "
                              "memory, on the CPU live bytes are counted. On the CPU the default is meant to let "
                              "auto-fit pick a middle setup of the embedded default, not the first rung nor the "
                              "CPU rung (its choice and why: the auto-fit table)")
    measure: bool = param(True, "measure the rungs that can run on this machine")
    autofit: bool = param(True, "run auto-fit for the model at hand with the budget enforced")
    device: Literal["auto", "cpu", "cuda"] = setting(
        "device", "auto", "where auto-fit runs its choice: on a card under a real CUDA budget (its allocator capped "
        "at budget_mib), on the CPU with the budget played by counting live bytes; the rungs are measured on the "
        "CPU either way (a card's rungs: workbench gpu-check)")
    reference_model: str = param("data/configs/qwen2-0.5b.json", "reference config predicted for every rung ('': none)")
    reference_micro_batch: int = param(1, "micro-batch of the reference prediction")
    reference_seq_len: int = param(512, "sequence length of the reference prediction")
    reference_budget_mib: float = param(6144.0, "budget the reference model is checked against (MiB)")
    reference_device: str = param("cpu", "device the reference is predicted for: cpu (exact) or cuda (CUDA's "
                                  "choices simulated, allocator modelled; the budget then caps reserved memory)",
                                  choices=("cpu", "cuda"))
    breakdown_rung: str = param("", "rung whose per-category breakdown the notebook shows ('': bf16_ckpt when "
                                "it is among the rungs, else the first)")
    threads: int = setting("threads", 0)
    seed: int = setting("seed", 0, "of the weights a rung adds (LoRA) and a config.json model's random weights and "
                        "tokens; a measured step's batches are drawn with seed 0")

    def __post_init__(self):
        unknown = [r for r in self.rungs if r not in RUNGS]
        if unknown:
            raise ConfigError(f"unknown rung{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                              f"known rungs: {', '.join(RUNGS)}")
        if not self.rungs:
            raise ConfigError("rungs must name at least one rung")
        check_no_repeats("rungs", self.rungs)
        if self.reference_device not in ("cpu", "cuda"):
            raise ConfigError(f"reference_device must be cpu or cuda, got {self.reference_device!r}")
        if not self.breakdown_rung:  # the default follows the rungs chosen
            object.__setattr__(self, "breakdown_rung", self._default_breakdown())
        if self.breakdown_rung not in self.rungs:
            raise ConfigError(f"breakdown_rung {self.breakdown_rung!r} is not among rungs: {', '.join(self.rungs)} "
                              "(name one of them, or '' for the default)")
        for name in ("micro_batch", "seq_len", "reference_micro_batch", "reference_seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.steps < 2:
            raise ConfigError(f"steps must be at least 2 (the first is warm-up), got {self.steps}")
        if self.threads < 0:  # it was torch's own traceback (set_num_threads expects a positive integer)
            raise ConfigError(f"threads must be 0 (leave as set) or more, got {self.threads}")
        for name in ("budget_mib", "reference_budget_mib"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be a positive number of MiB, got {getattr(self, name)}")

    def resolved_device(self) -> str:
        """Where auto-fit runs (`fallback.resolve_device`: 'auto' is the card where torch can run on one)."""
        return resolve_device(self.device)

    def spec(self):
        return TINY_SPEC if self.base_size == "tiny" else EmbeddedSpec()

    def run_id(self) -> str:
        return f"ladder-{self.hash()}"

    def _default_breakdown(self) -> str:
        return "bf16_ckpt" if "bf16_ckpt" in self.rungs else self.rungs[0]

    def knob_values(self) -> dict:
        """The default breakdown rung as '' on a panel: resolved, it stayed bf16_ckpt when bf16_ckpt was
        taken out of the rungs there, and the run was refused ("not among rungs")."""
        values = super().knob_values()
        return {**values, "breakdown_rung": ""} if self.breakdown_rung == self._default_breakdown() else values


def _resolve(path: str) -> str:
    """A project-relative config path works from any working directory (notebooks run in notebooks/)."""
    p = Path(path)
    return str(ROOT / p) if path and not p.is_absolute() and not p.exists() and (ROOT / p).exists() else path
