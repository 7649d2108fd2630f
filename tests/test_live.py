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
