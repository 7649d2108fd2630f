"""Study 2's auto-fit on the machine at hand (studies/ladder/fit_run.py): on a card, the search predicts
the card's step and each try runs under a real CUDA budget; on the CPU the budget is played.

No card here: the card's side is played by stand-ins for the four calls that touch it (the card's
properties, the budget's cap, the measurement and the release); everything else is the study's own path.
"""

from __future__ import annotations

import contextlib
import json
import os

import pandas as pd
import pytest
import torch

from workbench.core import fallback
from workbench.core.common import MiB
from workbench.core.config import ConfigError
from workbench.core.memory import cuda_model
from workbench.core.memory.predict import predict
from workbench.front.gpu_report import short_of_time
from workbench.studies.ladder import fit_run, gpu_autofit
from workbench.studies.ladder import autofit
from workbench.studies.ladder.autofit import prediction_margin
from workbench.studies.ladder.figures import _fit_where, findings
from workbench.studies.ladder.fit_run import CPU_MARGIN, run_choice, search_here
from workbench.studies.ladder.runner import LadderConfig, model_at_hand, run_ladder

CARD = "RTX 4060 Ti 8GB"


@pytest.fixture
def env(tiny_base, tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path / "results"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tmp_path
    torch.set_num_threads(threads)


@pytest.fixture
def played_card(monkeypatch):
    """A card the study finds (torch could run on it) with the stand-ins' record of what touched it:
    `tries` (setup, device, counted, the budget in force), `budgets`, `released`. The first setup tried
    on the card runs out of memory, as a card's allocator would under its cap; the next trains."""
    seen = {"tries": [], "budgets": [], "released": [], "cap": None}
    monkeypatch.setattr(fallback, "unavailable", lambda device: None)
    monkeypatch.setattr(cuda_model, "card_at_hand", lambda device="cuda": cuda_model.card(CARD))

    @contextlib.contextmanager
    def budget(device, budget_mib=None, allocator="live"):
        seen["budgets"].append((str(device), budget_mib, allocator))
        seen["cap"] = budget_mib
        try:
            yield None
        finally:
            seen["cap"] = None

    def measure(plan, load, blocks, *, batch, steps, device="cpu", budget_mib=None, counted=True, **kw):
        seen["tries"].append({"setup": plan.name, "device": str(device), "counted": counted, "cap": seen["cap"],
                              "budget_mib": budget_mib, "batch": batch})
        if len(seen["tries"]) == 1:
            return {"status": "oom", "reason": "CUDA out of memory. Tried to allocate 20.00 MiB (played)"}
        return {"status": "ok", "reason": "", "measured_peak_bytes": 21 * MiB, "cuda_max_allocated_bytes": 21 * MiB,
                "cuda_max_reserved_bytes": 26 * MiB, "step_ms": 5.0}

    monkeypatch.setattr(fit_run, "device_budget", budget)
    monkeypatch.setattr(fit_run, "measure", measure)
    monkeypatch.setattr(fit_run, "release_held", lambda device: seen["released"].append(str(device)))
    return seen


def test_on_a_card_auto_fit_searches_the_cards_step_and_steps_down_under_a_real_cuda_budget(env, played_card):
    """Until 2026-11-28 study 2's auto-fit ran on the CPU on every machine: its search predicted the CPU's
    step with the CPU's 1% margin, and its tries ran under the played budget, so a card's own
    out-of-memory error (item 5 of the card issue: step down on a real one) never reached it."""
    cfg = LadderConfig(base_size="tiny", rungs=("fp32",), micro_batch=4, seq_len=64, steps=2, budget_mib=30.0,
                       reference_model="", measure=False)
    rows = []
    result = run_ladder(cfg, sinks=[rows.append], progress=False)
    searched, fit = result.tables["autofit_search"], result.tables["autofit"]
    # the live chart hears how each try ended, the one that trained too (its status line ends on it)
    assert [r["result"] for r in rows if r.get("event") == "attempt"] == ["oom", "ok"]

    # the search predicted the card's step: its reserved peak, with the margin measured on cards
    first = searched.iloc[0]
    margins = searched["margin"].dropna().unique()
    assert len(margins) == 1 and margins[0] > CPU_MARGIN  # the bytes' error + the reserved shortfall on cards
    assert first["need_mib"] > 20  # a card reserves 20 MiB segments and its cuBLAS workspace: the CPU's step is ~2 MiB

    # each try on the card, under a real CUDA budget of budget_mib, measured by the allocator (no dispatch mode)
    tries = played_card["tries"]
    assert [t["device"] for t in tries] == ["cuda", "cuda"] and not any(t["counted"] for t in tries)
    assert all(t["cap"] == 30.0 and t["budget_mib"] is None for t in tries)
    assert played_card["budgets"] == [("cuda", 30.0, "live")] * 2
    assert played_card["released"] == ["cuda", "cuda"]  # each try starts as a fresh process would
    # a real out-of-memory error stepped down to the next setup kept, the same effective batch
    kept = searched[searched["kept"] == True]["setup"].tolist()  # noqa: E712 (a column of bools and Nones)
    assert [t["setup"] for t in tries] == kept[:2] and all(t["batch"] == 4 for t in tries)
    assert fit["status"].tolist() == ["oom", "ok"] and fit["device"].tolist() == ["cuda", "cuda"]
    assert fit["ran"].iloc[-1] == kept[1] and fit["predicted_choice"].iloc[-1] == kept[0]
    assert fit["measured_reserved_mib"].iloc[-1] == 26.0 and "CUDA out of memory" in fit["error"].iloc[0]
    said = " ".join(text for text, _ in findings(result))
    assert f"ran {kept[1]} with the budget enforced on the card (its allocator's reserved memory capped" in said
    with open(os.path.join(result.paths["run_dir"], "summary.json")) as f:
        assert json.load(f)["autofit_device"] == "cuda"
    # runs.csv's `device` is where auto-fit's setup trained: gpu-check's notebooks check reads it
    assert pd.read_csv(env / "results" / "ladder" / "runs.csv")["device"].tolist() == ["cuda"]


def test_the_card_search_predicts_the_step_its_tries_run_for_that_card(env, monkeypatch):
    """The search's figures on a card are `predict(device="cuda", card=..., load="host")`'s (the tries
    convert the weights on the host before moving them, as `measure` does), and its margins are
    `prediction_margin(plan, device="cuda")`, the same the command line's --search keeps."""
    # a card before sm_80, where bf16 is emulated: the search offers fp16-mixed there, so it shows the card
    # at hand was searched for (on the tiny base a newer card's figures are the same as no card's)
    monkeypatch.setattr(cuda_model, "card_at_hand", lambda device="cuda": cuda_model.card("T4 16GB"))
    loads = []  # (on the tiny base the two loads leave the same segments: the call is what tells them apart)
    monkeypatch.setattr(autofit, "predict", lambda *a, **kw: loads.append(kw.get("load")) or predict(*a, **kw))
    cfg = LadderConfig(base_size="tiny", micro_batch=4, seq_len=64)
    config = model_at_hand(cfg)[0]
    choice = search_here(config, fit_run.RUNGS["fp32"], device="cuda", batch=4, seq=64, budget_mib=30.0)
    assert loads and set(loads) == {"host"}
    assert choice.table[0]["setup"].startswith("fp16-mixed") and choice.plan.precision == "fp16"
    row = next(r for r in choice.table if r["setup"] == choice.plan.name)
    p = predict(config, choice.plan, batch=4, seq=64, device="cuda", card="T4 16GB", load="host")
    assert row["need_mib"] == pytest.approx(p.fit_bytes / MiB)
    assert row["margin"] == pytest.approx(prediction_margin(choice.plan, device="cuda")[0])
    on_cpu = search_here(config, fit_run.RUNGS["fp32"], device="cpu", batch=4, seq=64, budget_mib=30.0)
    assert {r["margin"] for r in on_cpu.table} == {CPU_MARGIN}


def test_a_card_try_past_the_hosts_free_memory_is_not_run(env, played_card, monkeypatch):
    """An offloaded setup keeps its share in host memory: past what this machine has free, the try is an
    out-of-memory row that steps down, never run (the OOM killer would take the study)."""
    monkeypatch.setattr(fit_run, "past_free_memory", lambda mib, **kw: "9,000.0 MiB > the 10 MiB this machine has free"
                        if mib > 1 else None)
    cfg = LadderConfig(base_size="tiny", micro_batch=4, seq_len=64)
    config, load, blocks, _ = model_at_hand(cfg)
    choice = search_here(config, fit_run.RUNGS["fp32"], device="cuda", batch=4, seq=64, budget_mib=30.0)
    choice.table[0]["host_mib"] = 9000.0  # the chosen setup, as an offloaded one's row would say
    events = []
    chosen, tries = run_choice(choice, config, load, blocks, device="cuda", batch=4, budget_mib=30.0,
                               on_event=lambda **row: events.append(row))
    assert tries[0]["status"] == "oom" and "its predicted host memory 9,000.0 MiB" in tries[0]["error"]
    assert events[0] == {"rung": choice.plan.name, "attempt": f"auto-fit {choice.plan.name}", "result": "skipped"}
    # every try's end is an event, the one that trained too (a live chart's status line ends on it)
    assert [e["rung"] for e in events] == [t["setup"] for t in tries if t["setup"]]
    # not run: the first setup the card measured is the next one (which the played card runs out of memory on)
    assert played_card["tries"][0]["setup"] == choice.fitting[1].name


def test_a_try_that_neither_trains_nor_runs_out_keeps_the_tries_before_it(env, played_card, monkeypatch):
    """A setup that cannot run here (measure() skips it, e.g. no bitsandbytes kernel) after one that ran out
    of memory: both tries are rows, each under its own name. The whole table had been one row naming the
    first setup, with the second's error."""
    def measure(plan, load, blocks, **kw):
        played_card["tries"].append(plan.name)
        if len(played_card["tries"]) == 1:
            return {"status": "oom", "reason": "CUDA out of memory (played)"}
        return {"status": "skipped", "reason": "bitsandbytes has no kernel here (played)"}

    monkeypatch.setattr(fit_run, "measure", measure)
    cfg = LadderConfig(base_size="tiny", micro_batch=4, seq_len=64)
    config, load, blocks, _ = model_at_hand(cfg)
    choice = search_here(config, fit_run.RUNGS["fp32"], device="cuda", batch=4, seq=64, budget_mib=30.0)
    events = []
    chosen, tries = run_choice(choice, config, load, blocks, device="cuda", batch=4, budget_mib=30.0,
                               on_event=lambda **row: events.append(row))
    first, second = (p.name for p in choice.fitting[:2])
    assert chosen is None and played_card["tries"] == [first, second]
    assert [(t["setup"], t["status"], t["device"]) for t in tries] == [(first, "oom", "cuda"),
                                                                       (second, "skipped", "cuda")]
    assert "played" in tries[0]["error"] and "bitsandbytes" in tries[1]["error"]
    assert [(e["rung"], e["result"]) for e in events] == [(first, "oom"), (second, "skipped")]


def test_device_cuda_without_a_card_is_a_one_line_error_before_anything_runs(env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = LadderConfig(base_size="tiny", rungs=("fp32",), device="cuda", micro_batch=4, seq_len=64, reference_model="")
    with pytest.raises(ConfigError, match=r"^device=cuda: no CUDA device on this machine .*; use device=cpu or "
                                          r"device=auto$"):
        run_ladder(cfg, progress=False)
    assert not os.path.exists(env / "results" / "ladder")  # no rung was measured first
    assert LadderConfig().device == "auto"
    with pytest.raises(ConfigError, match="device"):
        LadderConfig(device="tpu")


# ------------------------------------------------------------------------------------------------
# gpu-check's auto-fit check (studies/ladder/gpu_autofit.py): its plan and verdict, and its CUDA layer played

def test_the_checks_cap_lies_between_the_two_needs_only_where_it_is_clear_of_both():
    # Qwen2-0.5B at 1 x 512 on the H200 (its record): fp32's allocated peak, bf16-true's reserved one
    cap, setups = gpu_autofit.plan_cap(8_664.8, 5_156.0)
    assert setups == ["fp32", "bf16_true"] and cap == pytest.approx(6_910.4)
    cap, setups = gpu_autofit.plan_cap(12.0, 24.0)  # the tiny base: the segments and the workspace decide
    assert setups == ["fp32"] and cap == 6.0  # fp32 must run out, and the step-down ends on the CPU
    assert gpu_autofit.plan_cap(10.0, 8.5)[1] == ["fp32"]  # a cap between them would be inside the error
    # clear of bf16-true's need (110 MiB under a 110.5 cap) but not of fp32's (121 is 9.5% above it)
    assert gpu_autofit.plan_cap(121.0, 100.0) == (60.5, ["fp32"])
    # a card that cannot give the cap (under about 6 GB for this model): bf16-true would not fit it either
    assert gpu_autofit.plan_cap(8_664.8, 5_156.0, room_mib=5_500.0) == (4_332.4, ["fp32"])
    assert gpu_autofit.plan_cap(8_664.8, 5_156.0, room_mib=7_000.0)[1] == ["fp32", "bf16_true"]


def _tries(first="oom", second=("bf16_true", "ok", 7_000.0), device="cuda"):
    return [{"setup": "fp32", "status": first, "device": device,
             "error": "CUDA out of memory. Tried to allocate 1.02 GiB" if first == "oom" else ""},
            {"setup": second[0], "status": second[1], "device": device, "error": "",
             "measured_reserved_mib": second[2]}]


@pytest.mark.parametrize("tries, left, failure", [
    (_tries(), 66.0, None),
    (_tries(first="ok"), 66.0, "fp32 (allocated peak predicted 10,376 MiB) did not run out of memory under a "
                               "7,766 MiB cap: ok"),
    (_tries(second=("cpu", "ok", None)), 66.0, "the step-down ended on cpu, not bf16_true"),
    (_tries(second=("bf16_true", "ok", 8_000.0)), 66.0, "bf16_true reserved 8,000 MiB, past the 7,766 MiB cap"),
    (_tries(), 2_066.0, "the card holds 2,000 MiB more allocated after the step-down than before it"),
    (_tries(device="cpu"), 66.0, "fp32 was not run on the card"),
    # not run for the host's memory (fit_run counts it out of memory, on the card's device): no card error
    ([{**_tries()[0], "error": "its predicted host memory 9,000.0 MiB > the 10 MiB this machine has free: not run"},
      _tries()[1]], 66.0, "fp32 was not run on the card"),
    ([*_tries()[:1], {"setup": "bf16_true", "status": "oom", "error": "CUDA out of memory"}], 66.0,
     "nothing trained after the step-down (expected bf16_true): fp32: oom; bf16_true: oom"),
])
def test_the_auto_fit_checks_verdict(tries, left, failure):
    v = gpu_autofit.autofit_verdict(tries, cap_mib=7_766.0, needs_mib={"fp32": 10_376.0, "bf16_true": 5_156.0},
                                    setups=["fp32", "bf16_true"], left_before_mib=66.0, left_after_mib=left)
    assert v["status"] == ("pass" if failure is None else "fail"), v["failures"]
    if failure:
        assert any(f.startswith(failure) for f in v["failures"]), v["failures"]
    assert "| fp32 | 10,376 | " in v["report"] and "cap 7,766 MiB" in v["report"]


def test_the_auto_fit_check_runs_the_step_down_on_the_card_under_its_cap(tiny_base, played_card, monkeypatch):
    """check_autofit's CUDA layer on the CPU: the card's calls played (fit_run's stand-ins: the first
    setup runs out of memory, the next trains). On the tiny base the two needs are too close: fp32 alone
    on the card, under half its need, then the CPU."""
    import types

    allocated = iter([66 * MiB, 100 * MiB])  # before and after the step-down (within its tolerance)
    order = []  # the releases and the readings: each reading follows a release
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: order.append("read") or next(allocated))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(gpu_autofit, "release_held",
                        lambda device: order.append("release") or played_card["released"].append(str(device)))
    asked = []  # the check's predictions: for the card at hand, loaded as measure() loads them
    monkeypatch.setattr(gpu_autofit, "predict", lambda *a, **kw: asked.append(kw) or predict(*a, **kw))
    # the card as found now: 8 GiB, of which 1.5 GiB in use by others and this process's context
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(6.5 * 1024) * MiB, 8192 * MiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    rooms = []  # the cap is planned within what the card can give
    plan_cap = gpu_autofit.plan_cap
    monkeypatch.setattr(gpu_autofit, "plan_cap", lambda *a: rooms.append(a[2:]) or plan_cap(*a))
    opts = types.SimpleNamespace(model="embedded", tiny=True, batch=4, seq=64, device="cuda", out_of_time=lambda: True)
    # past --time-budget once its predictions are made, the step-down does not begin (it could end past the kill)
    assert gpu_autofit.check_autofit(opts) == {"status": "not run", "reason": "the time budget (--time-budget) was "
                                               "spent before its step-down began (after its predictions)"}
    assert not played_card["tries"] and len(asked) == 2 and short_of_time(gpu_autofit.check_autofit(opts))
    asked.clear()
    opts.out_of_time = lambda: False
    v = gpu_autofit.check_autofit(opts)
    assert v["status"] == "pass", v["failures"]
    assert [(kw["card"].name, kw["load"]) for kw in asked] == [(CARD, "host")] * 2
    config = model_at_hand(LadderConfig(base_size="tiny", micro_batch=4, seq_len=64))[0]
    need = predict(config, "fp32", batch=4, seq=64, device="cuda", card=CARD, load="host")
    assert v["predicted_needs_mib"]["fp32"] == need.allocated_peak_bytes / MiB != need.fit_bytes / MiB
    need = need.allocated_peak_bytes / MiB  # fp32's allocated peak on the card: no cap below it holds the step
    assert v["cap_mib"] == need / 2 and v["expected"] == "cpu" and need > 2
    assert [(t["setup"], t["device"], t["cap"]) for t in played_card["tries"]] == [
        ("fp32", "cuda:0", need / 2), ("cpu", "cpu", None)]
    assert [(t["setup"], t["device"], t["status"]) for t in v["tries"]] == [("fp32", "cuda:0", "oom"),
                                                                          ("cpu", "cpu", "ok")]
    assert played_card["budgets"] == [("cuda:0", need / 2, "live")]  # the card's try alone under the cap
    # before the check, before the card's try, and after the step-down: both readings are of tensors,
    # not of the workspaces a run leaves (65 MiB on the H200, over the tolerance)
    assert played_card["released"] == ["cuda:0", "cuda:0", "cuda:0"]
    assert order[:2] == ["release", "read"] and order[-2:] == ["release", "read"], order
    assert (v["left_before_mib"], v["left_after_mib"]) == (66.0, 100.0)
    assert rooms == [(6.5 * 1024,)]


def test_the_finding_says_where_auto_fits_last_try_ran():
    """A step-down past the card ends on the CPU, with no budget: the finding had said "on the card"
    whenever any try had been there."""
    where = lambda *devices: _fit_where(pd.DataFrame({"device": [*devices, None]}))  # noqa: E731 (the verdict row)
    assert where("cuda", "cuda").startswith(" with the budget enforced on the card (")
    assert "then" not in where("cuda", "cuda")
    assert where("cuda", "cpu").endswith(", then on the CPU (the cpu rung: no budget)")
    assert where("cpu", "cpu") == " with the budget enforced on the CPU (the budget played: live tensor bytes counted)"
    assert _fit_where(pd.DataFrame({"setup": ["x"]})) == ""
    # the ladder's last resort, the cpu rung, runs with no budget: it read "with the budget enforced on the CPU"
    ran_cpu = lambda *setups: _fit_where(pd.DataFrame({"setup": setups, "device": ["cpu"] * len(setups),  # noqa: E731
                                                       "ran": ["cpu"] * len(setups)}))
    assert ran_cpu("cpu") == " on the CPU with no budget (the cpu rung, the last resort)"
    assert ran_cpu("bf16", "cpu") == (" on the CPU with no budget (the cpu rung, the last resort; the tries before it "
                                      "under the budget played: live tensor bytes counted)")


def test_the_finding_read_back_from_disk_says_nothing_chosen_not_nan():
    """An empty cell of autofit.csv read back is NaN, not None: the finding said "Auto-fit chose nan"."""
    from workbench.core.results import StudyResult

    fit = pd.DataFrame({"setup": ["cpu"], "device": ["cpu"], "status": ["ok"], "predicted_choice": [float("nan")],
                        "ran": ["cpu"], "why": ["nothing fits 0.1 MiB"], "budget_mib": [0.1]})
    result = StudyResult("ladder", runs=pd.DataFrame({"rung": ["fp32"], "role": ["at hand"], "budget_mib": [0.1]}),
                         tables={"autofit": fit}, facts={"budget_mib": 0.1})
    said = [f for f, _ in findings(result) if f.startswith("Auto-fit")]
    assert said == ["Auto-fit chose nothing on the device for a 0.1 MiB budget and ran cpu on the CPU with no budget "
                    "(the cpu rung, the last resort), the batch per step kept. Why: nothing fits 0.1 MiB"], said
