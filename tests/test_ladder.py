"""The ladder: rungs as composed plans, the study runner, auto-fit with a real OOM, the monitor.

    .venv/bin/python -m pytest tests/test_ladder.py -q        # about 40 s
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from workbench.config import ConfigError
from workbench.memory.ladder import RUNGS, FitChoice, auto_fit, measure, run_with_fallback
from workbench.memory.monitor import MemoryMonitor
from workbench.memory.study import LadderConfig, run_ladder
from workbench.models import TINY_SPEC, load_model



@pytest.fixture(scope="module")
def env(tiny_base, tmp_path_factory):
    """A results folder for this module; the tiny base comes from conftest (built once)."""
    old = os.environ.get("WORKBENCH_RESULTS")
    results = tmp_path_factory.mktemp("results")
    os.environ["WORKBENCH_RESULTS"] = str(results)
    torch.set_num_threads(1)
    yield results
    if old is not None:
        os.environ["WORKBENCH_RESULTS"] = old


def test_rungs_are_composed_plans():
    assert [r.tier for r in RUNGS.values()] == sorted(r.tier for r in RUNGS.values())
    ckpt = RUNGS["bf16_ckpt"]
    assert ckpt.precision == "bf16" and ckpt.grad_checkpointing
    # Tier 2 rungs keep tier 1's choices and change one thing each.
    for name, field, value in [("adamw8bit", "optimizer", "adamw8bit"), ("lora", "trainable", "lora"),
                               ("qlora", "trainable", "qlora"), ("zero_offload", "placement", "zero_offload")]:
        r = RUNGS[name]
        assert getattr(r, field) == value and r.precision == "bf16" and r.grad_checkpointing
    assert RUNGS["bf16_ckpt_accum"].settings(8, 2).micro_batch == 2
    assert RUNGS["bf16_ckpt_accum"].settings(8, 2).grad_accum == 4
    assert RUNGS["cpu"].tier == 3 and RUNGS["cpu"].precision == "fp32"


def test_run_ladder_predicts_measures_and_explains(env):
    rungs = ("fp32", "fp16", "bf16_ckpt", "lora", "device_map", "cpu")
    cfg = LadderConfig(tiny=True, rungs=rungs, batch=4, seq_len=64, steps=2, budget_mib=3.0, reference_model="")
    df = run_ladder(cfg)
    at_hand = df[df["role"] == "at hand"].set_index("rung")
    assert list(at_hand.index) == list(rungs)
    ok = at_hand[at_hand["status"] == "ok"]
    assert set(ok.index) == {"fp32", "bf16_ckpt", "lora", "cpu"}
    for name, r in ok.iterrows():
        if name != "cpu":
            assert abs(r["predicted_peak_bytes"] / r["measured_peak_bytes"] - 1) < 0.01, name
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["loss_after"] == r["loss_after"]
    assert ok.loc["cpu", "measured_host_bytes"] > 0
    # Rungs that cannot run here are rows that say why; their figure is labelled estimated.
    for name in ("fp16", "device_map"):
        row = at_hand.loc[name]
        assert row["status"] == "skipped" and ("CUDA" in row["reason"] or "GPU" in row["reason"]), name
        assert row["method"] == "estimated" and row["note"].startswith("estimated")
    # The ladder saves memory as it goes down.
    assert at_hand.loc["lora", "predicted_peak_bytes"] < at_hand.loc["bf16_ckpt", "predicted_peak_bytes"] \
        < at_hand.loc["fp32", "predicted_peak_bytes"]
    run_dir = Path(df.attrs["run_dir"])
    for f in ("config.json", "summary.json", "ladder.csv", "steps.jsonl", "autofit.csv"):
        assert (run_dir / f).exists(), f
    assert (env / "ladder" / "runs.csv").exists()
    fit = df.attrs["autofit"]
    assert fit.iloc[-1]["status"] == "ok" and fit.iloc[-1]["ran"] in rungs


def test_auto_fit_steps_down_on_a_real_oom(env):
    model, tok = load_model("embedded", spec=TINY_SPEC)
    from workbench.data import corpus_blocks, target_corpus

    blocks, _ = corpus_blocks(tok, target_corpus(), 64)
    rungs = ("fp32", "bf16_ckpt", "lora")
    # Predicted for batch 1 (fp32: 3.57 MiB), run at batch 2 (fp32: 5.07 MiB, bf16_ckpt: 3.29 MiB):
    # the fastest rung fits on paper, not for real, and auto-fit must step down.
    choice = auto_fit(model.config, batch=1, seq=64, budget_mib=3.6, rungs=rungs, device="cpu")
    assert choice.rung == "fp32" and choice.order() == ["fp32", "bf16_ckpt", "lora"]

    def attempt(name):
        m = measure(name, lambda: load_model("embedded", spec=TINY_SPEC)[0], blocks, batch=2, steps=2,
                    budget_mib=3.6)
        if m["status"] == "oom":
            raise torch.OutOfMemoryError(m["reason"])
        return m

    ran, result, tries = run_with_fallback(choice, attempt, log=lambda s: None)
    assert tries[0]["status"] == "oom" and tries[-1]["status"] == "ok"
    assert ran == tries[-1]["rung"] == "bf16_ckpt"
    assert result["measured_peak_bytes"] <= 3.6 * 2**20
    # Nothing fits: a clear OOM, not a silent choice.
    with pytest.raises(torch.OutOfMemoryError, match="no rung fits"):
        run_with_fallback(FitChoice(None, 1, []), attempt)


def test_config_and_budget_errors():
    with pytest.raises(ConfigError, match="unknown rung 'fp64'"):
        LadderConfig(rungs=("fp32", "fp64"))
    with pytest.raises(ConfigError, match="budget_mib must be a positive"):
        LadderConfig(budget_mib=0.0)
    with pytest.raises(ConfigError, match="unknown parameter"):
        LadderConfig.from_dict({"budjet_mib": 3.0})
    with pytest.raises(ConfigError, match="budget must be a positive"):
        auto_fit("unused", batch=1, seq=8, budget_mib=-1)


def test_monitor_rows_go_to_sinks_and_a_missing_driver_is_one_line(capsys):
    from workbench.memory.live_bytes import LiveBytes

    got = []
    with LiveBytes("cpu") as live, MemoryMonitor("cpu", interval_s=0.01, sinks=[got.append], live=live, nvml=True) as mon:
        x = torch.ones(1 << 20)  # 4 MiB live
        import time

        time.sleep(0.1)
        del x
    err = capsys.readouterr().err
    if "NVML unavailable" in err:  # no driver here: one line, no traceback
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert len(got) >= 3 and got == mon.rows
    assert all(r["source"] == "monitor" and r["rss_mib"] > 0 for r in got)
    assert mon.peak["live_mib"] >= 4.0
