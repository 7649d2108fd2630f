"""A model without its weights: its config from whatever names it, its modules on the meta device.

    from workbench.core.memory.meta import model_config, build_meta_model, weights_bytes
    config = model_config("data/configs/qwen2-0.5b.json")
    weights_bytes(config)          # (parameters, fp32 bytes, largest decoder layer's parameters)

Used by the step prediction (workbench.core.memory.predict) and by the libraries' own estimators
(workbench.core.memory.baselines), which both need a model's shapes but never its values.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from workbench.core.models import load_config
from workbench.core.trainable import model_parts


def model_config(model: Any, spec=None):
    """A PretrainedConfig from a name / model dir / config.json path, a config, or a model."""
    if isinstance(model, PretrainedConfig):
        return model
    if isinstance(model, torch.nn.Module):
        return model.config

    return load_config(model, spec=spec) if spec is not None else load_config(model)


def model_label(config) -> str:
    return getattr(config, "_name_or_path", "") or getattr(config, "model_type", "model")


def build_meta_model(config) -> torch.nn.Module:
    """The model's modules on the meta device, fp32 (as `load_model` loads it), no weights."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def weights_bytes(config) -> tuple[int, int, int]:
    """(parameters, fp32 bytes, largest decoder layer's parameters) from a meta model."""
    model = build_meta_model(config)
    params = {id(p): p for p in model.parameters()}
    n = sum(p.numel() for p in params.values())

    largest = max(sum(p.numel() for p in layer.parameters()) for layer in model_parts(model).layers)
    return n, 4 * n, largest
