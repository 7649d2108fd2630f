"""Live charts and knobs: fed by plain rows, validated like the parameters cell."""

import pytest
from jupyter_client.manager import start_new_kernel

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


def test_on_colab_the_live_chart_also_carries_html(monkeypatch):
    """Colab frames each output and draws no plotly mimetype: the live chart was a blank box there.
    HTML (plotly.js from its CDN, as plotly's Colab renderer loads it) goes beside the mimetype."""
    live = LiveChart(display=False, min_interval_s=0)
    for r in rows():
        live(r)
    monkeypatch.delenv("COLAB_NOTEBOOK_ID", raising=False)
    assert list(live._bundle()) == ["application/vnd.plotly.v1+json"]  # elsewhere: the notebook stays small
    monkeypatch.setenv("COLAB_NOTEBOOK_ID", "1")
    bundle = live._bundle()
    assert "application/vnd.plotly.v1+json" in bundle and "cdn.plot.ly" in bundle["text/html"]
    assert "full 0 cpu" in bundle["text/html"]


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


def test_the_runs_take_the_palettes_colours_in_order_with_a_cards_columns_too():
    """A card's columns (allocated, reserved, NVML) are traces of a run too: counted as runs, each later
    run's colour skipped ahead, and study 1's 21 runs shared colours sooner (a fault audit)."""
    from workbench.core.charts import palette

    live = LiveChart(display=False, min_interval_s=0)
    for i, strategy in enumerate(("full", "lora", "adapter")):
        live({"strategy": strategy, "seed": 0, "device": "cuda", "step": 1, "loss": 5.0, "mem_mib": 10.0,
              "cuda_peak_allocated_mib": 10.0, "cuda_peak_reserved_mib": 12.0, "nvml_used_mib": 500.0})
    fig = live.close()
    shown = [(t.name, t.line.color) for t in fig.data if t.showlegend is not False]
    assert shown == list(zip(("full 0 cuda", "lora 0 cuda", "adapter 0 cuda"), palette()[:3]))


def test_a_budgets_line_says_whose_budget_it_is():
    """A run fallen back to the CPU, which has no budget, was drawn above "budget 13 MiB" and fit."""
    live = LiveChart(display=False, min_interval_s=0)
    run = {"strategy": "full", "seed": 0, "step": 1, "loss": 5.0}
    live({**run, "device": "cpu@13", "budget_mib": 13.0, "mem_mib": 12.0})
    live({**run, "device": "cpu", "budget_mib": None, "mem_mib": 14.0})
    assert [a.text for a in live.close().layout.annotations if "budget" in a.text] == ["budget 13 MiB (cpu@13)"]
    # the same budget on two devices is two budgets (it was drawn once, named by the first device)
    live = LiveChart(display=False, min_interval_s=0)
    for device in ("cuda@13", "cpu@13", "cpu@13"):
        live({**run, "device": device, "budget_mib": 13.0, "mem_mib": 12.0})
    assert [a.text for a in live.close().layout.annotations if "budget" in a.text] == [
        "budget 13 MiB (cuda@13)", "budget 13 MiB (cpu@13)"]


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
    # the error quotes what was typed, shown as text: markup in it is not the page's (an HTML widget)
    panel.controls["seeds"].value = "[<b>1</b>]"
    panel.button.click()
    assert "<b>" not in panel.message.value and "&lt;b&gt;" in panel.message.value


def test_a_default_resolved_from_other_fields_follows_them_on_the_panel():
    """The ladder's breakdown rung defaults to bf16_ckpt when that rung is run: the panel showed it
    resolved, so taking bf16_ckpt out of the rungs was refused ("not among rungs")."""
    from workbench.studies.ladder.config import LadderConfig

    seen = []
    panel = knobs(LadderConfig, LadderConfig(), seen.append)
    assert panel.controls["breakdown_rung"].value == ""
    panel.controls["rungs"].value = ("fp32", "bf16")
    panel.button.click()
    assert panel.message.value == "" or "not among rungs" not in panel.message.value
    assert seen and seen[-1].rungs == ("fp32", "bf16") and seen[-1].breakdown_rung == "fp32"
    # one set on purpose stays as set
    chosen = knobs(LadderConfig, LadderConfig(breakdown_rung="fp32"), seen.append)
    assert chosen.controls["breakdown_rung"].value == "fp32"


def test_a_device_this_machine_lacks_is_a_message_and_the_last_run_stays(monkeypatch):
    """device=cuda on a machine without a card was a traceback from inside the run, after the last
    run's charts had been cleared."""
    from workbench.core import fallback
    from workbench.studies.split.config import SplitConfig

    monkeypatch.setattr(fallback, "unavailable", lambda device: "no CUDA device here" if device == "cuda" else None)
    seen = []
    panel = knobs(SplitConfig, SplitConfig(), seen.append)
    panel.output.append_stdout("the last run's charts")
    panel.controls["device"].value = "cuda"
    panel.button.click()
    assert not seen and panel.message.value == ('<span style="color:#c00">device=cuda: no CUDA device here; use '
                                                'device=cpu or device=auto</span>')
    assert panel.output.outputs and "the last run's charts" in str(panel.output.outputs)
    panel.controls["device"].value = "cpu"
    panel.button.click()
    assert len(seen) == 1 and seen[0].device == "cpu"
    # an optional number (host_share: float | None) is empty for None, a number when given ("None" was refused)
    assert panel.controls["host_share"].value == "" and seen[0].host_share is None
    panel.controls["host_share"].value = "0.8"
    panel.button.click()
    assert len(seen) == 2 and seen[1].host_share == 0.8
    panel.controls["host_share"].value = " None "  # as a config prints it: none again
    panel.button.click()
    assert len(seen) == 3 and seen[2].host_share is None


def test_no_knob_runs_code_a_dashboard_viewer_chooses():
    """The panel is a Voila app too, whose viewers must not run code: study 1's offered
    trust_remote_code (a hub repository's Python) and a Dask scheduler address (which hands the
    kernel pickles to load). Set in code, they are kept as given; asked for by name, still no knob."""
    seen = []
    given = StrategiesConfig(trust_remote_code=True, scheduler="tls://10.0.0.5:8786")
    for fields in (None, ["token_budget", "trust_remote_code", "scheduler"]):
        panel = knobs(StrategiesConfig, given, seen.append, fields=fields)
        assert "token_budget" in panel.controls
        assert not {"trust_remote_code", "scheduler"} & set(panel.controls)
        panel.button.click()
        assert seen[-1].trust_remote_code is True and seen[-1].scheduler == "tls://10.0.0.5:8786"


PLOTLY = "application/vnd.plotly.v1+json"
KERNEL_CODE = """
from workbench.front.live import LiveChart
with LiveChart(title="t", min_interval_s=0) as live:
    for step in range(1, 4):
        live({"strategy": "full", "seed": 0, "step": step, "loss": 5.0 - step, "tokens": 64 * step})
"""


def test_a_notebook_live_chart_redraws_as_jupyterlab_can_show(tmp_path):
    """What a kernel sends while a notebook's chart runs. JupyterLab's plotly renderer keeps the graph
    it drew first and ignores an update of a display id (plotly.py issue 3053): the chart redrew by
    update_display and stayed empty in JupyterLab. Each redraw must be a new plotly output: the chart's
    Output's content replaced whole through its widget state (not captured by message id, which nests
    two capturing Outputs inside the knobs panel: ipywidgets PR 3261); the one update of the display
    id, at the end, replaces the Output by the final figure (another mimetype, so a new renderer),
    which the notebook file keeps."""
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        msg_id = kc.execute(KERNEL_CODE)
        reply = kc.get_shell_msg(timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        msgs = []
        while not (msgs and msgs[-1]["msg_type"] == "status" and msgs[-1]["content"]["execution_state"] == "idle"
                   and msgs[-1]["parent_header"].get("msg_id") == msg_id):
            msgs.append(kc.get_iopub_msg(timeout=60))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    shown = [(m["msg_type"], m["content"]) for m in msgs
             if m["msg_type"] in ("display_data", "update_display_data", "clear_output")]
    first_type, first = shown[0]
    assert first_type == "display_data" and PLOTLY not in first["data"]  # the Output widget, shown by display id
    display_id = first["transient"]["display_id"]
    assert not [c for t, c in shown if t == "display_data" and PLOTLY in c["data"]]  # nothing captured
    states = [m["content"]["data"]["state"] for m in msgs if m["msg_type"] == "comm_msg"
              and m["content"]["data"].get("method") == "update" and "outputs" in m["content"]["data"]["state"]]
    draws = [s["outputs"] for s in states if s["outputs"]]
    assert len(draws) >= 4  # the first (empty) chart and one per row, each a new output
    assert all(len(o) == 1 and PLOTLY in o[0]["data"] for o in draws)  # replaced whole, not appended
    assert len(draws[-1][0]["data"][PLOTLY]["data"][0]["x"]) == 3
    assert states[-1]["outputs"] == []  # emptied before the display id's update: no copy in the widget state
    updates = [(t, c) for t, c in shown if t == "update_display_data"]
    assert len(updates) == 1 and shown[-1] == updates[0] and PLOTLY in updates[0][1]["data"]
    assert updates[0][1]["transient"]["display_id"] == display_id
    assert len(updates[0][1]["data"][PLOTLY]["data"][0]["x"]) == 3  # the final state: every row
