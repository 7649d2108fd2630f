"""What did the published studies claim, and where does the workbench's measurement differ?

The claims live in one data file, `data/published_claims.json`, with their sources named
(copied from the seed documents of the studies); the reference model's shape is its config's
(data/configs/qwen2-0.5b.json). Nothing here hard-codes a published figure.
"""

from __future__ import annotations

import json
from functools import lru_cache

import pandas as pd

from workbench.core.common import PROJECT_ROOT

CLAIMS_FILE = PROJECT_ROOT / "data" / "published_claims.json"
REFERENCE_CONFIG = PROJECT_ROOT / "data" / "configs" / "qwen2-0.5b.json"  # the published model's shape

# What each published row of study 1 counted: true of the published figures whatever
# was measured. Why the improvements differ depends on the measurement (`_why`). The counts and the model's
# size are the claims file's; the embedding's shape is the model's config (data/configs/qwen2-0.5b.json).
_STUDY1_COUNTS = {
    "freeze_lower": "Published '{freeze_lower}' is a tensor count, and the layers were picked by substring: "
    "'layers.1' also matches layers 10-19, so 'freeze lower' trained only 3 non-layer tensors. "
    "Here the decoder stack is found structurally and its upper half trains, with the final norm and the head "
    "(with tied embeddings the head is the input embedding, so that trains too).",
    "adapter": "Published '{adapter}' counts tensors (2 layers x 12 tensors + norm + head); in elements the "
    "share is very different, and with tied embeddings the head is the embedding, so it trains too.",
    "freeze_embeddings": "Published '{freeze_embeddings}' counts tensors; one tensor (the embedding, {vocab:,} x "
    "{hidden:,}) is {share:.1%} of {model}'s {params:,} elements. With tied embeddings the head is frozen with "
    "the embedding.",
    "full": "All parameters train in both.",
}


@lru_cache(maxsize=2)
def _reference_config(path) -> dict:  # read once per path (a comparison asks for it per strategy)
    return json.loads(path.read_text())


def _study1_counts(name: str) -> str:
    s1 = published()["study1_strategies"]
    config = _reference_config(REFERENCE_CONFIG)
    vocab, hidden, params = config["vocab_size"], config["hidden_size"], s1["setup"]["params_total"]
    counts = {r["strategy"]: r["claimed_trainable"].split()[0] for r in s1["rows"]}
    return _STUDY1_COUNTS.get(name, "").format(**counts, vocab=vocab, hidden=hidden, share=vocab * hidden / params,
                                               model=s1["setup"]["model"], params=params)


# A measured improvement this close to the published one (percentage points, or 2 spreads over seeds where
# that is wider) agrees with it: the published figure has no spread to compare with.
AGREE_POINTS = 5.0


def better(pct: float) -> str:
    """An improvement in held-out perplexity as said: a perplexity that rose is worse, not "-238.3% better"."""
    return f"{pct:.1f}% better" if pct >= 0 else f"{-pct:.1f}% worse"


def _why(name: str, published_pct: float, measured_pct, spread_pct) -> str:
    """Which way, and how far, the measured improvement is from the published one, and the mechanism that
    explains it only where the measurement is consistent with it; then what the published row counted."""
    counts = _study1_counts(name)
    if measured_pct is None or pd.isna(measured_pct):
        return f"Not measured in this run: nothing to set beside the published {published_pct:.1f}%. {counts}"
    spread = 0.0 if spread_pct is None or pd.isna(spread_pct) else float(spread_pct)
    tol = max(AGREE_POINTS, 2 * spread)
    gap = float(measured_pct) - published_pct
    said = f"Measured {better(measured_pct)} against the published {published_pct:.1f}% better: "
    if abs(gap) <= tol:
        said += f"within {tol:.1f} percentage points, they agree."
    else:
        said += f"{abs(gap):.1f} percentage points {'above' if gap > 0 else 'below'}."
        if name == "full":  # all parameters train in both: what else differs, and what it does not show
            rows = published()["study1_strategies"]["rows"]
            top = max(rows, key=lambda r: r["improvement_pct"])
            said += (" The published run started from random weights, so it measured training from scratch, not "
                     f"fine-tuning; that start alone does not explain the gap (the published {top['strategy']} run, "
                     f"from the same start, gained {top['improvement_pct']:.1f}%): not traced.")
    return f"{said} {counts}".strip()


@lru_cache(maxsize=1)
def published() -> dict:
    try:
        return json.loads(CLAIMS_FILE.read_text())
    except FileNotFoundError as e:
        raise FileNotFoundError(f"the published claims file is missing: {CLAIMS_FILE}") from e


def study1_general_problems() -> list[str]:
    s1 = published()["study1_strategies"]
    setup = s1["setup"]
    problems = list(s1["known_problems"])
    vocab = _reference_config(REFERENCE_CONFIG)["vocab_size"]
    problems.insert(0, f"baseline perplexity {setup['baseline_perplexity']:,} is above {setup['model']}'s "
                       f"vocabulary size ({vocab:,}): a model predicting uniformly would score better, so the "
                       "weights were random")
    return problems


def study1_comparison(summary: pd.DataFrame) -> pd.DataFrame:
    """Published rows of study 1 beside the measured summary (from `strategies.tables.summarize`)."""
    s1 = published()["study1_strategies"]
    measured = summary.set_index("strategy") if len(summary) else pd.DataFrame()
    rows = []
    for claim in s1["rows"]:
        name = claim["strategy"]
        m = measured.loc[name] if name in measured.index else None
        rows.append({
            "strategy": name,
            "published_trainable": claim["claimed_trainable"],
            "published_final_ppl": claim["final_perplexity"],
            "published_improvement_pct": claim["improvement_pct"],
            "published_device": claim["device"],
            "published_baseline_ppl": s1["setup"]["baseline_perplexity"],
            "measured_trainable_params": None if m is None else m.get("trainable_params"),
            "measured_trainable_share": None if m is None else m.get("trainable_share"),
            "measured_ppl_before": None if m is None else m.get("ppl_before"),
            "measured_ppl_after": None if m is None else m.get("ppl_after_mean"),
            "measured_improvement_pct": None if m is None else m.get("improvement_mean_pct"),
            "measured_device": None if m is None else m.get("devices"),
            "why_they_differ": _why(name, claim["improvement_pct"], None if m is None else m.get("improvement_mean_pct"),
                                    None if m is None else m.get("improvement_std_pct")),
        })
    return pd.DataFrame(rows)
