"""Study 1's settings: which strategies, seeds, token budget, and the device attempts.

    cfg = StrategiesConfig.from_dict({"base_size": "tiny", "token_budget": 2000, "seeds": [0]})

Field names map 1:1 onto notebook 01's parameters cell (generated from this class) and onto
`workbench strategies NAME=VALUE ...`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

from workbench.core.config import (Config, ConfigError, check_corpus, check_no_repeats, check_scheduler, check_seed,
                                  param, setting)
from workbench.core.fallback import Attempt, default_attempts
from workbench.core.models import EMBEDDED, TINY_SPEC, EmbeddedSpec
from workbench.core.trainable import PAPER_STRATEGIES, STRATEGIES
from workbench.core.training import TrainSettings

STUDY = "strategies"


@dataclass(frozen=True)
class StrategiesConfig(Config):
    model: str = setting("model", EMBEDDED)
    base_size: Literal["default", "tiny"] = setting("base_size", "default")
    corpus: str = setting("corpus", "embedded", "the target domain")
    strategies: tuple[str, ...] = param(PAPER_STRATEGIES + ("lora", "bitfit", "qlora"), "strategies to compare",
                                        choices=tuple(STRATEGIES))
    seeds: tuple[int, ...] = param((0, 1, 2), "one run per seed and strategy")
    token_budget: int = param(150_000, "training tokens per run (equal for every strategy; rounded down to whole "
                                       "optimizer steps)")
    seq_len: int = setting("seq_len", 128)
    micro_batch: int = setting("micro_batch", 8)
    grad_accum: int = setting("grad_accum", 1)
    lr: float = setting("lr", 1e-3, "warm-up then cosine decay")
    qlora_lr: float = param(0.0, "peak learning rate of the QLoRA row; 0: the same as lr (a 3e-4 of its own, "
                                 "once needed, hid a gradient lost in bitsandbytes' CPU path)")
    lora_rank: int = setting("lora_rank", 8, "also of QLoRA")
    precision: Literal["fp32", "bf16", "fp16"] = setting("precision", "fp32", "autocast over fp32 weights; fp16 needs CUDA")
    budget_mib: float = param(160.0, "device-memory budget of the first attempt (the GPU, or the CPU playing one); 0: none")
    devices: tuple[str, ...] = param((), "attempts in order, e.g. ['cuda', 'cpu'] or ['cpu@64', 'cpu'] ('cpu@64:cuda' also models a card's caching allocator); empty: the default")
    preflight: bool = param(True, "skip an attempt whose predicted peak exceeds its budget")
    eval_blocks: int = setting("eval_blocks", 64)
    trust_remote_code: bool = setting("trust_remote_code", False)
    workers: int = param(0, "independent runs side by side: 0 or 1 in this process; N on a local Dask cluster of N "
                            "processes sharing the cores (results unchanged)")
    scheduler: str = param("", "a Dask scheduler address to run the runs on (e.g. a dask-jobqueue SLURM cluster; "
                               "'': none)")

    def __post_init__(self):
        check_corpus(self.corpus)
        if self.workers < 0:
            raise ConfigError(f"workers must be >= 0, got {self.workers}")
        if self.scheduler:
            check_scheduler(self.scheduler)
        for name in ("token_budget", "seq_len", "micro_batch", "grad_accum", "eval_blocks", "lora_rank"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        step = self.micro_batch * self.grad_accum * self.seq_len
        if self.token_budget < step:
            raise ConfigError(f"token_budget {self.token_budget:,} is less than one optimizer step (micro_batch "
                              f"{self.micro_batch} x grad_accum {self.grad_accum} x seq_len {self.seq_len} = "
                              f"{step:,} tokens): raise token_budget or lower those")
        if self.lr <= 0 or self.qlora_lr < 0:
            raise ConfigError(f"lr must be positive and qlora_lr >= 0 (0: the same as lr), got {self.lr} and "
                              f"{self.qlora_lr}")
        if self.budget_mib < 0:
            raise ConfigError(f"budget_mib must be >= 0 (0 = no budget), got {self.budget_mib}")
        if not self.strategies:
            raise ConfigError(f"strategies is empty: give at least one, e.g. strategies=[full]; known: "
                              f"{', '.join(STRATEGIES)}")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ConfigError(f"unknown strategy {', '.join(unknown)}; known: {', '.join(STRATEGIES)}")
        check_no_repeats("strategies", self.strategies)
        check_no_repeats("seeds", self.seeds)
        if not self.seeds:
            raise ConfigError("seeds is empty: give at least one seed, e.g. seeds=[0]")
        for i, seed in enumerate(self.seeds):
            check_seed(f"seeds[{i}]", seed)
        for d in self.devices:
            Attempt.parse(d)
        check_no_repeats("devices", self.devices)
        if self.devices and self.budget_mib not in (0, type(self).__dataclass_fields__["budget_mib"].default):
            # the attempts are the devices as written: a budget beside them was dropped without a word (0, no
            # budget, drops nothing: the quick settings' and the knobs' way out)
            raise ConfigError("budget_mib applies only without devices: write the budget into devices, e.g. "
                              "cuda@8192, and set budget_mib to 0")
        cpu = [d for d in self.attempts_as_text() if not d.startswith("cuda")]
        if self.precision == "fp16" and cpu:  # a fallback to the CPU would end the study, not run
            raise ConfigError(f"fp16 autocast runs on CUDA only, and the attempts include {', '.join(cpu)}; use "
                              f"bf16 or fp32, or devices=['cuda'] (no CPU fallback)")

    # derived values are methods, not stored fields
    def spec(self) -> EmbeddedSpec:
        return TINY_SPEC if self.base_size == "tiny" else EmbeddedSpec()

    def attempts(self) -> tuple[Attempt, ...]:
        if self.devices:
            return tuple(Attempt.parse(d) for d in self.devices)
        return default_attempts(self.budget_mib or None)

    def attempts_as_text(self) -> list[str]:
        return [str(a) for a in self.attempts()]

    def steps(self) -> int:
        """Optimizer steps per run: the token budget rounded down to whole steps."""
        return self.token_budget // (self.micro_batch * self.grad_accum * self.seq_len)

    def train_settings(self, seed: int, strategy: str = "") -> TrainSettings:
        steps = self.steps()
        lr = self.qlora_lr if strategy == "qlora" and self.qlora_lr else self.lr
        return TrainSettings(steps=steps, micro_batch=self.micro_batch, grad_accum=self.grad_accum,
                             lr=lr, warmup_steps=max(1, steps // 10), precision=self.precision, seed=seed)

    def science(self) -> "StrategiesConfig":
        """The settings that change a result: where the runs execute (workers, scheduler) does not."""
        return self.replace(workers=0, scheduler="")

    def run_id(self, strategy: str, seed: int, inputs: str = "") -> str:
        """The run's folder name: strategy, seed and a key of everything that changes its result:
        the settings, and `inputs` (see `run_inputs`: corpus content, base weights, version, code)."""
        run_fields = {k: v for k, v in self.science().to_dict().items() if k not in ("strategies", "seeds")}
        blob = json.dumps({"settings": type(self).from_dict(run_fields).hash(), "inputs": inputs}, sort_keys=True)
        return f"{strategy}-s{seed}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"
