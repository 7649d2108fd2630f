"""Knobs: an ipywidgets control panel built from a study's config class.

    panel = knobs(StrategiesConfig, cfg, on_run=run_fn)   # one widget per config field + Run
    panel                                                   # show it in a notebook or Voila

Each field of the config (but `NOT_A_KNOB`'s) becomes a widget chosen from its type (Literal:
dropdown, bool: checkbox, int/float/str: text boxes, a tuple with known choices: multi-select, other
tuples: a YAML list). Run builds the config with `from_dict`, the same validation as the notebook's
`parameters` cell, so a bad value is shown as the same error and nothing runs. `on_run(cfg)` runs
inside the panel's output area, where its live charts and tables appear.
"""

from __future__ import annotations

import html
import traceback
import typing
from typing import Any, Callable, get_args, get_origin, get_type_hints

import ipywidgets as W
import yaml

from workbench.core.config import Config, ConfigError


# Set in code, never offered as knobs: the panel is also a Voila app, whose viewers must not run code
# (trust_remote_code runs a hub repository's Python; a Dask scheduler of their choosing hands this
# kernel pickles to load). A value given in the config is kept.
NOT_A_KNOB = ("trust_remote_code", "scheduler")


def _label_width(names: list[str]) -> str:
    """Room for the longest field name: at a fixed 140 px, "reference_budget_mib" read
    "reference_budget_..." in the apps (about 7.5 px per character of the widgets' 13 px font)."""
    return f"{max(140, round(7.5 * max(map(len, names), default=0)) + 12)}px"


def _widget_for(name: str, tp: Any, value: Any, help_text: str, choices, label_width: str = "140px") -> W.Widget:
    common = dict(description=name, tooltip=help_text, style={"description_width": label_width})
    if not (tp is bool or (get_origin(tp) is tuple and choices)):  # a box as wide as its column, not 300 px
        common["layout"] = W.Layout(width="98%")
    origin = get_origin(tp)
    if origin is typing.Literal:
        return W.Dropdown(options=list(get_args(tp)), value=value, **common)
    if tp is bool:
        return W.Checkbox(value=value, indent=False, **common)
    if tp is int:
        return W.IntText(value=value, **common)
    if tp is float:
        return W.FloatText(value=value, **common)
    if origin is tuple and choices:
        return W.SelectMultiple(options=list(choices), value=tuple(v for v in value if v in choices),
                                rows=min(8, len(choices)), **common)
    if origin is tuple:
        return W.Text(value=yaml.safe_dump(list(value), default_flow_style=True).strip(), **common)
    if type(None) in get_args(tp):  # float | None and the like: empty is None (it read "None", then refused)
        return W.Text(value="" if value is None else str(value), placeholder="empty: none", **common)
    return W.Text(value=str(value), **common)


def _read(widget: W.Widget, tp: Any) -> Any:
    value = widget.value
    if get_origin(tp) is tuple and isinstance(widget, W.Text):
        try:
            parsed = yaml.safe_load(value) if value.strip() else []
        except yaml.YAMLError as e:
            raise ConfigError(f"{widget.description}: {value!r} is not a list ({e.problem})") from None
        return parsed if isinstance(parsed, list) else [parsed]
    if isinstance(widget, W.SelectMultiple):
        return list(value)
    if type(None) in get_args(tp) and isinstance(widget, W.Text):
        if value.strip() in ("", "None"):
            return None
        if float in get_args(tp) or int in get_args(tp):
            try:
                return float(value)  # "0.8": a number (the config checks its kind and range)
            except ValueError:
                pass
        return value  # text as typed (YAML would read "on" as true); the config says what it expected
    return value


class Knobs(W.VBox):
    """The panel: widgets for every field, a Run button, a message line and an output area."""

    def __init__(self, config_cls: type[Config], values: Config | dict, on_run: Callable[[Config], Any],
                 *, fields: list[str] | None = None, title: str = ""):
        self.config_cls = config_cls
        self.on_run = on_run
        current = values.knob_values() if isinstance(values, Config) else dict(values)
        hints = get_type_hints(config_cls)
        helps = config_cls.help()
        meta = config_cls.fields()
        names = [n for n in fields or meta if n not in NOT_A_KNOB]
        self.hints = hints
        label_width = _label_width(names)
        self.controls: dict[str, W.Widget] = {
            n: _widget_for(n, hints[n], current.get(n, meta[n].default), helps[n], meta[n].metadata.get("choices"),
                           label_width)
            for n in names
        }
        self.fixed = {k: v for k, v in current.items() if k not in self.controls and k in meta}
        self.button = W.Button(description="Run", button_style="primary", icon="play")
        self.message = W.HTML()
        self.output = W.Output()
        self.button.on_click(lambda _: self.run())
        grid = W.GridBox(list(self.controls.values()),
                         layout=W.Layout(grid_template_columns="repeat(2, minmax(320px, 1fr))"))
        header = [W.HTML(f"<b>{title}</b>")] if title else []
        super().__init__(header + [grid, W.HBox([self.button, self.message]), self.output])

    def config(self) -> Config:
        """The settings on the panel as a config; a device this machine lacks (device=cuda without a
        card) is refused here too, as a message, before the last run's output is cleared."""
        values = {**self.fixed, **{n: _read(w, self.hints[n]) for n, w in self.controls.items()}}
        cfg = self.config_cls.from_dict(values)
        if hasattr(cfg, "resolved_device"):
            cfg.resolved_device()
        return cfg

    def run(self) -> Any:
        try:
            cfg = self.config()
        except ConfigError as e:
            self.message.value = f'<span style="color:#c00">{html.escape(str(e), quote=False)}</span>'
            return None
        self.message.value = "running…"
        self.button.disabled = True
        self.output.clear_output()
        try:
            with self.output:
                result = self.on_run(cfg)
            self.message.value = '<span style="color:#080">done</span>'
            return result
        except ConfigError as e:  # a setting found wrong as the run began: its one line, as above
            self.message.value = f'<span style="color:#c00">{html.escape(str(e), quote=False)}</span>'
            return None
        except Exception as e:  # shown in the panel, with the traceback in the output area
            self.message.value = f'<span style="color:#c00">{type(e).__name__}: {html.escape(str(e), quote=False)}</span>'
            self.output.append_stderr(traceback.format_exc())
            return None
        finally:
            self.button.disabled = False


def knobs(config_cls, values, on_run, **kw) -> Knobs:
    return Knobs(config_cls, values, on_run, **kw)
