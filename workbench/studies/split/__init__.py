"""Study 3: how much speed does splitting the Adam update between accelerator and host win back?

    from workbench.studies.split import SplitConfig, run_split_study
    df = run_split_study(SplitConfig.from_dict({"iterations": 6}))

Modules: engine (the split training engine), adam (host Adam backends), layers (what a layer
is, arrival order), balance (the k formula), perf_model (named GPU profiles, the per-layer
schedule simulation; every figure it gives is labelled modelled), study (the runner, its panel
`app` and its report section), cli.
"""

from workbench.studies.split.adam import AdamHP
from workbench.studies.split.balance import Rates, balance_k
from workbench.studies.split.config import SplitConfig
from workbench.studies.split.engine import SplitEngine
from workbench.studies.split.runner import app, report_section, run_split_study

__all__ = ["AdamHP", "Rates", "SplitConfig", "SplitEngine", "app", "balance_k", "report_section", "run_split_study"]
