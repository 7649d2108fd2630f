"""Study 3's text: the training batches every measured run gets (the same blocks from the same
seeded start) and the held-out blocks each run is scored on, with the scoring itself."""

from __future__ import annotations

import torch

from workbench.core.data import corpus_blocks
from workbench.core.fallback import out_of_memory, release
from workbench.core.models import corpus_for
from workbench.core.training import evaluate_perplexity
from workbench.studies.split.config import SplitConfig


def text_batches(cfg: SplitConfig, tokenizer) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(training batches, held-out blocks) from the target corpus: `steps` batches of `micro_batch` consecutive
    blocks (from a seeded block, wrapping around), the same for every run; `eval_blocks` held-out blocks."""
    train, held = corpus_blocks(tokenizer, corpus_for(cfg.model, cfg.corpus, cfg.spec()), cfg.seq_len, cfg.eval_blocks)
    start = int(torch.randint(0, len(train), (1,), generator=torch.Generator().manual_seed(cfg.seed)))
    batches = []
    for i in range(cfg.steps):
        idx = (start + i * cfg.micro_batch + torch.arange(cfg.micro_batch)) % len(train)
        batches.append(train[idx])
    return batches, held[: cfg.eval_blocks]


def heldout_ppl(model, held: torch.Tensor) -> float:
    return evaluate_perplexity(model, held, batch_size=8)


def base_perplexity(base, held: torch.Tensor, device: torch.device) -> float:
    """The base's held-out perplexity on `device` (on the CPU where its fp32 weights do not fit on
    the card); the base is left on the CPU, so a card holds one run's copy at a time."""
    try:
        ppl = heldout_ppl(base.to(device), held)
    except Exception as e:  # a card too small for the fp32 weights (the runs may still fit)
        if not out_of_memory(e):  # CUDA's own (a cuBLAS handle) as well as torch's
            raise
        ppl = None
    base.to("cpu")
    release(device)
    return heldout_ppl(base, held) if ppl is None else ppl
