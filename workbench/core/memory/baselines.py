"""What do the estimators people use today say, and why do they differ from the simulated step?

    from workbench.core.memory.baselines import baseline_table
    baseline_table(config)            # accelerate's estimate-memory and DeepSpeed's model-state figures

Both are called from the libraries themselves:
- accelerate's `estimate-memory` (accelerate/commands/estimate.py): `calculate_maximum_sizes` on
  an empty model, then `estimate_training_usage`, whose largest entry it reports as "Training
  using Adam": for fp32 its step entry, 4x the model's bytes (as many as weights + gradients + two
  moments); for mixed precision its optimizer entry, 2x (the two fp32 moments alone, without the
  weights and gradients beside them); with no activations, no logits and no temporaries.
- DeepSpeed's `estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs`
  (model states only: weights, gradients, optimizer; activations are left to the user).

The simulated step differs because it counts what they leave out: activations saved for backward,
the vocabulary-sized logits and their loss gradient, the tied embedding's gradient existing
several times at the end of backward, and optimizer temporaries (measured here).
"""

from __future__ import annotations

from typing import Any


from workbench.core.memory.meta import build_meta_model, weights_bytes


def accelerate_estimate(config) -> dict[str, Any]:
    """accelerate's estimate-memory figures for an empty model of `config` (bytes)."""
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes


    total, largest = calculate_maximum_sizes(build_meta_model(config))  # fp32 bytes
    out = {"total_bytes": int(total), "largest_layer_bytes": int(largest[0])}
    for dtype in ("float32", "float16"):
        usage = estimate_training_usage(total, dtype)
        # estimate-memory prints max(usage.values()) as "Training using Adam"
        out[f"training_{dtype}_bytes"] = int(max(usage.values()))
        out[f"components_{dtype}"] = {k: int(v) for k, v in usage.items()}
    return out


def deepspeed_estimates(total_params: int, largest_layer_params: int) -> dict[str, int]:
    """DeepSpeed's model-state estimates for one GPU (bytes): ZeRO-2 and ZeRO-3, with and without offload."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    out = {}
    for offload in (False, True):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total_params, 1, 1, cpu_offload=offload)
        key = "zero2_offload" if offload else "zero2"
        out[f"{key}_gpu_bytes"], out[f"{key}_cpu_bytes"] = int(gpu), int(cpu)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, 1, 1,
                                                       cpu_offload=True, cpu_offload_params=True)
    out["zero3_offload_params_gpu_bytes"], out["zero3_offload_params_cpu_bytes"] = int(gpu), int(cpu)
    return out


def simple_estimate(total_params: int, trainable_params: int) -> int:
    """weights + grads + 2 AdamW moments, fp32: the rule of thumb (16 bytes per trained parameter)."""
    return 4 * total_params + 12 * trainable_params


def baseline_table(config) -> list[dict[str, Any]]:
    """The library estimators' figures as rows (bytes), with why each differs from the simulation."""

    n, fp32_bytes, largest = weights_bytes(config)
    acc = accelerate_estimate(config)
    ds = deepspeed_estimates(n, largest)
    meaning = {4: "as many bytes as weights + gradients + 2 moments",
               2: "the two fp32 moments alone, not the weights and gradients beside them"}

    def why_acc(dtype: str) -> str:  # which of accelerate's entries it reports, and what that counts
        usage = acc[f"components_{dtype}"]
        top = max(usage.values())
        entry, times = next(k for k, v in usage.items() if v == top), top / acc["total_bytes"]
        return (f"its largest entry, '{entry}': {times:g} x the fp32 weights"
                + (f" ({meaning[times]})" if times in meaning else "") + "; no activations, logits or temporaries")
    why_ds = "model states only (weights, gradients, optimizer); activations left out"
    return [
        {"estimator": "rule of thumb (16 B/param)", "compares_to": "fp32", "estimated_bytes": simple_estimate(n, n),
         "why_it_differs": "weights + grads + 2 moments only; no activations, logits, temporaries"},
        {"estimator": "accelerate estimate-memory float32", "compares_to": "fp32",
         "estimated_bytes": acc["training_float32_bytes"], "why_it_differs": why_acc("float32")},
        {"estimator": "accelerate estimate-memory float16", "compares_to": "bf16",
         "estimated_bytes": acc["training_float16_bytes"], "why_it_differs": why_acc("float16")},
        {"estimator": "DeepSpeed ZeRO-2 (no offload)", "compares_to": "fp32",
         "estimated_bytes": ds["zero2_gpu_bytes"], "why_it_differs": why_ds + "; assumes 16-bit weights + fp32 master"},
        {"estimator": "DeepSpeed ZeRO-2 offload", "compares_to": "zero_offload",
         "estimated_bytes": ds["zero2_offload_gpu_bytes"], "why_it_differs": why_ds},
        {"estimator": "DeepSpeed ZeRO-3 offload params", "compares_to": "zero_offload_params",
         "estimated_bytes": ds["zero3_offload_params_gpu_bytes"], "why_it_differs": why_ds},
    ]
