"""The studies as notebooks: which exist, how each is generated from its config, and how one runs headless.

    STUDIES["02_ladder"].config              # LadderConfig
    write_notebooks()                        # notebooks/0N_<study>.ipynb from the studies' configs
    run_notebook("01_strategies", {"token_budget": 20000}, out_path)

One name per study everywhere: the package (workbench/studies/<name>), the notebook
(notebooks/0N_<name>.ipynb), the command (`workbench <name> NAME=VALUE ...`) and the results folder
(results/<name>/). Notebooks are generated, never edited by hand: markdown, a `parameters` cell
written from the config's fields, defaults and help (so the cell cannot drift from the config), one
call to the study's runner, and one call per chart or table of the study's figures module. They
are committed without outputs; `tests/test_notebooks.py` holds that the committed notebooks are
what this module generates.

Notebooks are executed with papermill in a fresh kernel; parameters are checked against the
study's config *before* the kernel starts (papermill itself only warns about unknown names), and
the notebook checks them again when it builds its config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

from traitlets.config import Config as TraitletsConfig

from workbench.core.common import PROJECT_ROOT, one_line
from workbench.core.config import Config
from workbench.core.files import atomic_write_text
from workbench.studies.ladder import figures as ladder_figures
from workbench.studies.ladder.config import LadderConfig
from workbench.studies.ladder.runner import load_result as load_ladder
from workbench.studies.ladder.runner import run_ladder
from workbench.studies.split import figures as split_figures
from workbench.studies.split.config import SplitConfig
from workbench.studies.split.runner import load_result as load_split
from workbench.studies.split.runner import run_split_study
from workbench.studies.strategies import figures as strategies_figures
from workbench.studies.strategies.config import StrategiesConfig
from workbench.studies.strategies.runner import load_result as load_strategies
from workbench.studies.strategies.runner import run_strategies

if TYPE_CHECKING:
    import nbformat

NOTEBOOK_DIR = PROJECT_ROOT / "notebooks"


@dataclass(frozen=True)
class StudyNotebook:
    """One study: its name, config, runner, figures module and notebook."""

    study: str                 # strategies | ladder | split
    number: int
    title: str
    config: type[Config]
    run: Callable              # run(cfg, sinks=[...]) -> StudyResult
    load: Callable             # load() -> the latest StudyResult in results/<study>/, or None
    figures: ModuleType        # NOTEBOOK_INTRO, NOTEBOOK, findings(result), report_section(result)
    quick: dict[str, Any] = field(default_factory=dict)  # tiny parameters: a fast, complete run
    # a field the user gives -> the quick parameters that give way to it (they would clash with it)
    quick_yields: dict[str, tuple[str, ...]] = field(default_factory=dict)
    reproduce: dict[str, Any] = field(default_factory=dict)  # what `workbench reproduce` adds (where runs go)

    @property
    def name(self) -> str:
        return f"{self.number:02d}_{self.study}"

    @property
    def path(self) -> Path:
        return NOTEBOOK_DIR / f"{self.name}.ipynb"

    def quick_under(self, given: dict[str, Any]) -> dict[str, Any]:
        """The quick parameters with the user's `given` on top, less those that give way to a given field."""
        quick = {k: v for k, v in self.quick.items() if not any(k in self.quick_yields.get(g, ()) for g in given)}
        return {**quick, **given}

    def config_class(self) -> type[Config]:
        return self.config

    def check(self, parameters: dict[str, Any]) -> Config:
        """Raise ConfigError for parameters the notebook would reject; return the config."""
        return self.config.from_dict(parameters)


STUDIES: dict[str, StudyNotebook] = {
    nb.name: nb
    for nb in (
        StudyNotebook(
            "strategies", 1, "Study 1: transfer strategies with device fallback",
            StrategiesConfig, run_strategies, load_strategies, strategies_figures,
            quick={"base_size": "tiny", "seq_len": 64, "token_budget": 6000, "seeds": [0, 1],
                   "strategies": ["adapter", "freeze_lower", "freeze_embeddings", "full", "lora"],
                   "budget_mib": 13.0, "eval_blocks": 16},
            quick_yields={"devices": ("budget_mib",)},  # devices carry their own budgets (cpu@64, cuda@8192)
            # two single-thread processes trained the embedded base at 1.2x the tokens/s of one
            # two-thread process here; the runs and their results are the same
            reproduce={"workers": 2},
        ),
        StudyNotebook(
            "ladder", 2, "Study 2: the memory ladder",
            LadderConfig, run_ladder, load_ladder, ladder_figures,
            # the pure 16-bit rungs too: the published table's FP16 rows are predicted on them
            quick={"base_size": "tiny", "rungs": ["fp32", "bf16", "bf16_ckpt", "bf16_true", "lora", "bf16_true_lora",
                                                  "zero_offload", "cpu"],
                   "micro_batch": 4, "seq_len": 64, "steps": 2, "budget_mib": 3.0, "reference_seq_len": 32},
        ),
        StudyNotebook(
            "split", 3, "Study 3: the adaptive GPU/CPU update split",
            SplitConfig, run_split_study, load_split, split_figures,
            quick={"base_size": "tiny", "steps": 6, "untimed_steps": 1, "k_sweep": [0.0, 0.5, 1.0],
                   "modelled_k_points": 6},
        ),
    )
}
BY_STUDY: dict[str, StudyNotebook] = {nb.study: nb for nb in STUDIES.values()}


def available() -> list[StudyNotebook]:
    """The study notebooks present in notebooks/."""
    return [nb for nb in STUDIES.values() if nb.path.exists()]


def find(name: str) -> StudyNotebook:
    """A study by notebook name ('01_strategies'), study name ('strategies') or notebook path."""
    stem = Path(name).stem
    if stem in STUDIES:
        return STUDIES[stem]
    if stem in BY_STUDY:
        return BY_STUDY[stem]
    raise KeyError(f"no study notebook {name!r}; known: {', '.join(STUDIES)}")


# ------------------------------------------------------------------------------------------------
# generating the notebooks


def _literal(value: Any) -> str:
    """A value as the flat Python literal a parameters cell holds (tuples become lists)."""
    if isinstance(value, tuple):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    return repr(value)


def parameters_cell(config: type[Config]) -> str:
    """The `parameters` cell: one line per field, its default and its help.

    papermill parses this cell to check the names it is given; a line with a second `=` (in a help
    text) is one it cannot parse and warns about, so help texts say "is" instead."""
    lines = [f"# Parameters: each name is a field of {config.__module__}.{config.__name__} "
             "(unknown names and wrong types are refused)."]
    for f in dataclasses.fields(config):
        help_ = re.sub(r"\s*=\s*", " is ", f.metadata.get("help", "")).replace("\n", " ")
        lines.append(f"{f.name} = {_literal(f.default)}  # {help_}")
    return "\n".join(lines)


def notebook(nb: StudyNotebook) -> nbformat.NotebookNode:
    """The generated notebook of one study."""
    import nbformat  # here, not at the top: ~1.7 s to import (nbformat, jsonschema)

    fig = nb.figures
    run_keys = getattr(fig, "NOTEBOOK_RUN_KEYS", None)
    live = f"LiveChart(title={fig.NOTEBOOK_RUN_TITLE!r}" + (f", run_keys={run_keys!r})" if run_keys else ")")
    cells = [
        nbformat.v4.new_markdown_cell(
            fig.NOTEBOOK_INTRO + f"\n\nRun headless: `workbench {nb.study} NAME=VALUE ...`, or "
            f"`papermill notebooks/{nb.name}.ipynb out.ipynb -p NAME VALUE` (a list as YAML: `-y 'NAME: [0, 1]'`; "
            f"papermill's `-p` reads it as text); every parameter below is a field of `{nb.config.__name__}`."),
        nbformat.v4.new_code_cell(parameters_cell(nb.config), metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(
            "import pandas as pd\n\n"
            "from workbench.core.charts import table\n"
            "from workbench.front.apps import app\n"
            "from workbench.front.live import LiveChart\n"
            f"from workbench.studies.{nb.study} import figures\n"
            f"from workbench.studies.{nb.study}.config import {nb.config.__name__}\n"
            f"from workbench.studies.{nb.study}.runner import {nb.run.__name__}\n\n"
            f"cfg = {nb.config.__name__}.from_namespace(globals())\n"
            f"with {live} as live:  # redrawn as the runs go; its final state stays\n"
            f"    result = {nb.run.__name__}(cfg, sinks=[live])"),
        nbformat.v4.new_markdown_cell("## What we found\n\nEach finding beside the published claim it answers."),
        nbformat.v4.new_code_cell(
            'table(pd.DataFrame(figures.findings(result), columns=["what we found", "published"]))'),
    ]
    for markdown, code in fig.NOTEBOOK:
        if markdown:
            cells.append(nbformat.v4.new_markdown_cell(markdown))
        cells.append(nbformat.v4.new_code_cell(code))
    cells += [
        nbformat.v4.new_markdown_cell(
            "## Try other settings\n\nThe knobs map onto the same config as the `parameters` cell and are "
            "validated the same way. Press **Run** to run the study again with live charts."),
        nbformat.v4.new_code_cell("app(cfg)"),
    ]
    out = nbformat.v4.new_notebook(cells=cells)
    out.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    out.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(out.cells):  # stable ids: regenerating an unchanged notebook changes nothing
        cell["id"] = f"{nb.study}-{i:02d}"
    return out


def notebook_text(nb: StudyNotebook) -> str:
    import nbformat

    return nbformat.writes(notebook(nb)) + "\n"


def write_notebooks(folder: str | Path | None = None) -> list[Path]:
    """Write every study's notebook (notebooks/ by default); returns the paths."""
    folder = Path(folder or NOTEBOOK_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for nb in STUDIES.values():
        path = folder / f"{nb.name}.ipynb"
        atomic_write_text(path, notebook_text(nb))  # a kill part-way left a torn notebook in notebooks/
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------------
# running one headless


UNIX_SOCKETS = os.name == "posix"  # zmq's ipc transport: not on Windows, which keeps TCP


def kernel_transport(ip: str | None = None) -> dict[str, Any]:
    """The traitlets config section that puts a kernel's sockets on Unix sockets (at path prefix
    `ip`; default: beside its connection file) instead of TCP ports on 127.0.0.1, whose output
    stream any user of the machine could read (and every run printed ipykernel's "Kernel is running
    over TCP without encryption"); {} where Unix sockets do not exist."""
    if not UNIX_SOCKETS:
        return {}
    return {"KernelManager": {"transport": "ipc", **({"ip": ip} if ip else {})}}


def cell_limit(timeout_s: int | None, deadline: float) -> Callable[[Any], int]:
    """nbclient's timeout_func: a cell's limit in seconds, what is left before `deadline` (at most
    `timeout_s`, at least 1)."""
    def limit(cell) -> int:
        left = max(1, int(deadline - time.perf_counter()))
        return left if timeout_s is None else min(timeout_s, left)
    return limit


def run_notebook(
    notebook: str | Path,
    parameters: dict[str, Any],
    output: str | Path,
    *,
    cwd: str | Path | None = None,
    log_output: bool = False,
    timeout_s: int | None = None,
    deadline: float | None = None,
    progress: str | None = None,
    kernel_log: str | Path | None = None,
) -> Path:
    """Execute a notebook with papermill; raises papermill's PapermillExecutionError on failure.

    `timeout_s`: each cell's limit (papermill's is per cell); `deadline`: a time.perf_counter() the
    whole notebook ends by (each cell's limit is then what is left of it, at least a second).
    `progress`: a label for papermill's bar of executed cells on stderr (a study's training cell
    runs for minutes, and without it a headless run shows nothing in that time); None: no bar.
    `kernel_log`: a file (rewritten) for the kernel process's own stdout and stderr (its log lines, a
    crash's last words), which it otherwise shares with this process: on ^C the kernel printed a
    15-line ZMQError traceback before the command's one line. The cells' output is in the notebook."""
    import papermill as pm  # here, not at the top: ~1.7 s to import (nbformat, jsonschema)

    path = Path(notebook)
    if not path.exists():
        path = find(str(notebook)).path
    try:
        find(path.stem).check(parameters)
    except KeyError:
        pass  # not a study notebook: papermill's own checks only
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    # the kernel's sockets in a folder only this user can open (removed after the run)
    sockets = tempfile.mkdtemp(prefix="wb-kernel-") if UNIX_SOCKETS else None
    kernel = {"config": TraitletsConfig(kernel_transport(f"{sockets}/k"))} if sockets else {}
    if kernel_log is not None:
        Path(kernel_log).parent.mkdir(parents=True, exist_ok=True)
        Path(kernel_log).write_bytes(b"")
        kernel["kernel_manager_class"] = _logged_kernel(Path(kernel_log))
    try:
        pm.execute_notebook(
            str(path),
            str(output),
            parameters=json.loads(json.dumps(parameters)),
            kernel_name="python3",
            cwd=str(cwd or NOTEBOOK_DIR),
            progress_bar={"desc": progress, "unit": "cell"} if progress else False,
            log_output=log_output,
            stdout_file=None,
            execution_timeout=timeout_s,
            **kernel,
            **({"timeout_func": cell_limit(timeout_s, deadline)} if deadline is not None else {}),
        )
    finally:
        if sockets:
            shutil.rmtree(sockets, ignore_errors=True)
    return output


def _logged_kernel(log: Path) -> type:
    """nbclient's kernel manager, its kernel's stdout and stderr appended to `log` (Popen's, at start)."""
    from jupyter_client import AsyncKernelManager

    class Logged(AsyncKernelManager):
        async def start_kernel(self, **kw: Any) -> None:
            with open(log, "ab") as f:  # the kernel holds its own copy once started
                await super().start_kernel(stdout=f, stderr=f, **kw)

    return Logged


def failure(e: BaseException) -> tuple[str, str | None]:
    """A failed run as (one line, the cell's traceback or None): for an error raised in a cell,
    the cell's exception and its traceback without colour codes (the executed notebook has it
    too); for anything else (a dead kernel, a cell timeout), the exception's first line, and its
    whole text where it has more (nbclient's cell timeout quotes the cell: ten lines had stood in
    runs.csv's error cell and the sweep's summary)."""
    from papermill.exceptions import PapermillExecutionError, strip_color

    if isinstance(e, PapermillExecutionError):
        first = str(e.evalue or "").strip().splitlines()
        return f"{e.ename}: {first[0][:300] if first else ''}", strip_color("\n".join(e.traceback))
    text = str(e).strip()
    return one_line(e), (f"{type(e).__name__}: {text}" if "\n" in text else None)


def nothing_ran(runs, measure: bool = True) -> bool:
    """Whether a study asked to run found no run that finished (ok, or fallback to another device), of those it
    ran here (study 3's measured rows: its modelled ones are no run; the ladder: every rung failed). A study
    whose every run was skipped (`devices=[cuda]` without one) had exited 0 after "No strategy finished a run"."""
    if "status" not in runs or not measure:  # a ladder of predictions alone (measure=False) runs nothing
        return False
    if "role" in runs:  # the ladder predicts first: a rung too big to measure here (a 7B config's) is skipped,
        hand = runs[runs["role"] == "at hand"]["status"]  # no failure; it fails where every rung at hand failed
        return len(hand) > 0 and bool((hand == "error").all())
    runs = runs[runs["source"] == "measured"] if "source" in runs else runs
    return len(runs) > 0 and not runs["status"].isin(["ok", "fallback"]).any()


def no_run_finished(name: str, params: dict[str, Any]) -> str | None:
    """For the notebook `name` just run with `params`: why none of its study's runs finished, read from the
    results it wrote (under results_root()); None where one did, or for a notebook of no study. A notebook
    whose every run was skipped or failed runs to its end (each is a row, with why): `reproduce` and
    `sweep` had called it ok, where `workbench STUDY` exits 1 (`nothing_ran`)."""
    nb = STUDIES.get(name)
    result = nb.load() if nb is not None else None
    if result is None or not nothing_ran(result.runs, measure=params.get("measure", True)):
        return None
    return "no run finished: every run was skipped or failed (the executed notebook's runs table says why)"


if __name__ == "__main__":  # python -m workbench.front.notebooks: regenerate notebooks/
    for written in write_notebooks():
        print("wrote", written)
