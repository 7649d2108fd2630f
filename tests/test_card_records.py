"""The card records (data/measured/): their re-prediction with this checkout's code, and the
reserved-peak margin auto-fit keeps on CUDA because of them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.conftest import tiny_config
from workbench.core.config import ConfigError
from workbench.core.memory import cuda_model as cm
from workbench.core.memory.plan import plan_from_flags
from workbench.core.memory.predict import predict
from workbench.studies.ladder import autofit, card_records
from workbench.studies.ladder.card_records import (CARD_RECORDS, REPREDICTED, card_reserved_errors,
                                                   repredict_card_record, reserved_shortfall)
from workbench.studies.ladder.validation import CONFIGS


def _card_record(root, name, rows, gpu="Test card"):
    (root / name).mkdir(parents=True)
    (root / name / "summary.json").write_text(json.dumps(
        {"environment": {"gpu": gpu}, "results": {"ladder": {"rows": rows}}}))


def test_on_cuda_the_margin_adds_the_reserved_shortfall_measured_on_a_card_per_placement(tmp_path):
    def row(rung, err, method="predicted"):
        return {"rung": rung, "method": method, "error_vs_reserved_pct": err}

    _card_record(tmp_path, "card-a", [row("fp32", -2.0), row("bf16_true", 1.5), row("zero_offload", -12.0),
                                      row("device_map", 8.0), row("zero_offload_params", -70.0, "estimated"),
                                      row("qlora", None)])
    _card_record(tmp_path, "card-b", [row("bf16_true_lora", -3.5)], gpu="Other card")
    rows = card_reserved_errors(tmp_path)
    # estimated rows and rows without a reserved prediction are no evidence about the allocator model
    assert sorted(r["rung"] for r in rows) == ["bf16_true", "bf16_true_lora", "device_map", "fp32", "zero_offload"]
    pct, why = reserved_shortfall("device", rows)
    assert pct == 3.5 and "bf16_true_lora on the Other card" in why  # the worst under-prediction, across cards
    assert reserved_shortfall("zero_offload", rows)[0] == 12.0  # each placement its own
    assert reserved_shortfall("device_map", rows)[0] == 0.0  # only over-predicted: no margin needed
    pct, why = reserved_shortfall("cpu", rows)  # never measured: the worst of any placement
    assert pct == 12.0 and "no cpu rung measured" in why
    assert reserved_shortfall("device", [])[0] == 0.0
    _card_record(tmp_path, "card-c", [row("no_such_rung", -1.0)])
    with pytest.raises(ValueError, match="no_such_rung"):
        card_reserved_errors(tmp_path)

    # auto-fit's margin: the bytes' error (published rows) plus, on CUDA only, the reserved shortfall
    (tmp_path / "card-c" / "summary.json").unlink()
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"by_precision_pct": {"bf16-true": 0.4}, "rows_by_precision": {"bf16-true": 5},
                                "overall_pct": 0.4, "min_family_rows": 3}))
    true = plan_from_flags(precision="bf16-true", optimizer="adamw_torch", trainable="full")
    assert autofit.prediction_margin(true, path=path, records=tmp_path)[0] == pytest.approx(0.004)
    m, why = autofit.prediction_margin(true, path=path, device="cuda", records=tmp_path)
    assert m == pytest.approx(0.004 + 0.035) and "3.5% below" in why
    zero = dataclasses.replace(true, placement="zero_offload")
    assert autofit.prediction_margin(zero, path=path, device="cuda", records=tmp_path)[0] == pytest.approx(0.124)


def test_a_re_predicted_record_gives_the_current_predictions_error(tmp_path):
    _card_record(tmp_path, "card-a", [{"rung": "zero_offload", "method": "predicted", "error_vs_reserved_pct": -16.3},
                                      {"rung": "lora", "method": "predicted", "error_vs_reserved_pct": 0.7}])
    assert reserved_shortfall("zero_offload", card_reserved_errors(tmp_path))[0] == 16.3
    (tmp_path / "card-a" / REPREDICTED).write_text(json.dumps({"git_commit": "abc1234", "rows": [
        {"rung": "zero_offload", "method": "predicted", "error_vs_reserved_pct": -3.9},
        {"rung": "lora", "method": "predicted", "error_vs_reserved_pct": 0.7}]}))
    # re-predicted is post hoc (the model was revised against the record): the latest record's error as
    # predicted on the day, before the card ran it, stays a row, and the margin takes the worse
    pct, why = reserved_shortfall("zero_offload", card_reserved_errors(tmp_path))
    assert pct == 16.3 and "card-a, predicted before the card ran it" in why
    # a later record tested the revised model: the older record's day errors measured an older one
    _card_record(tmp_path, "card-b", [{"rung": "zero_offload", "method": "predicted", "error_vs_reserved_pct": -2.0},
                                      {"rung": "zero_offload_params", "method": "predicted",
                                       "error_vs_reserved_pct": 0.2}])
    rows = card_reserved_errors(tmp_path)
    pct, why = reserved_shortfall("zero_offload", rows)
    assert pct == 3.9 and "card-a, re-predicted at abc1234 (post hoc)" in why
    # ZeRO-3 partitioned on the card (the records' path) is not the host path the workbench runs now:
    # that placement was never measured, so it takes the worst of any
    assert {r["placement"] for r in rows if r["rung"] == "zero_offload_params"} == {
        "zero_offload_params (partitioned on the card)"}
    pct, why = reserved_shortfall("zero_offload_params", rows)
    assert pct == 3.9 and "no zero_offload_params rung measured" in why


def test_each_cards_latest_record_by_its_date_keeps_its_errors_of_the_day(tmp_path):
    """By its folder's date, not its name's place in the alphabet, and one per card."""
    def row(err):
        return [{"rung": "fp32", "method": "predicted", "error_vs_reserved_pct": err}]

    _card_record(tmp_path, "z-name-2026-01-01", row(-9.0))  # older, though last by name
    _card_record(tmp_path, "a-name-2026-02-01", row(-2.0))
    _card_record(tmp_path, "other-2026-01-15", row(-4.0), gpu="Other card")
    for name in ("z-name-2026-01-01", "a-name-2026-02-01", "other-2026-01-15"):
        (tmp_path / name / REPREDICTED).write_text(json.dumps({"git_commit": "c", "rows": row(-0.1)}))
    rows = card_reserved_errors(tmp_path)
    day = sorted((r["record"], r["error_pct"]) for r in rows if "before the card" in r["record"])
    assert day == [("a-name-2026-02-01, predicted before the card ran it", -2.0),
                   ("other-2026-01-15, predicted before the card ran it", -4.0)]


def test_re_predicting_a_card_record_predicts_each_measured_rung_as_it_ran(tmp_path, monkeypatch):
    config = tmp_path / "config.json"
    config.write_text(tiny_config("qwen2").to_json_string())
    measured = {"status": "ok", "cuda_max_allocated_mib": 10.0, "cuda_max_reserved_mib": 20.0}
    rows = [{"rung": "bf16", "accounted_peak_mib": 9.0, **measured},  # measured under the live-bytes count
            {"rung": "lora", "accounted_peak_mib": None, **measured},  # plain
            {"rung": "zero_offload", "accounted_peak_mib": 9.0, **measured},  # offloaded: always plain
            {"rung": "fp32", **measured, "status": "oom"}]  # nothing measured: not predicted
    (tmp_path / "rec").mkdir()
    (tmp_path / "rec" / "summary.json").write_text(json.dumps(
        {"environment": {"gpu": "NVIDIA H200", "gpu_total_mib": 143156.0},
         "results": {"ladder": {"sm": 90, "rows": rows, "options": {"model": str(config), "batch": 1, "seq": 32, "steps": 4}}}}))
    asked, made = [], {}

    def recorded(*a, **k):  # each rung predicted once: the second re-prediction below checks only what is asked
        asked.append((a[1], k["instrumented"], k["replay_steps"], k["load"]))
        return made[a[1]] if a[1] in made else made.setdefault(a[1], predict(*a, **k))

    monkeypatch.setattr(card_records, "predict", recorded)
    out = json.loads(repredict_card_record(tmp_path / "rec", log=lambda *_: None).read_text())
    # a rung on the card measured under the count is predicted as the instrumented step; the rest plain;
    # the allocator replays as many steps as the card ran; a record whose rows say nothing of the load
    # ran before measure() converted the weights on the host: in fp32, converted on the card
    assert asked == [("bf16", True, 4, "card"), ("lora", False, 4, "card"), ("zero_offload", False, 4, "card")]
    card = cm.card_of("NVIDIA H200", int(143156.0 * 2**20), 90)
    assert out["card"] == "NVIDIA H200" and [r["rung"] for r in out["rows"]] == ["bf16", "lora", "zero_offload"]
    for r in out["rows"]:
        p = predict(str(config), r["rung"], batch=1, seq=32, device="cuda", card=card, instrumented=r["rung"] == "bf16",
                    replay_steps=4)
        assert r["counted"] == (r["rung"] == "bf16")
        assert r["predicted_reserved_mib"] == round(p.reserved_peak_bytes / 2**20, 1)
        assert r["error_vs_reserved_pct"] == round(100 * (p.reserved_peak_bytes / 2**20 / 20.0 - 1), 2)
        assert r["error_vs_allocated_pct"] == round(100 * (p.allocated_peak_bytes / 2**20 / 10.0 - 1), 2)
    # measure()'s rows now say how it loaded the weights; an offloaded rung's does not, and is predicted
    # (with any first rung replayed before it) as the record's runs loaded them
    rows[1]["load"] = "host"
    summary = json.loads((tmp_path / "rec" / "summary.json").read_text())
    summary["results"]["ladder"]["rows"] = rows
    (tmp_path / "rec" / "summary.json").write_text(json.dumps(summary))
    asked.clear()
    repredict_card_record(tmp_path / "rec", log=lambda *_: None)
    assert [a[3] for a in asked] == ["host"] * 3
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "summary.json").write_text(json.dumps({"environment": {}, "results": {}}))
    with pytest.raises(ConfigError, match="names no card"):
        repredict_card_record(tmp_path / "bad")


def test_a_rung_run_at_a_batch_of_its_own_is_re_predicted_at_that_batch_and_its_error_kept(tmp_path, monkeypatch):
    """gpu-check runs the accumulation rung at 4 micro-batches of 1 while its options say batch 1: the
    re-prediction predicts it at 4 and says so, and the margin keeps that row (at batch 1 it would be
    bf16_ckpt's step, which the margin leaves out)."""
    config = tmp_path / "config.json"
    config.write_text(tiny_config("qwen2").to_json_string())
    measured = {"status": "ok", "cuda_max_allocated_mib": 10.0, "cuda_max_reserved_mib": 20.0}
    root = tmp_path / "records"
    (root / "card-2026-12-01").mkdir(parents=True)
    (root / "card-2026-12-01" / "summary.json").write_text(json.dumps(
        {"environment": {"gpu": "NVIDIA H200", "gpu_total_mib": 143156.0},
         "results": {"ladder": {"sm": 90, "options": {"model": str(config), "batch": 1, "seq": 32, "steps": 3,
                                                      "workspaces": "released before each rung"},
                                "rows": [{"rung": "bf16_ckpt_accum", "batch": 4, **measured}]}}}))
    batches = []
    monkeypatch.setattr(card_records, "predict", lambda *a, **k: batches.append(k["batch"]) or predict(*a, **k))
    out = json.loads(repredict_card_record(root / "card-2026-12-01", log=lambda *_: None).read_text())
    assert batches == [4] and out["rows"][0]["batch"] == 4
    kept = [r for r in card_reserved_errors(root) if "re-predicted" in r["record"]]
    assert [r["rung"] for r in kept] == ["bf16_ckpt_accum"]
    assert kept[0]["error_pct"] == out["rows"][0]["error_vs_reserved_pct"]


def test_which_rungs_of_a_record_ran_with_the_workspaces_held_and_how_a_small_shortfall_is_said():
    """The first rung of a process makes the cuBLAS workspaces inside its step, the later ones find them made
    (unless gpu-check released them before each rung); and a shortfall under 0.1% keeps its two decimals
    (device_map's 0.04% read "0.0% below")."""
    assert [card_records.workspaces_of({}, k) for k in (0, 1, 13)] == ["fresh", "held", "held"]
    assert card_records.workspaces_of({"workspaces": "released before each rung"}, 1) == "fresh"
    row = {"placement": "device_map", "error_pct": -0.04, "rung": "device_map", "card": "H200", "record": "r"}
    pct, why = reserved_shortfall("device_map", [row])
    assert pct == 0.04 and why.startswith("reserved peak 0.04% below the card's at worst (1 device_map rung(s);")
    assert reserved_shortfall("device_map", [{**row, "error_pct": 1.25}])[1].startswith("reserved peak never below")


def test_the_committed_card_records_give_every_simulated_placement_its_reserved_margin():
    """The H200 records re-predicted with this checkout's code (post hoc), and the latest one's errors
    as predicted before the card ran it: together they set the margin auto-fit keeps on CUDA. The
    latest (2026-11-30) is within the issue's 5% on every rung as predicted before the card ran it
    (zero_offload -3.2% the worst, ZeRO-3 partitioned from the host 0.0%, its first card); the worst
    miss left is post hoc, the 2026-11-22 record's bf16_true_lora (-3.9%, measured under the
    live-bytes count), and that is the on-card margin."""
    rows = card_reserved_errors()
    assert {r["placement"] for r in rows} >= {"device", "zero_offload", "device_map", "zero_offload_params"}
    post_hoc = [r for r in rows if "re-predicted" in r["record"]]
    day = [r for r in rows if r["record"] == "h200-2026-11-30, predicted before the card ran it"]
    # 13: bf16_ckpt_accum, run at --batch 1 (one micro-batch: bf16_ckpt's step), is not evidence of its own
    assert len(post_hoc) + len(day) == len(rows) and len(day) == 13 and "bf16_ckpt_accum" not in {r["rung"] for r in rows}
    for placement in ("device", "zero_offload", "device_map", "zero_offload_params"):
        assert reserved_shortfall(placement, post_hoc)[0] < 5 and reserved_shortfall(placement, day)[0] < 5
    assert reserved_shortfall("device", day)[0] < 0.1  # no device rung under by 0.1%, before the card ran them
    pct, why = reserved_shortfall("zero_offload", day)
    assert pct == pytest.approx(3.23, abs=0.01) and "predicted before the card ran it" in why
    assert reserved_shortfall("zero_offload_params", day) == (0.0, "reserved peak never below the card's "
                                                              "(1 zero_offload_params rung(s))")
    pct, why = reserved_shortfall("device", rows)
    assert pct == pytest.approx(3.86, abs=0.01) and "bf16_true_lora" in why and "h200-2026-11-22, re-predicted" in why


@pytest.mark.slow
def test_the_committed_re_prediction_is_what_this_checkout_predicts():
    """repredicted.json is rewritten by `predict_ladder.py --cards`; a change to the prediction that
    moves a figure without rewriting it fails here (checked on the rung whose replay is the longest)."""
    record = CARD_RECORDS / "h200-2026-11-22"
    again = {r["rung"]: r for r in json.loads((record / REPREDICTED).read_text())["rows"]}
    env = json.loads((record / "summary.json").read_text())["environment"]
    card = cm.card_of(env["gpu"], int(env["gpu_total_mib"] * 2**20), 90)
    p = predict(str(CONFIGS / "qwen2-0.5b.json"), "zero_offload", batch=1, seq=512, device="cuda", card=card,
                replay_steps=3, workspaces="held", load="card", after="fp32")  # it ran after fp32 in one process
    assert card_records.workspaces_of(json.loads((record / "summary.json").read_text())["results"]["ladder"]
                                      .get("options", {}), 13) == "held"
    assert card_records.workspaces_of({}, 0) == "fresh"  # the first rung of a process makes them
    assert card_records.workspaces_of({"workspaces": "released before each rung"}, 13) == "fresh"
    assert again["zero_offload"]["predicted_reserved_mib"] == round(p.reserved_peak_bytes / 2**20, 1)
    assert again["zero_offload"]["predicted_allocated_mib"] == round(p.allocated_peak_bytes / 2**20, 1)
    # a pure-half rung: cast on the card as measure() loaded it then, after the record's first rung (fp32)
    p = predict(str(CONFIGS / "qwen2-0.5b.json"), "bf16_true_lora", batch=1, seq=512, device="cuda", card=card,
                replay_steps=3, workspaces="held", instrumented=True, load="card", after="fp32")
    assert again["bf16_true_lora"]["after"] == "fp32" and again["bf16_true_lora"]["counted"]
    assert again["bf16_true_lora"]["predicted_reserved_mib"] == round(p.reserved_peak_bytes / 2**20, 1)
    # QLoRA: its linear weights quantized on the card after an fp32 load (card_load.loaded_on_card)
    p = predict(str(CONFIGS / "qwen2-0.5b.json"), "qlora", batch=1, seq=512, device="cuda", card=card,
                replay_steps=3, workspaces="held", instrumented=again["qlora"]["counted"], load="card",
                after="fp32", after_instrumented=again["fp32"]["counted"])
    assert again["qlora"]["predicted_reserved_mib"] == round(p.reserved_peak_bytes / 2**20, 1) == 2290.0
