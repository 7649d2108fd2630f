"""How close is the CUDA-modelled prediction to published GPU measurements? The validation table.

    .venv/bin/python benchmarks/predict_ladder.py --validate     # writes results/ladder/validation.csv
                                                                 # and data/prediction_error.json

Each row is a published training-step peak whose settings are complete (model, precision, what
trains, optimizer, batch x sequence, checkpointing, card, and what the figure measures). The
published runs are LitGPT's `finetune/lora.py` (commit 8641822, PyTorch 2.1, A100 40GB), so the
prediction judged against each figure is of that program: LitGPT's own model and LoRA code
(`lit_gpt`, installed from PyPI as litgpt 0.1.0.dev1, whose model and LoRA forward save the same
tensors as at 8641822: checked by running both) under Lightning Fabric's own precision plugin,
and the first training iteration of the script (the longest example, padded; no optimizer step
yet: the first comes after 128 / micro-batch iterations), simulated on fake tensors with CUDA's
choices and replayed through the caching allocator model, exactly as `workbench estimate` does
for a Hugging Face model. Beside it, the prediction for the same setup in the Hugging Face
implementation (what `workbench estimate` runs) shows how much the program alone changes the
answer. The inputs are the published settings only: nothing here is fitted to the figures.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from workbench.core.common import PROJECT_ROOT
from workbench.core.memory import allocator
from workbench.core.memory import cuda_model
from workbench.core.memory.accounting import MemoryAccounting, MemoryReport
from workbench.core.memory.fake import fakeify
from workbench.core.memory.plan import plan_from_flags
from workbench.core.memory.predict import predict
from workbench.core.results import atomic_write_csv, atomic_write_json, git_commit, now
from workbench.studies.ladder.bnb_041 import quantize_linears
from workbench.studies.ladder.validation_trainer import TRAINER_RUNS, trainer_table

ROOT = PROJECT_ROOT
CONFIGS = ROOT / "data" / "configs"

LITGPT_LORA = ("https://github.com/Lightning-AI/litgpt/blob/main/tutorials/finetune_lora.md "
               "(StableLM 3B / Llama 2 7B, LoRA, micro-batch 1, A100)")
LITGPT_TABLES = ("https://github.com/Lightning-AI/litgpt/blob/main/tutorials/resource-tables.md "
                 "(LitGPT 8641822, A100-SXM4-40GB, PyTorch 2.1.0+cu121)")
SOURCES = {
    "litgpt": "LitGPT finetune/lora.py (commit 8641822, Lightning 2.1.0rc0, PyTorch 2.1.0) prints "
              "torch.cuda.max_memory_allocated() / 1e9 after training (the run also holds a validation pass and one "
              "sample generation, both under inference mode and lower). LoRA r=8, alpha 16, dropout 0.05, on query "
              "and value (inside LitGPT's fused qkv), AdamW, no activation checkpointing, the LM head and "
              "cross-entropy in 128-token chunks, Fabric's bf16-true (weights built in bf16) or bf16-mixed "
              "(fp32 weights, autocast); Fabric casts the model's outputs (the logits) to fp32. The first "
              "iteration forces Alpaca's longest example into the micro-batch, padded (phi-1.5: 1044 tokens, "
              "StableLM Alpha: 1034, Llama 2: 1304); later ones are shorter. Predicted: that iteration of that "
              "program (lit_gpt from litgpt 0.1.0.dev1, Fabric's precision plugin); the Hugging Face column runs "
              "transformers' implementation of the same model with peft's LoRA (GPT-NeoX: on the fused "
              "query_key_value) through the workbench's loop.",
    "litgpt_qlora": "The same script with --quantize bnb.nf4 or bnb.nf4-dq (bf16-true): Lightning's "
                    "BitsandbytesPrecision (Lightning 71aed751) replaced torch.nn.Linear while the model was built, so "
                    "every linear layer, the LM head included, held a 4-bit weight, quantized from fp16, and trained "
                    "through bitsandbytes 0.41.1's MatMul4Bit (dequantize, cast, linear; the layer's input kept for "
                    "backward). The optimizer is bitsandbytes' PagedAdamW, which takes no step in the first "
                    "iteration. Predicted: that program with bitsandbytes 0.41.1's 4-bit layer as its source reads "
                    "(workbench/studies/ladder/bnb_041.py). No Hugging Face column: the workbench's qlora "
                    "setup is another program (today's bitsandbytes saves no input; peft's "
                    "prepare_model_for_kbit_training keeps the other weights in fp32; the LM head stays 16-bit).",
}

# finetune/lora.py's hyperparameters at 8641822
LORA = dict(r=8, alpha=16, dropout=0.05, to_query=True, to_key=False, to_value=True, to_projection=False,
            to_mlp=False, to_head=False)
BATCH_SIZE = 128  # the effective batch: gradient accumulation over 128 / micro-batch iterations
LM_HEAD_CHUNK = 128


@dataclass(frozen=True)
class Published:
    litgpt: str  # LitGPT's config name: the program that was measured
    model: str  # the same model's Hugging Face config file under data/configs
    precision: str  # Fabric's names, which are the CLI's
    lora_targets: str  # the Hugging Face module names, for the comparison column
    batch: int
    seq: int
    published_gb: float  # as published, in 1e9 bytes (0 for a run published as out of memory)
    measures: str  # "allocated" (max_memory_allocated), "reserved", or "oom" (it ran out of memory)
    card: str
    source: str
    source_key: str = "litgpt"
    trainable: str = "lora"
    optimizer: str = "adamw_torch"
    checkpointing: bool = False
    quantize: str = ""  # LitGPT's --quantize (bnb.nf4, bnb.nf4-dq): bitsandbytes 0.41.1 under Fabric's plugin


PUBLISHED = (
    Published("stablelm-base-alpha-3b", "stablelm-base-alpha-3b", "bf16-mixed", "query_key_value", 1, 1034, 26.92,
              "allocated", "A100 40GB", LITGPT_LORA),
    Published("stablelm-base-alpha-3b", "stablelm-base-alpha-3b", "bf16-true", "query_key_value", 1, 1034, 9.69,
              "allocated", "A100 40GB", LITGPT_TABLES),
    Published("stablelm-base-alpha-3b", "stablelm-base-alpha-3b", "bf16-true", "query_key_value", 2, 1034, 12.10,
              "allocated", "A100 40GB", LITGPT_TABLES),
    Published("stablelm-base-alpha-3b", "stablelm-base-alpha-3b", "bf16-true", "query_key_value", 4, 1034, 16.92,
              "allocated", "A100 40GB", LITGPT_TABLES),
    Published("phi-1_5", "phi-1_5", "bf16-true", "q_proj,v_proj", 1, 1044, 4.82, "allocated", "A100 40GB", LITGPT_TABLES),
    Published("phi-1_5", "phi-1_5", "bf16-true", "q_proj,v_proj", 2, 1044, 6.76, "allocated", "A100 40GB", LITGPT_TABLES),
    Published("phi-1_5", "phi-1_5", "bf16-true", "q_proj,v_proj", 4, 1044, 10.68, "allocated", "A100 40GB", LITGPT_TABLES),
    Published("Llama-2-7b-hf", "llama-2-7b", "bf16-true", "q_proj,v_proj", 1, 1304, 21.30, "allocated", "A100 40GB",
              LITGPT_TABLES),
    Published("Llama-2-7b-hf", "llama-2-7b", "bf16-true", "q_proj,v_proj", 2, 1304, 29.07, "allocated", "A100 40GB",
              LITGPT_TABLES),
    # published as out of memory on the same card: the prediction must say it does not fit
    Published("Llama-2-7b-hf", "llama-2-7b", "bf16-true", "q_proj,v_proj", 4, 1304, 0.0, "oom", "A100 40GB",
              LITGPT_TABLES),
    Published("Llama-2-7b-hf", "llama-2-7b", "bf16-mixed", "q_proj,v_proj", 1, 1304, 0.0, "oom", "A100 40GB",
              LITGPT_LORA),
    # QLoRA: the same tables' --quantize rows (bitsandbytes 0.41.1)
    *(Published(lit, model, "bf16-true", targets, 1, seq, gb, "allocated", "A100 40GB", LITGPT_TABLES,
                source_key="litgpt_qlora", quantize=q)
      for lit, model, targets, seq, nf4, dq in (
          ("phi-1_5", "phi-1_5", "q_proj,v_proj", 1044, 3.78, 3.72),
          ("stablelm-base-alpha-3b", "stablelm-base-alpha-3b", "query_key_value", 1034, 6.35, 6.19),
          ("Llama-2-7b-hf", "llama-2-7b", "q_proj,v_proj", 1304, 14.14, 13.84))
      for q, gb in (("bnb.nf4", nf4), ("bnb.nf4-dq", dq))),
)


# ------------------------------------------------------------------------------------------------
# the measured program, simulated

def litgpt_config(name: str, **overrides):
    """LitGPT's config `name` with finetune/lora.py's LoRA settings (overrides: tests shrink it)."""
    from lit_gpt.lora import Config

    return Config.from_name(name, **{**LORA, **overrides})


def simulate_litgpt_lora(config, precision: str, *, batch: int, seq: int, target: str = "cuda",
                         sm: int = cuda_model.DEFAULT_SM, quantize: str = "") -> MemoryReport:
    """The first iteration of LitGPT's finetune/lora.py for `config`, over fake tensors, accounted.

    What the script does, in its order: the model built under `fabric.init_module()` (the
    precision plugin's init context) and LoRA-only trainable; `fabric.setup` (the plugin converts
    the module); `model.max_seq_length = seq` (the longest example; the rope cache is rebuilt
    outside any dtype context); then one micro-batch: `_FabricModule.forward` (convert the input,
    the plugin's forward context, convert the output), the shift, `chunked_cross_entropy`, backward
    of the loss over the accumulation. `target="cuda"`: CUDA's kernel, dropout and autocast
    choices (workbench.core.memory.cuda_model) and the allocation timeline for the allocator model.
    `quantize` ("bnb.nf4", "bnb.nf4-dq"; bf16-true only): every linear layer 4-bit as bitsandbytes
    0.41.1 under Fabric's BitsandbytesPrecision trained it (workbench.studies.ladder.bnb_041); that
    plugin's dtype, forward context and input and output conversions are HalfPrecision's.
    """
    from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision
    from lit_gpt.lora import GPT, mark_only_lora_as_trainable
    from lit_gpt.utils import chunked_cross_entropy
    from torch._subclasses.fake_tensor import FakeTensorMode

    if precision == "bf16-true":
        plugin = HalfPrecision(precision)
    elif precision == "bf16-mixed":
        plugin = MixedPrecision(precision, device="cpu")  # the CPU's autocast under CudaChoices is CUDA's
    else:
        raise ValueError(f"unknown Fabric precision {precision!r}; use bf16-true or bf16-mixed")
    if quantize and (quantize not in ("bnb.nf4", "bnb.nf4-dq") or precision != "bf16-true"):
        raise ValueError(f"quantize {quantize!r} with {precision}: use bnb.nf4 or bnb.nf4-dq with bf16-true")
    with plugin.module_init_context(), torch.device("meta"):
        model = GPT(config)
    mark_only_lora_as_trainable(model)
    model = plugin.convert_module(model)
    if quantize:  # after convert_module, whose .to(bf16) would cast the fp32 quantization state
        quantize_linears(model, double_quant=quantize == "bnb.nf4-dq")
    with torch.device("meta"):
        model.max_seq_length = seq
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakeify(model, fake_mode)
    cuda = torch.device(target).type == "cuda"
    with fake_mode:
        input_ids = torch.zeros((batch, seq), dtype=torch.long)
        targets = torch.zeros((batch, seq), dtype=torch.long)
    choices = cuda_model.cuda_step(sm) if cuda else contextlib.nullcontext()
    with fake_mode, MemoryAccounting(torch.device("cpu"), stub_scalars=True, timeline=cuda, plain_engine=True,
                                     cpu_kernels=not cuda) as acc:
        acc.watch(model)
        with choices as mode:
            (x,) = plugin.convert_input((input_ids,))
            with plugin.forward_context():
                logits = model(x, lm_head_chunk_size=LM_HEAD_CHUNK)
            logits = plugin.convert_output(logits)
            logits[-1] = logits[-1][..., :-1, :]
            loss = chunked_cross_entropy(logits, targets[..., 1:])
            (loss / max(1, BATCH_SIZE // batch)).backward()  # the loop's `logits` stays referenced meanwhile
            del logits, loss
    report = acc.report()
    report.kernels = dict(mode.kernels) if cuda else {}
    return report


def litgpt_peaks(row: Published, config=None, sm: int | None = None) -> dict:
    """Allocated / reserved / live peaks (bytes) of `row`'s program on its card, and where."""
    card = cuda_model.card(row.card)
    report = simulate_litgpt_lora(config or litgpt_config(row.litgpt), row.precision, batch=row.batch, seq=row.seq,
                                  sm=sm or card.sm, quantize=row.quantize)
    alloc = allocator.replay(report.timeline, report.timeline_roles, card.cublas_workspaces, steady_from=0)
    need = allocator.least_reserved(report.timeline, report.timeline_roles, card.cublas_workspaces,
                                     upper=alloc.reserved_peak_bytes)
    return {"allocated": alloc.steady_allocated_peak_bytes, "reserved": alloc.steady_reserved_peak_bytes,
            "needed": need, "live": report.peak_bytes, "where": f"{report.peak.phase} ({report.peak.op})",
            "kernels": ",".join(f"{k}x{n}" for k, n in (report.kernels or {}).items())}


def fits_card(peaks: dict, card) -> bool:
    """Fits: the reserved peak and the CUDA context within the card, as `Prediction.fits` judges (not
    the least cap the replay runs under, `needed`: on the H200 steps needed 5-23% more than it)."""
    return peaks["reserved"] <= card.usable_bytes  # less the context and any driver's reserve


def validate_row(row: Published) -> dict:
    """Predict one published setup on its card, as LitGPT's program and as Hugging Face's, and compare."""
    t0 = time.perf_counter()
    lit = litgpt_peaks(row)
    seconds = time.perf_counter() - t0
    predicted = lit["reserved"] if row.measures == "reserved" else lit["allocated"]
    card = cuda_model.card(row.card)
    fits = fits_card(lit, card)
    plan = plan_from_flags(precision=row.precision, optimizer=row.optimizer, trainable=row.trainable,
                           lora_targets=tuple(row.lora_targets.split(",")), checkpointing=row.checkpointing,
                           batch=row.batch)
    hf, hf_predicted = None, None
    if not row.quantize:  # a 4-bit row has no Hugging Face twin (SOURCES["litgpt_qlora"])
        hf = predict(str(CONFIGS / f"{row.model}.json"), plan, batch=row.batch, seq=row.seq, device="cuda",
                     card=row.card)
        hf_predicted = hf.reserved_peak_bytes if row.measures == "reserved" else hf.allocated_peak_bytes

    def err(b):
        return None if row.measures == "oom" or b is None else round(100 * (b / 1e9 / row.published_gb - 1), 1)

    return {
        "model": row.litgpt, "card": row.card,
        "setup": f"{plan.help}{f', {row.quantize}' if row.quantize else ''}; batch {row.batch} x {row.seq}",
        "published_gb": row.published_gb if row.measures != "oom" else None,
        "measures": "out of memory" if row.measures == "oom" else f"max_memory_{row.measures} (GB = 1e9 bytes)",
        "predicted_fits": fits, "card_gb": round(card.total_bytes / 1e9, 2),
        "predicted_gb": round(predicted / 1e9, 3), "error_pct": err(predicted),
        "predicted_live_gb": round(lit["live"] / 1e9, 3), "predicted_reserved_gb": round(lit["reserved"] / 1e9, 3),
        "predicted_where": lit["where"], "attention": lit["kernels"], "predict_seconds": round(seconds, 1),
        "hf_config": f"data/configs/{row.model}.json",
        "hf_predicted_gb": None if hf is None else round(hf_predicted / 1e9, 3),
        "hf_error_pct": err(hf_predicted), "hf_where": "" if hf is None else hf.where,
        "source": row.source, "notes": SOURCES[row.source_key],
    }


def validation_table(rows=PUBLISHED, out: str | Path | None = None, log=print, trainer_runs=TRAINER_RUNS) -> list[dict]:
    """Every published row predicted (LitGPT's allocated peaks, then optimum-benchmark's Trainer runs:
    allocated and reserved, workbench.studies.ladder.validation_trainer); written atomically to `out`
    (CSV) when given."""
    results = []
    for r in rows:
        res = validate_row(r)
        if res["published_gb"] is None:
            log(f"  {res['model']:<24} {res['setup']:<62} published out of memory; predicted "
                f"{res['predicted_gb']:.3f} GB allocated: {'fits' if res['predicted_fits'] else 'does not fit'} "
                f"on {res['card']} ({res['card_gb']} GB)  [{res['predict_seconds']:.0f} s]")
        else:
            hf = ("no Hugging Face twin" if res["hf_predicted_gb"] is None else
                  f"Hugging Face {res['hf_predicted_gb']:>7.3f} ({res['hf_error_pct']:+5.1f}%)")
            log(f"  {res['model']:<24} {res['setup']:<62} published "
                f"{res['published_gb']:>6.2f}  predicted {res['predicted_gb']:>7.3f} ({res['error_pct']:+5.1f}%)  "
                f"{hf}  [{res['predict_seconds']:.0f} s]")
        results.append(res)
    results += trainer_table(trainer_runs, log=log)
    if out is not None:
        atomic_write_csv(out, pd.DataFrame(results))
    return results


# The margin auto-fit keeps below a card: derived from how far the prediction of the measured
# program missed the published peaks above, never a fixed guess. Every row is within a fraction
# of a percent and most over-predict slightly; the margin is the worst miss in either direction
# (a prediction that is sometimes high can also be low by as much on a program not checked here).
MARGINS_FILE = ROOT / "data" / "prediction_error.json"
MIN_FAMILY_ROWS = 3  # fewer rows of a precision than this are no spread: such a family uses the overall


def margins(results: list[dict]) -> dict:
    """The worst error (in %, either direction) of the allocated peaks per precision family among
    `results`, and overall: the margin a prediction of that kind needs on the cards it was checked
    against. The published reserved peaks are kept as rows (`reserved_rows`) beside the card
    records' (autofit adds the worst shortfall of a setup's placement: card_records.reserved_shortfall)."""
    scored = [r for r in results if not pd.isna(r.get("error_pct"))]  # runs published as out of memory have none
    reserved = [r for r in scored if r["measures"].startswith("max_memory_reserved")]
    scored = [r for r in scored if not r["measures"].startswith("max_memory_reserved")]
    worst: dict[str, float] = {}
    count: dict[str, int] = {}
    for r in scored:
        family = r["setup"].split(",")[0].strip()  # bf16-mixed, bf16-true, ...
        worst[family] = max(worst.get(family, 0.0), abs(float(r["error_pct"])))
        count[family] = count.get(family, 0) + 1
    return {"by_precision_pct": worst, "rows_by_precision": count, "overall_pct": max(worst.values(), default=0.0),
            "rows": sum(count.values()), "min_family_rows": MIN_FAMILY_ROWS,
            "measures": sorted({r["measures"] for r in scored}),
            "reserved_rows": [{"rung": f"{r['model']}: {r['setup']}", "placement": "device", "card": r["card"],
                               "error_pct": float(r["error_pct"]), "record": r["source"].split(":")[0] + " (published)"}
                              for r in reserved]}


def write_margins(results: list[dict], path: str | Path = MARGINS_FILE) -> Path:
    """data/prediction_error.json: the margins, with where they come from (committed: auto-fit reads it)."""
    return atomic_write_json(path, {**margins(results), "source": "workbench.studies.ladder.validation against "
                                    + "; ".join(sorted({r["source"] for r in results})),
                                    "written": now(), "git_commit": git_commit()})
