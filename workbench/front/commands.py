"""`workbench strategies|ladder|split NAME=VALUE ...`: run one study from the shell.

    workbench strategies base_size=tiny token_budget=6000 'seeds=[0]'
    workbench ladder --quick micro_batch=2
    workbench split steps=20 'k_sweep=[0, 0.5, 1]' 'profiles=["H100-SXM"]'
    workbench split --published        # only the seed's operating point and the verdict on its k band

Every study takes the same syntax: NAME=VALUE for any field of its config (the same names as its
notebook's parameters cell and its knobs; `workbench STUDY --help` lists them). VALUE is read as
YAML (`1e-3`, `true`, `[0, 1]`), else kept as a string; unknown names, wrong types and bad values
are one-line errors. `--quick` starts from the tiny settings `workbench reproduce --quick` uses.
Results go to results/<study>/ (or $WORKBENCH_RESULTS/<study>/); the runs table is printed rounded.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

import pandas as pd

from workbench.core.charts import Table
from workbench.core.common import stdout_to_stderr
from workbench.core.config import ConfigError
from workbench.core.results import results_root
from workbench.front.notebooks import STUDIES, StudyNotebook, nothing_ran
from workbench.front.sweep_points import parse_value
from workbench.studies.split.figures import operating_point_table
from workbench.studies.split.perf_model import measure_here, published_operating_point, seed_verdict


def parse_assignments(items: list[str]) -> dict:
    """NAME=VALUE strings as a dict; each VALUE parsed exactly as a sweep's (sweep_points.parse_value)."""
    out = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name.isidentifier():
            raise ConfigError(f"expected NAME=VALUE, got {item!r}")
        out[name] = parse_value(raw)
    return out


def split_long_text(table: pd.DataFrame, width: int = 48) -> tuple[pd.DataFrame, list[str]]:
    """The runs table for a terminal: a text column with a value longer than `width` (a skipped
    rung's reason, a strategy's notes) would make every row hundreds of characters wide, so it
    leaves the table and its texts follow it, once each, under the row's first column; where a first
    column's value has several texts (study 3's `source`: measured, modelled), under the row's number,
    a `#` column (they had read "measured: ..." twice over, with nothing to say which row)."""
    longest = {c: table[c].map(lambda v: len(v) if isinstance(v, str) else 0).max() for c in table.columns[1:]
               if not pd.api.types.is_numeric_dtype(table[c])}
    long = [c for c, n in longest.items() if n > width]
    if not long:
        return table, []
    key, lines = table.columns[0], []
    if any(table.groupby(key, dropna=False)[c].nunique(dropna=False).max() > 1 for c in long):
        table = table.copy()
        table.insert(0, "#", range(1, len(table) + 1))
        key = "#"
    for col in long:
        lines.append(f"{col} (by {key}):")
        texts = [(k, v) for k, v in zip(table[key], table[col]) if isinstance(v, str) and v.strip()]
        lines += [f"  {k}: {v}" for k, v in dict.fromkeys(texts)]
    return table.drop(columns=long), lines


def paragraph(text: str, indent: str = "", width: int = 100) -> str:
    """A finding or a verdict for a terminal: wrapped at `width` columns, its later lines indented by
    `indent`, words and numbers never split (study 3's verdict had printed as one line of 1,500 characters)."""
    return textwrap.fill(text, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def json_records(table: pd.DataFrame) -> list[dict]:
    """The runs table as JSON records, a column of JSON text (a CSV cell's `history`, a config's list)
    decoded: `--json` carried each run's `history` as a string of JSON to parse again."""

    def decoded(value):
        if isinstance(value, str) and value[:1] in "[{":
            try:
                return json.loads(value)
            except ValueError:
                pass
        return value

    records = json.loads(table.to_json(orient="records"))  # NaN as null, numpy scalars as numbers
    return [{k: decoded(v) for k, v in row.items()} for row in records]


def register(sub) -> None:
    for nb in STUDIES.values():
        # each field's help wrapped under its own column (some run to 300 characters)
        fields = "\n".join(textwrap.fill(h, 100, initial_indent=f"  {n:<22} ",
                                         subsequent_indent=" " * 25, break_on_hyphens=False)
                           for n, h in nb.config.help().items())
        p = sub.add_parser(nb.study, help=nb.title, description=__doc__, epilog=f"fields (NAME=VALUE):\n{fields}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("assignments", nargs="*", metavar="NAME=VALUE", help=f"a field of {nb.config.__name__}")
        p.add_argument("--quick", action="store_true", help="start from the tiny settings (a minute or two)")
        p.add_argument("--json", action="store_true", help="print the runs table as JSON records")
        if nb.study == "split":
            p.add_argument("--published", action="store_true",
                           help="print the seed's operating point as modelled and the verdict on its k band, then stop "
                                "(with --json: both as one JSON document)")
        p.set_defaults(func=main, study=nb)


def main(args) -> int:
    nb: StudyNotebook = args.study
    if getattr(args, "published", False):
        if args.assignments or args.quick:  # the seed's setting is fixed: they were ignored without a word
            raise ConfigError(f"--published models the seed's own setting and takes no "
                              f"{'NAME=VALUE' if args.assignments else '--quick'}; run `workbench split "
                              f"{' '.join(args.assignments) or '--quick'}` for a study of your own settings")
        host = measure_here()  # one measurement for both: two gave an operating point and a verdict of different alphas
        op, verdict = published_operating_point(host_meas=host), seed_verdict(host)
        if args.json:  # stdout is one JSON document
            print(json.dumps({"operating_point": op, "verdict": verdict}, indent=1, default=str))
        else:
            print("The seed's setting, modelled from inputs independent of its figures (claim_*: the seed's):")
            print(Table(operating_point_table(op)))
            print(paragraph(verdict["text"]))
        return 0
    given = parse_assignments(args.assignments)
    cfg = nb.config.from_dict(nb.quick_under(given) if args.quick else given)
    with stdout_to_stderr():  # what is printed while it runs (a library's warning, progress)
        result = nb.run(cfg)  # goes to stderr: stdout carries the runs table and findings alone
    if args.json:  # the runs, with the labels the printed table adds (study 1's peak_is: what a peak counts)
        shown = nb.figures.runs_table(result)
        labels = shown[[c for c in shown if c not in result.runs and not pd.api.types.is_numeric_dtype(shown[c])]]
        print(json.dumps(json_records(result.runs.join(labels)), indent=1))
    else:
        table, notes = split_long_text(nb.figures.runs_table(result))
        print(Table(table))  # as the notebooks show it: thousands separated, flags yes/no, gaps empty
        for line in notes:
            print(line)
        for finding, claim in nb.figures.findings(result):
            print(paragraph(f"- {finding}" + (f"  [published: {claim}]" if claim else ""), indent="  "))
    if result.paths:  # (stderr: stdout is the table, or one JSON document)
        run_dir = f"; this run's files in {result.paths['run_dir']}" if "run_dir" in result.paths else ""
        print(f"workbench {args.command}: results in {results_root() / result.study}{run_dir}", file=sys.stderr)
    return 1 if nothing_ran(result.runs, measure=getattr(cfg, "measure", True)) else 0
