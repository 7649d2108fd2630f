"""Live charts and knobs: fed by plain rows, validated like the parameters cell."""

import pytest

from workbench.front.live import LiveChart
from workbench.front.panel import knobs
from workbench.studies.strategies.runner import StrategiesConfig


def rows():
    yield {"event": "attempt", "strategy": "full", "seed": 0, "attempt": "cpu@10", "result": "oom", "phase": "train"}
    for step in range(1, 6):
        yield {"strategy": "full", "seed": 0, "device": "cpu", "budget_mib": None, "step": step,
               "loss": 5.0 - step * 0.1, "tokens": step * 512, "mem_mib": 10.0 + step, "tokens_per_s": 1000.0}
    for step in range(1, 4):
        yield {"strategy": "lora", "seed": 0, "device": "cpu@64", "budget_mib": 64.0, "step": step,
               "loss": 4.0, "tokens": step * 512, "mem_mib": 30.0, "tokens_per_s": 2000.0}


def test_live_chart_holds_every_row_and_the_budget():
    live = LiveChart(display=False, min_interval_s=0)
    for r in rows():
        live(r)
    fig = live.close()
    names = {t.name for t in fig.data}
    assert {"full 0 cpu", "lora 0 cpu@64"} <= names
    loss = [t for t in fig.data if t.name == "full 0 cpu" and t.xaxis == "x"][0]
    assert list(loss.y) == pytest.approx([4.9, 4.8, 4.7, 4.6, 4.5]) and list(loss.x) == [512, 1024, 1536, 2048, 2560]
    mem = [t for t in fig.data if t.name == "lora 0 cpu@64" and t.xaxis == "x2"][0]
    assert list(mem.y) == [30.0, 30.0, 30.0]
    assert any(s.y0 == 64.0 for s in fig.layout.shapes)  # the budget line
    assert live.rows == 8


def test_a_run_wears_one_colour_in_every_panel_and_runs_differ():
    """plotly's cycle gave each new trace the next colour: a run's memory and speed lines wore
    other runs' legend colours, and the reader matched the wrong lines."""
    live = LiveChart(display=False, min_interval_s=0)
    for r in rows():
        live(r)
    live({"strategy": "full", "seed": 0, "device": "cpu", "step": 6, "loss": 4.4, "tokens": 3072, "mem_mib": 16.0,
          "cuda_peak_reserved_mib": 20.0})
    fig = live.close()
    colours = {}
    for t in fig.data:
        colours.setdefault(t.legendgroup, set()).add(t.line.color)
    assert all(len(c) == 1 for c in colours.values())  # loss, memory, speed (and reserved) alike
    assert len({next(iter(c)) for c in colours.values()}) == 2  # two runs, two colours
    assert [t.name for t in fig.data if t.showlegend is not False] == ["full 0 cpu", "lora 0 cpu@64"]


def test_an_empty_memory_panel_says_why():
    live = LiveChart(display=False, min_interval_s=0)
    live({"run": "k=0", "step": 1, "loss": 5.0, "tokens": 512, "tokens_per_s": 900.0})
    notes = [a.text for a in live.close().layout.annotations]
    assert any(n.startswith("no device memory in these rows") for n in notes)
    full = LiveChart(display=False, min_interval_s=0)
    for r in rows():
        full(r)
    assert not any(a.text.startswith("no device memory") for a in full.close().layout.annotations)


def test_knobs_validate_like_the_parameters_cell_and_run():
    seen = []
    panel = knobs(StrategiesConfig, StrategiesConfig(), seen.append)
    panel.controls["token_budget"].value = 1234
    panel.controls["strategies"].value = ("full", "lora")
    panel.controls["seeds"].value = "[3, 4]"
    panel.button.click()
    assert len(seen) == 1
    assert seen[0].token_budget == 1234 and seen[0].strategies == ("full", "lora") and seen[0].seeds == (3, 4)
    panel.controls["token_budget"].value = 0
    panel.button.click()
    assert len(seen) == 1 and "token_budget must be positive" in panel.message.value
    panel.controls["token_budget"].value = 10
    panel.controls["seeds"].value = "[oops"
    panel.button.click()
    assert len(seen) == 1 and "seeds" in panel.message.value
