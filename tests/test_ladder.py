"""The ladder: rungs as composed plans, the study runner, auto-fit with a real OOM, the monitor.

    .venv/bin/python -m pytest tests/test_ladder.py -q        # about 40 s
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
import types
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch

from workbench.core import common
from workbench.core.common import MiB, single_process_env
from workbench.core.config import ConfigError
from workbench.core.data import corpus_blocks, target_corpus
from workbench.core.memory import monitor
from workbench.core.memory.live_bytes import LiveBytes
from workbench.core.memory.meta import model_config
from workbench.core.memory.monitor import MemoryMonitor, step_memory
from workbench.core.memory.offload import REDUCE_BUCKET_SIZE, device_map_max_memory
from workbench.core.memory.plan import RUNGS, apply_trainable, quantize_4bit
from workbench.core.memory.predict import predict
from workbench.core.models import TINY_SPEC, EmbeddedSpec, load_model
from workbench.core.results import RERUN_ENV, RunDir
from workbench.core.trainable import apply_strategy
from workbench.core.training import TrainSettings, train
from workbench.studies.ladder import figures as ladder_figures
from workbench.studies.ladder import rungs as ladder
from workbench.studies.ladder import runner
from workbench.studies.ladder.autofit import MARGINS_FILE, SetupChoice, run_with_step_down
from workbench.studies.ladder.figures import BUDGET_NOTE, report_section
from workbench.studies.ladder.rungs import auto_fit, measure, zero_config
from workbench.studies.ladder.fit_run import search_here
from workbench.studies.ladder.runner import LadderConfig, load_result, run_ladder
from tests.conftest import LINUX_RELEASE, WSL2_RELEASE, played_uname


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


def test_the_accumulation_rung_keeps_the_whole_batch_when_4_does_not_divide_it():
    """Micro-batch batch // 4 with batch // micro of them trained 8 of a batch of 9 (and 12 of 14)
    without a word; now the batch per step is kept, and the prediction's note says how it was split."""
    accum = RUNGS["bf16_ckpt_accum"]
    for batch, split in [(8, (2, 4)), (9, (1, 9)), (14, (2, 7)), (10, (2, 5)), (6, (1, 6)), (2, (1, 2)), (100, (25, 4))]:
        s = accum.settings(batch, 2)
        assert (s.micro_batch, s.grad_accum) == split and s.micro_batch * s.grad_accum == batch, (batch, s)
    assert all(RUNGS["bf16_ckpt"].split(b) == (b, 1) for b in (1, 7, 9))
    config = model_config(str(Path(__file__).resolve().parent.parent / "data" / "configs" / "gpt2.json"))
    assert predict(config, "bf16_ckpt_accum", batch=9, seq=32, device="cpu").note == \
        "batch 9 is not 4 equal micro-batches: 9 of 1 instead (the batch per step kept)"
    assert predict(config, "bf16_ckpt_accum", batch=8, seq=32, device="cpu").note == ""


def test_a_zero_rung_that_fails_on_the_card_destroys_its_engine(monkeypatch):
    """A ZeRO rung out of memory on a card (gpu-check) left its DeepSpeed engine undestroyed: its
    gradient hooks hold the model in a cycle the collector cannot see, so the card kept that memory
    for the rungs and checks after it. Played with a stand-in engine (the path needs CUDA)."""
    import deepspeed

    from conftest import OomDeepSpeedEngine

    engine = OomDeepSpeedEngine()
    before = os.environ.get("MASTER_PORT")
    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: (engine, None, None, None))
    # measure_offloaded sets DeepSpeed's rendezvous variables where unset: set here, they go after the
    # test (left behind, every later DeepSpeed subprocess of the suite took this one port: EADDRINUSE)
    for name, value in single_process_env().items():
        monkeypatch.setenv(name, value)
    groups = []  # the one-process group each rung makes (on the card: NCCL, which a CPU-only torch lacks)
    monkeypatch.setattr(ladder, "single_process_group", groups.append)
    for name in ("empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    partitioned = []  # ZeRO-3 partitions the model from the host first (it moves the buffers to the card)

    def partition_on_host(model, plan, config):  # as zero.Init(module=...) does, it replaces torch's linear
        partitioned.append(plan.name)
        torch.nn.functional.linear = lambda *a, **kw: None

    monkeypatch.setattr(ladder, "partition_on_host", partition_on_host)
    model = load_model("embedded", spec=TINY_SPEC)[0]
    linear = torch.nn.functional.linear
    for rung_name in ("zero_offload", "zero_offload_params"):
        with pytest.raises(torch.OutOfMemoryError):
            ladder.measure_offloaded(RUNGS[rung_name], lambda: model, torch.zeros(4, 8, dtype=torch.long), batch=1,
                                     steps=1, device=torch.device("cuda"), lr=1e-3)
    assert engine.destroyed == 2 and torch.nn.functional.linear is linear
    assert partitioned == ["zero_offload_params"] and groups == [torch.device("cuda")] * 2
    monkeypatch.undo()
    assert os.environ.get("MASTER_PORT") == before


def test_an_offloaded_setup_trains_what_its_plan_trains(monkeypatch):
    """An offloaded setup was measured as full fine-tuning whatever its plan said: `measure_offloaded`
    handed DeepSpeed the model as loaded, while the prediction simulates the plan's trainable set (a
    LoRA setup with ZeRO-Offload, which auto-fit's search offers). QLoRA is not offloaded here: said.
    Played with a stand-in engine (the path needs CUDA)."""
    import deepspeed

    from conftest import OomDeepSpeedEngine

    from deepspeed.runtime.zero import parameter_offload

    handed, modes = [], []

    def initialize(**kw):  # what DeepSpeed is handed, and whether the model trains as the prediction simulates
        handed.append(kw)
        modes.append((all(m.training for m in kw["model"].modules()), kw["model"].is_gradient_checkpointing))
        return OomDeepSpeedEngine(kw["model"]), None, None, None

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    for name, value in single_process_env().items():
        monkeypatch.setenv(name, value)
    groups = []  # the one-process group each rung makes (on the card: NCCL, which a CPU-only torch lacks)
    monkeypatch.setattr(ladder, "single_process_group", groups.append)
    for name in ("empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    lora = RUNGS["zero_offload"].compose("zero lora", "", trainable="lora")
    blocks = torch.zeros(4, 8, dtype=torch.long)
    with pytest.raises(torch.OutOfMemoryError):
        ladder.measure_offloaded(lora, lambda: load_model("embedded", spec=TINY_SPEC)[0], blocks, batch=1, steps=1,
                                 device=torch.device("cuda"), lr=1e-3)
    trained = handed[0]["model_parameters"]
    names = {n for n, p in handed[0]["model"].named_parameters() if p.requires_grad}
    assert names and all("lora_" in n for n in names) and len(trained) == len(names)
    # from_pretrained's model is in eval mode, and DeepSpeed's engine never sets it: the ZeRO rungs had run without
    # checkpointing (transformers checkpoints in training mode only) and without dropout
    assert not load_model("embedded", spec=TINY_SPEC)[0].training and modes == [(True, True)]
    # ZeRO-3's engine leaves the model on DeepSpeed's module stack, which destroy() does not clear: taken off
    assert not any(m is handed[0]["model"] for m in parameter_offload.FWD_MODULE_STACK)
    qlora = RUNGS["zero_offload"].compose("zero qlora", "", trainable="qlora")
    row = measure(qlora, lambda: load_model("embedded", spec=TINY_SPEC)[0], blocks, batch=1, steps=1, device="cuda")
    assert row["status"] == "not measured" and "QLoRA is not measured with zero_offload" in row["reason"]


def test_a_rung_bigger_than_this_machine_is_not_measured(env, monkeypatch):
    """The rungs are measured on this CPU with no budget enforced: micro_batch 100,000 on the tiny base
    (146 GiB predicted) had the kernel's OOM killer take the study with its first rung."""
    monkeypatch.setattr(common, "host_free_mib", lambda: 20_000.0)  # any machine's, a CI's with more free too
    cfg = LadderConfig(base_size="tiny", rungs=("fp32", "cpu"), micro_batch=100_000, seq_len=64, steps=2,
                       budget_mib=3.0, reference_model="", autofit=False)
    result = run_ladder(cfg)
    rows = result.runs.set_index("rung")
    for name in ("fp32", "cpu"):  # the cpu rung's step is host memory: held to the same limit
        assert rows.loc[name, "status"] == "skipped"
        assert re.fullmatch(r"predicted peak 149,\d{3}\.\d MiB > the 20,000 MiB this machine has free: not measured",
                            rows.loc[name, "reason"]), rows.loc[name, "reason"]
    # predicted, not measured: the findings say so (they said "Nothing was predicted or measured.")
    assert ladder_figures.findings(result) == [("No finding to state from 2 rung(s) predicted and 0 measured here "
                                                "(the table has each rung).", "")]


def test_auto_fit_holds_each_attempt_to_the_memory_this_machine_has_free(env, monkeypatch, capsys):
    """Auto-fit steps down to the cpu rung last, which has no budget at all: a step past the free
    memory there was run, and the OOM killer would take the study. Each attempt is now held to
    the free memory as the rungs are; one past it is an out-of-memory try that steps down."""
    monkeypatch.setattr(common, "host_free_mib", lambda: 1.0)
    cfg = LadderConfig(base_size="tiny", rungs=("fp32",), micro_batch=4, seq_len=64, steps=2, budget_mib=3.0,
                       reference_model="")
    fit = run_ladder(cfg).tables["autofit"]
    assert re.search(r"auto-fit: .*\d+/\d+ \[", capsys.readouterr().err)  # the search's bar (a large batch is slow)
    tries, verdict = fit.iloc[:-1], fit.iloc[-1]
    assert tries["setup"].iloc[-1] == "cpu" and len(tries) >= 2  # the search's setups, then the last resort
    assert (fit["status"] == "oom").all() and fit["ran"].isna().all()
    assert re.fullmatch(r"auto-fit: no setup fits 3\.0 MiB \(tried: .+, cpu\)", verdict["error"]), verdict["error"]
    assert tries["error"].str.fullmatch(r"predicted peak [\d,]+\.\d MiB > the 1 MiB this machine has free: "
                                        r"not measured").all(), tries["error"].tolist()


def test_run_ladder_predicts_measures_and_explains(env):
    rungs = ("fp32", "fp16", "bf16_ckpt", "lora", "device_map", "cpu")
    cfg = LadderConfig(base_size="tiny", rungs=rungs, micro_batch=4, seq_len=64, steps=2, budget_mib=3.0, reference_model="")
    result = run_ladder(cfg)
    df = result.runs
    at_hand = df[df["role"] == "at hand"].set_index("rung")
    assert list(at_hand.index) == list(rungs)
    ok = at_hand[at_hand["status"] == "ok"]
    assert set(ok.index) == {"fp32", "bf16_ckpt", "lora", "cpu"}
    for name, r in ok.iterrows():
        if name != "cpu":
            assert abs(r["predicted_peak_bytes"] / r["measured_peak_bytes"] - 1) < 0.01, name
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["loss_after"] == r["loss_after"]
    assert ok.loc["cpu", "measured_host_bytes"] > 0
    # Rungs that cannot run here are rows that say why; fp16 autocast's figure is labelled estimated,
    # device_map's is simulated (each tensor at its place) with the host's share beside it.
    for name in ("fp16", "device_map"):
        row = at_hand.loc[name]
        assert row["status"] == "skipped" and ("CUDA" in row["reason"] or "GPU" in row["reason"]), name
    assert at_hand.loc["fp16", "method"] == "estimated" and at_hand.loc["fp16", "note"].startswith("estimated")
    dm = at_hand.loc["device_map"]
    assert dm["method"] == "predicted" and dm["note"].startswith("simulated placement") and dm["host_bytes"] > 0
    # The ladder saves memory as it goes down.
    assert at_hand.loc["lora", "predicted_peak_bytes"] < at_hand.loc["bf16_ckpt", "predicted_peak_bytes"] \
        < at_hand.loc["fp32", "predicted_peak_bytes"]
    run_dir = Path(result.paths["run_dir"])
    for f in ("config.json", "summary.json", "ladder.csv", "steps.jsonl", "autofit.csv"):
        assert (run_dir / f).exists(), f
    # runs.csv's row (what a sweep stacks per point) carries each rung's peaks
    row = pd.read_csv(env / "ladder" / "runs.csv").iloc[-1]
    assert row["fp32_measured_mib"] == pytest.approx(ok.loc["fp32", "measured_peak_bytes"] / 2**20, abs=1e-3)
    assert row["fp16_predicted_mib"] == pytest.approx(at_hand.loc["fp16", "predicted_peak_bytes"] / 2**20, abs=1e-3)
    assert "fp16_measured_mib" not in row and 0 <= row["max_prediction_error_pct"] < 1
    assert row["device"] == "cpu"  # where auto-fit's setup trained (the setting is auto; no card here)
    fit, searched = result.tables["autofit"], result.tables["autofit_search"]
    assert fit.iloc[-1]["status"] == "ok" and fit.iloc[-1]["ran"] == fit.iloc[-1]["predicted_choice"]
    # the joint search ran: every setup it predicted before the chosen one is over the budget
    first_fit = searched["fits"].tolist().index(True)
    assert searched.iloc[first_fit]["setup"] == fit.iloc[-1]["ran"] and not searched["fits"][:first_fit].any()
    assert searched.iloc[first_fit]["with_margin_mib"] <= cfg.budget_mib and "MiB" in fit.iloc[-1]["why"]
    # its table shows the margin in %, as the why does (a bare fraction beside it)
    shown = ladder_figures.autofit_search_table(result)
    assert "margin" not in shown and list(shown["margin (%)"]) == pytest.approx(list(100 * searched["margin"]), abs=0.05)


def test_a_paged_optimizer_on_the_cpu_is_measured_and_predicted_unpaged_without_a_warning(env):
    """On the CPU bitsandbytes runs a paged optimizer unpaged, with a warning (a red box in notebook
    02 and its app). The prediction took its state as pageable all the same and left it out of
    what must fit: at a budget between the two, it said "fits" where the measured step did not."""
    base = dict(base_size="tiny", rungs=("adamw8bit", "paged_adamw8bit"), micro_batch=2, seq_len=32, steps=2,
                reference_model="", autofit=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = run_ladder(LadderConfig(**base, budget_mib=1000.0)).runs.set_index("rung")
    assert not [w for w in seen if "Paged optimizers are not supported" in str(w.message)]
    paged = first.loc["paged_adamw8bit"]
    unpaged = first.loc["adamw8bit", "measured_peak_bytes"]
    assert paged["measured_peak_bytes"] == paged["predicted_peak_bytes"] == unpaged
    assert paged["note"].startswith("on the CPU a paged optimizer runs unpaged")
    between = (paged["predicted_peak_bytes"] - paged["optimizer_state_bytes"] / 2) / 2**20
    again = run_ladder(LadderConfig(**base, budget_mib=round(between, 3))).runs.set_index("rung")
    assert not again.loc["paged_adamw8bit", "fits_predicted"] and not again.loc["paged_adamw8bit", "fits_measured"]


def test_a_rungs_step_time_leaves_out_the_first_step(env):
    """The first step (kernels chosen, state made) is no step of a run's speed: with two steps (gpu-check's trial
    runs) a median over all of them was the first step's time. The first step is played slow here."""
    model, tok = load_model("embedded", spec=TINY_SPEC)
    blocks, _ = corpus_blocks(tok, target_corpus(), 32)

    def slow_first(row):  # (the sinks share the row the measurement keeps)
        if row.get("step") == 1:
            row["step_ms"] = 1e6

    out = measure("fp32", lambda: model, blocks, batch=1, steps=2, sinks=[slow_first])
    assert out["status"] == "ok" and out["step_ms"] < 1e6 and out["tokens_per_s"] > 32 / 1e3


@pytest.mark.parametrize("sm", [75, 90])
def test_the_cpu_rung_ranks_after_every_rung_on_the_card(sm):
    """Where every rung fits, the CPU comes last, on a card with bf16 (sm_90) and without (a T4's sm_75, where the
    bf16 rungs rank after fp32 and fp16): ranked with the card's fast rungs, auto-fit chose the CPU over QLoRA."""
    from workbench.core.memory.plan import RUNGS

    fits = {n: types.SimpleNamespace(fit_bytes=2**20, peak_bytes=2**20, method="predicted") for n in RUNGS}
    choice = auto_fit("unused", batch=1, seq=8, budget_mib=100, predictions=fits, device="cuda", margin=0, sm=sm)
    ranks = {r["rung"]: r["rank"] for r in choice.table}
    assert ranks["cpu"] > max(rank for name, rank in ranks.items() if name != "cpu")
    assert choice.rung != "cpu" and (sm == 90 or ranks["bf16_true"] > ranks["fp16"])


def test_auto_fit_steps_down_on_a_real_oom(env):
    model, tok = load_model("embedded", spec=TINY_SPEC)

    blocks, _ = corpus_blocks(tok, target_corpus(), 64)
    rungs = ("fp32", "bf16_ckpt", "lora")
    # Predicted for batch 1 (fp32: 3.57 MiB), run at batch 2 (fp32: 5.07 MiB, bf16_ckpt: 3.29 MiB):
    # the fastest rung fits on paper, not for real, and auto-fit must step down.
    choice = auto_fit(model.config, batch=1, seq=64, budget_mib=3.6, rungs=rungs, device="cpu")
    assert choice.rung == "fp32" and choice.order() == ["fp32", "bf16_ckpt", "lora"]
    overall = json.loads(MARGINS_FILE.read_text())["overall_pct"] / 100  # none of these precisions has 3 rows
    assert all(r["margin"] == pytest.approx(overall) for r in choice.table)  # the bytes' measured error on a CPU
    # a rung fits only with its margin: fp32 (3.57 MiB) is out once 1% is kept
    assert auto_fit(model.config, batch=1, seq=64, budget_mib=3.6, rungs=rungs, device="cpu", margin=0.01).rung \
        == "bf16_ckpt"

    def attempt(plan):
        m = measure(plan, lambda: load_model("embedded", spec=TINY_SPEC)[0], blocks, batch=2, steps=2,
                    budget_mib=3.6)
        if m["status"] == "oom":
            raise torch.OutOfMemoryError(m["reason"])
        return m

    rung_choice = SetupChoice(RUNGS[choice.rung], 2, choice.budget_bytes, 0.0, "",
                              fitting=[RUNGS[n] for n in choice.order()])
    ran, result, tries = run_with_step_down(rung_choice, attempt, log=lambda s: None)
    assert tries[0]["status"] == "oom" and tries[-1]["status"] == "ok"
    assert ran.name == tries[-1]["setup"] == "bf16_ckpt"
    assert result["measured_peak_bytes"] <= 3.6 * 2**20
    # Nothing fits: a clear OOM, not a silent choice.
    with pytest.raises(torch.OutOfMemoryError, match="no setup fits"):
        run_with_step_down(SetupChoice(None, 2, 1, 0.0, ""), attempt)


def test_cudas_own_out_of_memory_error_is_an_oom_row(monkeypatch):
    """A cuBLAS handle made on a full card fails as a RuntimeError (CUBLAS_STATUS_ALLOC_FAILED), not
    torch's OutOfMemoryError: the rung's measurement crashed instead of being an `oom` row that
    auto-fit steps down from; an offloaded rung's was 'not measured'."""
    cublas = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    def fails(error):
        def run(*a, **k):
            raise error
        return run

    blocks, load = torch.randint(0, 100, (8, 16)), lambda: load_model("embedded", spec=TINY_SPEC)[0]
    monkeypatch.setattr(ladder, "train", fails(cublas))
    m = measure("fp32", load, blocks, batch=2, steps=2)
    assert m["status"] == "oom" and "CUBLAS_STATUS_ALLOC_FAILED" in m["reason"]
    monkeypatch.setattr(ladder, "train", fails(RuntimeError("shape '[2, 3]' is invalid")))
    with pytest.raises(RuntimeError, match="shape"):  # a bug is not an out-of-memory row
        measure("fp32", load, blocks, batch=2, steps=2)
    monkeypatch.setattr(ladder, "measure_offloaded", fails(cublas))
    assert measure("zero_offload", load, blocks, batch=2, steps=2, device="cuda")["status"] == "oom"


def test_config_and_budget_errors():
    with pytest.raises(ConfigError, match="unknown rung 'fp64'"):
        LadderConfig(rungs=("fp32", "fp64"))
    with pytest.raises(ConfigError, match="budget_mib must be a positive"):
        LadderConfig(budget_mib=0.0)
    with pytest.raises(ConfigError, match="unknown parameter"):
        LadderConfig.from_dict({"budjet_mib": 3.0})
    with pytest.raises(ConfigError, match=r"^threads must be 0 \(leave as set\) or more, got -2$"):  # was torch's traceback
        LadderConfig(threads=-2)
    assert LadderConfig(threads=0).threads == 0
    with pytest.raises(ConfigError, match="budget must be a positive"):
        auto_fit("unused", batch=1, seq=8, budget_mib=-1)
    # an uncounted measurement is the CUDA allocator's peak: nothing to read on the CPU
    blocks = torch.zeros((2, 8), dtype=torch.long)
    with pytest.raises(ValueError, match="needs a rung trained on a CUDA device and no budget"):
        measure("bf16", lambda: None, blocks, batch=1, steps=2, counted=False)
    with pytest.raises(ValueError, match="needs a rung trained on a CUDA device"):  # CPU only trains on the host
        measure("cpu", lambda: None, blocks, batch=1, steps=2, device="cuda", counted=False)


def test_monitor_rows_go_to_sinks_and_a_missing_driver_is_one_line(capsys):
    got = []
    with LiveBytes("cpu") as live, MemoryMonitor("cpu", interval_s=0.01, sinks=[got.append], live=live, nvml=True) as mon:
        x = torch.ones(1 << 20)  # 4 MiB live
        import time

        time.sleep(0.1)
        del x
    err = capsys.readouterr().err
    if not torch.cuda.is_available():  # no driver here: said, in one line, no traceback (the check had
        # been under `if "NVML unavailable" in err`, so a monitor that said nothing passed it)
        assert "NVML unavailable" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert len(got) >= 3 and got == mon.rows
    assert all(r["source"] == "monitor" and r["rss_mib"] > 0 for r in got)
    assert mon.peak["live_mib"] >= 4.0


# ------------------------------------------------------------------------------------------------
# GPU paths held on the CPU (issue 11 items 1 and 2)

class _PretendCuda(torch.Tensor):
    """A CPU tensor that says it lives on cuda:0: what quantize_4bit sees of a model on a GPU."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def _tiny_linear_model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).to(device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (bitsandbytes' CUDA kernels quantize there)"))])
def test_quantize_4bit_leaves_the_weights_on_the_models_device(device):
    import bitsandbytes as bnb

    model = _tiny_linear_model(device)
    x = torch.randn(3, 64, device=device)
    assert quantize_4bit(model, torch.float32, skip=()) == 2
    layers = [m for m in model if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 2
    for q in layers:
        assert q.weight.device.type == device and q.weight.bnb_quantized
        assert q.weight.quant_state.absmax.device.type == device
        assert q.bias.device.type == device
    assert model(x).shape == (3, 64)  # a device mismatch would fail here


def test_quantize_4bit_quantizes_where_the_weight_is_not_on_the_cpu(monkeypatch):
    """On a GPU the layer's weight says cuda: quantization must be asked for there, not on the CPU."""
    import bitsandbytes as bnb

    asked = []
    real = bnb.nn.Params4bit._quantize

    def spy(self, device):
        asked.append(torch.device(device))
        self.data = self.data.as_subclass(torch.Tensor)
        return real(self, "cpu")  # the kernels this CPU has

    monkeypatch.setattr(bnb.nn.Params4bit, "_quantize", spy)
    model = _tiny_linear_model("cpu")
    for lin in (model[0], model[2]):
        lin.weight = torch.nn.Parameter(lin.weight.detach().as_subclass(_PretendCuda), requires_grad=False)
    quantize_4bit(model, torch.float32, skip=())
    assert asked == [torch.device("cuda", 0)] * 2


def test_measure_converts_on_the_host_and_quantizes_each_layer_onto_the_card(monkeypatch):
    """measure() moved the fp32 model to the card and converted it there: a 7B QLoRA or bf16-true LoRA
    setup predicted to fit a 12 or 24 GB card would run out of memory loading 30 GB of fp32 weights.
    Now apply_trainable gets the model on the host and the device: quantize_4bit quantizes each
    linear layer onto the device from the host (bitsandbytes moves one fp32 weight there at a time,
    card_load.quantize_onto_card), and the model moves after."""
    import bitsandbytes as bnb

    asked = []
    real = bnb.nn.Params4bit._quantize

    def spy(self, device):
        asked.append((self.data.device, torch.device(device)))
        return real(self, "cpu")  # the kernels this CPU has

    monkeypatch.setattr(bnb.nn.Params4bit, "_quantize", spy)
    model = _tiny_linear_model("cpu")
    assert quantize_4bit(model, torch.float32, skip=(), device=torch.device("cuda", 0)) == 2
    assert asked == [(torch.device("cpu"), torch.device("cuda", 0))] * 2  # from the host, onto the card
    # measure() hands apply_trainable the model as loaded (on the host) and the device it trains on, and
    # moves the model after it
    calls, apply = [], ladder.apply_trainable

    def moves(model):  # the model's own .to, logged
        to = model.to
        model.to = lambda *a, **k: calls.append("to") or to(*a, **k)
        return model

    def spy(model, plan, device=None):
        calls.append(("apply", device))
        return moves(apply(model, plan, device))

    monkeypatch.setattr(ladder, "apply_trainable", spy)
    row = measure("qlora", lambda: moves(load_model("embedded", spec=TINY_SPEC)[0]),
                  torch.zeros(4, 8, dtype=torch.long), batch=1, steps=1)
    assert row["status"] == "ok" and calls == [("apply", torch.device("cpu")), "to"]


def test_quantize_4bit_on_the_meta_device_quantizes_each_shape_once_and_each_layer_gets_its_own_copy(monkeypatch):
    """A prediction's QLoRA model: zeros quantized once per shape, each layer its own bytes."""
    import bitsandbytes as bnb

    shapes = []
    real = bnb.nn.Params4bit._quantize
    monkeypatch.setattr(bnb.nn.Params4bit, "_quantize", lambda self, device: shapes.append(tuple(self.shape))
                        or real(self, device))

    def four_layers(device):
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64), torch.nn.Linear(64, 128),
                                   torch.nn.Linear(128, 64)).to(device)

    meta = four_layers("meta")
    assert quantize_4bit(meta, torch.float32, skip=()) == 4
    assert shapes == [(128, 64), (64, 128)]  # two shapes, two quantizations
    cpu = four_layers("cpu")
    for lin in cpu:
        torch.nn.init.zeros_(lin.weight)
    quantize_4bit(cpu, torch.float32, skip=())
    states = [(q.weight, q.weight.quant_state) for q in meta]
    for tensors in ([w for w, _ in states], [s.absmax for _, s in states], [s.state2.absmax for _, s in states]):
        assert len({t.data_ptr() for t in tensors}) == 4  # no layer shares another's storage
    for q, ref in zip(meta, cpu):  # the same bytes as quantizing each layer's zeros
        assert q.quant_state is q.weight.quant_state and q.weight.bnb_quantized
        assert torch.equal(q.weight, ref.weight) and q.weight.dtype == ref.weight.dtype
        assert torch.equal(q.weight.quant_state.absmax, ref.weight.quant_state.absmax)
        assert torch.equal(q.weight.quant_state.state2.absmax, ref.weight.quant_state.state2.absmax)
        assert q.weight.quant_state.shape == ref.weight.quant_state.shape


def test_quantize_4bit_quantizes_gpt2s_conv1d_layers_the_way_transformers_does():
    """GPT-2 stores its linear layers as Conv1D (weight transposed). They were left whole: a GPT-2
    QLoRA plan kept 16-bit weights and `estimate --trainable qlora` stopped with a traceback."""
    import bitsandbytes as bnb
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=96, n_positions=32)).eval()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    assert quantize_4bit(model, torch.float32) == 2 * 4  # c_attn, c_proj, c_fc, mlp.c_proj per block
    layers = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert (layers["transformer.h.0.attn.c_attn"].in_features, layers["transformer.h.0.attn.c_attn"].out_features) \
        == (128, 384)
    with torch.no_grad():
        after = model(ids).logits
    # NF4's rounding, not a transposed weight (which gives an error of the logits' own size)
    assert ((after - before).norm() / before.norm()).item() < 0.25


def test_lora_on_gpt2s_conv1d_layers_is_set_up_for_them_without_a_warning():
    """Every GPT-2 LoRA run (study 1's lora, `--lora-targets c_attn`, the ladder's lora rung) printed
    peft's "fan_in_fan_out is set to False but the target module is `Conv1D`" warning."""
    from peft.tuners.lora import LoraLayer
    from transformers import GPT2Config, GPT2LMHeadModel

    def gpt2():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=96, n_positions=32)).eval()

    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = gpt2()(ids).logits
    plans = {"lora (study 1)": None, "c_attn": dataclasses.replace(RUNGS["lora"], lora_targets=("c_attn",)),
             "lora rung": RUNGS["lora"]}
    for name, plan in plans.items():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model = apply_strategy(gpt2(), "lora")[0] if plan is None else apply_trainable(gpt2(), plan)
        assert not [w for w in seen if "fan_in_fan_out" in str(w.message)], name
        layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        assert layers and all(m.fan_in_fan_out for m in layers), name
        with torch.no_grad():
            assert torch.allclose(model(input_ids=ids).logits, base, atol=1e-5), name  # B starts at zero
            for m in layers:  # a trained adapter, merged into the weight as stored: the same function
                m.lora_B["default"].weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
            trained = model(input_ids=ids).logits
            assert not torch.allclose(trained, base, atol=1e-3), name
            model.merge_adapter()
            assert torch.allclose(model(input_ids=ids).logits, trained, atol=1e-4), name
    with warnings.catch_warnings(record=True) as seen:  # a model of nn.Linear layers keeps it off, silently
        warnings.simplefilter("always")
        llama = apply_strategy(load_model("embedded", spec=TINY_SPEC)[0], "lora")[0]
    assert not [w for w in seen if "fan_in_fan_out" in str(w.message)]
    assert not any(m.fan_in_fan_out for m in llama.modules() if isinstance(m, LoraLayer))


@pytest.mark.parametrize("name", ["device_map", "zero_offload", "zero_offload_params"])
def test_offloaded_rungs_on_cuda_are_never_measured_as_plain_bf16(name, monkeypatch):
    """On a (pretend) CUDA device these rungs go through their own mechanism; where it cannot run
    they are `not measured` with the reason, never bf16_ckpt's figure under their name."""

    def plain(*a, **k):
        raise AssertionError("trained as plain bf16")

    monkeypatch.setattr(ladder, "train", plain)  # rungs.py's own name for it (training.train was patched in vain)
    blocks = torch.randint(0, 100, (8, 16))
    loads = []

    def load():
        loads.append(1)
        return torch.nn.Linear(4, 4)

    # No CUDA here: the real mechanism runs, fails, and the row says so with no figure.
    m = measure(name, load, blocks, batch=2, steps=2, device="cuda")
    if not torch.cuda.is_available():
        assert m["status"] == "not measured" and RUNGS[name].placement in m["reason"], m
        assert "measured_peak_bytes" not in m and "step_ms" not in m
    # The real mechanism is what measure() calls for these rungs, with the rung itself.
    called = []

    def mechanism(plan, load, blocks, **kw):
        called.append((plan.name, str(kw["device"])))
        return {"status": "ok", "reason": "", "measured_peak_bytes": 123, "measured_by": "cuda allocator"}

    monkeypatch.setattr(ladder, "measure_offloaded", mechanism)
    m = measure(name, load, blocks, batch=2, steps=2, device="cuda")
    assert called == [(name, "cuda")] and m["status"] == "ok" and m["measured_peak_bytes"] == 123
    assert m["rung"] == name and m["device"] == "cuda"
    over = measure(name, load, blocks, batch=2, steps=2, device="cuda", budget_mib=100 / 2**20)
    assert over["status"] == "oom" and "> budget" in over["reason"]
    # On the CPU they are still skipped with the reason (nothing to move between two memories).
    assert measure(name, load, blocks, batch=2, steps=2, device="cpu")["status"] == "skipped"


def test_zero_and_device_map_settings(monkeypatch):
    s2 = zero_config(RUNGS["zero_offload"], RUNGS["zero_offload"].settings(8, 3))
    s3 = zero_config(RUNGS["zero_offload_params"], RUNGS["zero_offload_params"].settings(8, 3))
    # the reduce bucket the simulation replays is the one the measured run is given
    assert s2["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                       "reduce_bucket_size": REDUCE_BUCKET_SIZE}
    assert s3["zero_optimization"]["stage"] == 3
    assert s3["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert s3["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert s2["bf16"]["enabled"] and not s2["fp16"]["enabled"]
    # DeepSpeed trains the weights the prediction simulates (offload.simulate_placed): a pure-half setup's
    # in 16 bits (it had run in fp32: twice the predicted weights on the card), fp32's in fp32
    for precision, bf16, fp16 in (("bf16_true", True, False), ("fp16_true", False, True), ("fp16", False, True),
                                  ("fp32", False, False)):
        plan = RUNGS["zero_offload"].compose("z", "", precision=precision)
        conf = zero_config(plan, plan.settings(8, 3))
        assert (conf["bf16"]["enabled"], conf["fp16"]["enabled"]) == (bf16, fp16), precision
    assert s2["train_micro_batch_size_per_gpu"] * s2["gradient_accumulation_steps"] == 8
    # DeepSpeed's engine clips and steps, not train(): the rung's clipping, rate and decay are handed to it
    given = dataclasses.replace(RUNGS["zero_offload"].settings(8, 3), lr=2e-4, weight_decay=0.05, max_grad_norm=0.7)
    conf = zero_config(RUNGS["zero_offload"], given)
    assert conf["gradient_clipping"] == 0.7
    assert conf["optimizer"] == {"type": "AdamW", "params": {"lr": 2e-4, "weight_decay": 0.05}}
    with pytest.raises(ValueError):
        zero_config(RUNGS["bf16_ckpt"], RUNGS["bf16_ckpt"].settings(8, 3))
    # under WSL2 pinned host memory is limited, and a pinned copy past it fails as "CUDA error: out
    # of memory" (read as the card's): the host's copies are pageable there
    monkeypatch.setattr(common.platform, "uname", played_uname(WSL2_RELEASE))
    assert common.in_wsl()
    s3 = zero_config(RUNGS["zero_offload_params"], RUNGS["zero_offload_params"].settings(8, 3))
    assert s3["zero_optimization"]["offload_param"]["pin_memory"] is False
    assert s3["zero_optimization"]["offload_optimizer"]["pin_memory"] is False
    monkeypatch.setattr(common.platform, "uname", played_uname(LINUX_RELEASE))
    assert not common.in_wsl()
    assert zero_config(RUNGS["zero_offload"], RUNGS["zero_offload"].settings(8, 3))["zero_optimization"][
        "offload_optimizer"]["pin_memory"] is True
    model = torch.nn.Linear(256, 256)  # 257 KiB of fp32 weights
    mem = device_map_max_memory(sum(p.numel() * 4 for p in model.parameters()), 0)
    assert mem[0] == (256 * 256 + 256) * 4 // 2 and mem["cpu"] > 4 * mem[0]


# ------------------------------------------------------------------------------------------------
# the memory monitor in the training rows (issue 11 item 7)

def _fake_cuda_memory(monkeypatch):
    """torch.cuda's statistics and NVML as a GPU would answer (MiB figures chosen to differ)."""
    import sys
    import types

    MiB = 2**20
    for fn, mib in [("max_memory_allocated", 100), ("max_memory_reserved", 128), ("memory_reserved", 120),
                    ("memory_allocated", 90)]:
        monkeypatch.setattr(torch.cuda, fn, lambda device=None, _m=mib: _m * MiB)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)  # card i of the machine uses 500 + i MiB
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=(500 + h[1]) * MiB, total=80_000 * MiB, free=0)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)


def test_a_rung_study_2_cannot_measure_on_the_cpu_does_not_say_the_machine_has_no_gpu():
    """Study 2 measures on the CPU on any machine; on a GPU machine its rows said "on a machine
    without a GPU both are the same memory"."""
    whys = {n: p.cannot_run_here(torch.device("cpu")) for n, p in RUNGS.items()}
    assert {n for n, w in whys.items() if w} == {"fp16", "device_map", "zero_offload", "zero_offload_params"}
    assert all("on the CPU" in w and "gpu-check" in w and "without a GPU" not in w for w in whys.values() if w)
    assert all(p.cannot_run_here(torch.device("cuda")) is None for p in RUNGS.values())


def test_step_memory_columns_on_cuda_and_none_on_the_cpu(monkeypatch):
    assert step_memory("cpu") is None
    _fake_cuda_memory(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cols = step_memory("cuda:0")()
    assert cols == {"cuda_peak_allocated_mib": 100.0, "cuda_peak_reserved_mib": 128.0, "cuda_reserved_mib": 120.0,
                    "nvml_used_mib": 500.0}
    # CUDA's cuda:1 where CUDA_VISIBLE_DEVICES=3,1 is the machine's card 1, cuda:0 its card 3 (NVML reads the
    # machine's numbering: the monitor read card 0, another card, for cuda:0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert step_memory("cuda:0")()["nvml_used_mib"] == 503.0 and step_memory("cuda:1")()["nvml_used_mib"] == 501.0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-4d8f7c2e-0000-0000-0000-000000000000")  # no mapping: CUDA's index
    assert step_memory("cuda:0")()["nvml_used_mib"] == 500.0


def test_the_monitor_reads_the_drivers_reserve_where_nvml_has_a_v2_query(monkeypatch):
    """NVML's v1 `used` (what the monitor reads) includes what the driver reserves; nvidia-smi on
    drivers with the v2 query leaves it out. The reserve is recorded where the driver answers v2."""
    import sys
    import types

    _fake_cuda_memory(monkeypatch)
    nvml, MiB = sys.modules["pynvml"], 2**20
    v1 = nvml.nvmlDeviceGetMemoryInfo
    nvml.nvmlMemory_v2 = 0x02000028
    nvml.nvmlDeviceGetMemoryInfo = lambda h, version=None: (
        v1(h) if version is None else types.SimpleNamespace(used=(500 - 615 + h[1]) * MiB, reserved=615 * MiB))
    row = MemoryMonitor("cuda:0").sample()
    assert row["nvml_used_mib"] == 500.0 and row["nvml_driver_reserved_mib"] == 615.0
    assert row["cuda_allocated_mib"] == 90.0 and row["nvml_total_mib"] == 80_000.0
    assert (row["cuda_reserved_mib"], row["cuda_max_allocated_mib"], row["cuda_max_reserved_mib"]) == (120, 100, 128)
    nvml.nvmlDeviceGetMemoryInfo = v1  # a driver without the v2 query: no such column
    assert "nvml_driver_reserved_mib" not in MemoryMonitor("cuda:0").sample()


def test_the_ladder_gives_back_the_thread_count_it_set(monkeypatch):
    """`threads` set torch's thread count for the study and left it set for whatever a notebook's
    kernel ran next (study 3 gives its own back); an error on the way gives it back too."""
    before, seen = torch.get_num_threads(), []

    def study(cfg, sinks, progress, device, ref):
        seen.append(torch.get_num_threads())
        raise RuntimeError("a rung failed")

    monkeypatch.setattr(runner, "_run_ladder", study)
    with pytest.raises(RuntimeError, match="a rung failed"):
        run_ladder(LadderConfig(base_size="tiny", threads=before + 1))
    assert seen == [before + 1] and torch.get_num_threads() == before


def test_the_monitor_samples_the_card_it_was_given_from_its_own_thread(monkeypatch):
    """CUDA's current device is per thread: after `torch.cuda.set_device(1)` a monitor on "cuda"
    sampled card 0 from its thread (torch's figures) while NVML read card 1. Played: the main
    thread's current card is 1, any other thread's 0, and each card answers its own figures."""
    import threading

    def card(device=None):  # torch's rule: a device without an index is the calling thread's current card
        device = torch.device("cuda" if device is None else device)
        return torch.cuda.current_device() if device.index is None else device.index

    _fake_cuda_memory(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    main_thread = threading.main_thread()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: int(threading.current_thread() is main_thread))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: (90 + 1000 * card(device)) * 2**20)
    with MemoryMonitor("cuda", interval_s=0.01) as mon:
        deadline = time.monotonic() + 30
        while len(mon.rows) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert mon.device == torch.device("cuda", 1)
    assert {r["cuda_allocated_mib"] for r in mon.rows} == {1090.0} and {r["nvml_used_mib"] for r in mon.rows} == {501.0}


def test_the_monitors_cost_is_read_with_the_peak_counters_of_its_own_runs(monkeypatch):
    """On a card the peak counters are the process's: gpu-check's monitor check came after the split
    check's peers, and its rows read their 1,236.7 MiB beside a workload that reserved 398. Played: the
    counter holds an earlier check's 1,000 MiB, and the workload's own peak is 100."""
    from workbench.core.memory.monitor import overhead

    _fake_cuda_memory(monkeypatch)
    peak = [1000 * 2**20]
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak[0])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: peak.__setitem__(0, 90 * 2**20))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def run():
        peak[0] = max(peak[0], 100 * 2**20)

    r = overhead(run, "cuda", rounds=1, interval_s=0.005)
    assert r["rows"] and {row["cuda_max_allocated_mib"] for row in r["rows"]} == {100.0}


def test_training_rows_carry_the_gpu_columns_only_where_there_is_a_gpu(monkeypatch):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def model():
        torch.manual_seed(0)
        return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1))

    blocks = torch.randint(0, 64, (8, 16))
    settings = TrainSettings(steps=2, micro_batch=2, lr=1e-3)
    rows: list[dict] = []
    train(model(), blocks, settings, sinks=[rows.append])
    assert len(rows) == 2 and not any(k.startswith(("cuda_", "nvml_")) for r in rows for k in r)
    # Where step_memory answers (a GPU), its columns are in every row the sinks get.
    _fake_cuda_memory(monkeypatch)
    real = monitor.step_memory
    monkeypatch.setattr(monitor, "step_memory", lambda device, **kw: real("cuda"))
    rows.clear()
    train(model(), blocks, settings, sinks=[rows.append])
    assert [r["nvml_used_mib"] for r in rows] == [500.0, 500.0]
    assert all(r["cuda_peak_allocated_mib"] == 100.0 and r["cuda_peak_reserved_mib"] == 128.0 for r in rows)


def test_the_report_says_what_a_budget_caps_on_each_device(env):
    run_ladder(LadderConfig(base_size="tiny", rungs=("fp32",), breakdown_rung="fp32", micro_batch=2, seq_len=32,
                            steps=2, measure=False, autofit=False, reference_model=""))
    parts = report_section(load_result())
    shown = ladder_figures.ladder_table(load_result())  # how the predicted peak was made, not "method: predicted"
    assert "method" not in shown and list(shown["how_predicted"]) == ["simulated"]
    # the reference model's table and the chart's legend say it the same way (they said "predicted")
    from workbench.core.results import StudyResult

    runs = pd.DataFrame({"rung": ["fp32", "fp16"], "role": ["reference", "reference"],
                         "method": ["predicted", "estimated"], "predicted_peak_mib": [10.0, 6.0], "note": ["", ""]})
    ref = ladder_figures.reference_table(StudyResult("ladder", runs))
    assert "method" not in ref and list(ref["how_predicted"]) == ["simulated", "estimated"]
    legend = [t.name for t in ladder_figures.ladder_figure(load_result()).data]
    assert legend[0] == "predicted, simulated (not measured)", legend
    assert "reserved memory" in BUDGET_NOTE and "live tensor bytes" in BUDGET_NOTE
    assert BUDGET_NOTE in parts[0][2]
    assert "reserved memory on a GPU, live tensor bytes on the CPU" in parts[1][1]
    # autofit=False: it spoke of "the auto-fit attempts" and showed two empty auto-fit tables
    assert "auto-fit" not in parts[0][2] and not [p for p in parts if p[1].startswith("Auto-fit")]


def test_reference_device_is_validated_and_the_pure_bf16_rungs_are_in_the_study():
    with pytest.raises(ConfigError, match="reference_device must be cpu or cuda"):
        LadderConfig(reference_device="tpu")
    assert LadderConfig().reference_device == "cpu"  # study 2's default stays the exact CPU prediction
    assert {"bf16_true", "bf16_true_lora"} <= set(LadderConfig().rungs)


def test_the_default_budget_makes_auto_fit_choose_a_middle_setup_of_the_embedded_default():
    """The notebook's auto-fit demonstration: at the default budget the faster setups do not fit and
    a middle one does (not the CPU, which always fits), with the batch per step kept; the rung-level
    auto-fit (`workbench estimate --auto-fit`) picks a middle rung too. The embedded default's config
    is built from its spec (its trained tokenizer has exactly spec.vocab_size tokens), no weights needed."""
    from transformers import Qwen2Config

    spec, cfg = EmbeddedSpec(), LadderConfig()
    config = Qwen2Config(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                         intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                         num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    rungs = ("fp32", "bf16_true", "bf16_ckpt", "lora", "cpu")
    choice = auto_fit(config, batch=cfg.micro_batch, seq=cfg.seq_len, budget_mib=cfg.budget_mib, rungs=rungs,
                      device="cpu")
    fits = {r["rung"]: r["fits"] for r in choice.table}
    assert choice.rung == "bf16_ckpt"
    assert not fits["fp32"] and not fits["bf16_true"] and fits["lora"] and fits["cpu"]

    joint = search_here(config, RUNGS[cfg.rungs[0]], device="cpu", batch=cfg.micro_batch, seq=cfg.seq_len,
                        budget_mib=cfg.budget_mib)  # as the study searches on the CPU
    assert joint.plan is not None and joint.plan.placement == "device" and not joint.table[0]["fits"]
    assert joint.plan.accum > 1 and cfg.micro_batch // joint.plan.accum * joint.plan.accum == cfg.micro_batch
    assert "micro-batch 4 x 2" in joint.plan.name


def test_a_re_measuring_ladder_killed_part_way_leaves_the_finished_one_whole(tmp_path, monkeypatch, tiny_base):
    """A ladder measured again (WORKBENCH_RERUN=1, or new code) and killed in its second rung had emptied the
    finished call's steps.jsonl: the study read back the finished call's table beside the killed call's two
    steps. Its steps stay aside until it finishes; the next call goes on from the rung it reached."""
    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path))
    monkeypatch.delenv(RERUN_ENV, raising=False)
    cfg = LadderConfig(base_size="tiny", rungs=("fp32", "bf16_ckpt"), breakdown_rung="fp32", micro_batch=2,
                       seq_len=32, steps=2, autofit=False, reference_model="")
    run_ladder(cfg)
    before = runner.load_result()
    assert list(before.steps.groupby("rung", sort=False).size().items()) == [("fp32", 2), ("bf16_ckpt", 2)]
    real = runner.measure

    def dies_in_bf16_ckpt(name, *args, sinks=(), **kw):
        if name == "bf16_ckpt":
            for sink in sinks:
                sink({"rung": name, "step": 1, "loss": 9.9})
            raise KeyboardInterrupt
        return real(name, *args, sinks=sinks, **kw)

    monkeypatch.setattr(runner, "measure", dies_in_bf16_ckpt)
    monkeypatch.setenv(RERUN_ENV, "1")
    with pytest.raises(KeyboardInterrupt):
        run_ladder(cfg)
    after = runner.load_result()
    pd.testing.assert_frame_equal(after.steps, before.steps)
    pd.testing.assert_frame_equal(after.runs, before.runs)
    measured = []

    def counts(name, *args, **kw):
        measured.append(name)
        return real(name, *args, **kw)

    monkeypatch.setattr(runner, "measure", counts)
    monkeypatch.delenv(RERUN_ENV)
    resumed = run_ladder(cfg)  # the rerun goes on: the rung it finished is kept, the one cut short measured
    assert measured == ["bf16_ckpt"] and list(resumed.runs["reused"].eq(True)) == [True, False]
    assert list(resumed.steps.groupby("rung", sort=False).size().items()) == [("fp32", 2), ("bf16_ckpt", 2)]
    assert 9.9 not in set(resumed.steps["loss"])


def test_a_resumed_ladder_writes_back_the_rungs_it_reuses_whole(tmp_path, monkeypatch, tiny_base):
    """A resumed call emptied rungs.jsonl and then wrote the reused rungs back: killed in between, it lost
    every finished rung. They are on disk whole before the call goes on."""
    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path))
    monkeypatch.delenv(RERUN_ENV, raising=False)
    cfg = LadderConfig(base_size="tiny", rungs=("fp32",), breakdown_rung="fp32", micro_batch=2, seq_len=32,
                       steps=2, autofit=False, reference_model="")
    run_ladder(cfg)
    log = tmp_path / "ladder" / cfg.run_id() / "rungs.jsonl"
    kept = log.read_text()

    class KilledOnOpening(runner.JsonlSink):  # a kill as the rungs' log is opened for this call
        def __init__(self, path, **kw):
            super().__init__(path, **kw)
            if Path(path).name == "rungs.jsonl":
                raise KeyboardInterrupt

    monkeypatch.setattr(runner, "JsonlSink", KilledOnOpening)
    with pytest.raises(KeyboardInterrupt):
        run_ladder(cfg)
    assert log.read_text() == kept and json.loads(kept)["row"]["status"] == "ok"


@pytest.mark.parametrize("status", ["skipped", "oom", "not measured", "error"])
def test_a_rung_that_measured_nothing_runs_again_as_the_machine_is_now(tmp_path, monkeypatch, tiny_base, status):
    """A rung skipped for want of free memory was read back as skipped by every later call with these
    settings (its old reason, '1 MiB free', with it): only a rung that measured is reused, not one that ran
    out of memory or failed either."""
    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path))
    monkeypatch.delenv(RERUN_ENV, raising=False)
    cfg = LadderConfig(base_size="tiny", rungs=("fp32",), breakdown_rung="fp32", micro_batch=2, seq_len=32,
                       steps=2, autofit=False, reference_model="")
    with monkeypatch.context() as m:
        if status == "skipped":
            m.setattr(common, "host_free_mib", lambda: 1.0)
        else:
            m.setattr(runner, "measure", lambda name, *a, **kw: {"status": status, "reason": "played"})
        busy = run_ladder(cfg).runs.set_index("rung")
    assert busy.loc["fp32", "status"] == status
    # runs.csv's row (a sweep stacks these) says error where every rung did, as summary.json does; it said ok
    row = pd.read_csv(tmp_path / "ladder" / "runs.csv").set_index("run_id").loc[cfg.run_id()]
    summary = json.loads((tmp_path / "ladder" / cfg.run_id() / "summary.json").read_text())
    assert row["status"] == summary["status"] == ("error" if status == "error" else "ok")
    free = run_ladder(cfg).runs.set_index("rung")
    assert free.loc["fp32", "status"] == "ok" and "reused" not in free  # measured, not read back
    assert run_ladder(cfg).runs.set_index("rung").loc["fp32", "reused"]  # a rung that measured is reused


def test_the_same_ladder_started_twice_at_once_waits_for_the_first(tmp_path, monkeypatch, tiny_base, capsys):
    """Two callers given the same ladder at once both measured it into one rungs.jsonl and steps.jsonl
    (and, on a card, each measured its peak beside the other's). The second waits now, said in one line;
    the first is played by holding the run's lock here."""
    import threading
    import time

    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path))
    cfg = LadderConfig(base_size="tiny", rungs=("fp32",), breakdown_rung="fp32", micro_batch=2, seq_len=32, steps=2,
                       measure=False, autofit=False, reference_model="")
    run_dir, done = tmp_path / "ladder" / cfg.run_id(), []
    with RunDir("ladder", cfg.run_id()).training():
        second = threading.Thread(target=lambda: done.append(run_ladder(cfg, progress=False)))
        second.start()
        said, t0 = "", time.monotonic()
        while ("being trained by another process" not in said and second.is_alive()
               and not (run_dir / "rungs.jsonl").exists() and time.monotonic() - t0 < 300):
            time.sleep(0.2)
            said += capsys.readouterr().err
        assert not (run_dir / "rungs.jsonl").exists() and not done  # nothing written while the first holds it
        assert f"ladder run {cfg.run_id()} is being trained by another process" in said, said
    second.join(300)
    assert done and list(done[0].runs["rung"]) == ["fp32"]


def test_a_killed_ladder_keeps_its_finished_rungs_and_goes_on_from_there(tmp_path, monkeypatch, tiny_base):
    """Each rung's row is on disk (rungs.jsonl) when the rung ends: a run that dies keeps them, and
    the same settings run again measure only what is left; the steps of the rung cut short go."""
    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path))
    monkeypatch.delenv(RERUN_ENV, raising=False)
    cfg = LadderConfig(base_size="tiny", rungs=("fp32", "bf16_ckpt", "cpu"), breakdown_rung="fp32", micro_batch=2,
                       seq_len=32, steps=2, autofit=False, reference_model="")
    real, measured = runner.measure, []

    def dies_at_cpu(name, *args, sinks=(), **kw):
        if name == "cpu":
            for sink in sinks:  # a step of the rung being cut short reaches steps.jsonl first
                sink({"rung": "cpu", "step": 1, "loss": 9.9})
            raise KeyboardInterrupt
        measured.append(name)
        return real(name, *args, sinks=sinks, **kw)

    monkeypatch.setattr(runner, "measure", dies_at_cpu)
    with pytest.raises(KeyboardInterrupt):
        run_ladder(cfg)
    run_dir = tmp_path / "ladder" / cfg.run_id()
    kept = [json.loads(line)["rung"] for line in (run_dir / "rungs.jsonl").read_text().splitlines()]
    assert kept == ["fp32", "bf16_ckpt"] and measured == ["fp32", "bf16_ckpt"]

    def dies_in_the_chart(row):  # killed again while the resumed run redraws the kept steps
        if "loss" in row:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_ladder(cfg, sinks=[dies_in_the_chart])
    steps = [json.loads(line) for line in (run_dir / "steps.partial.jsonl").read_text().splitlines()]
    assert [s["rung"] for s in steps] == ["fp32"] * 2 + ["bf16_ckpt"] * 2 and measured == ["fp32", "bf16_ckpt"]

    def counts(name, *args, **kw):
        measured.append(name)
        return real(name, *args, **kw)

    monkeypatch.setattr(runner, "measure", counts)
    seen = []
    result = run_ladder(cfg, sinks=[seen.append])
    assert measured == ["fp32", "bf16_ckpt", "cpu"]  # the finished two were not measured again
    at_hand = result.runs.set_index("rung")
    assert (at_hand["status"] == "ok").all() and at_hand.loc["fp32", "measured_peak_bytes"] > 0
    assert list(result.steps.groupby("rung", sort=False).size().items()) == [("fp32", 2), ("bf16_ckpt", 2), ("cpu", 2)]
    assert 9.9 not in set(result.steps["loss"])  # the step of the try that died is gone
    assert {r["rung"] for r in seen if "loss" in r} == {"fp32", "bf16_ckpt", "cpu"}  # the chart gets all three
    # ... the cpu rung's without a memory figure: its device holds nothing (its host's live bytes, drawn as
    # device memory, stood over the budget's line); its steps file keeps them
    charted = {r["rung"]: r["mem_mib"] for r in seen if "loss" in r}
    assert charted["cpu"] is None and charted["fp32"] > 0 and charted["bf16_ckpt"] > 0
    assert (result.steps.loc[result.steps["rung"] == "cpu", "mem_mib"] > 0).all()
    # the reused rows are the rows: run again, nothing is measured and the table is the same
    again = run_ladder(cfg)
    assert measured == ["fp32", "bf16_ckpt", "cpu"]
    pd.testing.assert_frame_equal(again.runs.drop(columns="reused"), result.runs.drop(columns="reused"))
    # ... and say so: the first call read back two rungs, the second all three
    assert at_hand["reused"].fillna(False).tolist() == [True, True, False]
    assert again.runs.set_index("rung").loc[list(cfg.rungs), "reused"].tolist() == [True, True, True]
    said = [f for f, _ in ladder_figures.findings(again) if "read back" in f]
    assert said and said[0].startswith("3 of 3 rungs (fp32, bf16_ckpt, cpu) were read back")
    # other weights or another version, or $WORKBENCH_RERUN: measured again
    monkeypatch.setattr(runner, "__version__", "0.0.0-other")
    run_ladder(cfg)
    assert measured[3:] == ["fp32", "bf16_ckpt", "cpu"]
    monkeypatch.setattr(runner, "code_fingerprint", lambda: "other-code")  # the same version, other code
    run_ladder(cfg)
    assert measured[6:] == ["fp32", "bf16_ckpt", "cpu"]
    monkeypatch.setattr(runner, "library_versions", lambda: "torch 9.9.9")  # an upgraded library
    run_ladder(cfg)
    assert measured[9:] == ["fp32", "bf16_ckpt", "cpu"]
    monkeypatch.setenv(RERUN_ENV, "1")
    run_ladder(cfg)
    assert measured[12:] == ["fp32", "bf16_ckpt", "cpu"]


def test_the_published_fp16_rows_are_predicted_on_the_pure_16_bit_step_they_build_on(env):
    """The published table's FP16 rows add checkpointing and an adapter to "FP16 full model", the pure
    16-bit step (bf16_true). They had been mapped to autocast's rungs (bf16_ckpt, lora: fp32 weights and
    AdamW state), so on Qwen2-0.5B checkpointing read as costing FP16 3.6 GB (8,059 against 4,394 MiB)."""
    result = run_ladder(LadderConfig(base_size="tiny", rungs=("fp32", "bf16_true", "bf16_true_lora"), micro_batch=2,
                                     seq_len=32, steps=2, measure=False, autofit=False))
    pub = result.tables["published"].set_index("strategy")
    full, ckpt, adapter = (pub.loc[s, "workbench_predicted_mib"] for s in
                           ("FP16 full model", "FP16 + gradient checkpointing", "FP16 + adapter (6%)"))
    assert pub.loc["FP16 + gradient checkpointing", "rung"] == "bf16_true_ckpt"
    assert pub.loc["FP16 + adapter (6%)", "rung"] == "bf16_true_lora"
    assert 0 < ckpt < full and 0 < adapter < full  # each saves on the pure step, as the published rows say
    assert pub.loc["FP32 full model", "workbench_predicted_mib"] > 1.9 * full


def test_the_cpu_rungs_breakdown_sets_its_predicted_host_bytes_beside_the_measured_ones(env):
    """The cpu rung's count is host memory; its prediction's device side is zeros. The chart had set those
    zeros beside the measured host bytes, a total miss where the two agree to the byte."""
    from workbench.studies.ladder.figures import breakdown_figure

    result = run_ladder(LadderConfig(base_size="tiny", rungs=("cpu",), breakdown_rung="cpu", micro_batch=2, seq_len=32,
                                     steps=2, autofit=False, reference_model=""))
    fig = breakdown_figure(result, "cpu")
    bars = {}
    for trace in fig.data:
        for x, y in zip(trace.x, trace.y):
            bars[x] = bars.get(x, 0.0) + y
    row = result.runs.set_index("rung").loc["cpu"]
    assert bars["predicted"] == pytest.approx(row["host_bytes"] / MiB) and bars["predicted"] > 0
    assert bars["measured"] == pytest.approx(bars["predicted"], rel=0.01)  # the CPU prediction is exact
    assert "host bytes per category" in fig.layout.title.text


def test_a_reference_model_that_does_not_exist_is_said_before_any_rung(tmp_path, monkeypatch, tiny_base):
    """It was read after every rung had been measured: minutes of work, then the error; then after the
    model at hand, which builds the embedded base (minutes) where it is not built yet."""
    from workbench.core.models import ModelNotFoundError

    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path))
    monkeypatch.setattr(runner, "model_at_hand", lambda *a, **k: pytest.fail("the model at hand was built first"))
    monkeypatch.setattr(runner, "measure", lambda *a, **k: pytest.fail("a rung was measured first"))
    monkeypatch.setattr(runner, "predict", lambda *a, **k: pytest.fail("a rung was predicted first"))
    cfg = LadderConfig(base_size="tiny", rungs=("fp32",), breakdown_rung="fp32", micro_batch=2, seq_len=32, steps=2,
                       autofit=False, reference_model=str(tmp_path / "none.json"))
    with pytest.raises(ModelNotFoundError, match="none.json"):
        run_ladder(cfg, progress=False)
    # nor is a run folder made for it, nor for a model at hand that is not there (one was left holding
    # config.partial.json and a lock alone: a user audit)
    with pytest.raises(ModelNotFoundError, match="gone.json"):
        run_ladder(cfg.replace(reference_model="", model=str(tmp_path / "gone.json")), progress=False)
    assert not (tmp_path / "ladder").exists()


def test_the_ladder_shows_its_progress_over_the_rungs(tmp_path, monkeypatch, tiny_base, capsys):
    """The default ladder said nothing for minutes (auto-fit's bar, at the end, was its only one)."""
    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path))
    cfg = LadderConfig(base_size="tiny", rungs=("fp32", "bf16_ckpt"), breakdown_rung="fp32", micro_batch=2,
                       seq_len=32, steps=2, measure=False, autofit=False, reference_model="")
    run_ladder(cfg)
    assert re.search(r"ladder: 100%\S* *\S* 2/2 \[", capsys.readouterr().err)
    run_ladder(cfg, progress=False)
    assert "ladder:" not in capsys.readouterr().err
    # the reference model's predictions too: about a minute of silence after "ladder: 8/8" (a user audit)
    run_ladder(cfg.replace(reference_model="data/configs/gpt2.json", reference_seq_len=32))
    assert re.search(r"reference predictions: 100%\S* *\S* 2/2 \[", capsys.readouterr().err)


def test_a_qlora_rung_without_bitsandbytes_is_a_skipped_row_not_a_traceback(env, monkeypatch):
    """On a machine without bitsandbytes the ladder (and study 1's pre-flight) ended in a
    ModuleNotFoundError at the QLoRA rung's prediction; the rung is a skipped row saying why, the
    other rungs are predicted, and every table, chart and finding shows the result."""
    import sys

    from workbench.core.results import StudyResult
    from workbench.core.trainable import StrategyNotApplicable
    from workbench.studies.ladder.figures import findings, ladder_figure, ladder_table

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as where it is not installed: ImportError
    with pytest.raises(StrategyNotApplicable, match="QLoRA needs bitsandbytes, which is not installed"):
        from workbench.core.memory.plan import quantize_4bit

        quantize_4bit(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.float32)
    result = run_ladder(LadderConfig(base_size="tiny", rungs=("fp32", "qlora"), breakdown_rung="fp32", micro_batch=2,
                                     seq_len=32, steps=2, measure=False, autofit=False,
                                     reference_model="data/configs/gpt2.json", reference_seq_len=32), progress=False)
    for shown in (result, load_result()):
        rows = shown.runs.set_index(["role", "rung"])
        for role in ("at hand", "reference"):
            assert rows.loc[(role, "qlora"), "status"] == "skipped"
            assert rows.loc[(role, "qlora"), "reason"] == "QLoRA needs bitsandbytes, which is not installed"
            assert rows.loc[(role, "fp32"), "predicted_peak_mib"] > 0
        assert list(ladder_table(shown)["rung"]) == ["fp32", "qlora"]
        assert ladder_figure(shown).data and findings(shown) and report_section(shown)
    assert isinstance(result, StudyResult)
    alone = run_ladder(LadderConfig(base_size="tiny", rungs=("qlora",), breakdown_rung="qlora", micro_batch=2,
                                    seq_len=32, steps=2, measure=False, autofit=False, reference_model=""),
                       progress=False)  # every rung skipped before its prediction: no column to divide
    assert list(alone.runs["status"]) == ["skipped"] and alone.runs["predicted_peak_mib"].isna().all()
    assert findings(alone) and report_section(alone)


def test_a_kept_model_is_made_once_and_each_load_is_a_fresh_loads_equal(tmp_path, monkeypatch):
    """gpu-check loads its model some 35 times (a rung, a cap trial), and a random init of Qwen2-0.5B takes
    11 s here: kept (model_at_hand(keep=True)), it is made once and each load is a copy. A copy
    must be what a fresh load is: the same weights, tied weights still tied, a model of its own (a rung
    that changes it changes no later rung's), and torch's random state left as a fresh load leaves it."""
    import transformers
    from conftest import tiny_config

    path = tmp_path / "config.json"
    tiny_config("qwen2").to_json_file(path)
    cfg = runner.LadderConfig(model=str(path), seq_len=16, reference_model="")
    made, init = [], transformers.AutoModelForCausalLM.from_config
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", lambda *a, **k: made.append(1) or init(*a, **k))
    _, fresh, _, _ = runner.model_at_hand(cfg)
    _, load, _, _ = runner.model_at_hand(cfg, keep=True)
    assert not hasattr(fresh, "timings")
    want = fresh()
    drawn_after_fresh = torch.rand(4)
    for _ in range(3):
        got = load()
        assert torch.equal(torch.rand(4), drawn_after_fresh)  # what a run draws next (LoRA's A, dropout) is the same
        assert got.state_dict().keys() == want.state_dict().keys()
        assert all(torch.equal(got.state_dict()[k], v) for k, v in want.state_dict().items())
        assert got.lm_head.weight is got.model.embed_tokens.weight  # tied, as from_config ties them
        with torch.no_grad():  # a rung that changes its model in place (a cast, a wrapped layer)
            got.model.embed_tokens.weight.mul_(0.5)
            got.model.layers[0].self_attn.q_proj.weight.zero_()
    assert len(made) == 2  # the fresh load's and the kept model's: once, not once a load
    assert load.timings["copies"] == 3 and load.timings["kept"] is True
    # given back (a run's host memory that it would stand in the way of): each load from then on is made afresh
    assert load.drop() is True and load.timings["kept"] == "dropped" and load.drop() is False
    made.clear()
    got = load()
    assert torch.equal(torch.rand(4), drawn_after_fresh) and len(made) == 1 and load.timings["copies"] == 3
    assert all(torch.equal(got.state_dict()[k], v) for k, v in want.state_dict().items())
    # and a rung trained on a copy is the rung trained on a fresh load: LoRA's adapters drawn alike, the same
    # loss and the same peak (a kept loader of its own: `load` above, dropped, makes each model afresh; its
    # first copy is changed in place, so the rung's copy is made from the kept model, not from another copy)
    _, _, blocks, _ = runner.model_at_hand(cfg)
    _, copies, _, _ = runner.model_at_hand(cfg, keep=True)
    with torch.no_grad():
        copies().model.embed_tokens.weight.mul_(0.5)
    a, b = (ladder.measure("lora", f, blocks, batch=2, steps=2) for f in (fresh, copies))
    assert copies.timings["kept"] is True and copies.timings["copies"] == 2  # the rung trained a copy
    assert a["status"] == b["status"] == "ok" and a["loss_after"] == b["loss_after"]
    assert a["measured_peak_bytes"] == b["measured_peak_bytes"]
    # no room on the host for a copy beside the kept model (a 7B config on a 64 GB host): none is kept
    monkeypatch.setattr(runner, "past_free_memory", lambda need_mib: f"{need_mib:,.1f} MiB > the 1 MiB free")
    _, load, _, _ = runner.model_at_hand(cfg, keep=True)
    made.clear()
    for _ in range(2):
        got = load()
        assert torch.equal(torch.rand(4), drawn_after_fresh)
        assert all(torch.equal(got.state_dict()[k], v) for k, v in want.state_dict().items())
    assert len(made) == 2 and load.timings["kept"] is False and load.timings["copies"] == 0
