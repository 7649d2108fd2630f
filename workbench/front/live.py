"""Live charts: what is the run doing right now (loss, device memory against the budget, speed)?

    live = LiveChart(title="Study 1")
    df = run_strategies(cfg, sinks=[live])     # the chart updates while the study runs
    live.close()                               # final redraw (also done on the last row)

A LiveChart is a training sink: it receives the plain rows the train loop emits and never
reaches into the loop. It draws a plotly figure through a *display handle* and replaces that
output in place (`update_display`), throttled to one redraw per `min_interval_s`. Because each
redraw replaces the previous output, the notebook file holds exactly the final state of the
chart as plotly JSON: small (no plotly.js bundle per chart, unlike a saved FigureWidget) and
correct in an executed notebook, in Voila and in the HTML report (FIELD_NOTES: a FigureWidget
keeps the state it had when first displayed).

Rows it understands: training rows (step, loss, tokens, mem_mib, tokens_per_s, and the run's
labels such as strategy/seed/device/budget_mib) and event rows ({"event": "attempt", ...}) that
say where a run went (shown in the title). On a GPU, rows that carry the memory monitor's CUDA
columns (cuda_peak_allocated_mib, cuda_peak_reserved_mib, nvml_used_mib) add a trace each to the
memory panel, so the allocator's reserved memory and nvidia-smi's figure show beside the budget.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from workbench.core.charts import palette  # (importing charts sets the plotly_mimetype renderer)

CUDA_COLUMNS = (("cuda_peak_allocated_mib", "allocated", "solid"), ("cuda_peak_reserved_mib", "reserved", "dash"),
                ("nvml_used_mib", "NVML used", "dot"))


class LiveChart:
    """A sink drawing loss, memory and throughput per run, redrawn in place."""

    def __init__(
        self,
        title: str = "Live",
        run_keys: Sequence[str] = ("strategy", "seed", "device"),
        min_interval_s: float = 1.0,
        display: bool = True,
        output=None,
    ):
        self.title = title
        self.run_keys = tuple(run_keys)
        self.min_interval_s = min_interval_s
        self.fig = make_subplots(rows=1, cols=3, subplot_titles=("loss", "peak device memory per step (MiB)", "tokens/s"),
                                 horizontal_spacing=0.07)
        self.fig.update_layout(title=title, height=380, margin=dict(t=95, b=40, l=50, r=20),
                               legend=dict(orientation="h", y=-0.2))
        self.fig.update_xaxes(title_text="tokens", col=1)
        self.fig.update_xaxes(title_text="step", col=2)
        self.fig.update_xaxes(title_text="step", col=3)
        self._traces: dict[tuple, tuple[int, int, int]] = {}
        self._budgets: set[float] = set()
        self._status = ""
        self._last_draw = 0.0
        self.rows = 0
        self._handle = None
        # Inside an ipywidgets Output (the knobs panel) display ids are not updated in place, so
        # the chart gets an Output of its own that is cleared and redrawn instead.
        self._output = output
        if output is not None:
            self.draw()
        elif display:
            from IPython.display import display as ipy_display

            # A raw mimebundle: a plotly Figure displays itself through _ipython_display_, which
            # ignores display ids, so every update would append a new chart instead of replacing it.
            self._handle = ipy_display(self._bundle(), raw=True, display_id=True)

    # -- the sink --------------------------------------------------------------------------
    def __call__(self, row: dict[str, Any]) -> None:
        if row.get("event"):
            self._on_event(row)
        elif "loss" in row:
            self._on_step(row)
        now = time.monotonic()
        if now - self._last_draw >= self.min_interval_s:
            self.draw()

    def _label(self, row: dict[str, Any]) -> tuple:
        return tuple(row.get(k) for k in self.run_keys if k in row)

    def _on_event(self, row: dict[str, Any]) -> None:
        who = " ".join(f"{row[k]}" for k in ("strategy", "seed") if k in row)
        what = f"{row.get('attempt')}: {row.get('result')}"
        if row.get("phase"):
            what += f" in {row['phase']}"
        self._status = f"{who} — {what}"

    def _on_step(self, row: dict[str, Any]) -> None:
        key = self._label(row)
        if key not in self._traces:
            name = " ".join(str(v) for v in key) or "run"
            base = len(self.fig.data)
            group = str(key)
            # one colour per run in all three panels (plotly's own cycle gave each trace the next
            # colour, so a run's memory and speed lines wore other runs' legend colours)
            color = palette()[sum(1 for k in self._traces if len(self._traces[k]) == 3) % len(palette())]
            for col in (1, 2, 3):
                self.fig.add_trace(go.Scatter(x=[], y=[], mode="lines", name=name, legendgroup=group,
                                              line_color=color, showlegend=col == 1), row=1, col=col)
            self._traces[key] = (base, base + 1, base + 2)
        i_loss, i_mem, i_tps = self._traces[key]
        self._append(i_loss, row.get("tokens", row.get("step")), row["loss"])
        if row.get("mem_mib") is not None:
            self._append(i_mem, row["step"], row["mem_mib"])
        if row.get("tokens_per_s") is not None:
            self._append(i_tps, row["step"], row["tokens_per_s"])
        for column, what, dash in CUDA_COLUMNS:
            if row.get(column) is not None:
                if (key, column) not in self._traces:
                    self.fig.add_trace(go.Scatter(x=[], y=[], mode="lines", name=f"{self.fig.data[i_mem].name} {what}",
                                                  legendgroup=str(key), showlegend=False, line_dash=dash,
                                                  line_color=self.fig.data[i_mem].line.color), row=1, col=2)
                    self._traces[(key, column)] = (len(self.fig.data) - 1,)
                self._append(self._traces[(key, column)][0], row["step"], row[column])
        budget = row.get("budget_mib")
        if budget and budget not in self._budgets:
            self._budgets.add(budget)
            self.fig.add_hline(y=budget, line_dash="dash", line_color="red", row=1, col=2,
                               annotation_text=f"budget {budget:g} MiB")
        labels = ", ".join(f"{k}={row[k]}" for k in self.run_keys if k in row)
        self._status = f"{labels} — step {row['step']}, loss {row['loss']:.3f}"
        self.rows += 1

    def _append(self, index: int, x, y) -> None:
        trace = self.fig.data[index]
        trace.x = (*(trace.x or ()), x)
        trace.y = (*(trace.y or ()), y)

    # -- drawing ---------------------------------------------------------------------------
    def _snapshot(self) -> go.Figure:
        fig = go.Figure(self.fig)
        if self._status:
            fig.update_layout(title=f"{self.title}<br><sub>{self._status}</sub>")
        memory = [t for t in fig.data if t.xaxis == "x2" and t.y]
        if self.rows and not memory:  # an empty panel that says why, not a bare -1..4 grid
            fig.add_annotation(text="no device memory in these rows<br>(the run reports none on this device)",
                               xref="x2 domain", yref="y2 domain", x=0.5, y=0.5, showarrow=False,
                               font_color="#888")
        return fig

    def _bundle(self) -> dict:
        return pio.renderers["plotly_mimetype"].to_mimebundle(self._snapshot().to_dict())

    def draw(self) -> None:
        self._last_draw = time.monotonic()
        if self._handle is not None:
            self._handle.update(self._bundle(), raw=True)
        elif self._output is not None:
            from IPython.display import display as ipy_display

            self._output.clear_output(wait=True)
            with self._output:
                ipy_display(self._bundle(), raw=True)

    def close(self) -> go.Figure:
        """Draw the final state (whatever the throttle held back) and return the figure."""
        self.draw()
        return self._snapshot()
