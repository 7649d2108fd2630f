"""Each study as a widget app: a knob per config field; Run shows live charts, what it found, its figures.

    from workbench.front.apps import app
    app(StrategiesConfig())          # or LadderConfig(), SplitConfig(): the app of that study

The knobs come from the config class (workbench.front.panel), the live chart is fed by the
runner's sinks (workbench.front.live), and every chart shown after the run is a function of the
study's figures module, the same one the notebook and the report call.
"""

from __future__ import annotations

from typing import Callable

import ipywidgets
import pandas as pd
from IPython.display import display

from workbench.core.charts import table
from workbench.core.config import Config
from workbench.front.live import LiveChart
from workbench.front.panel import knobs
from workbench.studies.ladder import figures as ladder_figures
from workbench.studies.ladder.config import LadderConfig
from workbench.studies.ladder.runner import run_ladder
from workbench.studies.split import figures as split_figures
from workbench.studies.split.config import SplitConfig
from workbench.studies.split.runner import run_split_study
from workbench.studies.strategies import figures as strategies_figures
from workbench.studies.strategies.config import StrategiesConfig
from workbench.studies.strategies.runner import run_strategies


def _live_chart(figures) -> LiveChart:
    """The study notebook's live chart (its title and run keys), inside the knobs panel: with an
    Output of its own, as a display id is not updated in place inside an ipywidgets Output (the
    panel's); the ladder's and the split's apps showed an empty chart for the whole run."""
    chart = ipywidgets.Output()
    display(chart)
    keys = getattr(figures, "NOTEBOOK_RUN_KEYS", None)
    return LiveChart(title=figures.NOTEBOOK_RUN_TITLE, output=chart, **({"run_keys": keys} if keys else {}))


def _findings(figures, result) -> None:
    """What the run found, first, as the notebook shows it (a run read back instead of trained
    again says so there: a Run with the same settings gave the same charts at once, unexplained)."""
    display(table(pd.DataFrame(figures.findings(result), columns=["what we found", "published"])))


def strategies_app(cfg: StrategiesConfig):
    """Study 1's control panel: live loss and memory per run, then the summary and the spread."""

    def run(c: StrategiesConfig):
        live = _live_chart(strategies_figures)
        result = run_strategies(c, sinks=[live], progress=False)
        live.close()
        _findings(strategies_figures, result)
        display(table(strategies_figures.summary_table(result)))
        strategies_figures.perplexity_spread(result.runs).show()
        return result

    return knobs(StrategiesConfig, cfg, run, title="Study 1: change the settings and press Run")


def ladder_app(cfg: LadderConfig):
    """Study 2's control panel: live training charts per measured rung, then the ladder and auto-fit."""

    def run(c: LadderConfig):
        live = _live_chart(ladder_figures)
        result = run_ladder(c, sinks=[live], progress=False)
        live.close()
        _findings(ladder_figures, result)
        display(table(ladder_figures.ladder_table(result)))
        ladder_figures.ladder_figure(result, title=f"memory ladder: {c.model}, micro-batch {c.micro_batch} "
                                                   f"x seq {c.seq_len}").show()
        display(table(ladder_figures.autofit_table(result)))
        return result

    return knobs(LadderConfig, cfg, run, title="Study 2: change the settings and press Run")


# what-if inputs of the performance model: set in code, not offered as knobs
_SPLIT_NO_KNOB = ("host_share", "alpha")


def split_app(cfg: SplitConfig):
    """Study 3's control panel: live charts of the engine's measured runs, then throughput against k."""

    def run(c: SplitConfig):
        live = _live_chart(split_figures)
        result = run_split_study(c, sinks=[live])
        live.close()
        _findings(split_figures, result)
        for caption, runs in split_figures.run_tables(result):
            display(table(runs, caption))
        split_figures.throughput_figure(result).show()
        return result

    fields = [n for n in SplitConfig.fields() if n not in _SPLIT_NO_KNOB]
    return knobs(SplitConfig, cfg, run, fields=fields, title="Study 3: change the settings and press Run")


APPS: dict[type[Config], Callable] = {StrategiesConfig: strategies_app, LadderConfig: ladder_app,
                                      SplitConfig: split_app}


def app(cfg: Config):
    """The widget app of the study `cfg` configures."""
    try:
        return APPS[type(cfg)](cfg)
    except KeyError:
        raise TypeError(f"no app for {type(cfg).__name__}; known: {', '.join(c.__name__ for c in APPS)}") from None
