"""How close is the CUDA-modelled prediction to published GPU measurements? The validation table.

    .venv/bin/python benchmarks/predict_ladder.py --validate     # writes results/ladder/validation.csv
                                                                 # and data/prediction_error.json

Each row is a published training-step peak whose settings are complete (model, precision, what
trains, optimizer, batch x sequence, checkpointing, card, and what the figure measures), the
prediction for the same setup, and the error. The model inputs are the published settings only:
nothing here is fitted to the figures. Known differences between the published runs and the
predicted step are listed per source (`SOURCES`), not corrected for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from workbench.core.common import PROJECT_ROOT
from workbench.core.memory.plan import plan_from_flags
from workbench.core.memory.predict import predict
from workbench.core.results import atomic_write_csv, atomic_write_json, git_commit, now

ROOT = PROJECT_ROOT
CONFIGS = ROOT / "data" / "configs"

LITGPT_LORA = ("https://github.com/Lightning-AI/litgpt/blob/main/tutorials/finetune_lora.md "
               "(StableLM 3B / Llama 2 7B, LoRA, micro-batch 1, A100)")
LITGPT_TABLES = ("https://github.com/Lightning-AI/litgpt/blob/main/tutorials/resource-tables.md "
                 "(LitGPT 8641822, A100-SXM4-40GB, PyTorch 2.1.0+cu121)")
SOURCES = {
    "litgpt": "LitGPT finetune/lora.py prints torch.cuda.max_memory_allocated() / 1e9 after training "
              "(it covers the training steps, validation and one sample generation). LoRA r=8, alpha 16, "
              "on query and value, AdamW (torch's default: foreach on CUDA), no activation checkpointing, "
              "Alpaca with its longest example padded per micro-batch (phi-1.5: 1044 tokens, StableLM "
              "Alpha: 1034, Llama 2: 1304). Differences from the predicted step: LitGPT's own model code "
              "(fused qkv, LoRA on q and v inside it, the LM head and cross-entropy in 128-token chunks) "
              "where the prediction runs the Hugging Face implementation (GPT-NeoX's fused qkv takes "
              "LoRA on all of q, k, v; peft keeps adapters in fp32); the peak of a batch of several "
              "sequences assumes each is padded to the longest example.",
}


@dataclass(frozen=True)
class Published:
    model: str  # config file under data/configs
    precision: str  # the CLI's names
    lora_targets: str
    batch: int
    seq: int
    published_gb: float  # as published, in 1e9 bytes
    measures: str  # "allocated" (max_memory_allocated) or "reserved"
    card: str
    source: str
    source_key: str = "litgpt"
    trainable: str = "lora"
    optimizer: str = "adamw_torch"
    checkpointing: bool = False


PUBLISHED = (
    Published("stablelm-base-alpha-3b", "bf16-mixed", "query_key_value", 1, 1034, 26.92, "allocated", "A100 40GB", LITGPT_LORA),
    Published("stablelm-base-alpha-3b", "bf16-true", "query_key_value", 1, 1034, 9.69, "allocated", "A100 40GB", LITGPT_TABLES),
    Published("stablelm-base-alpha-3b", "bf16-true", "query_key_value", 2, 1034, 12.10, "allocated", "A100 40GB", LITGPT_TABLES),
    Published("stablelm-base-alpha-3b", "bf16-true", "query_key_value", 4, 1034, 16.92, "allocated", "A100 40GB", LITGPT_TABLES),
    Published("phi-1_5", "bf16-true", "q_proj,v_proj", 1, 1044, 4.82, "allocated", "A100 40GB", LITGPT_TABLES),
    Published("phi-1_5", "bf16-true", "q_proj,v_proj", 2, 1044, 6.76, "allocated", "A100 40GB", LITGPT_TABLES),
    Published("phi-1_5", "bf16-true", "q_proj,v_proj", 4, 1044, 10.68, "allocated", "A100 40GB", LITGPT_TABLES),
    # The same runs, with the activation kernel LitGPT's phi-1_5 runs (gelu_approximate="tanh": one
    # fused F.gelu) instead of Hugging Face's "gelu_new" (NewGELUActivation: tanh-GELU written as
    # six elementwise ops, each saving its input for backward). Same function, different program.
    Published("phi-1_5-litgpt-gelu", "bf16-true", "q_proj,v_proj", 1, 1044, 4.82, "allocated", "A100 40GB", LITGPT_TABLES),
    Published("phi-1_5-litgpt-gelu", "bf16-true", "q_proj,v_proj", 2, 1044, 6.76, "allocated", "A100 40GB", LITGPT_TABLES),
    Published("phi-1_5-litgpt-gelu", "bf16-true", "q_proj,v_proj", 4, 1044, 10.68, "allocated", "A100 40GB", LITGPT_TABLES),
    Published("llama-2-7b", "bf16-true", "q_proj,v_proj", 1, 1304, 21.30, "allocated", "A100 40GB", LITGPT_TABLES),
    Published("llama-2-7b", "bf16-true", "q_proj,v_proj", 2, 1304, 29.07, "allocated", "A100 40GB", LITGPT_TABLES),
)


def validate_row(row: Published) -> dict:
    """Predict one published setup on its card and compare."""

    plan = plan_from_flags(precision=row.precision, optimizer=row.optimizer, trainable=row.trainable,
                           lora_targets=tuple(row.lora_targets.split(",")), checkpointing=row.checkpointing,
                           batch=row.batch)
    t0 = time.perf_counter()
    p = predict(str(CONFIGS / f"{row.model}.json"), plan, batch=row.batch, seq=row.seq, device="cuda", card=row.card)
    predicted = p.allocated_peak_bytes if row.measures == "allocated" else p.reserved_peak_bytes
    return {
        "model": row.model, "setup": f"{plan.help}; batch {row.batch} x {row.seq}", "card": row.card,
        "published_gb": row.published_gb, "measures": f"max_memory_{row.measures} (GB = 1e9 bytes)",
        "predicted_gb": round(predicted / 1e9, 3), "error_pct": round(100 * (predicted / 1e9 / row.published_gb - 1), 1),
        "predicted_live_gb": round(p.peak_bytes / 1e9, 3), "predicted_reserved_gb": round(p.reserved_peak_bytes / 1e9, 3),
        "predicted_where": p.where, "attention": ",".join(f"{k}x{n}" for k, n in p.kernels.items()),
        "predict_seconds": round(time.perf_counter() - t0, 1), "source": row.source, "notes": SOURCES[row.source_key],
    }


def validation_table(rows=PUBLISHED, out: str | Path | None = None, log=print) -> list[dict]:
    """Every published row predicted; written atomically to `out` (CSV) when given."""
    results = []
    for r in rows:
        res = validate_row(r)
        log(f"  {res['model']:<24} {res['setup'][:60]:<60} published {res['published_gb']:>6.2f}  "
            f"predicted {res['predicted_gb']:>7.3f}  error {res['error_pct']:+5.1f}%  [{res['predict_seconds']:.0f} s]")
        results.append(res)
    if out is not None:
        atomic_write_csv(out, pd.DataFrame(results))
    return results


# The margin auto-fit keeps below a card: derived from how far the prediction fell short of the
# published peaks above (under-predictions are what make a "fits" wrong), never a fixed guess.
MARGINS_FILE = ROOT / "data" / "prediction_error.json"


def margins(results: list[dict]) -> dict:
    """The worst under-prediction (in %) per precision family among `results`, and overall: the
    margin a prediction of that kind needs to be safe on the cards it was checked against."""
    worst: dict[str, float] = {}
    for r in results:
        family = r["setup"].split(",")[0].strip()  # bf16-mixed, bf16-true, ...
        short = max(0.0, -float(r["error_pct"]))
        worst[family] = max(worst.get(family, 0.0), short)
    return {"by_precision_pct": worst, "overall_pct": max(worst.values(), default=0.0),
            "rows": len(results), "measures": sorted({r["measures"] for r in results})}


def write_margins(results: list[dict], path: str | Path = MARGINS_FILE) -> Path:
    """data/prediction_error.json: the margins, with where they come from (committed: auto-fit reads it)."""
    return atomic_write_json(path, {**margins(results), "source": "workbench.studies.ladder.validation against "
                                    + "; ".join(sorted({r["source"] for r in results})),
                                    "written": now(), "git_commit": git_commit()})
