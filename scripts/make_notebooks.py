"""Write the study notebooks this script owns (run: python scripts/make_notebooks.py).

Notebooks are generated so that they stay small, output-free and identical in structure:
a markdown question, a `parameters` cell of flat literals with a help comment each, one call
into the package, then plots of the returned DataFrame. No logic lives in a notebook.
"""

import sys
from pathlib import Path

import nbformat as nbf

ROOT = Path(__file__).resolve().parent.parent


def notebook(cells):
    nb = nbf.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    out = []
    for kind, src, *tags in cells:
        c = nbf.v4.new_markdown_cell(src) if kind == "md" else nbf.v4.new_code_cell(src)
        if tags:
            c.metadata["tags"] = tags
        out.append(c)
    nb.cells = out
    return nb


STRATEGIES = [
    ("md", """# Study 1: which transfer strategy gives the best model for my small dataset on my card?

Four strategies from the published study (adapter layers, freeze lower layers, freeze embeddings,
full fine-tuning) and three extra rows (LoRA, BitFit, QLoRA) each start from a **fresh copy of the
base model**, train on the target domain for the **same token budget**, and are scored by
**held-out perplexity** before and after, over several seeds.

Each run first tries the preferred device under a memory budget. On a machine without a GPU the
CPU *plays* a GPU of `budget_mib` MiB: live tensor bytes are counted and an out-of-memory error is
raised past the budget, exactly as CUDA would. A strategy that runs out of memory is freed and
restarted from scratch on the next device; the `device_history` column says what happened."""),
    ("code", """# Parameters: each maps onto a field of workbench.studies.strategies.runner.StrategiesConfig (unknown names are errors).
model = "embedded"            # 'embedded', a Hugging Face model id (e.g. 'Qwen/Qwen2-0.5B') or a local model directory
base_size = "default"         # embedded base: 'default' or 'tiny' (tests)
corpus = "embedded"           # target domain: 'embedded' (Python's language reference) or a text file/folder
strategies = ["adapter", "freeze_lower", "freeze_embeddings", "full", "lora", "bitfit", "qlora"]  # strategies to compare
seeds = [0, 1, 2]             # one run per seed and strategy
token_budget = 150000         # training tokens per run, equal for every strategy
seq_len = 128                 # tokens per sequence
micro_batch = 8               # sequences per forward/backward pass
grad_accum = 1                # micro-batches per optimizer step
lr = 1e-3                     # peak learning rate (warm-up, then cosine decay)
qlora_lr = 3e-4               # peak learning rate of the QLoRA row (a 4-bit base diverged at the shared rate)
lora_rank = 8                 # rank of the LoRA / QLoRA adapters
precision = "fp32"            # 'fp32', 'bf16' (CPU or GPU) or 'fp16' (GPU only)
budget_mib = 160.0            # memory budget (MiB) of the first attempt: the GPU, or the CPU playing one (0: none)
devices = []                  # attempts in order, e.g. cuda then cpu, or cpu@64 then cpu (empty: the default)
preflight = True              # skip an attempt whose predicted peak exceeds its budget
eval_blocks = 64              # held-out blocks scored for perplexity
trust_remote_code = False     # let transformers run model code from the hub""", "parameters"),
    ("code", """from workbench.studies.strategies.runner import (StrategiesConfig, run_strategies, summarize, claims_table, steps_frame,
                                write_tables, corpus_overlap, app)
from workbench.studies.strategies import figures as plots
from workbench.core.claims import study1_general_problems
from workbench.front.live import LiveChart

cfg = StrategiesConfig.from_namespace(globals())
print("attempts per strategy:", " -> ".join(cfg.attempts_as_text()), "|", cfg.steps(), "steps per run")
live = LiveChart(title="Study 1: loss, device memory against the budget, speed (live)")
df = run_strategies(cfg, sinks=[live])
live.close();"""),
    ("md", """## Is the held-out text really unseen?

Share of held-out 50-character windows that occur verbatim in the training text: split by
document name alone, and as the workbench splits (repeated paragraphs kept once, held-out
paragraphs sharing a window with training text left out). The limit is 0.5%."""),
    ("code", "corpus_overlap(cfg)"),
    ("md", "## What each strategy achieved (mean and spread over seeds)"),
    ("code", """summary = summarize(df)
summary[["strategy", "statuses", "device_history", "trainable_params", "trainable_share", "ppl_before",
         "ppl_after_mean", "ppl_after_std", "improvement_pct_mean", "improvement_pct_std",
         "train_seconds", "tokens_per_s", "peak_mem_mib", "seeds"]]"""),
    ("code", "plots.perplexity_spread(df).show()"),
    ("code", "plots.loss_curves(steps_frame(df)).show()"),
    ("md", """## Where each run went

`device_history` lists every attempt: `skipped` (the pre-flight estimate said it would not fit),
`oom` with the phase it ran out in, then `ok` on the device that finished it."""),
    ("code", """df[["strategy", "seed", "status", "device", "device_history", "peak_mem_mib", "predicted_peak_mib", "notes"]]"""),
    ("code", "plots.device_timeline(df).show()"),
    ("md", """## The published claims beside this measurement

The published comparison (Qwen2-0.5B, Rust/Candle) reported trainable *tensor* counts, selected
layers by substring, started from random weights, and scored perplexity on training text. Its
rows are shown beside what this run measured for the same strategies."""),
    ("code", """for problem in study1_general_problems():
    print("-", problem)
claims_table(df)"""),
    ("code", "write_tables(df)"),
    ("md", """## Try other settings

The knobs map onto the same config as the `parameters` cell and are validated the same way.
Press **Run** to run the study again with live charts; finished runs are read back, not redone."""),
    ("code", "app(cfg)"),
]


def main():
    targets = {"01_strategies": STRATEGIES}
    for name, cells in targets.items():
        path = ROOT / "notebooks" / f"{name}.ipynb"
        nbf.write(notebook(cells), path)
        print("wrote", path)


if __name__ == "__main__":
    sys.exit(main())
