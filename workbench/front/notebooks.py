"""Which study notebooks exist, and how is one executed headless?

    run_notebook("01_strategies", {"token_budget": 20000}, out_dir)

Notebooks are executed with papermill in a fresh kernel; parameters are checked against the
notebook's config class *before* the kernel starts (papermill itself only warns about unknown
names), and the notebook checks them again when it builds its config.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from workbench.core.common import PROJECT_ROOT

NOTEBOOK_DIR = PROJECT_ROOT / "notebooks"


@dataclass(frozen=True)
class StudyNotebook:
    name: str
    config: str  # "module:Class" of the config its parameters map onto
    quick: dict[str, Any] = field(default_factory=dict)  # tiny parameters: a fast, complete run
    title: str = ""

    @property
    def path(self) -> Path:
        return NOTEBOOK_DIR / f"{self.name}.ipynb"

    def config_class(self):
        module, _, cls = self.config.partition(":")
        return getattr(importlib.import_module(module), cls)

    def check(self, parameters: dict[str, Any]):
        """Raise ConfigError for parameters the notebook would reject; return the config."""
        return self.config_class().from_dict(parameters)


STUDIES: dict[str, StudyNotebook] = {
    nb.name: nb
    for nb in (
        StudyNotebook(
            "01_strategies",
            "workbench.studies.strategies.runner:StrategiesConfig",
            quick={"base_size": "tiny", "seq_len": 64, "token_budget": 6000, "seeds": [0, 1],
                   "strategies": ["adapter", "freeze_lower", "freeze_embeddings", "full", "lora"],
                   "budget_mib": 13.0, "eval_blocks": 16},
            title="Study 1: transfer strategies with device fallback",
        ),
        StudyNotebook(
            "02_memory_ladder",
            "workbench.studies.ladder.runner:LadderConfig",
            quick={"tiny": True, "rungs": ["fp32", "bf16", "bf16_ckpt", "lora", "zero_offload", "cpu"],
                   "batch": 4, "seq_len": 64, "steps": 2, "budget_mib": 3.0, "reference_seq": 32,
                   "breakdown_rung": "bf16_ckpt"},
            title="Study 2: the memory ladder",
        ),
        StudyNotebook(
            "03_adaptive_split",
            "workbench.studies.split:SplitConfig",
            quick={"base_size": "tiny", "iterations": 6, "warmup": 1, "k_sweep": [0.0, 0.5, 1.0], "modelled_k_points": 6},
            title="Study 3: the adaptive GPU/CPU update split",
        ),
    )
}


def available() -> list[StudyNotebook]:
    """The study notebooks present in notebooks/ whose package code is importable."""
    out = []
    for nb in STUDIES.values():
        if not nb.path.exists():
            continue
        try:
            nb.config_class()
        except (ImportError, AttributeError):
            continue
        out.append(nb)
    return out


def find(name: str) -> StudyNotebook:
    """A study notebook by name ('01_strategies') or path."""
    stem = Path(name).stem
    if stem in STUDIES:
        return STUDIES[stem]
    raise KeyError(f"no study notebook {name!r}; known: {', '.join(STUDIES)}")


def run_notebook(
    notebook: str | Path,
    parameters: dict[str, Any],
    output: str | Path,
    *,
    cwd: str | Path | None = None,
    log_output: bool = False,
    timeout_s: int | None = None,
) -> Path:
    """Execute a notebook with papermill; raises papermill's PapermillExecutionError on failure."""
    import papermill as pm

    path = Path(notebook)
    if not path.exists():
        path = find(str(notebook)).path
    try:
        find(path.stem).check(parameters)
    except KeyError:
        pass  # not a study notebook: papermill's own checks only
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    pm.execute_notebook(
        str(path),
        str(output),
        parameters=parameters,
        kernel_name="python3",
        cwd=str(cwd or NOTEBOOK_DIR),
        progress_bar=False,
        log_output=log_output,
        stdout_file=None,
        execution_timeout=timeout_s,
    )
    return output

