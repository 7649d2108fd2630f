"""Published reserved peaks: Hugging Face's optimum-benchmark training runs of GPT-2 through the Trainer.

    from workbench.studies.ladder.validation_trainer import TRAINER_RUNS, trainer_peaks, validate_trainer_run
    trainer_peaks(TRAINER_RUNS[0])   # {"allocated": bytes, "reserved": bytes, ...} of that program on its card

optimum-benchmark (Hugging Face's benchmarking harness) publishes each run's whole config, versions and
`torch.cuda.max_memory_allocated` / `max_memory_reserved` (huggingface.co/datasets/optimum-benchmark/rocm,
`cuda_training_transformers_text-generation_openai-community/gpt2`). The program measured
(optimum-benchmark's `scenarios/training` and `backends/pytorch/backend.py`, read at its source):
GPT-2 (124M) with random weights (`no_weights`), fp32, no autocast, built on the CPU and moved with
`.to("cuda")`; peak statistics reset; then `transformers.Trainer` with the scenario's training arguments
(per-device batch 2, no accumulation, 5 steps) and the Trainer's defaults for the rest (torch's AdamW, foreach
on the GPU, lr 5e-5, eps 1e-8, weight decay 0 in the Trainer's two parameter groups; gradient clipping at
1.0; `model.zero_grad()`, to None) on the scenario's generated dataset (input_ids, attention_mask and labels
of 16 tokens); the peaks are over the whole `trainer.train()`. The cards are AMD's (64 GiB; ROCm builds of
PyTorch 2.2-2.4), whose caching allocator is CUDA's, hipified: the same rounding, segments and caching.

Two Trainers were measured. transformers 4.41 called `torch.cuda.empty_cache()` in every training step,
after the forward (huggingface/transformers#28769; removed in 4.42 by #31530 for its cost); 4.40 and
4.42-4.45 did not. Both programs are predicted, from the same model, data and optimizer, with and without
that call: nothing is fitted to the figures.

What the simulation takes from where:
- the model: transformers' GPT2LMHeadModel (this checkout's), plus what 4.x's held beside its weights: each
  attention layer's causal-mask buffer (1 x 1 x n_positions x n_positions bool: 1 MiB) and `masked_bias`
  (an fp32 scalar), all moved to the card in `Module._apply`'s order; and 4.x's loss inside the model
  (`logits[..., :-1, :].contiguous()`, CrossEntropyLoss over the flattened shift) instead of today's;
- the attention: today's SDPA, whatever path each 4.x release took: at 2 x 16 tokens every attention
  tensor is a few KiB in the small pool (4.40 to 4.45, all but 4.41, published the same peaks);
- no cuBLAS workspace: on ROCm, PyTorch allocates the hipBLAS workspace from the caching allocator only
  since 2.6 (pytorch/pytorch#138791). hipBLASLt's per-call 1 MiB workspace (addmm with a bias) is not
  modelled: at most one more 2 MiB small segment.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from workbench.core.common import MiB, PROJECT_ROOT
from workbench.core.memory import allocator
from workbench.core.memory import cuda_model
from workbench.core.memory.accounting import MemoryAccounting, MemoryReport
from workbench.core.memory.fake import fake_step, unpacked_for_fake_inputs
from workbench.core.memory.meta import build_meta_model, model_config

GPT2 = PROJECT_ROOT / "data" / "configs" / "gpt2.json"
DATASET = "https://huggingface.co/datasets/optimum-benchmark/rocm/commit/"
# optimum-benchmark's scenarios/training/config.py: TRAINING_ARGUMENT and DATASET_SHAPES; the CI configs'
# scenario (tests/configs/_training_.yaml): 5 steps
BATCH, SEQ, STEPS = 2, 16, 5
LR, EPS, MAX_GRAD_NORM = 5e-5, 1e-8, 1.0  # TrainingArguments' defaults
ROCM_CARD = cuda_model.Card("AMD Instinct, 64 GiB (ROCm)", 64 * 2**30, cuda_model.DEFAULT_SM)
# what the allocator held for BLAS before the step: nothing on ROCm before PyTorch 2.6 (pytorch/pytorch#138791),
# not ROCM_CARD.cublas_workspaces (CUDA's)
ROCM_WORKSPACES: list[tuple[str, int]] = []
SOURCE = ("optimum-benchmark (Hugging Face) training scenario, published per run with its config: GPT-2, random "
          "weights, fp32, .to('cuda'), transformers.Trainer with per-device batch 2 x 16 tokens, 5 steps, "
          "the Trainer's defaults (torch AdamW foreach, two parameter groups, clipping 1.0); "
          "torch.cuda.max_memory_allocated / max_memory_reserved over trainer.train(), in MB (1e6 bytes); "
          "AMD cards, ROCm builds of PyTorch 2.2-2.4 (the caching allocator is CUDA's, hipified). "
          "Predicted: that program (workbench.studies.ladder.validation_trainer).")


@dataclass(frozen=True)
class TrainerRun:
    transformers: str  # the transformers releases whose runs published these figures
    empty_cache: bool  # the Trainer's training_step called torch.cuda.empty_cache() after the forward (4.41)
    allocated_mb: float  # as published: max_memory_allocated / 1e6
    reserved_mb: float  # max_memory_reserved / 1e6
    commits: tuple[str, ...]  # the dataset's commits that publish them


TRAINER_RUNS = (
    TrainerRun("4.40.2, 4.42.3, 4.42.4, 4.43.3, 4.45.2", False, 2506.73664, 2894.06976,
               ("bda607bab26e0eecce3368705f73723a6e52dadc", "c85dc7f03a6ad79cbb5ef30d275f68b13baae664",
                "c583bcde5f36efff2d3903ff76fc0cd59ad3bbaf", "43527a2723679517d11852ef21efa115ccae058f",
                "601f300a915f0c491fed92900a0557d406e3ef38")),
    TrainerRun("4.41.0", True, 2506.73664, 2738.880512,
               ("2539abf93b987e7e539e2eb74027efb14d0cdf1a", "0c764c714110e5c96b1fa24c0e6c0ae3c4710845")),
)


def add_transformers4_buffers(model: torch.nn.Module, n_positions: int) -> torch.nn.Module:
    """What transformers 4.x's GPT2Attention held beside its weights: the causal mask and `masked_bias`."""
    for module in model.modules():
        if type(module).__name__ == "GPT2Attention":
            module.register_buffer("bias", torch.empty((1, 1, n_positions, n_positions), dtype=torch.bool,
                                                       device="meta"), persistent=False)
            module.register_buffer("masked_bias", torch.empty((), device="meta"), persistent=False)
    return model


def moved_order(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors `module.to(device)` copies, in its order (`Module._apply`: each child first, then the
    module's own parameters, then its buffers); a tied tensor once."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(m):
        for child in m.children():
            walk(child)
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out.append(t)

    walk(module)
    return out


def trainer_optimizer(model: torch.nn.Module, foreach: bool | None) -> torch.optim.Optimizer:
    """Trainer.create_optimizer's AdamW: decayed and not-decayed groups (the Trainer's own split), both at
    weight decay 0.0 (the default), lr 5e-5, betas (0.9, 0.999), eps 1e-8."""
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": 0.0},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=EPS, foreach=foreach)


def trainer_steps(model, optimizer, vocab_size: int, *, batch: int, seq: int, steps: int, empty_cache=None,
                  foreach: bool | None = None) -> torch.Tensor:
    """The Trainer's inner loop as 4.40-4.45 ran it on one device (no accumulation, no mixed precision):
    the batch copied to the device, the forward with 4.x's loss, [`empty_cache()`: 4.41], backward, clipping,
    the optimizer's and the scheduler's steps (the schedule is host-side), `zero_grad` to None."""
    tr_loss = torch.zeros(())
    model.zero_grad()
    for _ in range(steps):
        model.train()
        inputs = {"input_ids": torch.zeros((batch, seq), dtype=torch.long),
                  "attention_mask": torch.ones((batch, seq), dtype=torch.long),
                  "labels": torch.zeros((batch, seq), dtype=torch.long)}
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        shift_logits = outputs.logits[..., :-1, :].contiguous()
        shift_labels = inputs["labels"][..., 1:].contiguous()
        loss = torch.nn.functional.cross_entropy(shift_logits.view(-1, vocab_size), shift_labels.view(-1))
        del outputs, shift_logits, shift_labels  # compute_loss returns the loss alone
        if empty_cache is not None:
            del inputs
            empty_cache()
        (loss / 1).backward()  # accelerate's backward divides by its accumulation steps
        inputs = None  # training_step returns: its batch on the device dies with it
        tr_loss += loss.detach() / 1
        del loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM, foreach=foreach)
        optimizer.step()
        model.zero_grad()
    return tr_loss


def simulate_trainer(config, *, empty_cache: bool, batch: int = BATCH, seq: int = SEQ, steps: int = STEPS,
                     target: str = "cuda", sm: int = cuda_model.DEFAULT_SM) -> MemoryReport:
    """That program over fake tensors, accounted: the weights allocated as `.to()` moves them, then the
    Trainer's steps (CUDA's choices and the allocation timeline for a cuda target)."""
    model = add_transformers4_buffers(build_meta_model(config), config.n_positions)
    step = fake_step(model, n_blocks=1, seq=seq, target=target, sm=sm)
    foreach = True if step.cuda else None  # torch's default picks foreach for CUDA tensors
    optimizer = trainer_optimizer(model, foreach)
    with (unpacked_for_fake_inputs(), step.fake_mode,
          MemoryAccounting(torch.device("cpu"), stub_scalars=True, timeline=step.cuda, plain_engine=True,
                           cpu_kernels=not step.cuda) as acc):
        acc.set_role(moved_order(model), "weights")
        acc.watch(model)
        with step.choices as mode:
            trainer_steps(model, optimizer, config.vocab_size, batch=batch, seq=seq, steps=steps,
                          empty_cache=acc.empty_cache if empty_cache else None, foreach=foreach)
    report = acc.report()
    report.kernels = dict(mode.kernels) if step.cuda else {}
    return report


def trainer_peaks(run: TrainerRun, config=None) -> dict:
    """Allocated / reserved / live peaks (bytes) of `run`'s program on its card, over all its steps."""
    report = simulate_trainer(config or model_config(str(GPT2)), empty_cache=run.empty_cache)
    alloc = allocator.replay(report.timeline, report.timeline_roles, ROCM_WORKSPACES, steady_from=0)
    return {"allocated": alloc.steady_allocated_peak_bytes, "reserved": alloc.steady_reserved_peak_bytes,
            "live": report.peak_bytes, "where": f"{report.peak.phase} ({report.peak.op})",
            "kernels": ",".join(f"{k}x{n}" for k, n in (report.kernels or {}).items())}


def validate_trainer_run(run: TrainerRun) -> list[dict]:
    """One published run: two rows of the validation table, its allocated and its reserved peak."""
    t0 = time.perf_counter()
    peaks = trainer_peaks(run)
    seconds = round(time.perf_counter() - t0, 1)
    setup = ("fp32, full fine-tuning, Trainer defaults (AdamW foreach, 2 groups, clip 1.0)"
             + (", empty_cache() after each forward" if run.empty_cache else "") + f"; batch {BATCH} x {SEQ}, {STEPS} steps")
    rows = []
    for measures, published_mb in (("allocated", run.allocated_mb), ("reserved", run.reserved_mb)):
        predicted = peaks[measures]
        rows.append({
            "model": "gpt2", "card": ROCM_CARD.name, "setup": setup,
            "published_gb": round(published_mb / 1e3, 5),
            "measures": f"max_memory_{measures} (GB = 1e9 bytes)",
            "predicted_fits": peaks["reserved"] <= ROCM_CARD.usable_bytes,
            "card_gb": round(ROCM_CARD.total_bytes / 1e9, 2), "predicted_gb": round(predicted / 1e9, 5),
            "error_pct": round(100 * (predicted / 1e6 / published_mb - 1), 1),
            "predicted_live_gb": round(peaks["live"] / 1e9, 3),
            "predicted_reserved_gb": round(peaks["reserved"] / 1e9, 3), "predicted_where": peaks["where"],
            "attention": peaks["kernels"], "predict_seconds": seconds, "hf_config": "data/configs/gpt2.json",
            "hf_predicted_gb": None, "hf_error_pct": None, "hf_where": "",
            "source": f"transformers {run.transformers}: " + ", ".join(DATASET + c for c in run.commits),
            "notes": SOURCE,
            "published_mib": round(published_mb * 1e6 / MiB, 1), "predicted_mib": round(predicted / MiB, 1),
        })
    return rows


def trainer_table(runs=TRAINER_RUNS, log=print) -> list[dict]:
    rows = []
    for run in runs:
        got = validate_trainer_run(run)
        for r in got:
            log(f"  gpt2 (optimum-benchmark, transformers {run.transformers.split(',')[0]}"
                f"{', empty_cache' if run.empty_cache else ''}) {r['measures'][:18]:<18} published "
                f"{r['published_mib']:>8,.1f} MiB  predicted {r['predicted_mib']:>8,.1f} MiB ({r['error_pct']:+.1f}%)"
                f"  [{r['predict_seconds']:.0f} s]")
        rows += got
    return rows

