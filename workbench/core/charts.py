"""What every chart and table of the workbench shares: plotly's defaults, the loss curve, and
tables rounded with their units and shown in full (`table`: the notebooks, the apps and the report
show a table the same way).

The default renderer is `plotly_mimetype` (unless PLOTLY_RENDERER says otherwise), so an executed
notebook stores each chart as JSON data (rendered by JupyterLab and Voila) instead of embedding the
5 MB plotly.js bundle per chart; the HTML report includes plotly.js once. Each study's charts live
in its own figures module (workbench/studies/<study>/figures.py) and are built from results tables
only.
"""

from __future__ import annotations

import functools
import html
import math
import os
import sys
from decimal import Decimal

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio


def hosted_notebook() -> str | None:
    """The hosted notebook this runs in, by plotly's own test: 'colab', 'kaggle', or None. Colab
    frames each output and draws no plotly mimetype: plotly picks an HTML renderer there itself."""
    if "COLAB_NOTEBOOK_ID" in os.environ:
        return "colab"
    return "kaggle" if os.path.exists("/kaggle/input") else None


# Through the variable plotly reads when it first loads its renderers (at the first display):
# setting `pio.renderers.default` here would load them now, and nbformat with them, ~1.7 s of every
# command's start-up whether it shows a figure or not. Not on Colab or Kaggle (their own renderer).
if hosted_notebook() is None:
    os.environ.setdefault("PLOTLY_RENDERER", "plotly_mimetype")
    if "plotly.io._renderers" in sys.modules:  # loaded before this module: set it there as well
        pio.renderers.default = os.environ["PLOTLY_RENDERER"]
pio.templates.default = "plotly_white"


@functools.cache
def palette() -> tuple[str, ...]:
    """The template's colours, for a series that must keep its colour across panels (a run in the live
    chart's three panels, a category in study 2's per-model breakdown). Read at the first chart, not
    at import: loading the template costs every command ~0.1 s."""
    return tuple(pio.templates["plotly_white"].layout.colorway)


def loss_curves(steps: pd.DataFrame, *, color: str = "strategy", title: str = "Training loss") -> go.Figure:
    """Loss against tokens seen, one line per (color, seed) run."""
    fig = go.Figure()
    if steps.empty:
        return fig.update_layout(title=f"{title} (no steps recorded)")
    group_cols = [c for c in (color, "seed", "device") if c in steps]
    for key, g in steps.groupby(group_cols, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        label = " ".join(f"{v}" if c == color else f"{c}={v}" for c, v in zip(group_cols, key))
        fig.add_trace(go.Scatter(x=g["tokens"], y=g["loss"], mode="lines", name=label,
                                 legendgroup=str(key[0])))
    return fig.update_layout(title=title, xaxis_title="tokens seen", yaxis_title="loss (nats/token)")


# ------------------------------------------------------------------------------------------------
# tables as people read them: units in the header, rounded to what the measurement supports

_UNIT_SUFFIXES = (  # (column suffix, header suffix, scale, decimals)
    ("_bytes", " (MiB)", 1 / 2**20, 1),
    ("_mib", " (MiB)", 1.0, 1),
    ("_gib", " (GiB)", 1.0, 2),
    ("_pct", " (%)", 1.0, 1),
    ("_share", " (%)", 100.0, 1),
    ("_ms", " (ms)", 1.0, 1),
    ("_seconds", " (s)", 1.0, 1),
    ("tokens_per_s", " (tok/s)", 1.0, 0),
    ("tflops", " (TFLOP/s)", 1.0, None),  # None: 3 significant digits (a CPU's 0.053 is not "0.1")
)

# a header `rounded` wrote: "peak (MiB)", "tok/s", "TFLOP/s"
_SHOWN_UNITS = tuple(unit if suffix.startswith("_") else unit.strip(" ()") for suffix, unit, *_ in _UNIT_SUFFIXES)


def _round_sig(x: float, sig: int = 3) -> float:
    if pd.isna(x) or x == 0:
        return x
    return round(x, max(0, _sig_places(x, sig)))


def _round_fixed(x: float, decimals: int) -> float:
    """`x` to `decimals` places, but a figure those places would leave with one significant digit
    or none keeps two: a tiny model's 0.023 TFLOP/s does not read "0.0", nor BitFit's 0.07% of the
    parameters "0.1" (40% too many). Below a thousandth of the last place shown it is floating-point
    noise (an idle share of 5.6e-14 %), and reads 0."""
    r = round(x, decimals) + 0.0  # + 0.0: no "-0.0"
    small = abs(x) < 10.0 ** (1 - decimals)  # one significant digit at most in `decimals` places
    return _round_sig(x, 2) if small and abs(x) >= 10.0 ** -(decimals + 3) else r


def _numbers(s: pd.Series) -> pd.Series:
    """A column of numbers and gaps as floats: rows built with None where a run has no figure make
    an object column, which would otherwise be shown raw, under its raw name."""
    if s.dtype != object:
        return s
    present = s.dropna()
    if not len(present):  # all gaps: a figure column if its name has a unit (peak_mem_mib), else text
        return s.astype(float) if any(str(s.name).endswith(suffix) for suffix, *_ in _UNIT_SUFFIXES) else s
    if all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return s.astype("Int64")  # counts stay whole
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return s.astype(float)
    return s


def rounded(df: pd.DataFrame) -> pd.DataFrame:
    """A copy of `df` for reading: sizes in MiB, shares in %, times in ms or s, speeds in tok/s,
    each with its unit in the header and rounded to one or two decimals (two significant digits
    where that would show a figure that is not zero as 0); other numbers to three significant
    digits. The results files keep full precision; this is only how they are shown."""
    out = {}
    for col in df.columns:
        s = _numbers(df[col])
        name = str(col)
        if name.endswith(_SHOWN_UNITS):  # rounded already (a figures table shown by `table`): as it is
            out[name] = s
            continue
        if pd.api.types.is_bool_dtype(s) or not pd.api.types.is_numeric_dtype(s):
            out[name] = s
            continue
        for suffix, unit, scale, decimals in _UNIT_SUFFIXES:
            if name.endswith(suffix):
                if suffix.startswith("_"):
                    header = name[: -len(suffix)] + unit
                else:  # tokens_per_s -> tok/s, tflops -> TFLOP/s
                    header = name[: -len(suffix)] + unit.strip(" ()")
                if header in out:  # e.g. x_bytes beside x_mib: keep the first
                    break
                out[header] = (s.astype(float) * scale).map(
                    _round_sig if decimals is None else lambda x, d=decimals: _round_fixed(x, d))
                break
        else:
            out[name] = s if pd.api.types.is_integer_dtype(s) else _round_column(s.astype(float))
    return pd.DataFrame(out)


def _sig_places(x: float, sig: int = 3) -> int:
    return sig - 1 - int(math.floor(math.log10(abs(x))))


def _round_column(s: pd.Series) -> pd.Series:
    """A column without a unit to three significant digits of its smallest figure, every figure to
    the same places: a perplexity of 120.4 beside 85.9 reads 120.4, not 120 (shown as "120.0" in a
    column of one decimal, a digit it does not have). Where that would take more than two places
    (learning rates, 0.0248 beside 32.2) each figure keeps its own three significant digits."""
    present = [abs(v) for v in s if math.isfinite(v) and v != 0]
    places = max((_sig_places(v) for v in present), default=0)
    if places > 2:
        return s.map(_round_sig)
    return s.map(lambda x: x if not math.isfinite(x) else round(x, max(0, places)) + 0.0)


# ------------------------------------------------------------------------------------------------
# tables shown in full: a notebook, a Voila app and the report show a table the same way


def _decimals(x: float) -> int:
    """The decimal places `x` (rounded already) needs: 8577.0 -> 0, 4.25 -> 2, 1e-05 -> 5."""
    if x.is_integer():
        return 0
    return min(6, max(0, -Decimal(repr(x)).as_tuple().exponent))


def _cells(s: pd.Series) -> tuple[list[str], bool]:
    """A column's cells as text, and whether it holds numbers (shown right-aligned): thousands
    separated, one number of decimals per column, a gap as an empty cell, a flag as yes/no."""
    flags = [v for v in s if not _gap(v)]
    if pd.api.types.is_bool_dtype(s) or (flags and all(isinstance(v, (bool, np.bool_)) for v in flags)):
        return ["" if _gap(v) else "yes" if v else "no" for v in s], False  # a flag with gaps too
    if pd.api.types.is_numeric_dtype(s):
        present = [float(v) for v in s if not pd.isna(v)]
        if all(math.isfinite(v) for v in present):
            d = max((_decimals(v) for v in present), default=0)
            if d <= 2:  # the column's places for every figure: 8,577.0 above 4.2
                return ["" if pd.isna(v) else f"{float(v):,.{d}f}" for v in s], True
            # significant digits (TFLOP/s): each figure its own places, or 32.2 reads 32.2000 below 0.0248
            return ["" if pd.isna(v) else f"{float(v):,.{_decimals(float(v))}f}" for v in s], True
        return ["" if pd.isna(v) else f"{v:,}" for v in s], True
    return ["" if _gap(v) else str(v) for v in s], False


def _gap(v) -> bool:
    return v is None or (pd.api.types.is_scalar(v) and pd.isna(v))


def table_html(df: pd.DataFrame) -> str:
    """`df` as an HTML table for reading: rounded with units (`rounded`), every text in full, text
    left-aligned and numbers right-aligned, gaps empty, no row index; inside a box that scrolls
    sideways when the table is wider than the page (a run table with notes)."""
    shown = rounded(df)
    columns = [_cells(shown[c]) for c in shown.columns]
    align = ["right" if numeric else "left" for _, numeric in columns]
    head = "".join(f'<th style="text-align:{a}">{html.escape(str(c))}</th>' for c, a in zip(shown.columns, align))
    rows = "".join(
        "<tr>" + "".join(f'<td style="text-align:{a}">{html.escape(cells[i])}</td>'
                         for (cells, _), a in zip(columns, align)) + "</tr>"
        for i in range(len(shown)))
    return (f'<div class="wide" style="overflow-x:auto;max-width:100%"><table class="wb-table">'
            f"<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>")


class Table:
    """A table as a notebook, a Voila app or a terminal shows it (see `table_html`). pandas' own
    display cuts every cell at 50 characters, so the notebooks' findings and a skipped rung's
    reason read "Predicted peaks of 5 rung(s) measured here are..."; this shows them whole."""

    def __init__(self, df: pd.DataFrame, caption: str = ""):
        self.df = df
        self.caption = caption

    def _repr_html_(self) -> str:
        text = f"<p>{html.escape(self.caption)}</p>" if self.caption else ""
        return text + (table_html(self.df) if len(self.df.columns) else "<p>(no columns)</p>")

    def __repr__(self) -> str:  # a terminal, or a notebook's text/plain: the same cells, aligned
        shown = rounded(self.df)
        text = f"{self.caption}\n\n" if self.caption else ""
        if not len(shown.columns):
            return text + "(no columns)"
        lines = [[str(c) for c in shown.columns]]
        columns = [_cells(shown[c]) for c in shown.columns]
        lines += [[cells[i] for cells, _ in columns] for i in range(len(shown))]
        widths = [max(len(line[j]) for line in lines) for j in range(len(columns))]
        return text + "\n".join("  ".join(v.rjust(w) if numeric else v.ljust(w)
                                   for v, w, (_, numeric) in zip(line, widths, columns)).rstrip()
                         for line in lines)


def table(df: pd.DataFrame, caption: str = "") -> Table:
    """`df` shown in full, rounded with units, after a paragraph of `caption` (wrapped like text, where
    a printed line ran past a Voila page's edge): the last line of a notebook cell, or display(table(df))."""
    return Table(df, caption)
