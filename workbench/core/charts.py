"""What every chart and table of the workbench shares: plotly's defaults, the loss curve, and
tables rounded with their units.

The default renderer is `plotly_mimetype` (unless PLOTLY_RENDERER says otherwise), so an executed
notebook stores each chart as JSON data (rendered by JupyterLab and Voila) instead of embedding the
5 MB plotly.js bundle per chart; the HTML report includes plotly.js once. Each study's charts live
in its own figures module (workbench/studies/<study>/figures.py) and are built from results tables
only.
"""

from __future__ import annotations

import math
import os
import sys

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

# Through the variable plotly reads when it first loads its renderers (at the first display):
# setting `pio.renderers.default` here would load them now, and nbformat with them, ~1.7 s of every
# command's start-up whether it shows a figure or not.
os.environ.setdefault("PLOTLY_RENDERER", "plotly_mimetype")
if "plotly.io._renderers" in sys.modules:  # loaded before this module: set it there as well
    pio.renderers.default = os.environ["PLOTLY_RENDERER"]
pio.templates.default = "plotly_white"


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


def _round_sig(x: float, sig: int = 3) -> float:
    if pd.isna(x) or x == 0:
        return x
    return round(x, max(0, sig - 1 - int(math.floor(math.log10(abs(x))))))


def _round_fixed(x: float, decimals: int) -> float:
    """`x` to `decimals` places, but a figure that is not zero is not shown as 0: a tiny model's
    0.023 TFLOP/s keeps two significant digits instead of reading "0.0". Below a thousandth of the
    last place shown it is floating-point noise (an idle share of 5.6e-14 %), and reads 0."""
    r = round(x, decimals) + 0.0  # + 0.0: no "-0.0"
    return _round_sig(x, 2) if r == 0 and abs(x) >= 10.0 ** -(decimals + 3) else r


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
            out[name] = s if pd.api.types.is_integer_dtype(s) else s.astype(float).map(_round_sig)
    return pd.DataFrame(out)
