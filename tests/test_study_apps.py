"""The studies as apps: knobs panels, live-chart sinks fed by real runs, report sections.

    .venv/bin/python -m pytest tests/test_study_apps.py -q        # about 40 s on 2 cores

The button tests replace the study runner by a fake that records the config it was given (a
real run is seconds to minutes); the sink tests run the real runners on tiny settings once each.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from workbench.core.charts import Table
from workbench.core.results import StudyResult
from workbench.front import apps
from workbench.front.live import LiveChart
from workbench.studies.ladder import figures as ladder_figures
from workbench.studies.ladder import runner as ladder_study
from workbench.studies.ladder.config import LadderConfig
from workbench.studies.split import figures as split_figures
from workbench.studies.split import runner as split_study
from workbench.studies.split.config import SplitConfig
from workbench.studies.strategies.config import StrategiesConfig

LADDER_TINY = {"base_size": "tiny", "rungs": ["fp32", "bf16_ckpt", "zero_offload"], "micro_batch": 2, "seq_len": 32,
               "steps": 2, "budget_mib": 3.0, "reference_model": "", "breakdown_rung": "fp32", "threads": 1}
SPLIT_TINY = {"base_size": "tiny", "eval_blocks": 4, "micro_batch": 2, "seq_len": 16,
              "steps": 4, "untimed_steps": 1, "k_sweep": [0.0, 1.0], "modelled_k_points": 3, "host_share": 0.8}


def _loss_traces(fig) -> dict[str, tuple]:
    return {t.name: tuple(t.y) for t in fig.data if t.xaxis == "x" and t.y}


# ------------------------------------------------------------------------------------------------
# study 1


def test_strategies_app_says_when_its_runs_were_read_back(monkeypatch, tiny_base, results_dir):
    """Run pressed again with the same settings showed the same charts within two seconds and no
    word of why (the runs were read back, not trained): the app shows the findings first, as the
    notebook does, and they say so."""
    shown: list = []
    monkeypatch.setattr(apps, "display", shown.append)
    cfg = StrategiesConfig(base_size="tiny", strategies=("bitfit",), seeds=(0,), seq_len=64, token_budget=2048,
                           eval_blocks=4, budget_mib=0)
    panel = apps.app(cfg)
    found = []
    for _ in range(2):
        shown.clear()
        panel.button.click()
        assert "done" in panel.message.value, panel.message.value
        tables = [s.df for s in shown if isinstance(s, Table)]
        assert list(tables[0].columns) == ["what we found", "published"]  # first, before the summary
        found.append(" ".join(tables[0]["what we found"]))
    assert found[0].startswith("Best held-out perplexity: bitfit") and "read back" not in found[0]
    assert "1 of 1 runs were read back, not trained again" in found[1]


# ------------------------------------------------------------------------------------------------
# study 2


def test_ladder_run_feeds_a_live_chart_and_the_report(tiny_base, results_dir):
    assert ladder_study.load_result() is None and ladder_figures.report_section(None) == []  # nothing run yet
    cfg = LadderConfig.from_dict(LADDER_TINY)
    rows: list[dict] = []
    live = LiveChart(display=False, min_interval_s=0, run_keys=("rung", "stage"))
    df = ladder_study.run_ladder(cfg, sinks=[live, rows.append]).runs

    steps = [r for r in rows if "loss" in r]
    ladder = [r for r in steps if r["stage"] == "ladder"]
    assert [(r["rung"], r["step"]) for r in ladder] == [("fp32", 1), ("fp32", 2), ("bf16_ckpt", 1), ("bf16_ckpt", 2)]
    assert all(r["budget_mib"] == 3.0 for r in steps)
    assert {"rung": "zero_offload", "attempt": "zero_offload", "result": "skipped"}.items() <= \
        next(r for r in rows if r.get("event")).items()  # a rung that cannot run here is an event, not steps
    # the same losses the runner wrote in its results
    hand = df[df["role"] == "at hand"].set_index("rung")
    assert ladder[1]["loss"] == pytest.approx(hand.loc["fp32", "loss_after"])
    # each row's memory is its step's peak, so the live trace reaches the measured peak (not the
    # bytes left alive after the step, which sit far below it)
    for rung in ("fp32", "bf16_ckpt"):
        assert max(r["mem_mib"] for r in ladder if r["rung"] == rung) == pytest.approx(hand.loc[rung, "measured_peak_mib"])

    fig = live.close()
    assert live.rows == len(steps)
    assert _loss_traces(fig)["fp32 ladder"] == tuple(r["loss"] for r in ladder[:2])
    assert any(s.y0 == 3.0 for s in fig.layout.shapes)  # the budget line

    parts = ladder_figures.report_section(ladder_study.load_result())
    kinds = [k for k, _, _ in parts]
    assert kinds[0] == "text" and 1 <= kinds.count("figure") <= 3 and kinds.count("table") >= 2
    text = parts[0][2]
    assert 'class="tag measured"' in text and 'class="tag modelled">predicted' in text
    table = parts[1][2]
    assert list(table["rung"]) == LADDER_TINY["rungs"]
    assert table.set_index("rung").loc["zero_offload", "status"] == "skipped"
    # no figure calls a number measured unless it was: the measured bars are the rungs that ran here
    bars = parts[2][2]
    memory = [t for t in bars.data if t.xaxis in (None, "x")]  # the peak-memory panel (the other: step time)
    measured = [t for t in memory if "measured on" in t.name]
    assert len(measured) == 1 and list(measured[0].x) == ["fp32", "bf16_ckpt"]
    assert all("not measured" in t.name for t in memory if t is not measured[0])
    loss = next(p for k, _, p in parts if k == "figure" and "loss" in p.layout.title.text.lower())
    assert "measured" in loss.layout.title.text and {t.name for t in loss.data} == {"fp32", "bf16_ckpt"}


def _fake_ladder(calls):
    def run_ladder(cfg, sinks=(), *, progress=True):
        assert progress is False  # the app has its own chart: no bar on standard error
        calls.append(cfg)
        for sink in sinks:
            sink({"rung": "fp32", "stage": "ladder", "step": 1, "loss": 3.0, "tokens": 64,
                  "budget_mib": cfg.budget_mib})
        df = pd.DataFrame([{"rung": "fp32", "role": "at hand", "method": "predicted", "predicted_peak_mib": 5.0,
                            "measured_peak_mib": 5.1, "status": "ok", "reason": "", "note": "",
                            "budget_mib": cfg.budget_mib}])
        return StudyResult("ladder", runs=df, tables={"autofit": pd.DataFrame()})

    return run_ladder


def test_ladder_app_validates_like_the_parameters_cell_and_runs(monkeypatch, results_dir):
    calls: list[LadderConfig] = []
    monkeypatch.setattr(apps, "run_ladder", _fake_ladder(calls))
    panel = apps.app(LadderConfig.from_dict(LADDER_TINY))
    assert tuple(panel.controls["rungs"].value) == tuple(LADDER_TINY["rungs"])  # a multi-select of the ladder

    panel.controls["steps"].value = 1
    panel.button.click()
    assert calls == [] and "steps must be at least 2" in panel.message.value
    panel.controls["steps"].value = 3
    panel.controls["breakdown_rung"].value = "lora"  # not among the rungs
    panel.button.click()
    assert calls == [] and "breakdown_rung 'lora' is not among rungs" in panel.message.value

    panel.controls["breakdown_rung"].value = "fp32"
    panel.controls["rungs"].value = ("fp32", "cpu")
    panel.controls["budget_mib"].value = 7.5
    panel.button.click()
    assert "done" in panel.message.value, panel.message.value
    (cfg,) = calls
    assert cfg.steps == 3 and cfg.rungs == ("fp32", "cpu") and cfg.budget_mib == 7.5 and cfg.base_size == "tiny"


# ------------------------------------------------------------------------------------------------
# study 3


def test_split_run_feeds_a_live_chart_and_the_report(results_dir):
    assert split_study.load_result() is None and split_figures.report_section(None) == []
    cfg = SplitConfig.from_dict(SPLIT_TINY)
    rows: list[dict] = []
    live = LiveChart(display=False, min_interval_s=0, run_keys=("run",))
    df = split_study.run_split_study(cfg, sinks=[live, rows.append]).runs

    runs = ["k=0", "k=1", "adaptive"]  # the engine's runs (plain AdamW, the reference, sends none)
    assert [r["run"] for r in rows] == [run for run in runs for _ in range(cfg.steps)]
    per_it = cfg.micro_batch * cfg.seq_len
    for run in runs:
        mine = [r for r in rows if r["run"] == run]
        assert [r["step"] for r in mine] == [1, 2, 3, 4]
        assert [r["tokens"] for r in mine] == [i * per_it for i in (1, 2, 3, 4)]  # cumulative, like train()
        assert all(r["tokens_per_s"] > 0 and r["source"] == "measured" for r in mine)
    # the rows are the engine's own: the final loss matches the run's summary
    measured = df[df["source"] == "measured"].set_index("run")
    assert rows[-1]["loss"] == pytest.approx(measured.loc["adaptive", "final_loss"])

    fig = live.close()
    assert live.rows == len(rows) and set(_loss_traces(fig)) == set(runs)

    parts = split_figures.report_section(split_study.load_result())
    kinds = [k for k, _, _ in parts]
    assert kinds[0] == "text" and 1 <= kinds.count("figure") <= 3
    assert 'class="tag measured"' in parts[0][2] and 'class="tag modelled"' in parts[0][2]
    tables = {title: t for k, title, t in parts if k == "table"}
    mtable = tables[split_figures.RUN_TABLES["measured"]]
    assert list(mtable["run"]) == ["plain AdamW", *runs] and mtable["hardware"].str.startswith("this machine").all()
    modelled = next(t for title, t in tables.items() if title.startswith("Modelled"))
    assert len(modelled) and not modelled["hardware"].str.startswith("this machine").any()
    # every panel of the throughput figure says where its points come from
    speed = next(p for k, _, p in parts if k == "figure" and "against k" in p.layout.title.text)
    panels = [a.text for a in speed.layout.annotations]
    assert any(a.startswith("measured: this machine") for a in panels)
    assert all(a.startswith(("measured", "modelled")) for a in panels)
    loss = next(p for k, _, p in parts if k == "figure" and "loss" in p.layout.title.text.lower())
    assert "measured" in loss.layout.title.text and {t.name for t in loss.data} == {"plain AdamW", *runs}


def _fake_split(calls, charts=None):
    def run_split_study(cfg, sinks=()):
        calls.append(cfg)
        if charts is not None:
            charts.extend(s for s in sinks if isinstance(s, LiveChart))
        for sink in sinks:
            sink({"run": "k=0", "step": 1, "loss": 4.0, "tokens": 32, "tokens_per_s": 100.0})
        return StudyResult("split", runs=pd.DataFrame([
            {"source": "measured", "panel": "measured: this machine (cpu)", "run": "k=0", "mode": "host only (k=0)",
             "k_actual": 0.0, "tokens_per_s": 100.0, "status": "ok"},
            {"source": "modelled", "panel": "modelled: H100-SXM", "hardware": "H100-SXM", "run": "all on H100",
             "mode": "all on accelerator", "k_actual": 1.0, "status": "oom", "reason": "needs 161 GiB of 80"}]))

    return run_split_study


def test_split_app_validates_like_the_parameters_cell_and_runs(monkeypatch, results_dir):
    calls: list[SplitConfig] = []
    charts: list[LiveChart] = []
    monkeypatch.setattr(apps, "run_split_study", _fake_split(calls, charts))
    shown: list = []
    monkeypatch.setattr(apps, "display", shown.append)
    panel = apps.app(SplitConfig.from_dict(SPLIT_TINY))
    assert "host_share" not in panel.controls and panel.fixed["host_share"] == 0.8

    panel.controls["k_sweep"].value = "[0.0, 2.0]"
    panel.button.click()
    assert calls == [] and "k values must lie in [0, 1], got 2.0" in panel.message.value
    panel.controls["k_sweep"].value = "[0.0, 0.5]"
    panel.controls["untimed_steps"].value = 9
    panel.button.click()
    assert calls == [] and "got untimed_steps=9 with steps=" in panel.message.value

    panel.controls["untimed_steps"].value = 1
    panel.controls["steps"].value = 5
    panel.controls["model"].value = "tiny-gpt2"
    panel.button.click()
    assert "done" in panel.message.value, panel.message.value
    (cfg,) = calls
    assert cfg.steps == 5 and cfg.k_sweep == (0.0, 0.5) and cfg.model == "tiny-gpt2" and cfg.host_share == 0.8
    # the app's live chart is the notebook's: its title (which says why the loss lines coincide) and run keys
    (chart,) = charts
    assert chart.title == split_figures.NOTEBOOK_RUN_TITLE and "one line" in chart.title and chart.run_keys == ("run",)
    # one table per source, each with the columns its rows fill and the status beside the run (one table of
    # every run was 17 columns wide, with status and reason at its far right)
    runs = {t.caption: list(t.df.columns) for t in shown if isinstance(t, Table) and t.caption}
    assert runs == {split_figures.RUN_TABLES["measured"]: ["source", "run", "mode", "status", "k_actual",
                                                           "tok/s"],
                    split_figures.RUN_TABLES["modelled"]: ["source", "hardware", "run", "mode", "status", "k_actual",
                                                           "reason"]}, runs


def test_the_fp16_halves_memory_verdict_is_made_on_pure_16_bit_not_autocast():
    runs = pd.DataFrame([{"rung": r, "role": "reference", "model": "cfg.json", "predicted_peak_bytes": b}
                         for r, b in (("fp32", 1000.0), ("bf16", 900.0), ("bf16_true", 520.0))])
    text = ladder_figures.precision_verdict(StudyResult("ladder", runs=runs))
    assert "autocast (mixed precision) needs 90% of fp32's peak" in text and "(bf16-true) need 52%" in text
    found = ladder_figures.findings(StudyResult("ladder", runs=runs))
    assert found[0][0] == text and "FP16 halves memory" in found[0][1]
    assert ladder_figures.precision_verdict(StudyResult("ladder", runs=runs[runs["rung"] != "bf16_true"])) == ""
    assert ladder_study.published_table().set_index("strategy").loc["FP16 full model", "rung"] == "bf16_true"


def test_the_prediction_finding_gives_the_worst_error_of_the_rungs_compared_in_percent():
    """The cpu rung has no device peak to compare: it had been counted, and a ladder of it alone read
    "within nan%"."""
    runs = pd.DataFrame([{"rung": r, "role": "at hand", "status": "ok", "predicted_vs_measured": v}
                         for r, v in (("fp32", 1.02), ("bf16", 0.995), ("cpu", float("nan")))])
    said = [text for text, _ in ladder_figures.findings(StudyResult("ladder", runs=runs))]
    assert any(t.startswith("Predicted peaks of 2 rung(s) measured here are within 2.0% of") for t in said), said
    alone = ladder_figures.findings(StudyResult("ladder", runs=runs[runs["rung"] == "cpu"]))
    assert not any("Predicted peaks" in text or "nan" in text for text, _ in alone), alone


def test_the_published_rows_findings_say_which_setting_was_predicted():
    runs = pd.DataFrame([{"rung": "fp32", "role": "reference", "model": "qwen.json", "batch": 1, "seq": 512,
                          "predicted_peak_bytes": 1.0}])
    pub = pd.DataFrame([{"strategy": "FP32 full model", "published_mib": 9537.0, "workbench_predicted_mib": 8577.0}])
    found = ladder_figures.findings(StudyResult("ladder", runs=runs, tables={"published": pub}))
    assert ("FP32 full model: predicted 8,577 MiB for qwen.json at 1 x 512.", "9,537 MiB") in found
    assert not any("checkpointing" in text for text, _ in found)  # no checkpointing row: nothing said of it


@pytest.mark.parametrize("ckpt_mib, said", [(4280.0, True), (3000.0, False)])
def test_a_reference_setting_too_short_for_checkpointing_to_save_anything_says_so(ckpt_mib, said):
    """The quick settings predict the reference model at 1 x 32 tokens: "FP16 + gradient checkpointing"
    was predicted as much as "FP16 full model", read as checkpointing saving nothing, and the precision
    verdict did not say at which setting it was made. It is said from what checkpointing saves: the share
    of activations at fp32's peak (after backward freed them) had said "0.0%" at 1 x 512 (a user audit)."""
    runs = pd.DataFrame([{"rung": r, "role": "reference", "model": "qwen.json", "batch": 1, "seq": 32,
                          "predicted_peak_bytes": b, "activations_bytes": 0.0}
                         for r, b in (("fp32", 1000.0), ("bf16", 900.0), ("bf16_true", 520.0))])
    pub = pd.DataFrame([{"strategy": s, "published_mib": 4000.0, "workbench_predicted_mib": v}
                        for s, v in (("FP16 full model", 4288.0), ("FP16 + gradient checkpointing", ckpt_mib))])
    found = [text for text, _ in ladder_figures.findings(StudyResult("ladder", runs=runs, tables={"published": pub}))]
    assert found[0].startswith("qwen.json at 1 x 32: bf16 autocast (mixed precision) needs 90% of fp32's peak")
    little = [text for text in found if "checkpointing lowers" in text]
    assert little == (["At qwen.json at 1 x 32 checkpointing lowers pure bf16's predicted peak by 0.2% (4,288 to "
                       "4,280 MiB): the activations it saves are a small part of that step's peak, so this row says "
                       "little of what it saves at a longer sequence (reference_seq_len)."] if said else [])


def test_the_ladder_chart_says_how_each_peak_was_predicted():
    """A simulated peak and an estimated one (hatched) are named as the table's how_predicted names them."""
    runs = pd.DataFrame([{"rung": r, "role": "at hand", "method": m, "predicted_peak_mib": v, "budget_mib": 64.0,
                          "status": "skipped", "note": ""}
                         for r, m, v in (("fp32", "predicted", 40.0), ("zero_offload", "estimated", 20.0))])
    bars = {t.name: t for t in ladder_figures.ladder_figure(StudyResult("ladder", runs=runs)).data}
    assert set(bars) == {"predicted, simulated (not measured)", "predicted, estimated (not measured)"}, set(bars)
    assert list(bars["predicted, estimated (not measured)"].x) == ["zero_offload"]
    assert bars["predicted, estimated (not measured)"].marker.pattern.shape == "/"
    assert not bars["predicted, simulated (not measured)"].marker.pattern.shape


def test_a_rung_far_above_the_others_puts_the_ladder_chart_on_a_log_axis():
    """On the tiny model ZeRO's 500M-element reduce bucket (954 MiB) stood beside rungs of 1-8 MiB and a 3 MiB
    budget, all squashed into the panel's bottom; where the bars are alike the axis stays linear."""
    def chart(values):
        runs = pd.DataFrame([{"rung": f"r{i}", "role": "at hand", "method": "predicted", "predicted_peak_mib": v,
                              "budget_mib": 3.0, "status": "skipped"} for i, v in enumerate(values)])
        return ladder_figures.ladder_figure(StudyResult("ladder", runs=runs))

    squashed = chart([1.6, 1.5, 0.9, 1.0, 0.0, 954.0])
    assert squashed.layout.yaxis.type == "log" and squashed.layout.yaxis2.type != "log"
    texts = {a.text: a for a in squashed.layout.annotations}
    assert "peak device memory (MiB, log scale)" in texts
    assert texts["budget 3 MiB"].y == pytest.approx(math.log10(3.0))  # on a log axis, at log10 of the value
    assert [s.y0 for s in squashed.layout.shapes] == [3.0]  # the line at the value
    alike = chart([1.6, 1.5, 0.9, 1.0, 0.0, 12.0])
    assert alike.layout.yaxis.type != "log" and "peak device memory (MiB)" in {a.text for a in alike.layout.annotations}
    # the ladder's table says why such a rung needs so much (its note was in the reference model's table alone)
    runs = pd.DataFrame([{"rung": "zero_offload", "role": "at hand", "note": "a 500,000,000-element reduce bucket"}])
    assert list(ladder_figures.ladder_table(StudyResult("ladder", runs=runs))["note"]) == [
        "a 500,000,000-element reduce bucket"]


def test_an_estimators_row_without_a_workbench_figure_says_why():
    """The ZeRO-3 estimator's row had an empty workbench cell (its rung not in the run) and a missing bar."""
    base = pd.DataFrame([{"estimator": "DeepSpeed ZeRO-3 offload params", "compares_to": "zero_offload_params",
                          "estimated_bytes": 1.0, "why_it_differs": "model states only",
                          "workbench_predicted_bytes": None},
                         {"estimator": "rule of thumb", "compares_to": "fp32", "estimated_bytes": 2.0,
                          "why_it_differs": "no activations", "workbench_predicted_bytes": 3.0}])
    shown = ladder_figures.baselines_table(StudyResult("ladder", runs=pd.DataFrame(), tables={"baselines": base}))
    assert list(shown["why_it_differs"]) == ["model states only; no workbench figure: zero_offload_params was not run",
                                             "no activations"]


def test_the_comparison_charts_draw_no_empty_workbench_trace():
    """Where no rung of the ladder is one the published rows or the library estimators compare to, the
    charts drew a workbench trace with no bar, named in the legend as if it were shown."""
    runs = pd.DataFrame([{"rung": "lora", "role": "reference", "model": "qwen.json", "predicted_peak_bytes": 1.0}])
    nan = float("nan")
    pub = pd.DataFrame([{"strategy": "FP32 full model", "published_mib": 9537.0, "workbench_predicted_mib": nan}])
    base = pd.DataFrame([{"estimator": "accelerate", "estimated_bytes": 2.0**30, "workbench_predicted_bytes": nan}])
    pub = pd.concat([pub, pub.assign(strategy="FP16 full model")], ignore_index=True)  # one row predicted, or none
    base = pd.concat([base, base.assign(estimator="DeepSpeed")], ignore_index=True)
    for predicted in (nan, 8577.0):
        pub["workbench_predicted_mib"], base["workbench_predicted_bytes"] = [nan, predicted], [nan, predicted * 2**20]
        result = StudyResult("ladder", runs=runs, tables={"published": pub, "baselines": base})
        for fig in (ladder_figures.published_figure(result), ladder_figures.baselines_figure(result)):
            names = [t.name for t in fig.data]
            assert len(names) == (1 if predicted != predicted else 2), names
            assert all(pd.Series(t.y).notna().any() for t in fig.data), names
        title = ladder_figures.published_figure(result).layout.title.text
        assert ("qwen.json: none predicted" in title) == (predicted != predicted), title
    no_reference = StudyResult("ladder", runs=runs.iloc[:0],
                               tables={"published": pub.drop(columns="workbench_predicted_mib")})
    assert ladder_figures.published_figure(no_reference).layout.title.text.endswith("for no reference model")


def test_the_breakdown_gives_each_model_its_own_scale():
    """On one axis, the model at hand's 4 MiB were invisible beside the reference model's 8,000 MiB."""
    cats = {f"{c}_bytes": v for c, v in zip(ladder_figures.CATEGORIES, (1, 2, 3, 4, 5))}
    measured = {f"measured_{c}_bytes": v for c, v in zip(ladder_figures.CATEGORIES, (1, 2, 3, 4, 6))}
    runs = pd.DataFrame([
        {"rung": "fp32", "role": "at hand", "model": "tiny", "status": "ok", "where": "step 2, forward",
         **{k: v * 2**20 for k, v in cats.items()}, **{k: v * 2**20 for k, v in measured.items()}},
        {"rung": "fp32", "role": "reference", "model": "qwen.json", "where": "step 2, backward",
         **{k: v * 2**30 for k, v in cats.items()}},
        {"rung": "lora", "role": "reference", "model": "qwen.json", **{k: 1.0 for k in cats}},
    ])
    fig = ladder_figures.breakdown_figure(StudyResult("ladder", runs=runs), "fp32")
    by_panel = {}
    for t in fig.data:
        by_panel.setdefault(t.yaxis, []).append(t)
    assert sorted(by_panel) == ["y", "y2"]  # two panels, two y axes
    assert [tuple(t.x) for t in by_panel["y"]][0] == ("predicted", "measured")
    assert [t.y[1] for t in by_panel["y"]] == [1, 2, 3, 4, 6]  # MiB, measured
    assert [t.y[0] for t in by_panel["y2"]] == [1024, 2048, 3072, 4096, 5120]
    assert [t.name for t in fig.data if t.showlegend] == ladder_figures.CATEGORIES  # one legend entry each
    titles = [a.text for a in fig.layout.annotations]
    assert titles[0].startswith("at hand: tiny") and "step 2, backward" in titles[1]
    assert "not in the ladder" in ladder_figures.breakdown_figure(StudyResult("ladder", runs=runs), "cpu").layout.title.text


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_parity_finding_is_claimed_only_where_the_engine_and_adamw_compute_alike(precision):
    """In bf16 the engine trains a bf16 copy and the reference AdamW fp32 weights under bf16 autocast:
    their weights differ by the 16-bit compute (0.0017 after 6 steps here), and "trains the same
    weights" was said anyway."""
    runs = pd.DataFrame([{"source": "measured", "hardware": "this machine (cpu)", "precision": precision,
                          "run": f"k={k}", "max_abs_diff_vs_adamw": d} for k, d in ((0, 0.0017), (1, 0.0009))])
    first = split_figures.findings(StudyResult("split", runs=runs))[0][0]
    if precision == "fp32":
        assert first.startswith("The engine trains the same weights as AdamW at every k (largest difference 0.0017)")
    else:
        assert first.startswith("In bf16, the engine's weights differ from plain AdamW's (bf16 autocast over fp32 "
                                "weights) by at most 0.0017")
        assert "not a parity check; precision=fp32 is" in first and "trains the same weights" not in first
