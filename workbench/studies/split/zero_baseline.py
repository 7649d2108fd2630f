"""How fast is DeepSpeed's own ZeRO-Offload (ZeRO-2, optimizer on the CPU) on the same data?

The baseline the split is meant to beat: gradients go to the host and DeepSpeedCPUAdam updates
them after backward. One process, rank 0 of 1: NCCL when the model is on CUDA, gloo on the CPU
(`workbench.core.common.single_process_group`). The first run builds DeepSpeed's ops
(about two minutes here); a failure to set DeepSpeed up is returned as a reason; one while it trains
is raised (the runner makes it a row).
"""

from __future__ import annotations

import time

import torch

from workbench.core.common import clear_stale_build_lock, one_line, single_process_group
from workbench.core.memory.offload import REDUCE_BUCKET_SIZE  # DeepSpeed's default

NOT_INSTALLED = "not installed"  # a library baseline's reason: recorded, and passed over by gpu-check's verdict


def run_zero_offload(model: torch.nn.Module, batches: list[torch.Tensor], lr: float, weight_decay: float,
                     precision: str = "fp32", max_grad_norm: float = 0.0) -> tuple[list[dict], str | None]:
    """Train with deepspeed.initialize(ZeRO-2 + offload_optimizer=cpu); per-iteration rows, or
    ([], reason) when DeepSpeed cannot run here (NOT_INSTALLED: not installed at all)."""
    try:
        import deepspeed
    except ImportError:
        return [], NOT_INSTALLED
    try:
        single_process_group(next(model.parameters()).device)  # no port open to the network (DeepSpeed's own would)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        config = {
            "train_micro_batch_size_per_gpu": batches[0].shape[0],
            "gradient_accumulation_steps": 1,
            # the gradient bucket: with the optimizer offloaded DeepSpeed keeps one of reduce_bucket_size
            # elements on the card (contiguous_gradients is forced on), 5e8 by default: 1.9 GiB in fp32
            # whatever the model. No larger than the trainable parameters: the same one flush per
            # backward for a model under 5e8 parameters, without the gigabytes a small card lacks
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                  "reduce_bucket_size": min(REDUCE_BUCKET_SIZE, trainable)},
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": weight_decay}},
            "bf16": {"enabled": precision == "bf16"},
            "fp16": {"enabled": precision == "fp16"},
            "steps_per_print": 10**9,
            "gradient_clipping": max_grad_norm,  # 0: off (DeepSpeed's default), as in the engine
        }
        clear_stale_build_lock("cpu_adam")  # the offloaded optimizer is DeepSpeed's CPU Adam, built on first use
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    except Exception as e:  # build failures, missing package, unsupported device
        return [], f"DeepSpeed ZeRO-Offload unavailable: {one_line(e, 200)}"
    rows = []
    try:
        for i, b in enumerate(batches):
            t0 = time.perf_counter()
            loss = engine(input_ids=b.to(engine.device), labels=b.to(engine.device)).loss
            engine.backward(loss)
            engine.step()
            value = loss.item()
            if torch.device(engine.device).type == "cuda":  # what step() left queued is this iteration's too
                torch.cuda.synchronize(engine.device)
            dt = time.perf_counter() - t0
            rows.append({"iteration": i, "loss": value, "iteration_ms": dt * 1e3,
                         "tokens": b.numel(), "tokens_per_s": b.numel() / dt, "k_actual": 0.0})
    finally:  # also after an error (out of memory on a card): its gradient hooks would hold the model for good
        engine.destroy()
    return rows, None
