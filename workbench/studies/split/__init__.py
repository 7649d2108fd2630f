"""Study 3: how much speed does splitting the Adam update between accelerator and host win back?

    from workbench.studies.split.config import SplitConfig
    from workbench.studies.split.runner import run_split_study
    result = run_split_study(SplitConfig.from_dict({"steps": 6}))

Modules: config (SplitConfig), runner (run_split_study, load_result), figures (every chart, the
report section, the notebook's cells), engine (the split training engine), adam (host Adam
backends), layers (what a layer is, arrival order), balance (the k formula), perf_model (named GPU
profiles, the per-layer schedule simulation; every figure it gives is labelled modelled),
hostbench (this machine's host rates), zero_baseline (DeepSpeed ZeRO-Offload), reference (the plain
AdamW run), preflight (a CPU run held to the memory free), _cuda (the CUDA-only parts), gpu_check
(this study's part of `workbench gpu-check`).
"""
