"""Auto-fit that keeps the training the same (issue 10 item 5): the joint search on a tiny config.

    .venv/bin/python -m pytest tests/test_autofit.py -q        # about a minute on 2 cores
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import pytest
import torch
from conftest import tiny_config

from workbench.cli import main
from workbench.core.common import mib_text
from workbench.core.config import ConfigError
from workbench.core.memory.plan import plan_from_flags
from workbench.studies.ladder import autofit
from workbench.studies.ladder import cli as estimate_cli
from workbench.studies.ladder.autofit import candidates, cost, prediction_margin, run_with_step_down, search
from workbench.studies.ladder.card_records import card_reserved_errors, reserved_shortfall

BATCH, SEQ = 8, 64


@pytest.fixture(scope="module")
def config():
    return tiny_config("qwen2")


def _setup(**kw):
    return plan_from_flags(**{"precision": "fp32", "optimizer": "adamw_torch", "trainable": "full", "batch": BATCH,
                              **kw})


def test_every_candidate_keeps_the_effective_batch_and_the_setup_is_among_them():
    setup = _setup()
    plans = candidates(setup, BATCH)
    assert all(BATCH % p.accum == 0 for p in plans)  # micro-batch x accumulation = the batch, always
    assert {BATCH // p.accum for p in plans} == {1, 2, 4, 8}
    assert any((p.precision, p.optimizer, p.grad_checkpointing, p.accum) == ("fp32", "adamw_torch", False, 1)
               for p in plans)
    assert all(p.trainable == "full" for p in plans)  # LoRA changes what trains: only when allowed
    assert {p.trainable for p in candidates(setup, BATCH, allow_lora=True)} == {"full", "lora"}
    # the prior: half precision is cheaper, checkpointing and accumulation cost
    base = cost(setup)
    assert cost(setup.__class__(**{**setup.__dict__, "precision": "bf16"})) < base
    assert cost(setup.__class__(**{**setup.__dict__, "grad_checkpointing": True})) > base
    # the offload placements are searched too, ZeRO-3 (weights on the host as well) as the last resort
    zero = {p.placement: cost(p) for p in plans if p.placement != "device" and p.accum == 1
            and (p.precision, p.grad_checkpointing) == (setup.precision, setup.grad_checkpointing)}
    assert set(zero) == {"zero_offload", "zero_offload_params"} and base < zero["zero_offload"] < zero["zero_offload_params"]
    assert all(p.optimizer == setup.optimizer for p in plans if p.placement != "device")  # DeepSpeed's own Adam
    # DeepSpeed trains a pure-half setup as its mixed twin (an fp32 master on the host): offered once, as that
    assert {p.precision for p in plans if p.placement != "device"} == {"fp32", "bf16"}
    assert len({p.name for p in plans}) == len(plans)
    true = candidates(_setup(precision="bf16-true"), BATCH)
    assert {p.precision for p in true if p.placement != "device"} == {"bf16"}
    assert len({p.name for p in true}) == len(true)
    assert {p.placement for p in candidates(_setup(trainable="qlora"), BATCH)} == {"device"}  # 4-bit: not offloaded


def test_before_ampere_bf16_is_ranked_after_fp16(monkeypatch):
    """A T4, a V100 or an RTX 20xx has no bf16 tensor cores (torch emulates bf16 there, and
    is_bf16_supported() says yes): the search ranked bf16 as fast as fp16 on every card."""
    setup = _setup()
    plans = {p.precision: p for p in candidates(setup, BATCH) if p.accum == 1 and not p.grad_checkpointing
             and p.placement == "device" and p.optimizer == setup.optimizer}
    plans["fp16"] = dataclasses.replace(plans["bf16"], precision="fp16")
    assert cost(plans["bf16"], 86) == cost(plans["fp16"], 86) < cost(plans["fp32"], 86)
    assert cost(plans["fp16"], 75) < cost(plans["bf16"], 75) == cost(plans["fp32"], 75)
    assert cost(plans["bf16_true"], 70) == cost(plans["fp32"], 70)
    seen = []  # the search ranks with the card's compute capability
    monkeypatch.setattr(autofit, "cost", lambda p, sm=80: seen.append(sm) or 1.0)
    monkeypatch.setattr(autofit, "predict", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("stop")))
    with pytest.raises(RuntimeError, match="stop"):
        search("embedded", setup, batch=BATCH, seq=64, budget_mib=1000, card="T4 16GB", margin=0.1)
    assert seen and set(seen) == {75}


def test_before_ampere_fp16_mixed_is_offered_and_chosen(config):
    """On a T4 (sm_75, the free notebook card) bf16 is emulated: the fast half precision there is
    fp16 autocast with a GradScaler, which the search did not offer, so it chose fp32 or emulated bf16."""
    def precisions(setup, **kw):
        return {p.precision for p in candidates(setup, BATCH, **kw)}

    assert "fp16" in precisions(_setup(), sm=75) and "fp16" in precisions(_setup(precision="bf16-mixed"), sm=75)
    assert "fp16" not in precisions(_setup(), sm=80) | precisions(_setup())  # bf16 runs natively from sm_80
    assert "fp16" not in precisions(_setup(precision="bf16-true"), sm=75)  # pure fp16 without loss scaling: no
    # QLoRA: peft's prepare_model_for_kbit_training upcasts every weight but the 4-bit ones to fp32, so a
    # "bf16-true" QLoRA trains in fp32 without autocast; ranked as pure bf16 it came first in every search
    assert "bf16_true" in precisions(_setup(trainable="lora"))
    assert "bf16_true" not in precisions(_setup(trainable="qlora"))
    t4 = search(config, _setup(), batch=BATCH, seq=SEQ, budget_mib=10_000, card="T4 16GB", keep=1)
    assert t4.plan.precision == "fp16" and t4.table[0]["setup"].startswith("fp16-mixed") and len(t4.table) == 1


def test_the_margin_is_the_predictions_measured_error(tmp_path):
    data = json.loads(autofit.MARGINS_FILE.read_text())
    m, why = prediction_margin(_setup(precision="bf16-true"))
    assert m == pytest.approx(data["by_precision_pct"]["bf16-true"] / 100) and "bf16-true" in why
    m, why = prediction_margin(_setup())  # fp32 was not validated: the worst row overall
    assert m == pytest.approx(data["overall_pct"] / 100) and "fp32 row" in why  # fewer than min_family_rows
    assert data["overall_pct"] == max(data["by_precision_pct"].values()) > 0
    with pytest.raises(ConfigError, match="predict_ladder.py --validate"):
        prediction_margin(_setup(), path=tmp_path / "missing.json")
    # on CUDA the budget caps the reserved peak: its shortfall on a card is added, per placement
    cuda, why = prediction_margin(_setup(precision="bf16-true"), device="cuda")
    assert cuda > data["by_precision_pct"]["bf16-true"] / 100 and "below the card's" in why
    zero = prediction_margin(dataclasses.replace(_setup(precision="bf16-true"), placement="zero_offload"),
                             device="cuda")[0]
    rows = card_reserved_errors()
    assert zero == pytest.approx(data["by_precision_pct"]["bf16-true"] / 100
                                 + reserved_shortfall("zero_offload", rows)[0] / 100)
    assert zero != cuda  # each placement its own shortfall


def test_the_fastest_setup_that_fits_with_the_margin_is_chosen(config):
    setup = _setup()
    roomy = search(config, setup, batch=BATCH, seq=SEQ, budget_mib=10_000, keep=1)
    ranked = sorted(candidates(setup, BATCH), key=cost)
    assert roomy.plan.name == ranked[0].name and len(roomy.table) == 1  # the cheapest prior fits: one prediction
    # what the choice changes of the setup searched from is said (fp32 had become pure bf16 without a word)
    assert "precision fp32 -> bf16-true" in roomy.changes and all(c in roomy.why for c in roomy.changes)
    assert roomy.why.endswith("(your setup as given was not predicted: one expected faster fits first)")
    again = search(config, roomy.plan, batch=BATCH, seq=SEQ, budget_mib=10_000, keep=1)  # from the choice itself
    assert again.changes == [] and again.why.endswith("; it is your setup as given")
    need = roomy.table[0]["need_mib"]
    # a budget the cheapest setup fits only without the margin: the search moves on, to a setup that
    # fits with it, and says why
    margin = prediction_margin(setup, device="cuda")[0]  # search's default device
    assert margin > 0
    budget = need * (1 + margin / 2)
    tight = search(config, setup, batch=BATCH, seq=SEQ, budget_mib=budget, keep=1)
    assert tight.plan is not None and tight.plan.name != ranked[0].name
    assert tight.table[0]["setup"] == ranked[0].name and not tight.table[0]["fits"]
    chosen = tight.table[-1]
    assert chosen["fits"] and chosen["with_margin_mib"] <= budget < tight.table[0]["with_margin_mib"]
    assert tight.micro_batch * tight.plan.accum == BATCH and "margin" in tight.why
    # the sentence states its sum with figures close enough to check it (a tiny model's peaks are a few MiB)
    stated = re.search(r"predicted ([\d.,]+) MiB \+ ([\d.]+)% margin \(.*\) = ([\d.,]+) MiB <= ([\d.,]+) MiB", tight.why)
    need_s, margin_s, with_s, budget_s = (float(x.replace(",", "")) for x in stated.groups())
    for shown, true in ((need_s, chosen["need_mib"]), (with_s, chosen["with_margin_mib"]), (budget_s, budget)):
        assert abs(shown - true) <= max(0.05, 0.005 * true), (shown, true, tight.why)
    assert search(config, setup, batch=BATCH, seq=SEQ, budget_mib=budget, keep=1, margin=0.0).plan.name \
        == ranked[0].name  # without the margin the cheapest would have been taken


def test_a_setup_that_fits_only_with_its_paged_state_paged_out_says_so(config, monkeypatch, capsys):
    """The need leaves a paged optimizer's state out (it pages to the host under pressure), so a row
    fitting only because of that read as any other fit, though every step then moves that state."""
    import types

    from workbench.core.memory import predict as predict_module
    from workbench.studies.ladder import cli

    monkeypatch.setattr(predict_module, "in_wsl", lambda: False)  # under WSL2 the state cannot page out
    # bitsandbytes pages a parameter's state from 100,000 elements: a (tied) embedding of 4,096 x 32
    config = tiny_config("qwen2")
    config.vocab_size = 4096
    paged_only = dict(runnable=lambda p: p.optimizer == "paged_adamw8bit", keep=1, margin=0.0)
    setup = _setup(optimizer="paged_adamw_8bit")
    roomy = search(config, setup, batch=BATCH, seq=SEQ, budget_mib=10_000, **paged_only)
    row = roomy.table[0]
    assert row["paged_mib"] > 0 and row["fits"] and not row["fits_only_paged_out"]
    assert "paged out" not in roomy.why
    between = row["need_mib"] + row["paged_mib"] / 2  # the need fits, the need with the state does not
    tight = search(config, setup, batch=BATCH, seq=SEQ, budget_mib=between, **paged_only)
    row = tight.table[0]
    assert row["fits"] and row["fits_only_paged_out"] and tight.plan.name == row["setup"]
    assert f"with its {mib_text(row['paged_mib'])} MiB of paged optimizer state paged out to the host" in tight.why
    args = types.SimpleNamespace(json=False, model="tiny", batch=BATCH, seq=SEQ, device="cuda")
    assert cli._print_search(args, tight, between, setup, "--budget-mib") == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith(row["setup"][:40])]
    assert line.endswith(f"yes  (only with its {mib_text(row['paged_mib'])} MiB of paged state paged out)"), line
    assert not search(config, setup, batch=BATCH, seq=SEQ, budget_mib=row["need_mib"] + row["paged_mib"] + 0.01,
                      **paged_only).table[0]["fits_only_paged_out"]


def test_a_setup_whose_weights_are_more_than_the_card_is_one_that_does_not_fit(config, monkeypatch):
    """The search stopped at the first setup whose weights alone were more than the card (a one-line
    error), where a later one could fit. Played: the cheapest setup's weights do not fit."""
    from workbench.core.memory.predict import WeightsExceedCard

    first = sorted(candidates(_setup(), BATCH), key=lambda p: cost(p))[0].name
    real = autofit.predict

    def predict(model, plan, **kw):
        if plan.name == first:
            raise WeightsExceedCard("smaller than the weights alone")
        return real(model, plan, **kw)

    monkeypatch.setattr(autofit, "predict", predict)
    choice = search(config, _setup(), batch=BATCH, seq=SEQ, budget_mib=10_000, keep=1)
    row = choice.table[0]
    assert row["setup"] == first and row["method"] == "weights > card" and not row["fits"] and row["need_mib"] is None
    assert choice.plan is not None and choice.plan.name != first


def test_a_setups_name_gives_the_optimizer_as_estimate_takes_it():
    """A chosen setup's name said `paged_adamw8bit`, which --optimizer refused (its name is paged_adamw_8bit)."""
    from workbench.core.memory.plan import CLI_OPTIMIZERS

    named = {p.name.split(", ")[1] for p in candidates(plan_from_flags(precision="fp32"), 4)}
    assert named == {"adamw_torch", "adamw_8bit", "paged_adamw_8bit"} and named <= set(CLI_OPTIMIZERS)


def test_the_step_down_order_goes_down_in_memory():
    """A setup needing as much as one that ran out of memory would run out too: the order was every
    fitting rung by speed, so auto-fit stepped from bf16_true (1,444 MiB) up to bf16 (2,802 MiB)."""
    from workbench.studies.ladder.rungs import FitChoice

    rows = [{"rung": n, "fits": fits, "rank": (1, i), "fit_bytes": mib * 2**20} for i, (n, fits, mib) in enumerate(
        [("fp32", False, 3000), ("bf16_true", True, 1444), ("bf16", True, 2802), ("bf16_ckpt", True, 1300),
         ("adamw8bit", True, 1300), ("lora", True, 900)])]
    assert FitChoice("bf16_true", 2000 * 2**20, rows).order() == ["bf16_true", "bf16_ckpt", "lora"]


def test_a_real_oom_steps_down_at_the_same_effective_batch(config, capsys, monkeypatch):
    choice = search(config, _setup(), batch=BATCH, seq=SEQ, budget_mib=10_000, keep=3, progress=True)
    assert len(choice.fitting) == 3
    need = {r["setup"]: r["need_mib"] for r in choice.table}
    needs = [need[p.name] for p in choice.fitting]
    assert needs[0] > needs[1] > needs[2]  # each step down needs less than the setup before it
    assert [r["setup"] for r in choice.table if r["kept"]] == [p.name for p in choice.fitting]
    # the progress bar ends where the search stops, and says why, not part way with time to go
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    left = len(candidates(_setup(), BATCH)) - len(choice.table)
    assert left > 0 and "100%" in last and "stopped: 3 setups fit, each needing less than the one before; the " \
        f"{left} left are slower" in last, last
    ran, released = [], []
    # what a failed setup left cached goes back to the card before the next (cuBLAS takes its handle outside it)
    monkeypatch.setattr(autofit, "release", lambda device: released.append((len(ran), str(device))))

    def attempt(plan):
        ran.append(plan)
        if len(ran) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (first setup)")
        if len(ran) == 2:  # CUDA's own, outside the caching allocator: the card is full all the same
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        return "trained"

    plan, result, tries = run_with_step_down(choice, attempt, log=lambda s: None)
    assert result == "trained" and plan is choice.fitting[2] and [t["status"] for t in tries] == ["oom", "oom", "ok"]
    assert released == [(1, "cuda"), (2, "cuda")]
    assert all(BATCH % p.accum == 0 for p in ran)
    with pytest.raises(RuntimeError, match="illegal memory access"):  # not the card's memory: no step down
        run_with_step_down(choice, lambda p: (_ for _ in ()).throw(RuntimeError("CUDA error: an illegal memory "
                                                                                "access was encountered")))
    with pytest.raises(torch.OutOfMemoryError, match="no setup fits"):
        run_with_step_down(choice, lambda p: (_ for _ in ()).throw(torch.OutOfMemoryError("x")), log=lambda s: None)


def test_a_search_for_the_card_here_reads_what_is_free_once(config, monkeypatch):
    """`search(card="here")` from Python judged each setup against what was free when that setup was
    predicted (the card read anew each time); one budget for all. Played: a T4, 13,460 MiB free."""
    import types

    import bitsandbytes  # noqa: F401  (imported as on a machine without CUDA, before CUDA is played)

    MiB, reads = 2**20, []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(
        name="Tesla T4", total_memory=15360 * MiB, major=7, minor=5))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: reads.append(1) or (13460 * MiB, 15360 * MiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    choice = search(config, _setup(precision="bf16-mixed"), batch=BATCH, seq=SEQ, budget_mib=10_000, card="here", keep=2)
    assert len(choice.table) >= 2 and len(reads) == 1
    assert choice.plan.precision == "fp16"  # the card's own sm: bf16 is emulated on a T4


def test_estimate_search_from_the_command_line(config, tmp_path, capsys, monkeypatch):
    # each search stops at the first setup that fits (on this model every setup needs about the same, so
    # looking for step-downs predicted them all, 70 s here); the step-down order is the next tests'
    monkeypatch.setattr(estimate_cli, "search", functools.partial(search, keep=1))
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    assert main(["estimate", "--model", str(path), "--batch", "8", "--seq", "64", "--search"]) == 2
    assert "--search needs --budget-mib or --card" in capsys.readouterr().err
    assert main(["estimate", "--model", str(path), "--batch", "8", "--seq", "64", "--search", "--auto-fit",
                 "--budget-mib", "100"]) == 2
    capsys.readouterr()
    assert main(["estimate", "--model", str(path), "--batch", "8", "--seq", "64", "--precision", "bf16-true",
                 "--search", "--budget-mib", "10000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chosen"].startswith("bf16-true") and out["margin"] == pytest.approx(
        prediction_margin(_setup(precision="bf16-true"), device="cuda")[0])  # estimate's default device
    assert all(r["margin"] >= out["margin"] for r in out["tried"])
    assert 8 % out["micro_batch"] == 0 and out["step_down"][0] == out["chosen"]
    # the table says where the budget comes from and what the search started from; a card smaller
    # than its CUDA context is a one-line error (it was "budget must be positive, got -479.52...")
    assert main(["estimate", "--model", str(path), "--batch", "8", "--seq", "64", "--precision", "bf16-true",
                 "--search", "--card", "RTX 4060 Ti 8GB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = lines[:2]
    # the table's prior column and need are said (prior: an assumed cost, not a measurement)
    assert [line for line in lines if line.startswith("prior: ")] == [
        "prior: step time relative to fp32 AdamW, the product of each mechanism's assumed cost (autofit.py COSTS, "
        "not measured); need: the predicted reserved peak it is compared with"]
    assert head[0].endswith("budget 7,467 MiB (RTX 4060 Ti 8GB's 8,188 MiB less its CUDA context, 721 MiB modelled)")
    assert head[1] == "searched from your setup: custom (bf16-true, adamw_torch, full)"
    # the H200 preset's total is nvidia-smi's, which holds the driver's reserve: the budget leaves it out and says so
    assert main(["estimate", "--model", str(path), "--batch", "8", "--seq", "64", "--precision", "bf16-true",
                 "--search", "--card", "H200"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(
        "budget 142,387 MiB (H200 141GB's 143,771 MiB less its CUDA context, 769 MiB modelled, and the driver's "
        "reserve, 615 MiB)")
    # the search is for the card named: before sm_80 (a T4) bf16 is emulated, and fp16 is the fast half precision
    assert main(["estimate", "--model", str(path), "--batch", "8", "--seq", "64", "--precision", "bf16-mixed",
                 "--search", "--card", "T4 16GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chosen"].startswith("fp16-mixed") and out["tried"][0]["setup"] == out["chosen"], out["tried"]
    assert main(["estimate", "--model", str(path), "--batch", "8", "--seq", "64", "--search", "--card", "0.2"]) == 2
    assert capsys.readouterr().err == ("workbench estimate: --card 0.2: its 205 MiB do not hold the CUDA context "
                                       "(721 MiB, modelled); give a larger card, or --budget-mib for a budget of "
                                       "your own\n")


def test_a_prediction_rules_out_the_setups_holding_the_same_weights_and_state_without_predicting_them(config):
    """A 7B model on a 12 GB card predicted every setup, 12-33 s each, to find the same weights too
    big each time. A setup whose weights alone exceed the card, or whose weights and optimizer state
    alone exceed the budget, as predicted for one differing only in micro-batch and checkpointing
    (the same tensors), is not predicted; each such row names the setup whose prediction showed it."""
    from workbench.core.memory.meta import build_meta_model
    from workbench.core.memory.predict import WeightsExceedCard, predict

    n = sum(p.numel() for p in build_meta_model(config).parameters())
    card = 3 * n / 2**30  # GiB: the fp32 weights (4 bytes a parameter) exceed it, bf16-true's (2) do not
    device_adamw = dict(runnable=lambda p: p.placement == "device" and p.optimizer == "adamw_torch"
                        and p.precision in ("fp32", "bf16_true"), keep=1)
    budget = 5 * n / 2**20  # MiB: over bf16-true's weights (2 bytes a parameter), under them with the state (6)
    choice = search(config, _setup(), batch=2, seq=SEQ, budget_mib=budget, card=card, **device_adamw)
    assert choice.plan is None and len(choice.table) == 8
    predicted = [r for r in choice.table if not r["not_predicted"]]
    assert len(predicted) == 2  # one of each precision: the rest ruled out by its prediction
    by_precision = {r["setup"].split(", ")[0]: r for r in predicted}
    assert by_precision["fp32"]["method"] == "weights > card" and by_precision["fp32"]["floor_mib"] is None
    bf16 = by_precision["bf16-true"]
    # the bound: the weights and the AdamW state in live bytes, 6 bytes a parameter in bf16-true (the state in
    # bf16, as torchtune trains), and AdamW's step counts and the rotary buffer: not the gradients (2 more)
    assert 6 * n <= bf16["floor_mib"] * 2**20 <= 6 * n + 4096 and bf16["floor_mib"] < bf16["need_mib"]
    for r in choice.table:
        if r["not_predicted"]:
            source = by_precision[r["setup"].split(", ")[0]]
            assert r["ruled_out_by"] == source["setup"] and r["need_mib"] is None and not r["fits"]
            assert r["floor_mib"] == source["floor_mib"] and r["predict_seconds"] == 0.0
            stated = ("its weights alone exceed the card" if source is by_precision["fp32"]
                      else "its weights and optimizer state alone exceed the budget with the margin")
            assert r["not_predicted"] == stated
    assert "2 setups predicted, 6 not predicted, ruled out by those" in choice.why
    # what was ruled out holds what its bound says when predicted: each fp32 setup's weights exceed the card,
    # each bf16-true setup holds at least the bound (the same weights and state)
    for plan in (p for p in candidates(_setup(), 2) if device_adamw["runnable"](p)):
        if plan.precision == "fp32":
            with pytest.raises(WeightsExceedCard):
                predict(config, plan, batch=2, seq=SEQ, device="cuda", card=card)
        else:
            p = predict(config, plan, batch=2, seq=SEQ, device="cuda", card=card)
            assert autofit.floor_bytes(p) == bf16["floor_mib"] * 2**20 <= p.fit_bytes


def test_once_a_setup_fits_one_that_cannot_need_less_is_not_predicted(monkeypatch):
    """After the first fit the search looks for step-downs (each needing less than the setup kept
    last) and predicted every setup left where none needed less. A setup whose weights and optimizer
    state alone, as predicted for one differing only in micro-batch and checkpointing, need as much as
    the setup kept last cannot be one: it is not predicted. The choice and the step-down order are
    those of predicting every setup. A model whose weights and state are most of its need (on the CPU,
    as study 2 searches): bf16-mixed holds 12 bytes a parameter before its gradients, bf16-true needs
    less than that in all."""
    import transformers as T

    cfg = T.Qwen2Config(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, tie_word_embeddings=True, vocab_size=4096)
    kw = dict(batch=2, seq=16, budget_mib=10_000, device="cpu", keep=4,
              runnable=lambda p: p.placement == "device" and p.optimizer == "adamw_torch"
              and p.precision in ("bf16", "bf16_true"))
    choice = search(cfg, _setup(), **kw)
    real = autofit.ruled_out
    monkeypatch.setattr(autofit, "ruled_out", lambda *a, **k: real(*a[:5]))  # without the step-down bound
    every = search(cfg, _setup(), **kw)
    assert choice.plan.name == every.plan.name and [p.name for p in choice.fitting] == [p.name for p in every.fitting]
    kept = next(r for r in choice.table if r["kept"])
    skipped = [r for r in choice.table if r["not_predicted"]]
    assert len(skipped) == 3 and not any(r["not_predicted"] for r in every.table)
    need = {r["setup"]: r["need_mib"] for r in every.table}
    for r in skipped:
        assert r["setup"].startswith("bf16-mixed") and r["floor_mib"] >= kept["need_mib"]
        assert r["fits"] is None  # not known: its bound is far below the budget
        assert r["not_predicted"] == (f"its weights and optimizer state alone need as much as {kept['setup']} (kept): "
                                      "not a step down") and r["ruled_out_by"].startswith("bf16-mixed")
        assert need[r["setup"]] >= r["floor_mib"]  # predicted, it needs at least its bound: not a step down
    assert all(r["need_mib"] == need[r["setup"]] for r in choice.table if not r["not_predicted"])
    # the setups after the chosen one are slower by the prior: not among those "expected faster" (all 3 were)
    assert choice.table[0]["kept"] and "0 setup(s) expected faster did not fit" in choice.why
    # the bound is the last kept setup's need, which falls as setups are kept: a floor at it rules out, below it not
    plan, key = choice.fitting[0], autofit._floor_key(choice.fitting[0])
    floors = {key: (100 * 2**20, "sibling")}
    assert real(plan, 0.1, 2**40, {}, floors, (100 * 2**20, "b"))[1:] == (
        "its weights and optimizer state alone need as much as b (kept): not a step down", "sibling")
    assert real(plan, 0.1, 2**40, {}, floors, (100 * 2**20 + 1, "a")) == (None, "", "")


def test_a_bound_that_rules_out_nothing_that_fits(config, capsys):
    """With a budget the least-needing setup just fits, the search finds it. On the CPU (as study 2
    searches), where a tiny model's need is not the allocator's segments, a bound counting more than
    the weights and optimizer state (a larger micro-batch's activations, the need itself) rules it out."""
    import types

    from workbench.core.memory.predict import predict
    from workbench.studies.ladder import cli

    fp32 = dict(runnable=lambda p: p.placement == "device" and p.optimizer == "adamw_torch" and p.precision == "fp32",
                keep=1, margin=0.0, device="cpu")
    plans = [p for p in candidates(_setup(), 2) if fp32["runnable"](p)]
    need = min(predict(config, p, batch=2, seq=SEQ, device="cpu").peak_bytes for p in plans) / 2**20
    choice = search(config, _setup(), batch=2, seq=SEQ, budget_mib=need, **fp32)
    assert choice.plan is not None and not any(r["not_predicted"] for r in choice.table)
    assert all(r["floor_mib"] < r["need_mib"] for r in choice.table)
    # under the bound: the first prediction rules out the other three, and the table says so
    first = choice.table[0]
    under = search(config, _setup(), batch=2, seq=SEQ, budget_mib=first["floor_mib"] * 0.99, **fp32)
    assert [bool(r["not_predicted"]) for r in under.table] == [False, True, True, True]
    args = types.SimpleNamespace(json=False, model="tiny", batch=2, seq=SEQ, device="cuda")
    assert cli._print_search(args, under, first["floor_mib"] * 0.99, _setup(), "--budget-mib") == 1
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith(under.table[-1]["setup"])]
    assert f">={int(first['floor_mib']):,}" in line and line.endswith(
        "no  (not predicted: its weights and optimizer state alone exceed the budget with the margin)"), line
    assert "--json names which" in out


def test_the_least_cap_is_replayed_only_when_read(config, monkeypatch):
    """needed_reserved_bytes (a binary search of allocator replays under caps, a quarter to a third of a
    prediction's time) is replayed when first read, once: the search, which never reads it, skips it."""
    from workbench.core.memory import allocator
    from workbench.core.memory.predict import predict

    calls, real = [], allocator.least_reserved
    monkeypatch.setattr(allocator, "least_reserved", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    choice = search(config, _setup(), batch=2, seq=SEQ, budget_mib=10_000, keep=1)
    p = predict(config, choice.plan, batch=2, seq=SEQ, device="cuda")
    assert choice.plan is not None and calls == []
    before = p.seconds
    assert p.allocated_peak_bytes <= p.needed_reserved_bytes <= p.reserved_peak_bytes and calls == [1]
    assert p.seconds > before  # the prediction's seconds count the replay once it is made (estimate prints them)
    assert p.row()["needed_reserved_bytes"] == p.needed_reserved_bytes and calls == [1]  # kept once replayed
    assert p.needed is None  # the timeline it replayed is let go (an `estimate --rung all` keeps every prediction)
    q = predict(config, choice.plan, batch=2, seq=SEQ, device="cuda")
    before = q.seconds
    assert q.row()["predict_seconds"] == q.seconds > before  # a row made first (the replay inside it) counts it


def test_the_choice_says_whether_the_setup_as_given_fits_where_it_was_predicted(config):
    """The why names what the choice changes of the setup as given and what the search found of
    that setup: fits too, does not fit (with its need), or not predicted (a faster one fitted first)."""
    given = _setup(precision="bf16-mixed")  # the search offers bf16-true (faster by the prior) before it

    def run(p):  # micro-batch 8, full AdamW on the device: bf16-true, bf16-mixed; each with checkpointing or not
        return (p.placement == "device" and p.optimizer == "adamw_torch" and p.trainable == "full" and p.accum == 1
                and p.precision in ("bf16", "bf16_true"))

    roomy = search(config, given, batch=BATCH, seq=SEQ, budget_mib=10_000, runnable=run, keep=4, margin=0.0)
    need = {r["setup"]: r["need_mib"] for r in roomy.table}
    assert roomy.plan.name == roomy.table[0]["setup"] and roomy.given_name == roomy.table[1]["setup"]
    assert roomy.why.endswith(f"it changes precision bf16-mixed -> bf16-true (your setup as given fits too, "
                              f"{mib_text(need[roomy.given_name])} MiB with its margin)")
    first = search(config, given, batch=BATCH, seq=SEQ, budget_mib=10_000, runnable=run, keep=1, margin=0.0)
    assert first.why.endswith("(your setup as given was not predicted: one expected faster fits first)")
    # a budget only checkpointing fits: the setup as given was predicted on the way, and did not fit
    ckpt = min(need, key=need.get)
    assert "checkpointing" in ckpt and need[ckpt] < min(v for k, v in need.items() if "checkpointing" not in k)
    tight = search(config, given, batch=BATCH, seq=SEQ, budget_mib=need[ckpt], runnable=run, keep=1, margin=0.0)
    assert tight.plan.name == ckpt and tight.why.endswith(
        "it changes precision bf16-mixed -> bf16-true, checkpointing off -> on (your setup as given does not fit, "
        f"{mib_text(need[tight.given_name])} MiB with its margin)"), tight.why
    assert tight.given_name in [r["setup"] for r in tight.table if r["fits"] is False]


def test_with_lora_allowed_a_setup_that_keeps_what_trains_comes_first(config):
    """LoRA's prior cost (0.7) is the lowest of all: ranked by cost alone, a search that may use it would
    choose it over a full fine-tune that fits, changing what trains. It is offered only after them."""
    choice = search(config, _setup(), batch=2, seq=16, budget_mib=10_000, device="cpu", keep=1, margin=0.0,
                    allow_lora=True)
    assert choice.plan.trainable == "full" and any(r["changes_what_trains"] for r in choice.table) is False
    assert autofit.cost(choice.plan.compose("x", "", trainable="lora")) < autofit.cost(choice.plan)
    # where only LoRA fits (of the setups let run: the one given and LoRA's), it is chosen after the full
    # fine-tune was predicted and did not fit, and the table says it changes what trains
    given = choice.given_name  # the setup searched from, at micro-batch 2
    alone = search(config, _setup(), batch=2, seq=16, budget_mib=10_000, device="cpu", keep=1, margin=0.0,
                   runnable=lambda p: p.name == given)
    need = alone.table[0]["need_mib"]
    lora = search(config, _setup(), batch=2, seq=16, budget_mib=need * 0.98, device="cpu", keep=1, margin=0.0,
                  allow_lora=True, runnable=lambda p: p.name == given or p.trainable == "lora")
    assert (lora.table[0]["setup"], lora.table[0]["fits"], lora.table[0]["changes_what_trains"]) == (given, False, False)
    assert lora.plan.trainable == "lora" and lora.table[-1]["fits"] and lora.table[-1]["changes_what_trains"]


def test_a_search_on_the_cpu_offers_no_offload(config):
    """On the CPU the host is the device: `--device cpu --search` had offered ZeRO-Offload, "3,194 MiB, fits",
    the card's part of a process that needs 12 GiB of that one memory. On a card it is offered."""
    for device, offloads in (("cpu", set()), ("cuda", {"zero_offload", "zero_offload_params"})):
        seen = []
        search(config, _setup(), batch=2, seq=16, budget_mib=10_000, device=device, keep=1, margin=0.0,
               runnable=lambda p: seen.append(p.placement) or True)
        assert set(seen) - {"device"} == offloads


def test_a_search_that_finds_nothing_yet_says_the_least_need_so_far(config, capsys):
    """A budget nothing fits predicts every setup (minutes on a real model) with no sign of how far
    off it is; the bar says, once a setup was predicted, the least need so far against the budget."""
    def run(p):  # three setups: full AdamW on the device at micro-batch 8, bf16-true, fp32, fp32 checkpointed
        return (p.placement == "device" and p.optimizer == "adamw_torch" and p.trainable == "full" and p.accum == 1
                and p.precision in ("fp32", "bf16_true") and (p.precision == "fp32" or not p.grad_checkpointing))

    choice = search(config, _setup(), batch=BATCH, seq=SEQ, budget_mib=5, runnable=run, margin=0.01, progress=True)
    assert choice.plan is None and len(choice.table) == 3
    first, second = choice.table[0]["with_margin_mib"], choice.table[1]["with_margin_mib"]
    assert first < second  # so the least so far, at the third, is not the latest
    err = capsys.readouterr().err
    for at in (1, 2):
        assert (f"{choice.table[at]['setup']}; nothing fits yet, the least need {mib_text(first)} MiB with its "
                "margin, over the budget's 5.0 MiB") in err, err[-1500:]


def test_the_search_table_prints_each_setup_whole(config, capsys):
    """The table cut each setup at 62 characters: 'bf16-mixed, adamw_fused, full, checkpointing, micro-batch
    1, Z' hid which ZeRO stage the row was. Each row now holds its whole name, and the columns line up."""
    import argparse

    setups = ["bf16-mixed, adamw_fused, full, checkpointing, micro-batch 1, ZeRO-Offload",
              "bf16-mixed, adamw_fused, full, checkpointing, micro-batch 1, ZeRO-3 offload"]
    table = [dict(setup=s, prior_cost=2.0, need_mib=5660.0 + i, with_margin_mib=5990.0 + i, margin=0.058, fits=False,
                  changes_what_trains=False, fits_only_paged_out=False, not_predicted="") for i, s in enumerate(setups)]
    choice = argparse.Namespace(table=table, plan=None, fitting=[], why="nothing fits")
    args = argparse.Namespace(json=False, model="m", batch=1, seq=512, device="cuda")
    assert estimate_cli._print_search(args, choice, 1327.0, _setup(), "a 2 GiB card") == 1
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("bf16-mixed")]
    assert [r[:len(s)] for r, s in zip(rows, setups)] == setups
    head = next(line for line in lines if line.startswith("setup tried"))
    assert {r.index("2.000") for r in rows} == {head.rindex("prior")}  # right-aligned under the heading
