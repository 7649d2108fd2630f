"""Live charts: what is the run doing right now (loss, device memory against the budget, speed)?

    with LiveChart(title="Study 1") as live:
        result = run_strategies(cfg, sinks=[live])  # the chart updates while the study runs
    # leaving the block (also on an error) draws the final state: live.close()

A LiveChart is a training sink: it receives the plain rows the train loop emits and never
reaches into the loop. It redraws a plotly figure, throttled to one redraw per `min_interval_s`,
in an ipywidgets Output, whose content is replaced whole through the widget's state (JupyterLab's
plotly renderer keeps the graph it drew first and ignores an in-place update of a display id, so a
chart updated that way stayed empty in JupyterLab until the notebook was reopened; plotly.py issue
3053, `renderModel` in its mimeExtension.ts; that renderer also shows its own PNG of a graph once
the output carries one, as the widget's state brings it back in Voila, and draws the graph again
when a pointer enters it). close() then replaces the Output, through a display id, by the final
figure as plotly JSON, so the notebook file holds exactly the final state of the chart: small (no
plotly.js bundle per chart, unlike a saved FigureWidget) and correct in an executed notebook, in
Voila and in the HTML report (as found here: a FigureWidget keeps the state it had when first
displayed; an Output's drawings are not saved with the notebook).

Rows it understands: training rows (step, loss, tokens, mem_mib, tokens_per_s, and the run's
labels such as strategy/seed/device/budget_mib) and event rows ({"event": "attempt", ...}) that
say where a run went (shown in the title). On a GPU, rows that carry the memory monitor's CUDA
columns (cuda_peak_allocated_mib, cuda_peak_reserved_mib, nvml_used_mib) add a trace each to the
memory panel, so the allocator's reserved memory and nvidia-smi's figure show beside the budget. A
played card's rows ('cpu@N:cuda') carry modelled_reserved_mib, the allocator model's reserved peak
that its budget caps, beside mem_mib, that model's allocated peak.
"""

from __future__ import annotations

import textwrap
import time
from typing import Any, Sequence

import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from workbench.core.charts import hosted_notebook, palette  # (importing charts sets the plotly_mimetype renderer)

TITLE_CHARS = 100  # a title's line at most (three panels, about 1,000 px wide)
PANELS_PX, AXIS_TITLES_PX = 245, 52  # the panels' height; under them, the axes' ticks and titles
LEGEND_ROW_PX, LEGEND_WIDTH_PX = 22, 900  # a legend row; the narrowest width a notebook or the dashboard gives
CUDA_COLUMNS = (("cuda_peak_allocated_mib", "allocated", "solid"), ("cuda_peak_reserved_mib", "reserved", "dash"),
                ("nvml_used_mib", "NVML used", "dot"),
                # a played card's ('cpu@N:cuda'): its mem_mib is the allocator model's allocated peak
                ("modelled_reserved_mib", "reserved (modelled)", "dash"))


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
        self._title_html = "<br>".join(textwrap.wrap(title, TITLE_CHARS))  # plotly does not wrap a title
        self.run_keys = tuple(run_keys)
        self.min_interval_s = min_interval_s
        self.fig = make_subplots(rows=1, cols=3, subplot_titles=("loss", "peak device memory (MiB)", "tokens/s"),
                                 horizontal_spacing=0.07)
        self._top = 95 + 20 * self._title_html.count("<br>")  # each more line of title (the status line is under it)
        self.fig.update_layout(title=dict(text=self._title_html, yref="container", y=1, yanchor="top", pad_t=14),
                               legend=dict(orientation="h", yref="container", y=0, yanchor="bottom"))
        self._fit_legend(self.fig)
        self.fig.update_xaxes(title_text="tokens", col=1)
        self.fig.update_xaxes(title_text="step", col=2)
        self.fig.update_xaxes(title_text="step", col=3)
        self._traces: dict[tuple, tuple[int, int, int]] = {}
        self._budgets: set[tuple[float, str | None]] = set()
        self._status = ""
        self._last_draw = 0.0
        self.rows = 0
        self._handle = None
        # `output`: an Output to draw in (the knobs panel's); else, with `display`, one of our own,
        # shown through a display id that close() points at the final figure.
        self._output = output
        if output is None and display:
            import ipywidgets
            from IPython.display import display as ipy_display

            self._output = ipywidgets.Output()
            self._handle = ipy_display(self._output, display_id=True)
        if self._output is not None:
            self.draw()

    def __enter__(self) -> "LiveChart":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
        if budget and (budget, row.get("device")) not in self._budgets:  # cuda@8192 and cpu@8192: two budgets
            self._budgets.add((budget, row.get("device")))
            # whose budget: an attempt without one (a CPU run fallen back to) is drawn above it and fits
            where = f" ({row['device']})" if row.get("device") else ""
            self.fig.add_hline(y=budget, line_dash="dash", line_color="red", row=1, col=2,
                               annotation_text=f"budget {budget:g} MiB{where}")
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
            fig.update_layout(title_text=f"{self._title_html}<br><sub>{self._status}</sub>")
        self._fit_legend(fig)
        memory = [t for t in fig.data if t.xaxis == "x2" and t.y]
        if self.rows and not memory:  # an empty panel that says why, not a bare -1..4 grid
            fig.add_annotation(text="no device memory in these rows<br>(the run reports none on this device)",
                               xref="x2 domain", yref="y2 domain", x=0.5, y=0.5, showarrow=False,
                               font_color="#888")
        return fig

    def _fit_legend(self, fig: go.Figure) -> None:
        """Room under the panels for the legend, so that it never covers the axis titles (a legend
        placed at a fixed share of the plot's height did, once the runs filled two rows) and the
        panels keep their height however many runs there are. Rows are estimated for a chart about
        900 px wide, the narrowest a notebook or the dashboard shows it: more rows than needed
        leave some space, fewer would overlap."""
        rows, used = 0, LEGEND_WIDTH_PX  # the first entry opens the first row
        for trace in fig.data:
            if trace.showlegend is False or not trace.name:
                continue
            item = 40 + 7 * len(trace.name)  # the line sample and the text, at plotly's 12 px font
            if used + item > LEGEND_WIDTH_PX:
                rows, used = rows + 1, 0
            used += item
        legend = rows * LEGEND_ROW_PX + 6
        fig.update_layout(height=PANELS_PX + self._top + AXIS_TITLES_PX + legend,
                          margin=dict(t=self._top, b=AXIS_TITLES_PX + legend, l=50, r=20))

    def _bundle(self) -> dict:
        """plotly's own mimetype; on Colab or Kaggle, whose front ends may not draw it, HTML beside it
        (plotly.js from its CDN, as their renderers load it)."""
        fig = self._snapshot()
        bundle = pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict())
        if hosted_notebook():
            bundle["text/html"] = pio.to_html(fig, include_plotlyjs="cdn", full_html=False)
        return bundle

    def draw(self) -> None:
        self._last_draw = time.monotonic()
        if self._output is not None:
            # The Output's content is set as its `outputs` state, not captured with `with output:`
            # (clear, then display): inside the knobs panel's Output that nested two capturing widgets
            # on one message id, which the front end routes by hooks registered as each widget's state
            # arrives; ipywidgets' maintainers advise against mixing the two (ipywidgets PR 3261, issues
            # 1722, 3260). plotly's own mimetype (and HTML on Colab or Kaggle), whatever plotly's
            # default renderer is.
            self._output.outputs = ({"output_type": "display_data", "data": self._bundle(), "metadata": {}},)

    def close(self) -> go.Figure:
        """Draw the final state (whatever the throttle held back) and return the figure. A chart
        with an Output of its own is replaced by the figure itself (the Output is closed)."""
        if self._handle is not None:
            self._output.outputs = ()  # the executed notebook's widget state keeps no copy
            self._handle.update(self._bundle(), raw=True)
            self._output.close()
            self._output = self._handle = None
        else:
            self.draw()
        return self._snapshot()
