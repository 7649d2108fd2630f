"""`workbench gpu-check`: its logic on fabricated measurements (CPU), its one line without a GPU.

    .venv/bin/python -m pytest tests/test_gpu_check.py -q        # a few seconds
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from unittest import mock

import pytest
import torch

from workbench.cli import main
from workbench.core.memory import cuda_model as cm, segments
from workbench.core.memory.allocator import least_cap
from workbench.core.memory.monitor import overhead
from workbench.core.memory.plan import RUNGS
from workbench.core.results import RERUN_ENV, results_root, results_under, reuse_finished_runs
from workbench.front import gpu_check as gc, gpu_programs as gn, gpu_programs as gp, gpu_report as gr
from workbench.front.notebooks import STUDIES
from workbench.studies.ladder import gpu_cap
from workbench.studies.ladder.gpu_cap import STEP, TARGET_PCT, cap_row, cap_verdict
from workbench.studies.split import gpu_check as split_check

MiB = 2**20
ROOT = Path(__file__).resolve().parent.parent


def test_without_cuda_it_says_so_in_one_line_and_exits_0(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["gpu-check"]) == 0
    out = capsys.readouterr()
    assert out.out.strip().splitlines() == [gc.NO_GPU_LINE] and "GPU" in gc.NO_GPU_LINE
    assert out.err == ""
    monkeypatch.chdir(tmp_path)  # from anywhere, with the default model (a path inside the checkout)
    assert main(["gpu-check"]) == 0 and capsys.readouterr().out.strip() == gc.NO_GPU_LINE


def test_make_target_runs_the_subcommand_after_setup():
    text = (ROOT / "Makefile").read_text()
    assert "gpu-check: setup\n\t@$(BIN)/workbench gpu-check\n" in text


def test_every_gpu_rung_is_checked():
    names = gc.gpu_rungs(RUNGS)
    assert {"fp32", "bf16", "fp16", "bf16_ckpt", "lora", "qlora", "adamw8bit", "paged_adamw8bit", "device_map",
            "zero_offload", "zero_offload_params"} <= set(names)
    # in ladder order, the paged optimizer's last: its managed memory is never freed (bitsandbytes), and it had
    # added about 1 GiB to NVML's figures of every later rung on the H200 (2026-11-26)
    paged = [n for n in names if RUNGS[n].optimizer == "paged_adamw8bit"]
    assert "cpu" not in names and names[0] == "fp32" and paged and list(names[-len(paged):]) == paged
    assert list(names) == [n for n in RUNGS if n in names and n not in paged] + paged


def _measured(alloc_mib, reserved_mib, status="ok", **kw):
    return {"status": status, "reason": kw.pop("reason", ""), "cuda_max_allocated_bytes": int(alloc_mib * MiB),
            "cuda_max_reserved_bytes": int(reserved_mib * MiB), "measured_peak_bytes": int(alloc_mib * MiB), **kw}


def _pred(peak_mib, fit_mib=None):
    return {"predicted_peak_bytes": int(peak_mib * MiB), "fit_bytes": int((fit_mib or peak_mib) * MiB),
            "method": "predicted"}


def test_error_pct():
    assert gr.error_pct(110, 100) == pytest.approx(10.0)
    assert gr.error_pct(90, 100) == pytest.approx(-10.0)
    assert gr.error_pct(None, 100) is None and gr.error_pct(1, 0) is None and gr.error_pct(1, None) is None


def test_rung_row_puts_the_prediction_beside_the_card():
    nvml = {"nvml_used_peak_mib": 2000.0, "nvml_used_before_mib": 500.0}
    r = gr.rung_row("bf16", _pred(1000, 1100), _measured(950, 1200, step_ms=12.0), nvml)
    assert r["predicted_allocated_mib"] == 1000 and r["cuda_max_allocated_mib"] == 950 and r["cuda_max_reserved_mib"] == 1200
    assert r["error_vs_allocated_pct"] == pytest.approx(100 * 50 / 950)
    assert r["error_vs_reserved_pct"] == pytest.approx(100 * -100 / 1200)
    assert r["nvml_used_peak_mib"] == 2000 and r["nvml_used_delta_mib"] == 1500 and r["passed"] is True
    # Off by more than the allocated threshold: fails, and the verdict says which rung and by how much.
    bad = gr.rung_row("fp32", _pred(1000), _measured(800, 1000), {})
    assert bad["error_vs_allocated_pct"] == pytest.approx(25.0) and bad["passed"] is False
    assert bad["nvml_used_peak_mib"] is None and bad["nvml_used_delta_mib"] is None
    # Reserved far from the modelled reserved figure fails too.
    assert gr.rung_row("fp32", _pred(1000, 1000), _measured(1000, 2000), {})["passed"] is False
    # Predicted low is the dangerous way (predicted to fit, out of memory on the card): it fails as
    # predicted high does, at the thresholds the docs state (15% allocated, 35% reserved), either way.
    for measured, passed in ((1000 / 0.75, False), (1000 / 0.851, True), (1000 / 0.849, False),
                             (1000 / 1.149, True), (1000 / 1.151, False)):
        assert gr.rung_row("x", _pred(1000), _measured(measured, measured), {})["passed"] is passed, measured
    for reserved, passed in ((1000 / 0.651, True), (1000 / 0.649, False), (1000 / 1.349, True), (1000 / 1.351, False)):
        assert gr.rung_row("x", _pred(1000, 1000), _measured(1000, reserved), {})["passed"] is passed, reserved
    # A rung that did not run has no verdict of its own.
    nm = gr.rung_row("zero_offload", _pred(500), {"status": "not measured", "reason": "deepspeed failed"}, {})
    assert nm["passed"] is None and nm["cuda_max_allocated_mib"] is None and nm["error_vs_allocated_pct"] is None


def test_a_cuda_prediction_is_judged_by_its_allocator_figures_not_its_live_bytes():
    cuda = {**_pred(900), "allocated_peak_bytes": 1000 * MiB, "reserved_peak_bytes": 1150 * MiB,
            "nvidia_smi_bytes": 1650 * MiB}
    r = gr.rung_row("bf16", cuda, _measured(1000, 1200), {"nvml_used_peak_mib": 2600.0, "nvml_used_before_mib": 500.0,
                                                          "nvml_total_mib": 143771.0, "nvml_driver_reserved_mib": 615.0})
    assert r["nvml_total_mib"] == 143771.0 and r["nvml_driver_reserved_mib"] == 615.0  # kept for the record
    assert r["predicted_allocated_mib"] == 1000 and r["error_vs_allocated_pct"] == 0.0
    assert r["predicted_reserved_mib"] == 1150 and r["error_vs_reserved_pct"] == pytest.approx(100 * -50 / 1200)
    # what nvidia-smi would show beside NVML, and what NVML saw outside the allocator (context, kernels)
    assert r["predicted_nvidia_smi_mib"] == 1650 and r["outside_allocator_mib"] == 1400
    # nvidia-smi's used is NVML's v2: v1's less the driver's reserve (the H200's 615 MiB), and the prediction
    # is of that figure
    assert r["nvidia_smi_used_peak_mib"] == 2600.0 - 615.0
    assert r["outside_allocator_rise_mib"] is None  # no reserved figure from before the run
    # the rung's own rise outside the allocator: NVML 2,100 up, the allocator 1,200 - 300 of it, so 1,200
    # (a paged optimizer's state): not the 1,400 above, which holds the context and what earlier rungs left
    r = gr.rung_row("paged_adamw8bit", cuda, _measured(1000, 1200, reserved_before_bytes=300 * MiB),
                    {"nvml_used_peak_mib": 2600.0, "nvml_used_before_mib": 500.0})
    assert r["outside_allocator_rise_mib"] == 2100 - (1200 - 300)
    assert r["nvidia_smi_used_peak_mib"] is None  # a driver without the v2 query: not guessed
    assert r["predicted_reserved_by_stream_mib"] is None and r["cuda_reserved_by_stream_mib"] is None
    # ZeRO-3: each side stream's cache, predicted beside the card's (memory_snapshot's segments by stream)
    z3 = gr.rung_row("zero_offload_params", {**cuda, "reserved_by_stream_bytes": {"default": 600 * MiB, "reduce": 550 * MiB}},
                     _measured(1000, 1200, reserved_by_stream_bytes={"default": 620 * MiB, "reduce": 580 * MiB}), {})
    assert z3["predicted_reserved_by_stream_mib"] == {"default": 600, "reduce": 550}
    assert z3["cuda_reserved_by_stream_mib"] == {"default": 620, "reduce": 580}
    assert r["segment_difference"] is None  # no segments on either side: nothing to say


def test_a_reserved_miss_is_shown_by_segment_size():
    """The card's segments (memory_snapshot) beside the replay's: a reserved miss, by what made it."""
    snapshot = [{"total_size": 2 * MiB, "stream": 0}] * 3 + [{"total_size": 20 * MiB, "stream": 0}] * 5 + [
        {"total_size": 520 * MiB, "stream": 0}, {"total_size": 12 * MiB, "stream": 7}]
    measured = segments.segment_sizes(snapshot)
    assert measured == {"2": 3, "12": 1, "20": 5, "520": 1} and list(measured) == ["2", "12", "20", "520"]
    predicted = {"2": 3, "12": 1, "20": 2}  # three 20 MiB segments and the 520 MiB one fewer: 580 MiB short
    cuda = {**_pred(900), "allocated_peak_bytes": 1000 * MiB, "reserved_peak_bytes": 1150 * MiB, "segment_sizes": predicted}
    r = gr.rung_row("fp32", cuda, _measured(1000, 1730, segment_sizes=measured), {})
    assert r["predicted_segment_sizes"] == predicted and r["cuda_segment_sizes"] == measured
    assert r["segment_difference"] == ("segments predicted 6 (58 MiB), measured 10 (638 MiB); "
                                       "predicted less measured: -1 x 520 MiB, -3 x 20 MiB")
    assert segments.segment_difference(measured, measured).endswith("the same sizes")
    summary = {"status": "fail", "seconds": 1.0, "within_time_limit": True, "environment": {}, "checks": {},
               "results": {"ladder": {"rows": [r]}}}
    assert "- fp32: segments predicted 6 (58 MiB)" in gr.report_markdown(summary)


def test_a_failed_prediction_is_its_rungs_failure_with_the_measurement_kept():
    r = gr.rung_row("qlora", {"error": "TypeError: dispatch failed"}, _measured(2000, 2300), {})
    assert r["cuda_max_allocated_mib"] == 2000 and r["predicted_allocated_mib"] is None
    v = gr.ladder_verdict([r, gr.rung_row("bf16", _pred(100), _measured(98, 110), {})])
    assert v["status"] == "fail" and v["failures"] == ["qlora: the prediction failed: TypeError: dispatch failed"]


def _fake_card(monkeypatch, calls: list, measure_takes_s: float = 0.0) -> None:
    """check_ladder's CUDA layer replaced: predictions and measurements recorded in `calls`."""
    import contextlib
    import time
    import types

    def fake_predict(config, name, **kw):
        calls.append(("predict", name, kw["instrumented"]))
        return types.SimpleNamespace(row=lambda: {**_pred(100), "allocated_peak_bytes": 100 * MiB,
                                                  "reserved_peak_bytes": 110 * MiB})

    def fake_measure(name, load, blocks, **kw):
        calls.append(("measure", name, kw["counted"]))
        time.sleep(measure_takes_s)
        plain = not kw["counted"] or name in gc.OFFLOADED  # measure_offloaded reads the allocator
        return _measured(100, 110, **({"measured_by": "cuda allocator"} if plain else {}))

    class Monitor(contextlib.nullcontext):
        peak = {}

        def __enter__(self):
            return self

        def sample(self):
            return {}

    monkeypatch.setattr(gc, "model_at_hand", lambda cfg, **kw: (None, lambda: None, torch.zeros(4, 8), None))
    monkeypatch.setattr(gc, "card_at_hand", lambda device: gc.cuda_model.card("H200 141GB"))
    monkeypatch.setattr(gc, "card_free_now", lambda device: gc.cuda_model.card("H200 141GB"))
    monkeypatch.setattr(gc, "predict", fake_predict)
    monkeypatch.setattr(gc, "measure", fake_measure)
    monkeypatch.setattr(gc, "MemoryMonitor", lambda *a, **k: Monitor())
    for f in ("empty_cache", "synchronize"):
        monkeypatch.setattr(torch.cuda, f, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)


def test_the_ladder_predictions_made_ahead_on_workers_are_those_made_in_process(monkeypatch, tmp_path):
    """Where the machine has the cores (the H200's 16), gpu-check makes every rung's prediction side by
    side on Dask workers before it measures any: one after another they were 4/5 of the ladder check's
    315 s there (2026-11-26). The rows must be those made in process, rung by rung."""
    from conftest import play_cores, tiny_config

    calls = []
    _fake_card(monkeypatch, calls)
    monkeypatch.setattr(gc, "predict", gpu_cap.predict)  # the workers' own: the real one
    monkeypatch.setattr(gc, "model_at_hand", lambda cfg, **kw: (tiny_config("qwen2"), lambda: None,
                                                          torch.zeros(4, 32, dtype=torch.long), None))
    opts = gc.Options(out=tmp_path, rungs=("bf16", "zero_offload"), seq=32, steps=2)
    here = gc.check_ladder(opts)
    play_cores(monkeypatch, 4)
    calls.clear()
    # the workers (processes of their own) predict with the real one; here, a prediction is a failure
    # (a lost or mis-keyed result would be predicted again in process, and the rows still agree)
    monkeypatch.setattr(gc, "predict", lambda *a, **kw: pytest.fail("a rung was predicted in process"))
    ahead = gc.check_ladder(opts)
    assert (here["options"]["predicted"], ahead["options"]["predicted"]) == ("in this process",
                                                                              "ahead, on 2 Dask workers")
    # how long the predictions made ahead took (the cluster's start included): the rest of the check is the card's
    assert ahead["options"]["predicted_s"] > 0.5 > here["options"]["predicted_s"] >= 0
    assert here["rows"] == ahead["rows"] and not ahead["tracebacks"]
    assert [r["predicted_allocated_mib"] > 0 for r in ahead["rows"]] == [True, True]
    assert calls == [("measure", "bf16", False), ("measure", "zero_offload", False)]  # none predicted here


def test_a_rung_that_accumulates_runs_at_a_batch_it_splits(monkeypatch, tmp_path):
    """At gpu-check's --batch 1, bf16_ckpt_accum had run one micro-batch of 1: bf16_ckpt's step, its
    figures to the MiB in every card record, shown as a rung of its own. It runs at its accumulation's
    batch now (4 micro-batches of 1), predicted at that batch too; each row says its batch."""
    from conftest import tiny_config

    calls, seen = [], []
    _fake_card(monkeypatch, calls)
    fake = gc.measure
    monkeypatch.setattr(gc, "measure", lambda name, load, blocks, **kw: seen.append((name, kw["batch"])) or fake(
        name, load, blocks, **kw))
    predicted = []
    monkeypatch.setattr(gc, "predict", lambda config, name, **kw: predicted.append((name, kw["batch"])) or
                        gpu_cap.predict(config, name, **kw))
    monkeypatch.setattr(gc, "model_at_hand", lambda cfg, **kw: (tiny_config("qwen2"), lambda: None,
                                                          torch.zeros(8, 32, dtype=torch.long), None))
    out = gc.check_ladder(gc.Options(out=tmp_path, rungs=("bf16_ckpt", "bf16_ckpt_accum"), seq=32, steps=2, batch=1))
    assert seen == predicted == [("bf16_ckpt", 1), ("bf16_ckpt_accum", 4)]
    rows = {r["rung"]: r for r in out["rows"]}
    assert (rows["bf16_ckpt"]["batch"], rows["bf16_ckpt"]["micro_batches"]) == (1, 1)
    assert (rows["bf16_ckpt_accum"]["batch"], rows["bf16_ckpt_accum"]["micro_batches"]) == (4, 4)


def test_the_card_s_attention_kernels_are_counted_beside_the_prediction_s_and_a_difference_fails(monkeypatch,
                                                                                                  tmp_path):
    """The model claims the kernel torch picks on the card (cuDNN's, flash, memory-efficient or math: each
    keeps different tensors for backward), and no record said which ran: each rung's attention calls on
    the card are counted by the kernel torch picks for them (torch._fused_sdp_choice with the call's own
    arguments) beside the prediction's, and a rung whose kernels differ fails the ladder."""
    import torch.nn.functional as F

    from conftest import tiny_config
    from workbench.core.memory import cuda_attention

    # played on the CPU: the counting as check_ladder does it, for the CPU's calls, and a run that attends
    calls = []
    _fake_card(monkeypatch, calls)
    monkeypatch.setattr(gc, "counting_choices", lambda counts: cuda_attention.counting_choices(counts, "cpu"))
    monkeypatch.setattr(gc, "predict", gpu_cap.predict)
    monkeypatch.setattr(gc, "model_at_hand", lambda cfg, **kw: (tiny_config("qwen2"), lambda: None,
                                                          torch.zeros(4, 32, dtype=torch.long), None))

    def attends(name, load, blocks, **kw):
        q = torch.randn(1, 4, 8, 16, requires_grad=True)
        for _ in range(3):  # (the CPU picks flash here, without dropout)
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return _measured(100, 110, measured_by="cuda allocator")

    monkeypatch.setattr(gc, "measure", attends)
    out = gc.check_ladder(gc.Options(out=tmp_path, rungs=("bf16", "fp32"), seq=32, steps=2))
    bf16, fp32 = out["rows"]
    # the H200 (sm_90) with a cuDNN past 9.15: cuDNN's attention for bf16, the math kernel for fp32's grouped heads
    assert set(bf16["predicted_attention_kernels"]) == {"cudnn"} and set(fp32["predicted_attention_kernels"]) == {"math"}
    assert bf16["cuda_attention_kernels"] == fp32["cuda_attention_kernels"] == {"flash": 3}
    assert out["status"] == "fail" and [f.split(":")[0] for f in out["failures"] if "attention ran" in f] == [
        "bf16", "fp32"]
    assert "the card's attention ran flash, the prediction chose cudnn" in out["failures"][0]
    assert F.scaled_dot_product_attention is cuda_attention.torch.nn.functional.scaled_dot_product_attention
    # the verdict alone: the same kernels (counts aside) agree; an unknown side is not judged
    row = {"rung": "bf16", "predicted_attention_kernels": {"cudnn": 48}, "cuda_attention_kernels": {"cudnn": 72}}
    assert gr.kernels_differ(row) is None
    assert gr.kernels_differ({**row, "cuda_attention_kernels": None}) is None
    assert gr.kernels_differ({**row, "cuda_attention_kernels": {"cudnn": 24, "flash": 24}}).startswith(
        "the card's attention ran cudnn, flash, the prediction chose cudnn")


def test_counting_the_attention_kernels_sees_what_the_call_gets(monkeypatch):
    """counting_choices counts each call's kernel with the call's own arguments, after the cast autocast
    makes inside sdpa (an fp32 query under bf16 autocast is attended in bf16), counts only the calls on
    its device (a device_map run's host layers are not the card's), changes no result and puts sdpa back."""
    import torch.nn.functional as F

    from workbench.core.memory import cuda_attention

    real = F.scaled_dot_product_attention
    seen = []
    choice = torch._fused_sdp_choice
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda q, *a, **kw: seen.append(q.dtype) or choice(q, *a, **kw))
    q = torch.randn(1, 4, 8, 16)
    with cuda_attention.counting_choices({}, "cpu") as counts:
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)  # the CPU's math kernel, for dropout
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert counts == {"flash": 2, "math": 1} and seen == [torch.float32, torch.float32, torch.bfloat16]
    assert torch.equal(out, real(q, q, q, is_causal=True)) and low.dtype == torch.bfloat16
    assert F.scaled_dot_product_attention is real
    with cuda_attention.counting_choices({}) as counts:  # the card's: the CPU's calls are not counted
        F.scaled_dot_product_attention(q, q, q)
    assert counts == {} and F.scaled_dot_product_attention is real
    # a float mask is cast as the call casts it, given by name or by place (the choice had seen it in fp32)
    masks = []
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda q, k, v, m=None, *a, **kw:
                        masks.append(kw.get("attn_mask", m).dtype) or choice(q, k, v, kw.get("attn_mask", m)))
    mask = torch.zeros(8, 8)
    with cuda_attention.counting_choices({}, "cpu"), torch.autocast("cpu", dtype=torch.bfloat16):
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        F.scaled_dot_product_attention(q, q, q, mask)
    assert masks == [torch.bfloat16, torch.bfloat16]


def test_an_offload_rung_whose_host_state_is_past_the_free_memory_is_a_skipped_row(monkeypatch, tmp_path):
    """ZeRO keeps 16 bytes a parameter on the host: Qwen2-0.5B's is 7.4 GiB, more than a laptop's
    (or a WSL2 VM's, half the host's) free memory, where the OOM killer would end gpu-check itself."""
    import types

    from workbench.core import common

    calls = []
    _fake_card(monkeypatch, calls)
    real = gc.predict

    def with_host(config, name, **kw):
        row = real(config, name, **kw).row()
        return types.SimpleNamespace(row=lambda: {**row, "host_bytes": (7_600 if name == "zero_offload" else 0) * MiB})

    monkeypatch.setattr(gc, "predict", with_host)
    monkeypatch.setattr(common, "host_free_mib", lambda: 6_000.0)
    out = gc.check_ladder(gc.Options(out=tmp_path, rungs=("bf16", "zero_offload")))
    assert [c[1] for c in calls if c[0] == "measure"] == ["bf16"]
    row = out["rows"][1]
    assert row["status"] == "skipped" and row["reason"] == ("its predicted host memory 7,600.0 MiB > the 6,000 MiB "
                                                            "this machine has free")
    assert out["status"] == "fail" and out["failures"] == [f"zero_offload: skipped: {row['reason']}"]
    # where the check's kept model (made once, a copy for each rung) is what stands in the way, it is given
    # back and the rung runs; the rungs after it make the model afresh
    free, dropped = {"mib": 6_000.0}, []

    def drop():
        dropped.append(free.update(mib=9_000.0))
        return True

    load = lambda: None  # noqa: E731
    load.drop = drop
    monkeypatch.setattr(gc, "model_at_hand", lambda cfg, **kw: (None, load, torch.zeros(4, 8), None))
    monkeypatch.setattr(common, "host_free_mib", lambda: free["mib"])
    calls.clear()
    out = gc.check_ladder(gc.Options(out=tmp_path, rungs=("bf16", "zero_offload")))
    assert [c[1] for c in calls if c[0] == "measure"] == ["bf16", "zero_offload"] and len(dropped) == 1
    assert [r["status"] for r in out["rows"]] == ["ok", "ok"]
    assert out["options"]["loads"] == {}  # a load that keeps nothing has no timings
    load.timings = {"made_s": 9.1, "copies": 2, "copy_s": 2.4, "kept": "dropped"}  # as a kept model's says them
    assert gc.check_ladder(gc.Options(out=tmp_path, rungs=("bf16",)))["options"]["loads"] == load.timings


@pytest.mark.parametrize("counted", [False, True])
def test_each_rung_is_compared_with_the_prediction_of_the_step_it_runs(monkeypatch, tmp_path, counted):
    """Plain by default (no dispatch mode: the step a user's training runs); --counted measures the
    device rungs under the live-bytes count, which makes autograd sum gradients out of place, so
    their prediction must be the instrumented one; an offload rung always runs plain."""
    calls = []
    _fake_card(monkeypatch, calls)
    out = gc.check_ladder(gc.Options(out=tmp_path, rungs=("bf16", "device_map"), counted=counted))
    assert calls == [("predict", "bf16", counted), ("measure", "bf16", counted),
                     ("predict", "device_map", False), ("measure", "device_map", counted)]
    assert out["status"] == "pass"
    # the allocator's peak is not the live-bytes count: a plain row has no accounted figure
    assert [r["accounted_peak_mib"] for r in out["rows"]] == [100.0 if counted else None, None]


def test_a_rung_whose_weights_alone_exceed_the_card_is_a_verdict_the_card_checks(monkeypatch, tmp_path):
    """WeightsExceedCard (a card under 2 GB) was a failed prediction, failing the check whatever the
    card did: it is the prediction's verdict, agreed with when the rung runs out of memory there."""
    from workbench.core.memory.predict import WeightsExceedCard

    calls = []
    _fake_card(monkeypatch, calls)
    fake_predict, fake_measure = gc.predict, gc.measure

    def predict(config, name, **kw):
        if name == "fp32":
            raise WeightsExceedCard("the card is smaller than the weights alone; use --precision bf16-true")
        return fake_predict(config, name, **kw)

    monkeypatch.setattr(gc, "predict", predict)
    monkeypatch.setattr(gc, "measure", lambda name, *a, **kw: {"status": "oom", "reason": "CUDA out of memory"}
                        if name == "fp32" else fake_measure(name, *a, **kw))
    out = gc.check_ladder(gc.Options(out=tmp_path, rungs=("bf16", "fp32")))
    row = out["rows"][1]
    assert out["status"] == "pass" and not out["tracebacks"], out["failures"]
    assert row["method"] == "weights > card" and row["predicted_fits_card"] is False and row["status"] == "oom"
    assert row["free_before_mib"] == gc.cuda_model.card("H200 141GB").usable_bytes / MiB  # read before the run
    # each predicted rung carries the margin auto-fit would add to it, which the verdict holds it to
    assert out["rows"][0]["predicted_margin"] == gc.prediction_margin(RUNGS["bf16"], device="cuda")[0] > 0
    monkeypatch.setattr(gc, "measure", fake_measure)  # the card trained it: the verdict was wrong
    out = gc.check_ladder(gc.Options(out=tmp_path, rungs=("bf16", "fp32")))
    assert out["status"] == "fail" and out["failures"][0] == ("fp32: predicted not to fit (its weights alone "
                                                              "exceed the card), yet it trained")


def test_the_trace_fits_the_card_and_its_precision(monkeypatch, tmp_path):
    """On an 8 GB card Qwen2-0.5B's bf16 step (about 8.7 GB) ran out of memory and failed the whole
    check; before sm_80 it traced emulated bf16. Now fp16 there, and the tiny base where the step does not fit."""
    traced, cc = [], [(7, 5)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc[0])

    def fake_trace(opts, precision):
        traced.append((opts.model, opts.seq, precision))
        if not opts.tiny:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.85 GiB")
        return {"status": "pass", "files": ["trace.json", "memory_snapshot.pickle"], "failures": []}

    monkeypatch.setattr(gc, "_trace", fake_trace)
    out = gc.check_trace(gc.Options(out=tmp_path))
    assert traced == [(gc.Options.model, 512, "fp16"), ("embedded", 64, "fp16")]
    assert out["status"] == "pass" and out["model"] == "embedded (tiny)" and out["precision"] == "fp16"
    assert "ran out of memory on this card (OutOfMemoryError: CUDA out of memory." in out["note"]
    cc[0], traced[:] = (9, 0), []
    out = gc.check_trace(gc.Options(out=tmp_path, model="embedded", tiny=True, seq=64))
    assert traced == [("embedded", 64, "bf16")] and "note" not in out
    # CUDA's own out-of-memory error (a cuBLAS handle on a full card) steps down too; the tiny base does not
    monkeypatch.setattr(gc, "_trace", lambda opts, precision: traced.append(opts.tiny) or (
        {"status": "pass"} if opts.tiny else (_ for _ in ()).throw(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED"))))
    traced[:] = []
    assert gc.check_trace(gc.Options(out=tmp_path))["model"] == "embedded (tiny)" and traced == [False, True]
    monkeypatch.setattr(gc, "_trace", lambda opts, precision: (_ for _ in ()).throw(torch.OutOfMemoryError("x")))
    with pytest.raises(torch.OutOfMemoryError):
        gc.check_trace(gc.Options(out=tmp_path, model="embedded", tiny=True, seq=64))


def test_ladder_verdict():
    good = [gr.rung_row("bf16", _pred(100), _measured(98, 110), {}),
            gr.rung_row("fp32", _pred(200), {"status": "oom", "reason": "CUDA out of memory"}, {})]
    v = gr.ladder_verdict(good)
    assert v["status"] == "pass" and v["failures"] == []  # an OOM on the card is a result
    bad = good + [gr.rung_row("fp16", _pred(100), _measured(50, 60), {}),
                  gr.rung_row("device_map", _pred(100), {"status": "not measured", "reason": "no accelerate"}, {})]
    v = gr.ladder_verdict(bad)
    assert v["status"] == "fail" and len(v["failures"]) == 2
    assert v["failures"][0].startswith("fp16: prediction off by +100.0%")
    assert v["failures"][1] == "device_map: not measured: no accelerate"
    assert gr.ladder_verdict([])["status"] == "fail"
    # every rung out of memory (a card too small for the check's model): nothing was compared, no pass
    v = gr.ladder_verdict(good[1:])
    assert v["status"] == "fail" and v["failures"] == [v["failures"][0]]
    assert v["failures"][0].startswith("every rung ran out of memory, so no prediction was compared")


def test_the_predictions_fit_verdict_on_the_card_is_held_to_what_the_card_did():
    """An OOM was a result whatever the prediction said: a rung predicted to fit with room to spare
    that ran out of memory (what issue 10 is about: "fits" where the card runs out) passed the check.
    What was free before the run is the measure (a desktop's display, others' processes out)."""
    card = {"allocated_peak_bytes": 900 * MiB, "reserved_peak_bytes": 1000 * MiB, "fit_bytes": 1000 * MiB,
            "method": "predicted"}
    oom = {"status": "oom", "reason": "CUDA out of memory"}
    ran = gr.rung_row("bf16", _pred(100), _measured(98, 110), {})

    def verdict(prediction, measured, free_mib=None):
        measured = {**measured, **({} if free_mib is None else {"free_before_bytes": free_mib * MiB})}
        return gr.ladder_verdict([ran, gr.rung_row("fp32", prediction, measured, {})])["failures"]

    roomy = {**card, "fits": True, "headroom_bytes": 2000 * MiB}
    # without a measured margin in the row, the reserved threshold (35%) stands in for it
    assert verdict(roomy, oom) == ["fp32: predicted to need 1,000 MiB (1,350 with its 35.0% margin), with 3,000 MiB "
                                   "free on the card before it ran, yet it ran out of memory"]
    assert verdict(roomy, _measured(900, 1000)) == []
    # others' processes had taken most of the card: the rung did not have the room the model gave it
    assert verdict(roomy, oom, free_mib=1200) == []
    assert verdict(roomy, oom, free_mib=1500)[0].endswith("with 1,500 MiB free on the card before it ran, yet it ran "
                                                          "out of memory")
    # with the margin auto-fit adds (4.2% on the card), a rung it would have promised fits is held to it
    with_margin = {**roomy, "margin": 0.042}
    assert verdict(with_margin, oom, free_mib=1100) == ["fp32: predicted to need 1,000 MiB (1,042 with its 4.2% "
                                                        "margin), with 1,100 MiB free on the card before it ran, yet "
                                                        "it ran out of memory"]
    assert verdict(with_margin, oom, free_mib=1040) == []
    # figures that whole MiB would round equal keep the decimals that tell them apart
    assert verdict({**card, "fits": True, "headroom_bytes": 200 * MiB, "margin": 0.0996}, oom, free_mib=1099.8) == [
        "fp32: predicted to need 1,000 MiB (1,099.6 with its 10.0% margin), with 1,099.8 MiB free on the card "
        "before it ran, yet it ran out of memory"]
    assert verdict({**card, "fits": True, "headroom_bytes": 200 * MiB, "margin": 0.09996}, oom, free_mib=1100.04) == [
        "fp32: predicted to need 1,000 MiB (1,099.96 with its 10.0% margin), with 1,100.04 MiB free on the card "
        "before it ran, yet it ran out of memory"]  # apart only in the second decimal
    short = {**card, "fits": False, "headroom_bytes": -500 * MiB}
    assert verdict(short, oom) == []
    assert verdict(short, _measured(900, 1000)) == ["fp32: predicted to need 1,000 MiB, more than the 500 MiB free "
                                                    "before it ran, yet it trained"]
    # within the reserved threshold of the fit figure either way: the verdict was within the error allowed
    assert verdict({**card, "fits": True, "headroom_bytes": 300 * MiB}, oom) == []
    assert verdict({**card, "fits": False, "headroom_bytes": -300 * MiB}, _measured(900, 1000)) == []
    # the weights alone more than the card (WeightsExceedCard): a verdict, agreed with by an OOM
    too_big = {"method": "weights > card", "fits": False, "note": "smaller than the weights alone"}
    assert verdict(too_big, oom) == []
    assert verdict(too_big, _measured(900, 1000)) == ["fp32: predicted not to fit (its weights alone exceed the "
                                                      "card), yet it trained"]
    assert verdict(card, oom) == []  # no card in the prediction: no verdict to hold


def _run(strategy, *history):
    return {"strategy": strategy, "status": "fallback" if len(history) > 1 else "ok", "peak_mem_mib": 1.0,
            "device_history": " -> ".join(f"{a}: {r}" for a, r in history),
            "history": json.dumps([{"attempt": a, "result": r} for a, r in history])}


def test_study1_verdict_needs_a_real_fallback_and_nothing_left_on_the_gpu():
    runs = [_run("full", ("cuda@2", "oom"), ("cpu", "ok")), _run("adapter", ("cuda@2", "ok"))]
    v = gr.study1_verdict(runs, 1024, 1024)
    assert v["status"] == "pass" and v["fell_back"] == ["full"]
    v = gr.study1_verdict(runs, 1024, 1024 + 512)
    assert v["status"] == "fail" and v["failures"] == ["512 bytes left allocated on the GPU after study 1"]
    v = gr.study1_verdict([_run("adapter", ("cuda@2", "ok"))], 0, 0)
    assert v["status"] == "fail" and "no strategy ran out" in v["failures"][0]
    # An OOM that never reached the CPU is not a fallback either.
    assert gr.study1_verdict([_run("full", ("cuda@2", "oom"), ("cpu", "oom"))], 0, 0)["status"] == "fail"


def _fake_checks(ladder_rows):
    return {
        "environment": lambda o: {"status": "pass", "env": {"gpu": "Fake H0", "gpu_total_mib": 81920.0,
                                                            "torch": "2.13.0", "cuda": "12.8"}},
        "ladder": lambda o: gr.ladder_verdict(ladder_rows),
        "strategies": lambda o: {**gr.study1_verdict([_run("full", ("cuda@2", "oom"), ("cpu", "ok"))], 0, 0),
                                 "budget_mib": 2.0},
        "trace": lambda o: (_ for _ in ()).throw(RuntimeError("profiler broke")),
    }


def test_each_check_leaves_the_card_to_the_next_with_nothing_cached(tmp_path, monkeypatch):
    """The notebooks check runs its kernels as other processes: blocks the checks before it left in
    this process's caching allocator were theirs to lack on a small card. Played: CUDA is started."""
    emptied, seen = [], {}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))

    def check(name):
        def run(opts):
            seen[name] = len(emptied)  # what was given back before this check began
            return {"status": "pass"}
        return run

    found = {name: check(name) for name in ("environment", "ladder", "notebooks")}
    gc.run_checks(gc.Options(out=tmp_path), found, say=lambda s: None)
    assert seen == {"environment": 0, "ladder": 1, "notebooks": 2} and len(emptied) == 3
    # a sticky CUDA error (a device-side assert) raises again when the cache is emptied: said, and the next runs

    def sticky():
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(torch.cuda, "empty_cache", sticky)
    summary = gc.run_checks(gc.Options(out=tmp_path), found, say=lambda s: None)
    assert summary["checks"] == {"environment": "pass", "ladder": "pass", "notebooks": "pass"}
    assert summary["results"]["ladder"]["release_error"].startswith("RuntimeError: CUDA error: device-side assert")


def test_run_checks_writes_summary_and_report_and_survives_a_failing_check(tmp_path):
    rows = [gr.rung_row("bf16", _pred(100), _measured(98, 110), {"nvml_used_peak_mib": 900.0,
                                                                   "nvml_used_before_mib": 700.0})]
    said = []
    summary = gc.run_checks(gc.Options(out=tmp_path), _fake_checks(rows), say=said.append)
    assert summary["checks"] == {"environment": "pass", "ladder": "pass", "strategies": "pass", "trace": "error"}
    assert summary["status"] == "fail" and "profiler broke" in summary["results"]["trace"]["error"]
    assert len(said) == 4 and said[-1].startswith("gpu-check trace: error")
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["environment"]["gpu"] == "Fake H0" and saved["results"]["ladder"]["rows"][0]["rung"] == "bf16"
    assert saved["thresholds"] == {"allocated_pct": 15.0, "reserved_pct": 35.0} and saved["within_time_limit"] is True
    report = (tmp_path / "report.md").read_text()
    assert "## GPU check: fail" in report and "Fake H0" in report
    assert "| bf16 | ok | predicted | 100.0 | 98.0 | 2.0 |" in report
    assert "caps the allocator's reserved memory" in report and "live tensor bytes" in report
    assert "- full: fallback (cuda@2: oom -> cpu: ok)" in report
    assert "trace: RuntimeError: profiler broke" in report
    # Everything passes: the summary passes.
    fine = {k: v for k, v in _fake_checks(rows).items() if k != "trace"}
    assert gc.run_checks(gc.Options(out=tmp_path), fine, say=lambda s: None)["status"] == "pass"


def test_summary_is_on_disk_after_each_check_so_a_killed_run_keeps_what_came_before(tmp_path):
    rows = [gr.rung_row("bf16", _pred(100), _measured(98, 110), {})]
    found = {k: v for k, v in _fake_checks(rows).items() if k in ("environment", "ladder")}

    def killed(opts):  # what a lease ending or a timeout does mid-check: not an Exception
        raise KeyboardInterrupt

    found["strategies"] = killed
    found["trace"] = lambda opts: {"status": "pass"}
    said = []
    with pytest.raises(KeyboardInterrupt):
        gc.run_checks(gc.Options(out=tmp_path), found, say=said.append)
    saved = json.loads((tmp_path / "summary.json").read_text())
    # the check it died in and the one it never reached are said, and the run is not a pass
    assert saved["checks"] == {"environment": "pass", "ladder": "pass", "strategies": "killed", "trace": "pending"}
    assert saved["status"] == "incomplete" and said[-1] == "gpu-check strategies: killed (KeyboardInterrupt); " \
        "the checks after it did not run"
    assert saved["results"]["ladder"]["rows"][0]["rung"] == "bf16"
    report = (tmp_path / "report.md").read_text()
    assert "| bf16 | ok |" in report and "## GPU check: incomplete" in report
    assert "- trace: pending (not reached: the run ended before it began)" in report
    # killed in the second after a check, as the card is given back: the finished check is kept, not "running"
    with mock.patch.object(gc, "release_card", side_effect=KeyboardInterrupt), pytest.raises(KeyboardInterrupt):
        gc.run_checks(gc.Options(out=tmp_path), {"environment": found["environment"]}, say=said.append)
    assert json.loads((tmp_path / "summary.json").read_text())["checks"] == {"environment": "pass"}
    # a SIGKILL leaves no handler to run: what is on disk while a check runs says it was running
    seen = {}

    def look(opts):
        seen.update(json.loads((tmp_path / "summary.json").read_text())["checks"])
        return {"status": "pass"}

    found["strategies"] = look
    assert gc.run_checks(gc.Options(out=tmp_path), found, say=lambda s: None)["status"] == "pass"
    assert seen == {"environment": "pass", "ladder": "pass", "strategies": "running", "trace": "pending"}


def test_sigterm_ends_the_run_with_the_check_it_ended_recorded(tmp_path):
    """`timeout` (a lent card's hard limit) sends SIGTERM: gpu-check's handler makes it an exception,
    so the check in progress is recorded as killed and the process exits 128 + 15."""
    import os
    import signal

    def check(opts):
        os.kill(os.getpid(), signal.SIGTERM)
        return {"status": "pass"}

    previous = signal.signal(signal.SIGTERM, gc._terminated)
    try:
        with pytest.raises(SystemExit) as e:
            gc.run_checks(gc.Options(out=tmp_path), {"environment": check, "ladder": check}, say=lambda s: None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert e.value.code == 143
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["checks"] == {"environment": "killed", "ladder": "pending"}
    assert saved["results"]["environment"]["error"].startswith("SIGTERM after")


def test_past_the_time_budget_no_check_and_no_rung_begins_and_each_says_so(monkeypatch, tmp_path):
    """A lent card's call ends at a hard limit: what began before the budget ran out finishes and is
    kept; what had not begun is 'not run', in the summary and the report, and makes the run incomplete
    (never a pass; a fail when something that ran failed)."""
    import time

    ran = []

    def slow(o):
        ran.append("ladder")
        time.sleep(1.0)
        return {"status": "pass"}

    found = {"environment": lambda o: {"status": "pass", "gpu": "Fake H0"}, "ladder": slow,
             "trace": lambda o: ran.append("trace") or {"status": "pass"}}
    summary = gc.run_checks(gc.Options(out=tmp_path, deadline_at=time.perf_counter() + 0.5), found, say=lambda s: None)
    assert ran == ["ladder"]
    assert summary["checks"] == {"environment": "pass", "ladder": "pass", "trace": "not run"}
    assert summary["status"] == "incomplete" and "- trace: not run" in (tmp_path / "report.md").read_text()
    # something that ran and failed makes it a fail, whatever did not run
    failing = {**found, "ladder": lambda o: slow(o) and {"status": "fail", "failures": ["fp32: off by 40%"]}}
    summary = gc.run_checks(gc.Options(out=tmp_path, deadline_at=time.perf_counter() + 0.5), failing, say=lambda s: None)
    assert summary["checks"]["trace"] == "not run" and summary["status"] == "fail"
    # the environment is read even when the budget is spent before anything began
    summary = gc.run_checks(gc.Options(out=tmp_path, deadline_at=time.perf_counter() - 1), found, say=lambda s: None)
    assert summary["checks"] == {"environment": "pass", "ladder": "not run", "trace": "not run"}
    # inside the ladder: the rung that began finishes, the next one is a 'not run' row
    calls = []
    _fake_card(monkeypatch, calls, measure_takes_s=1.0)
    out = gc.check_ladder(gc.Options(out=tmp_path, rungs=("bf16", "device_map"),
                                     deadline_at=time.perf_counter() + 0.5))
    assert calls == [("predict", "bf16", False), ("measure", "bf16", False)]
    assert [r["status"] for r in out["rows"]] == ["ok", "not run"]
    assert out["status"] == "fail" and out["failures"][0].startswith("device_map: not run: the time budget")
    # a check failed only by rows that did not begin is not a failure of what ran: the run is incomplete
    env = {"gpu": "Fake H0", "gpu_total_mib": 1.0}
    summary = gr.summarize({"environment": {"status": "pass"}, "ladder": out}, env, 1.0)
    assert summary["status"] == "incomplete"
    assert ("- ladder: incomplete (the time budget (--time-budget) was spent before parts of it began or while "
            "they ran; what ran passed)") in gr.report_markdown(summary)
    # before the environment is read (the report written as the run starts), the card's memory is not "0 MiB"
    unread = gr.report_markdown(gr.summarize({"environment": {"status": "running"}}, {}, 0.0))
    assert "Card: ? (memory not read yet)" in unread and "0 MiB" not in unread
    # and the shell's line says so too (2026-11-30's card printed "notebooks: fail" for a notebook the budget cut)
    said = []
    cut = {"environment": found["environment"], "ladder": lambda o: out}
    assert gc.run_checks(gc.Options(out=tmp_path), cut, say=said.append)["checks"]["ladder"] == "fail"
    assert any(line.startswith("gpu-check ladder: incomplete (the time budget") for line in said), said
    # one rung off the mark beside it is a failure
    off = {**out, "failures": out["failures"] + ["bf16: prediction off by +40.0% of allocated"]}
    assert gr.summarize({"environment": {"status": "pass"}, "ladder": off}, env, 1.0)["status"] == "fail"
    # and so is a check that raised (its error) whatever its failures say
    raised = {**out, "error": "RuntimeError: CUDA error"}
    assert gr.summarize({"environment": {"status": "pass"}, "ladder": raised}, env, 1.0)["status"] == "fail"


def test_a_time_budget_that_is_not_positive_is_one_line(capsys):
    assert main(["gpu-check", "--time-budget", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--time-budget must be a positive number of seconds" in err and "\n" not in err


def test_only_runs_the_named_checks(tmp_path):
    ran = []
    found = {n: (lambda o, n=n: ran.append(n) or {"status": "pass"}) for n in ("environment", "ladder", "trace")}
    gc.run_checks(gc.Options(out=tmp_path, extra={"only": ("trace",)}), found, say=lambda s: None)
    assert ran == ["environment", "trace"]


def test_the_checks_run_quick_ones_first_and_the_cap_bisection_last():
    """On 2026-11-26 the checks took 670-760 s in all (the cap 160-228 s, the notebooks 144 s), more than a
    lent card's call of 600 s: under --time-budget what is left out should be what costs most and is on
    record already."""
    found = gc.checks()
    assert list(found) == ["environment", "ladder", "strategies", "trace", "split", "monitor", "autofit",
                           "notebooks", "cap"]
    assert found["split"] is split_check.check_split and found["cap"] is gpu_cap.check_cap
    sub = argparse.ArgumentParser().add_subparsers()
    gc.register(sub)
    only = next(a for a in sub.choices["gpu-check"]._actions if a.dest == "only")
    assert all(name in only.help for name in list(found)[1:])  # --only's help names every check


def test_the_cap_bisection_finds_the_least_cap_a_run_trains_under():
    MiB = 2**20
    for true_least in (3004 * MiB + 5, 3100 * MiB, 3300 * MiB):  # what the card needs (a stand-in trial)
        calls = []

        def runs(cap, true_least=true_least):
            calls.append(cap)
            return cap >= true_least

        least, tried = least_cap(runs, 2937 * MiB, 3316 * MiB, STEP)
        assert least >= true_least > least - STEP and least % STEP == 0  # the least multiple of the step
        assert [c for c, _ in tried] == calls and all(ok == (c >= true_least) for c, ok in tried)
        assert len(calls) <= 5  # (3316 - 2937) / 16 MiB: 24 steps, halved each trial
    # nothing below the uncapped reserved peak ran: that peak (rounded up to the step) is the answer
    least, tried = least_cap(lambda cap: False, 2937 * MiB, 3316 * MiB, STEP)
    assert least == -(-3316 * MiB // STEP) * STEP and tried and not any(ok for _, ok in tried)


def test_cap_rows_compare_the_need_less_the_workspaces_and_judge_it_by_the_target():
    MiB = 2**20
    ws = 64 * MiB  # the process held them in every capped run
    ok = cap_row("zero_offload", predicted_needed=4244 * MiB, workspaces=ws, predicted_reserved=5060 * MiB,
                 least=4192 * MiB, uncapped={"reserved_mib": 5200.0}, tried=[(4192 * MiB, True), (4176 * MiB, False)])
    assert ok["predicted_needed_mib"] == 4180.0 and ok["measured_least_cap_mib"] == 4192.0
    assert ok["error_pct"] == round(100 * (4180 - 4192) / 4192, 2) and ok["passed"]
    assert ok["trials"] == [{"cap_mib": 4192.0, "ran": True}, {"cap_mib": 4176.0, "ran": False}]
    # the error is of the measured least cap (25% above 800 MiB; of the need's 1,000 MiB it would read 20%)
    assert cap_row("bf16_true_lora", predicted_needed=1000 * MiB, workspaces=0, predicted_reserved=1100 * MiB,
                   least=800 * MiB, uncapped={}, tried=[])["error_pct"] == 25.0
    off = cap_row("bf16_true_lora", predicted_needed=3004 * MiB, workspaces=ws, predicted_reserved=3174 * MiB,
                  least=3200 * MiB, uncapped={}, tried=[])
    assert off["error_pct"] < -TARGET_PCT and not off["passed"]
    failed = cap_row("bf16_true_lora", predicted_needed=3004 * MiB, workspaces=ws, predicted_reserved=3174 * MiB,
                     least=None, uncapped={}, tried=[], reason="deepspeed failed")
    assert failed["status"] == "not measured" and not failed["passed"]
    assert cap_verdict([ok])["status"] == "pass"
    v = cap_verdict([ok, off, failed])
    assert v["status"] == "fail" and len(v["failures"]) == 2 and "deepspeed failed" in v["failures"][0]
    assert "| zero_offload | 4180.0 | 4192.0 |" in v["report"]
    assert cap_verdict([])["status"] == "fail"  # nothing measured is no pass
    # a rung out of memory uncapped, or too big for the card (predicted), is a result; but when none
    # trained, no least cap was compared: no pass
    big = {"rung": "zero_offload", "status": "too big", "reason": "smaller than the weights alone", "trials": [],
           "passed": None}
    assert cap_verdict([ok, big])["status"] == "pass"
    oom = {**big, "status": "oom", "reason": "CUDA out of memory"}
    v = cap_verdict([oom, big])
    assert v["status"] == "fail" and len(v["failures"]) == 1 and "no least cap was found" in v["failures"][0]
    # out of memory uncapped with room for the need (and the target's margin) free before it: a fault,
    # as in the ladder's check (it had passed as a result on any card, an H200's 140 GB included)
    short = {**oom, "predicted_needed_mib": 4000.0, "free_before_mib": 4100.0}  # 2.5% room: a result
    roomy = {**short, "free_before_mib": 4000.0 * (1 + TARGET_PCT / 100) + 1}
    assert cap_verdict([ok, short])["status"] == "pass"
    v = cap_verdict([ok, roomy])
    assert v["status"] == "fail" and v["failures"] == [
        f"zero_offload: predicted to need 4,000 MiB, with {roomy['free_before_mib']:,.0f} MiB free before it ran, "
        "yet it ran out of memory uncapped"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: runs the real check (make gpu-check)")
def test_gpu_check_on_this_card(tmp_path):
    summary = gc.run_checks(gc.Options(out=tmp_path, model="embedded", tiny=True, seq=64, steps=3))
    assert (tmp_path / "summary.json").exists() and (tmp_path / "trace.json").exists()
    # every check, not two of them: the split's, the auto-fit's, the cap's and the notebooks' too
    assert summary["status"] == "pass", {n: summary["results"][n] for n, s in summary["checks"].items() if s != "pass"}


def test_study_runs_of_the_check_go_under_its_folder_and_always_rerun(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_RESULTS", "/somewhere/else")
    monkeypatch.delenv(RERUN_ENV, raising=False)
    with results_under(tmp_path / "runs"):
        assert results_root() == tmp_path / "runs" and not reuse_finished_runs()
    assert str(results_root()) == "/somewhere/else" and reuse_finished_runs()


@pytest.mark.parametrize("args, error", [
    (["--only", "ladder,tracee"], "--only: unknown check tracee"),
    (["--steps", "1"], "--steps must be at least 2 (the first step is warm-up), got 1"),
    (["--batch", "0"], "--batch must be at least 1, got 0"),
    (["--seq", "-4"], "--seq must be at least 1, got -4"),
    (["--model", "data/configs/qwen2-0.5.json"], "'data/configs/qwen2-0.5.json': no such file or directory"),
    (["--rungs", "fp32,cpu"], "--rungs: cpu is no rung that uses the GPU; rungs: fp32, fp16"),
    # each had been dropped without a word
    (["--quick", "--model", "data/configs/gpt2.json"], "--quick runs the tiny embedded base at --seq 64: give --quick, "
     "or --model and --seq"),
    (["--quick", "--seq", "128"], "--quick runs the tiny embedded base at --seq 64"),
    (["--only", "split", "--rungs", "fp32"], "--rungs chooses the ladder check's rungs: add ladder to --only"),
    # a file where the results go: it was found after the checks (on a card: after its minutes)
    (["--out", "README.md"], "README.md: it is a file; name a folder you can write"),
    (["--out", "README.md/gpu"], "README.md is a file; name a folder you can write"),
])
def test_a_bad_argument_is_one_line_even_without_a_gpu(args, error, monkeypatch, capsys):
    """A command prepared here for a lent card's one call must fail here, not on the card."""

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["gpu-check", *args]) == 2
    out = capsys.readouterr()
    assert error in out.err and "\n" not in out.err.strip() and gc.NO_GPU_LINE not in out.out


def test_rungs_names_the_ladder_checks_rungs_in_the_order_given(tmp_path):
    parser = argparse.ArgumentParser()
    gc.register(parser.add_subparsers())
    opts = gc._options(parser.parse_args(["gpu-check", "--rungs", "bf16,fp32", "--out", str(tmp_path)]))
    assert opts.rungs == ("bf16", "fp32")
    assert gc._options(parser.parse_args(["gpu-check", "--out", str(tmp_path)])).rungs == ()  # every GPU rung
    opts = gc._options(parser.parse_args(["gpu-check", "--only", "trace,ladder", "--rungs", "fp32",
                                          "--out", str(tmp_path)]))
    assert (opts.rungs, opts.extra["only"]) == (("fp32",), ("trace", "ladder"))
    quick = gc._options(parser.parse_args(["gpu-check", "--quick", "--out", str(tmp_path)]))
    assert (quick.model, quick.tiny, quick.seq) == ("embedded", True, 64)


def test_a_relative_out_is_made_absolute(tmp_path, monkeypatch):
    """The notebooks check's kernels run in notebooks/ under WORKBENCH_RESULTS=<out>/runs/...: a relative
    --out put their runs in notebooks/<out>/ and the check, reading <out>/, failed every notebook."""
    parser = argparse.ArgumentParser()
    gc.register(parser.add_subparsers())
    monkeypatch.chdir(tmp_path)
    assert gc._options(parser.parse_args(["gpu-check", "--out", "card"])).out == tmp_path / "card"


def test_a_check_that_brings_its_own_report_section_has_it_in_the_report(tmp_path):
    found = {"environment": lambda o: {"status": "pass", "gpu": "Fake H0"},
             "split": lambda o: {"status": "pass", "report": "### Study 3 on the card\n\n| k | tok/s |\n|---|---|\n| 0.5 | 123 |"}}
    gc.run_checks(gc.Options(out=tmp_path), found, say=lambda s: None)
    report = (tmp_path / "report.md").read_text()
    assert "### Study 3 on the card" in report and "| 0.5 | 123 |" in report


# ------------------------------------------------------------------------------------------------
# the notebooks check (workbench/front/gpu_programs.py), with a stand-in for papermill

def _stand_in(recorded: dict[str, dict[str, str]], calls: list, fail: str = ""):
    """Executes nothing: writes the executed notebook and the runs.csv rows a study would, through the
    studies' own writer (a row of the same settings replaces the old one; `recorded`: the columns of
    each study's measured row)."""
    from workbench.core.results import ResultsWriter

    def execute(path, params, out, timeout_s=None, deadline=None):
        study = Path(path).stem.split("_", 1)[1]
        calls.append({"notebook": Path(path).stem, "params": params, "out": Path(out), "root": results_root(),
                      "timeout_s": timeout_s, "deadline": deadline})
        if study == fail:
            raise RuntimeError("PapermillExecutionError: cell 4 raised\nTraceback ...")
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text("{}")
        row = {"run_id": f"{study}-quick", "study": study, "source": "measured", **recorded.get(study, {})}
        # study 3 also writes modelled rows for other machines: they trained nowhere here
        other = {"run_id": f"{study}-h100", "study": study, "source": "modelled",
                 "hardware": "H100-PCIe + cuda (modelled)"}
        ResultsWriter(study).update_runs([row, other])
    return execute


def test_notebooks_check_executes_every_study_notebook_under_its_folder_and_reads_where_they_trained(tmp_path):
    calls = []
    recorded = {"strategies": {"device": "cuda", "device_history": "cuda: ok"}, "ladder": {"device": "cuda"},
                "split": {"hardware": "this machine (cuda)"}}
    r = gn.check_notebooks(gc.Options(out=tmp_path), execute=_stand_in(recorded, calls))
    assert [c["notebook"] for c in calls] == list(STUDIES)
    for c in calls:  # the quick parameters, the executed notebook and the runs under the check's folder
        # study 1's without its budget: 13 MiB is less than a card's first matmul takes (a cuBLAS workspace);
        # study 2's auto-fit with one its tiny setups fit on a card (70 MiB predicted on an H200), and no
        # reference model (its predictions are CPU work: 44 s of a card's time)
        changed = {"01_strategies": {"budget_mib": 0.0},
                   "02_ladder": {"budget_mib": 256.0, "reference_model": ""}}.get(c["notebook"], {})
        assert c["params"] == {**STUDIES[c["notebook"]].quick, **changed}
        assert c["out"] == tmp_path / "notebooks" / f"{c['notebook']}.ipynb" and c["out"].exists()
        assert c["root"] == tmp_path / "runs" / "notebooks" / c["notebook"]
    # a second check into the same folder (the default, results/gpu_check) runs the same settings,
    # whose rows replace the first check's: it read the rows past the table's old length, none
    for again in (False, True):
        r = gn.check_notebooks(gc.Options(out=tmp_path), execute=_stand_in(recorded, calls)) if again else r
        assert r["status"] == "pass", r["failures"]
        rows = {row["study"]: row for row in r["rows"]}
        assert rows["strategies"]["used_gpu"] and rows["strategies"]["devices"] == ["cuda"]
        assert rows["split"]["devices"] == ["this machine (cuda)"]
        # study 2's auto-fit trained on the card (its rungs are measured on the CPU by design)
        assert rows["ladder"]["used_gpu"] and rows["ladder"]["devices"] == ["cuda"] and rows["ladder"]["passed"]
        assert "| 03_split | ok |" in r["report"]


def test_notebooks_check_keeps_to_the_time_budget(tmp_path, monkeypatch):
    """Papermill's limit is per cell: under --time-budget each cell's limit is what is left of the
    budget (nbclient's timeout_func), and a notebook that would begin past it is a 'not run' row (a
    failure) instead of a kill at the hard limit."""
    import time
    import types

    import papermill

    from workbench.front import notebooks

    calls = []
    opts = types.SimpleNamespace(out=tmp_path, out_of_time=lambda: len(calls) >= 2, deadline_at=1234.5)
    r = gn.check_notebooks(opts, execute=_stand_in({"strategies": {"device": "cuda"}, "ladder": {"device": "cuda"},
                                                    "split": {"hardware": "cuda"}}, calls))
    assert [(c["timeout_s"], c["deadline"]) for c in calls] == [(gn.NOTEBOOK_TIMEOUT_S, 1234.5)] * 2
    assert [row["status"] for row in r["rows"]] == ["ok", "ok", "not run"] and r["status"] == "fail"
    assert r["failures"] == ["03_split: the time budget (--time-budget) was spent before it began"]
    # run_notebook hands papermill (nbclient) a limit per cell: what is left, at most timeout_s, at least 1
    seen = {}
    monkeypatch.setattr(papermill, "execute_notebook", lambda *a, **kw: seen.update(kw))
    now = time.perf_counter()
    notebooks.run_notebook(notebooks.STUDIES["03_split"].path, {}, tmp_path / "x.ipynb", timeout_s=300,
                           deadline=now + 120)
    assert seen["execution_timeout"] == 300 and 100 <= seen["timeout_func"](None) <= 120
    assert notebooks.cell_limit(300, now + 900)(None) == 300 and notebooks.cell_limit(300, now - 5)(None) == 1
    seen.clear()
    notebooks.run_notebook(notebooks.STUDIES["03_split"].path, {}, tmp_path / "x.ipynb", timeout_s=300)
    assert "timeout_func" not in seen  # without a budget: papermill's own per-cell limit


@pytest.mark.parametrize("spent", [True, False])
def test_a_notebook_cut_off_by_the_time_budget_leaves_the_check_incomplete_not_failed(tmp_path, spent):
    """A cell's limit under --time-budget is what is left of it: one cut off there raised nbclient's
    CellTimeoutError, recorded as an error, and the whole check read "fail" where the runbook expects
    "incomplete" (run the rest with --only). A cell that times out before the budget is spent still fails."""
    import types

    from nbclient.exceptions import CellTimeoutError

    from workbench.front.gpu_report import summarize

    calls = []
    inner = _stand_in({"strategies": {"device": "cuda"}, "ladder": {"device": "cuda"}}, calls)

    cut = []

    def execute(path, params, out, timeout_s=None, deadline=None):
        if Path(path).stem == "03_split":
            cut.append(True)  # the budget ran out while its cell ran (spent), or the cell's own limit did not
            raise CellTimeoutError("A cell timed out while it was being executed, after 12 seconds.")
        return inner(path, params, out, timeout_s, deadline)

    opts = types.SimpleNamespace(out=tmp_path, out_of_time=lambda: spent and bool(cut), deadline_at=1.0)
    r = gn.check_notebooks(opts, execute=execute)
    split = r["rows"][-1]
    assert split["status"] == ("not finished" if spent else "error") and r["status"] == "fail"
    assert summarize({"notebooks": r}, {}, 1.0)["status"] == ("incomplete" if spent else "fail")
    assert split["why"] == (("the time budget (--time-budget) was spent while it ran (" if spent else "")
                            + "CellTimeoutError: A cell timed out while it was being executed, after 12 seconds."
                            + (")" if spent else ""))


def test_notebooks_check_fails_a_study_whose_new_runs_trained_on_the_cpu_and_a_notebook_that_raised(tmp_path):
    # an earlier run on the card is in the notebook's runs.csv already: only this execution's rows count
    (tmp_path / "runs" / "notebooks" / "03_split" / "split").mkdir(parents=True)
    (tmp_path / "runs" / "notebooks" / "03_split" / "split" / "runs.csv").write_text(
        "run_id,study,source,hardware\nsplit-older,split,measured,this machine (cuda)\n")
    calls = []
    # study 1's attempts on the card were all skipped (as its quick 13 MiB budget did on the H200, 2026-11-26):
    # an attempt named in the history is not a run trained there
    recorded = {"strategies": {"device": "cpu", "device_history": "cuda@13: skipped in preflight -> cpu: ok"},
                "split": {"hardware": "this machine (cpu)"}}
    r = gn.check_notebooks(gc.Options(out=tmp_path), execute=_stand_in(recorded, calls, fail="ladder"))
    assert len(calls) == 3  # the failing notebook did not stop the next one
    assert r["status"] == "fail"
    assert r["failures"] == ["01_strategies: its runs did not train on the GPU (they recorded: cpu)",
                             "02_ladder: RuntimeError: PapermillExecutionError: cell 4 raised",
                             "03_split: its runs did not train on the GPU (they recorded: this machine (cpu))"]


# ------------------------------------------------------------------------------------------------
# the monitor check (issue 11 item 7): its cost measured ABBA, its rows judged

def test_monitor_overhead_alternates_the_order_and_divides_the_totals():
    """On a clock of the test's own (the monitor's thread is real): a run takes 40 ms with the
    monitor's thread alive and 20 ms without, and every reading of the clock 1 us. No sleep, so no
    bound that a loaded machine could break."""
    import threading

    seen, now = [], [0.0]

    def clock():
        now[0] += 1e-6
        return now[0]

    def run():  # slower while the monitor's thread is alive: the ratio must show it
        on = any(t.name == "workbench-memory-monitor" for t in threading.enumerate())
        seen.append("on" if on else "off")
        now[0] += 0.04 if on else 0.02

    r = overhead(run, "cpu", rounds=3, interval_s=0.005, clock=clock)
    assert seen == ["off", "on"] + ["off", "on", "on", "off", "off", "on"]  # warm-up, then ABBA
    assert r["on_s"] == pytest.approx(3 * 0.04 + 3e-6) and r["off_s"] == pytest.approx(3 * 0.02 + 3e-6)
    assert r["ratio"] == pytest.approx(r["on_s"] / r["off_s"])
    assert r["round_ratios"] == pytest.approx([2.0] * 3, rel=1e-3)
    assert r["samples"] == len(r["rows"]) >= 3  # the monitor sampled in real time inside the runs
    assert r["start_stop_s"] == pytest.approx(1e-6)  # a monitor around nothing: no run inside it


def test_monitor_check_runs_here_and_judges_its_rows(tmp_path):
    r = gp.check_monitor(gc.Options(out=tmp_path, device="cpu"), rounds=1, steps=2, run_s=0)
    assert r["status"] == "pass", r["failures"]
    assert r["steps"] == 2  # run_s=0: the workload as asked
    assert "Opening, starting and stopping it around nothing took" in r["report"] and r["start_stop_s"] > 0
    assert r["peaks_mib"]["rss_mib"] > 50 and r["overhead_ratio"] > 0
    assert "Memory monitor on cpu" in r["report"] and "target <= 1.01" in r["report"]
    # on a card a row without NVML's figure is a failure, whatever the cost
    rows = [{"cuda_allocated_mib": 1.0, "cuda_reserved_mib": 2.0, "cuda_max_allocated_mib": 1.0}]
    fake = {"rows": rows, "ratio": 1.002, "off_s": 1.0, "on_s": 1.002, "round_ratios": [1.002],
            "median_round_ratio": 1.002, "samples": 1, "interval_s": 0.5, "rounds": 1, "start_stop_s": 0.002}
    v = gp.monitor_verdict(fake, "cuda:0")
    assert v["status"] == "fail" and v["failures"] == ["monitor rows without nvml_used_mib"] and v["target_met"]
    assert gp.monitor_verdict({**fake, "rows": [{**rows[0], "nvml_used_mib": 900.0}]}, "cuda:0")["status"] == "pass"
    # a ratio just past the target reads past it (1.0104 had read "1.010x ... target <= 1.01: not met")
    over = gp.monitor_verdict({**fake, "ratio": 1.0104}, "cuda:0")
    assert "took 1.0104x its time without it" in over["report"] and "target <= 1.01: not met" in over["report"]


def test_the_monitor_workload_is_lengthened_to_last_long_enough_to_time(monkeypatch):
    """A card runs the 15-step workload in 0.3 s, where the monitor's once-a-run start is what is
    timed: the check scales the steps from one timed run (after a warm-up) to last about run_s."""
    made, clock = [], {"t": 0.0}

    def workload(device, steps):
        made.append(steps)

        def run():
            clock["t"] += 0.02 * steps  # 20 ms a step
        return run, 1000

    monkeypatch.setattr(gp, "monitor_workload", workload)
    now = lambda: clock["t"]  # noqa: E731
    run, steps = gp.workload_lasting("cpu", 15, 3.0, clock=now)
    assert steps == 150 and made == [15, 150]  # 0.3 s a run -> ten times the steps
    assert gp.workload_lasting("cpu", 200, 3.0, clock=now)[1] == 200 and made[-1] == 200  # long enough already
    assert gp.workload_lasting("cpu", 15, 0)[1] == 15


def _predict_once(monkeypatch) -> None:
    """gpu_cap.predict made once for each (config, rung, keywords) and read again after: the cap check's
    test runs check_cap eight times over the same two rungs, and replaying each prediction anew took
    most of its 113 s (2026-12-01, one thread)."""
    real, made = gpu_cap.predict, {}

    def once(config, name, **kw):
        key = (config.to_json_string(), name, repr(sorted(kw.items())))
        if key not in made:
            made[key] = real(config, name, **kw)
        return made[key]

    monkeypatch.setattr(gpu_cap, "predict", once)


@pytest.mark.parametrize("released", [True, False])
def test_the_cap_check_runs_its_trials_under_a_fraction_and_always_lifts_it(monkeypatch, released):
    """check_cap's CUDA layer, played on the CPU: torch.cuda's calls and the rung's run are stand-ins
    (a run trains when the cap above what is held covers what the rung needs). `released`: whether this
    torch can give back the cuBLAS workspaces before each run."""
    import types

    from torch.cuda._utils import _get_device_index

    from tests.conftest import tiny_config

    MiB, total = 2**20, 1000 * 2**20 * 1024
    need = {"bf16_true_lora": 700 * MiB + 3, "zero_offload": 900 * MiB}
    fractions, runs, before = [], [], 0.9
    # The card's process after a run: a 100 MiB segment kept by the cuBLAS workspaces made inside it,
    # 60 MiB of it free and used by the next run, until the workspaces are released (as on the H200)
    state = {"held": 100 * MiB, "room": 60 * MiB}

    def release():
        state.update(held=10 * MiB, room=0)  # what is left after the workspaces: a small live block

    def measure(name, load, blocks, **kw):
        assert kw["counted"] is False and kw["steps"] == gpu_cap.TRIAL_STEPS
        held, room = state["held"], state["room"]
        cap = fractions[-1] * total - held if fractions and fractions[-1] != before else None
        runs.append((name, cap))
        state.update(held=100 * MiB, room=60 * MiB)  # every run makes the workspaces again
        if cap is not None and cap + room < need[name]:
            return {"status": "oom", "reason": "CUDA out of memory"}
        # held, the step allocates up to 10 MiB less than it needs above what is allocated: its lower bound (the
        # allocated peak above what is reserved) is 70 MiB below its need, not 10 (above what is allocated)
        peak = held + need[name] - 50 * MiB if released else held - room + need[name] - 10 * MiB
        return {"status": "ok", "cuda_max_allocated_bytes": peak, "cuda_max_reserved_bytes": held + need[name] + 300 * MiB}

    if released:
        monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", release, raising=False)
    else:
        monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces", raising=False)
    for attr, fn in dict(
            get_device_properties=lambda d: types.SimpleNamespace(name="NVIDIA H200", total_memory=total, major=9, minor=0),
            memory_reserved=lambda d: state["held"],  # (held: the segment's 60 MiB free are not allocated)
            memory_allocated=lambda d: state["held"] - (10 * MiB if released else state["room"]),
            empty_cache=lambda: None, synchronize=lambda d=None: None,
            # torch's own check: it raises ValueError for a device without an index ("cuda")
            set_per_process_memory_fraction=lambda f, d: fractions.append(f) if _get_device_index(d) == 0 else None,
            current_device=lambda: 0, get_per_process_memory_fraction=lambda d: before,
            mem_get_info=lambda d=None: (state.get("card_free", total - state["held"]), total)).items():
        monkeypatch.setattr(torch.cuda, attr, fn)
    monkeypatch.setattr(gpu_cap, "measure", measure)
    _predict_once(monkeypatch)
    blocks = torch.zeros((4, 32), dtype=torch.long)
    load = lambda: None  # noqa: E731
    load.timings = {"made_s": 9.1, "copies": 16, "copy_s": 19.2, "kept": True}  # a kept model's, as it says them
    monkeypatch.setattr(gpu_cap, "model_at_hand", lambda cfg, **kw: (tiny_config("qwen2"), load, blocks, ""))
    opts = types.SimpleNamespace(model="x", tiny=True, batch=1, seq=32, device="cuda", extra={},
                                 out_of_time=lambda: False)
    result = gpu_cap.check_cap(opts)
    assert result["loads"] == load.timings  # what making the model and its copies took, in the check's result
    rows = {r["rung"]: r for r in result["rows"]}
    assert set(rows) == set(gpu_cap.CAP_RUNGS) and all(r["status"] == "ok" for r in rows.values()), result
    for name, r in rows.items():
        least = r["measured_least_cap_mib"] * MiB
        if not released:  # each trial draws on the 60 MiB the held segment has free: the bisection reaches there
            assert least >= need[name] - 60 * MiB > least - gpu_cap.STEP and not r["workspaces_released"]
            assert r["held_reserved_mib"] == 100
            continue
        # what the step needs, found above what the process held once the workspaces were released:
        # not 60 MiB less, which a trial drawing on the held segment's free room would have found
        assert least >= need[name] > least - gpu_cap.STEP
        assert r["uncapped_reserved_mib"] == (need[name] + 300 * MiB) / MiB  # above what was held
        assert r["held_reserved_mib"] == 10 and r["workspaces_released"] and len(r["trials"]) >= 3
        # the prediction is compared whole: the workspaces it models were made inside each trial's cap
        p = gpu_cap.predict(tiny_config("qwen2"), name, batch=1, seq=32, n_blocks=4, device="cuda",
                            card=cm.card_at_hand(0), replay_steps=gpu_cap.TRIAL_STEPS)
        assert r["predicted_needed_mib"] == round(p.needed_reserved_bytes / MiB, 1)
    # a warm-up and an uncapped run per rung, then capped trials; every cap lifted after its trial
    assert [c for n, c in runs if n == "zero_offload"][:2] == [None, None]
    if not released:
        return
    # a notebook's own cap (torchtune's way of playing a smaller card) is what each trial gives back
    assert fractions and fractions[-1] == before and all(f == before for f in fractions[1::2])
    assert "### Reserved needed" in result["report"]
    # made ahead, side by side on Dask workers where there are cores (the card's 16), the predictions
    # are those made here, and none is made here
    from tests.conftest import play_cores
    from workbench.core import parallel

    real_predict, real_cores = gpu_cap.predict, parallel.cores
    monkeypatch.setattr(gpu_cap, "predict", lambda *a, **kw: pytest.fail("predicted in process"))
    play_cores(monkeypatch, 4)
    ahead = gpu_cap.check_cap(opts)
    assert (result["predicted"], ahead["predicted"]) == ("in this process", "ahead, on 2 Dask workers")
    assert ahead["rows"] == result["rows"]
    monkeypatch.setattr(gpu_cap, "predict", real_predict)
    monkeypatch.setattr(parallel, "cores", real_cores)  # (its workers' threads stay 1: no more workers start)
    # under --time-budget no trial begins past it: the rung in its bisection keeps the trials it had
    # and says why it ended; the next rung does not begin; the check fails (never a pass)
    runs.clear()
    opts.out_of_time = lambda: len(runs) >= 4  # two trials in, of the first rung
    predicted, real_predict = [], gpu_cap.predict
    monkeypatch.setattr(gpu_cap, "predict", lambda config, name, **kw: predicted.append(name) or real_predict(
        config, name, **kw))
    result = gpu_cap.check_cap(opts)
    assert predicted == [gpu_cap.CAP_RUNGS[0]]  # the rung past the budget is not even predicted
    first, second = result["rows"]
    assert first["status"] == second["status"] == "not measured" and result["status"] == "fail"
    assert len(first["trials"]) == 2 and first["reason"].endswith("was spent after 2 trials")
    assert second["trials"] == [] and "spent before it began" in second["reason"] and len(runs) == 4
    assert fractions[-1] == before
    # a rung that runs out of memory uncapped does not fit the card: a result, as the ladder's check
    # takes it, not a failure of the check (an 8 GB card at a longer --seq, 50 MiB free beside the process)
    opts.out_of_time = lambda: False
    state["card_free"] = 50 * MiB
    monkeypatch.setattr(gpu_cap, "measure", lambda name, *a, **kw: {"status": "oom", "reason": "CUDA out of memory"}
                        if name == "zero_offload" else measure(name, *a, **kw))
    result = gpu_cap.check_cap(opts)
    rows = {r["rung"]: r for r in result["rows"]}
    assert rows["zero_offload"]["status"] == "oom" and rows["zero_offload"]["passed"] is None
    assert rows["zero_offload"]["reason"] == "CUDA out of memory"  # measure()'s text, not "str: ..."
    # (the played need is not the tiny model's: bf16_true_lora's error fails, the out-of-memory does not)
    assert rows["bf16_true_lora"]["status"] == "ok" and result["failures"] and not any(
        f.startswith("zero_offload") for f in result["failures"]), result["failures"]
    # free before the run: the card's free memory and what the process holds cached, not allocated
    # (10 MiB reserved, none of it allocated, once the workspaces are released)
    assert rows["zero_offload"]["free_before_mib"] == 50 + 10
    # with room for its need free before it, the out-of-memory is a fault of the check (it had passed)
    state["card_free"] = 10 * 1024 * MiB
    result = gpu_cap.check_cap(opts)
    assert any(f.startswith("zero_offload: predicted to need ") and f.endswith(
        "MiB, with 10,250 MiB free before it ran, yet it ran out of memory uncapped") for f in result["failures"]), \
        result["failures"]

    monkeypatch.setattr(gpu_cap, "measure", measure)
    # an offload rung whose predicted host memory is past what this machine has free is not run (the
    # OOM killer would end gpu-check, as the ladder's check says): a row that says why
    runs.clear()
    free_check = gpu_cap.past_free_memory
    monkeypatch.setattr(gpu_cap, "past_free_memory", lambda mib, **kw: "5,000.0 MiB > the 4,000 MiB this machine has free"
                        if mib > 0 else None)
    rows = {r["rung"]: r for r in gpu_cap.check_cap(opts)["rows"]}
    assert rows["zero_offload"]["status"] == "skipped" and rows["zero_offload"]["reason"] == (
        "its predicted host memory 5,000.0 MiB > the 4,000 MiB this machine has free")
    assert {n for n, _ in runs} == {"bf16_true_lora"}  # zero_offload never started
    monkeypatch.setattr(gpu_cap, "past_free_memory", free_check)
    # a rung whose weights alone are predicted to be more than the card has no cap to find: a row that
    # says so, not a failure of the check (it was "not measured", and failed it)
    from workbench.core.memory.predict import WeightsExceedCard

    real_cap_predict = gpu_cap.predict

    def too_big(config, name, **kw):
        if name == "zero_offload":
            raise WeightsExceedCard("the card is smaller than the weights alone")
        return real_cap_predict(config, name, **kw)

    monkeypatch.setattr(gpu_cap, "predict", too_big)
    runs.clear()
    result = gpu_cap.check_cap(opts)
    rows = {r["rung"]: r for r in result["rows"]}
    assert rows["zero_offload"]["status"] == "too big" and "weights alone" in rows["zero_offload"]["reason"]
    assert {n for n, _ in runs} == {"bf16_true_lora"} and not any(f.startswith("zero_offload") for f in
                                                                   result["failures"]), result["failures"]
    monkeypatch.setattr(gpu_cap, "predict", real_cap_predict)
    # a torch that cannot release the workspaces: they are held through the trials, so the modelled
    # workspaces come off the prediction, and the row and the report say so
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces")
    opts.out_of_time, opts.extra = (lambda: False), {"cap_rungs": ("bf16_true_lora",)}
    result = gpu_cap.check_cap(opts)
    (row,) = result["rows"]
    ws = sum(n for _, n in cm.card_at_hand(0).cublas_workspaces)
    assert not row["workspaces_released"] and row["held_reserved_mib"] == 100
    p = real_predict(tiny_config("qwen2"), "bf16_true_lora", batch=1, seq=32, n_blocks=4, device="cuda",
                     card=cm.card_at_hand(0), replay_steps=gpu_cap.TRIAL_STEPS)
    assert row["predicted_needed_mib"] == round((p.needed_reserved_bytes - ws) / MiB, 1)
    assert "workspaces held throughout and left out for bf16_true_lora" in result["report"]


def test_between_checks_the_card_and_the_pinned_host_memory_cached_go_back(monkeypatch):
    """DeepSpeed pins its offload buffers through torch's host allocator, which keeps them cached
    (page-locked) once freed: the checks after the ZeRO rungs, and the notebooks' kernels, had that
    much less host memory. release_card gives them back with the card's cache."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("card"))
    assert callable(torch.accelerator.empty_host_cache)  # the call this torch has (not torch._C._host_emptyCache)
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: calls.append("host"))
    gc.release_card()
    assert calls == ["card", "host"]
