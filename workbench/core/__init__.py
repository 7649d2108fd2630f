"""Shared machinery: no module here knows about a study.

    common     MiB, Sink, PROJECT_ROOT
    config     the frozen Config base, `param`, the shared vocabulary of settings
    data       corpora, the held-out split (unseen in content), token blocks
    models     the embedded base, loading models (safetensors only), fingerprints
    training   the one training loop (measured runs and predictions run the same code)
    trainable  what each trainable setting (strategy) does to a model
    fallback   device attempts with budgets, GPU-to-CPU fallback on out-of-memory
    results    the one results writer (atomic files, runs.csv under a lock, steps.jsonl)
    claims     the published claims, read from data/published_claims.json
    memory     live-bytes accounting, budgets, monitors, the plan and the step prediction
"""
