"""`workbench estimate`: a config file is enough; bad input is one clear line, not a traceback.

    .venv/bin/python -m pytest tests/test_estimate_cli.py -q        # about 20 s
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench.cli import main
from workbench.core.memory.accounting import CATEGORIES
from workbench.core.memory.plan import OFFLOADS, RUNGS
from workbench.studies.ladder import cli as estimate_cli
from workbench.studies.ladder.autofit import prediction_margin

ROOT = Path(__file__).resolve().parent.parent
TINY = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": True, "max_position_embeddings": 256}


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def test_json_output_has_the_peak_in_bytes(tiny_config, capsys):
    assert main(["estimate", "--model", tiny_config, "--batch", "2", "--seq", "32", "--rung", "bf16_ckpt", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (p,) = out["predictions"]
    assert p["rung"] == "bf16_ckpt" and p["method"] == "predicted"
    assert isinstance(p["peak_bytes"], int) and p["peak_bytes"] == sum(p["breakdown_bytes"].values())
    assert set(p["breakdown_bytes"]) == {"weights", "gradients", "optimizer_state", "activations", "temporaries"}
    # weights: the tiny model's fp32 parameters (tied embedding once) + the rotary buffer
    n = 512 * 64 + 2 * (64 * 64 + 64 + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    assert n * 4 <= p["breakdown_bytes"]["weights"] <= n * 4 + 1024


def test_json_is_all_that_reaches_stdout(tiny_config):
    """The real entry point in a fresh process, on the ZeRO-3 rung: `--json | jq` must read JSON. DeepSpeed's
    first `get_accelerator` printed "Setting accelerator to CPU ..." through a handler bound to stdout at
    import; it is dropped now (workbench/__init__.py), and whatever else is printed meanwhile goes to stderr
    (the next test)."""
    cmd = [sys.executable, "-m", "workbench", "estimate", "--model", tiny_config, "--batch", "2", "--seq", "32",
           "--rung", "zero_offload_params", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)  # the whole of stdout
    assert [p["rung"] for p in out["predictions"]] == ["zero_offload_params"]
    assert "Setting accelerator to CPU" not in run.stdout + run.stderr


def test_json_stdout_whatever_writes_there_meanwhile(tiny_config, capfd, monkeypatch):
    """Python's print, a log handler bound to the stdout object, and a write to descriptor 1, made
    while the prediction runs, all land on stderr; stdout is the JSON alone."""
    import logging

    # bound now to a stream on descriptor 1, as a library's handler binds the process's sys.stdout at
    # import (pytest's own sys.stdout here writes to its capture file, not descriptor 1)
    fd1 = open(1, "w", closefd=False)
    handler = logging.StreamHandler(fd1)
    log = logging.getLogger("test-json-stdout")
    log.addHandler(handler)
    real_predict = estimate_cli.predict

    def noisy_predict(*args, **kw):
        print("print-noise")
        log.warning("handler-noise")
        os.write(1, b"fd-noise\n")
        return real_predict(*args, **kw)

    monkeypatch.setattr(estimate_cli, "predict", noisy_predict)
    try:
        assert main(["estimate", "--model", tiny_config, "--batch", "2", "--seq", "32", "--rung", "fp32",
                     "--device", "cpu", "--json"]) == 0
    finally:
        log.removeHandler(handler)
        fd1.close()
    out, err = capfd.readouterr()
    assert json.loads(out)["predictions"][0]["rung"] == "fp32"
    for noise in ("print-noise", "handler-noise", "fd-noise"):
        assert noise in err and noise not in out


def test_table_and_auto_fit(tiny_config, capsys):
    code = main(["estimate", "--model", tiny_config, "--batch", "2", "--seq", "32", "--auto-fit", "--budget-mib", "1.2",
                 "--device", "cpu"])  # the CPU budget counts live bytes
    out = capsys.readouterr().out
    assert code == 0
    # on the CPU the host is the device: the rungs that offload to it are left out ("fits" had read the card's
    # part of the process alone)
    rows = {line.split()[0] for line in out.splitlines()[2:] if line.split() and line.split()[0] in RUNGS}
    assert rows == {n for n, r in RUNGS.items() if r.placement not in OFFLOADS} and len(rows) == len(RUNGS) - 3
    line = [l for l in out.splitlines() if l.startswith("auto-fit:")][0]
    chosen = line.split()[1]
    assert chosen in RUNGS and chosen != "fp32"  # fp32 needs ~1.9 MiB here
    fp32 = [l for l in out.splitlines() if l.startswith("fp32 ")][0]
    assert fp32.rstrip().endswith(")") and " no (" in fp32  # with the margin it was judged with


def test_auto_fit_from_python_judges_a_card_by_a_cards_prediction(tiny_config):
    """auto_fit() targets CUDA by default, but without `predictions` it predicted a CPU step (live
    bytes: no caching allocator, no cuBLAS workspace) and judged the card's budget with that: at 20
    MiB it chose bf16_true, which the CLI (CUDA predictions) says does not fit."""
    from workbench.core.memory.predict import predict
    from workbench.studies.ladder.rungs import auto_fit

    choice = auto_fit(tiny_config, batch=2, seq=32, budget_mib=20, rungs=("fp32", "bf16_true"))
    for r in choice.table:
        card = predict(tiny_config, r["rung"], batch=2, seq=32, device="cuda")
        cpu = predict(tiny_config, r["rung"], batch=2, seq=32, device="cpu")
        assert r["fit_bytes"] == card.fit_bytes > cpu.peak_bytes, r["rung"]
    assert choice.rung is None  # the CLI's verdict too: neither fits 20 MiB of a card


def test_auto_fit_to_a_card_fits_what_the_card_leaves_after_its_context(tiny_config, capsys):
    assert main(["estimate", "--model", tiny_config, "--batch", "2", "--seq", "32", "--auto-fit", "--card", "0.8"]) == 0
    out = capsys.readouterr().out.splitlines()
    (head,) = [line for line in out if line.startswith("model ")]
    # a 0.8 GiB card less the modelled 721 MiB context, and the header says so (it read the card's whole size)
    assert head.endswith(f"budget {0.8 * 1024 - 721:.1f} MiB (0.8 GiB card's 819 MiB less its CUDA context, "
                         "721 MiB modelled)"), head
    (fp32,) = [line for line in out if line.startswith("fp32 ")]
    assert " yes (" in fp32  # about 20 MiB reserved on a card that leaves 98
    (choice,) = [line.split() for line in out if line.startswith("auto-fit: ")]
    assert choice[1] in RUNGS and choice[1] != "cpu"  # a rung on the card, not the fall-back of nothing fitting


def test_auto_fit_goes_on_past_rungs_whose_weights_alone_are_more_than_the_card(tiny_config, capsys, monkeypatch):
    """A card smaller than fp32's weights stopped `--auto-fit` at its first rung, with advice it could
    not take, where qlora, the offload rungs or the CPU could still fit. Played: fp32's and bf16's
    weights do not fit the card; the other rungs are predicted as they are."""
    from workbench.core.memory.predict import WeightsExceedCard

    real = estimate_cli.predict

    def predict(config, name, **kw):
        if name in ("fp32", "bf16"):
            raise WeightsExceedCard(f"{kw['card'].name} (819.2 MiB) is smaller than the weights alone (900.0 MiB); "
                                    "use x")
        return real(config, name, **kw)

    monkeypatch.setattr(estimate_cli, "predict", predict)
    args = ["estimate", "--model", tiny_config, "--batch", "2", "--seq", "32", "--auto-fit", "--card", "0.8"]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert not [line for line in out if line.startswith(("fp32 ", "bf16 "))]
    assert "  fp32: does not fit (0.8 GiB card (819.2 MiB) is smaller than the weights alone (900.0 MiB))" in out
    (choice,) = [line.split() for line in out if line.startswith("auto-fit: ")]
    assert choice[1] in RUNGS and choice[1] not in ("fp32", "bf16")
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["weights_exceed_card"]) == {"fp32", "bf16"} and out["auto_fit"] not in ("fp32", "bf16")


def test_auto_fit_to_a_card_before_sm_80_ranks_its_emulated_bf16_rungs_after_fp16(tiny_config, capsys):
    """Every rung fits a tiny model; the fastest by the prior is pure bf16 on an Ampere card, but on a
    T4 (sm_75) bf16 is emulated at fp32's speed or slower: fp16 autocast is its fast rung."""
    chosen = {}
    for card in ("A100 40GB", "T4 16GB"):
        assert main(["estimate", "--model", tiny_config, "--batch", "2", "--seq", "32", "--auto-fit",
                     "--card", card]) == 0
        out = capsys.readouterr().out.splitlines()
        (line,) = [line.split() for line in out if line.startswith("auto-fit: ")]
        chosen[card] = line[1]
    assert chosen == {"A100 40GB": "bf16_true", "T4 16GB": "fp16"}


def test_card_here_fits_to_what_the_card_has_free_now(tiny_config, capsys, monkeypatch):
    """A desktop card drives a display, and a shared card has other processes: `--card here` fits to
    what CUDA reports free (with what this process holds), not to the card's total less a modelled
    context. Played: a T4 whose display and other process use 1,800 MiB with this process's context."""
    import types

    import bitsandbytes  # noqa: F401  (imported as on a machine without CUDA, before CUDA is played)

    MiB = 2**20
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(
        name="Tesla T4", total_memory=15360 * MiB, major=7, minor=5))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (13460 * MiB, 15360 * MiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 100 * MiB)
    # the search stops at the first setup that fits (on this model every setup needs about the same, so
    # looking for step-downs predicted all 52, 90 s here); the budget it is given is what is checked
    monkeypatch.setattr(estimate_cli, "search", functools.partial(estimate_cli.search, keep=1))
    assert main(["estimate", "--model", tiny_config, "--batch", "2", "--seq", "32", "--rung", "bf16",
                 "--card", "here"]) == 0
    out = capsys.readouterr().out.splitlines()
    (context,) = [line.split() for line in out if line.strip().startswith("CUDA context")]
    assert context[2:6] == ["1,800.0", "MiB", "measured", "now:"]
    (reserved,) = [float(line.split()[2].replace(",", "")) for line in out  # what fits compares, not the need
                   if line.strip().startswith("reserved peak")]
    (card,) = [line for line in out if line.strip().startswith("card Tesla T4")]
    assert card.split("headroom ")[1] == (f"{13560 - reserved:,.1f} MiB with no margin (the fit figure + the CUDA "
                                          "context; --budget-mib adds the measured one)")
    assert main(["estimate", "--model", tiny_config, "--batch", "2", "--seq", "32", "--precision", "bf16-mixed",
                 "--search", "--card", "here"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.endswith("budget 13,560 MiB (Tesla T4's 15,360 MiB less 1,800 MiB in use there, measured now: this "
                         "process's CUDA context and what other processes use)")


def test_every_rung_on_a_card_says_whether_it_fits(tiny_config, capsys):
    """`--rung all --card`: a column per rung, fits and headroom, not only for a single setup."""
    assert main(["estimate", "--model", tiny_config, "--batch", "2", "--seq", "32", "--rung", "all", "--card", "0.75"]) == 0
    out = capsys.readouterr().out.splitlines()
    heading = next(line for line in out if line.startswith("rung "))
    assert "card: fits, headroom MiB" in heading
    assert " alloc MiB reserved MiB    smi MiB " in heading  # each with its unit (reserved had none)
    # whole category names (cut at 10 characters they read "optimizer_", "activation", "temporarie")
    assert heading.split()[4:9] == ["weights", "gradients", "optimizer", "activations", "temporaries"]
    rows = {line.split()[0]: line.split() for line in out if line.split() and line.split()[0] in RUNGS}
    assert set(rows) == set(RUNGS)
    # tens of MiB reserved + the 721 MiB context fit in 768 MiB; the 500,000,000-element ZeRO bucket does not
    assert rows["fp32"][-2] == "yes" and float(rows["fp32"][-1]) >= 0
    assert rows["zero_offload"][-2] == "no" and float(rows["zero_offload"][-1].replace(",", "")) < -900
    assert any(line.startswith("card: 0.75 GiB card (768 MiB)") for line in out)
    # what the fit compares is shown, between the allocated and the reserved peak: needed + the context +
    # headroom is the card (Qwen2-0.5B's ZeRO-3 at 4 x 512: reserved about 9,630 MiB, needed 5,660, on 8 GB)
    num = lambda v: float(v.replace(",", ""))  # noqa: E731
    assert "fit MiB  card: fits, headroom MiB" in heading  # the figure the card's verdict compares
    context = num(rows["fp32"][-4]) - num(rows["fp32"][-5])  # smi less reserved (paged state aside)
    for rung, r in rows.items():
        alloc, reserved, fit, headroom = num(r[-6]), num(r[-5]), num(r[-3]), num(r[-1])
        if rung != "cpu":  # the fit figure is the reserved peak (paged state is outside it), not the least cap
            assert alloc <= fit == reserved, r
            assert reserved + context + headroom == pytest.approx(0.75 * 1024, abs=0.15), r


def test_help_lists_the_rungs():
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "estimate", "--help"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0
    # each rung a line of its own under the epilog's heading, by its first word: `name in out` had been
    # met by lora inside qlora, bf16 inside bf16_true and cpu in the options' help, a rung left out or not
    listed = out.stdout.split("rungs (--rung):\n", 1)[1].splitlines()
    assert [line.split()[0] for line in listed if line.strip()] == [*RUNGS, "all"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_qlora_with_an_8_bit_optimizer_is_predicted(tmp_path, capsys, device):
    """QLoRA's own recipe (paged 8-bit AdamW) ended in a traceback: peft made the adapters real tensors
    beside the real 4-bit layers, and bitsandbytes' step, setting p.data, turned them into meta ones."""
    gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 256, "n_layer": 2, "n_head": 4,
            "vocab_size": 512, "n_positions": 1024, "bos_token_id": 0, "eos_token_id": 0}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(gpt2))
    state = {}
    for trainable in ("lora", "qlora"):
        for optimizer in ("adamw_torch", "adamw_8bit", "paged_adamw_8bit"):
            # rank 32: each adapter holds 8,192+ values, above bitsandbytes' 4,096 for 8-bit state
            assert main(["estimate", "--model", str(path), "--seq", "32", "--device", device, "--json",
                         "--trainable", trainable, "--lora-rank", "32", "--optimizer", optimizer]) == 0
            state[trainable, optimizer] = json.loads(capsys.readouterr().out)["predictions"][0]["optimizer_state_bytes"]
    for optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        # the adapters have the same shapes on a 4-bit layer as on a full one: the same state
        assert state["qlora", optimizer] == state["lora", optimizer]
        # 2 bytes a value (plus block statistics) against AdamW's 8
        assert 0.25 < state["qlora", optimizer] / state["qlora", "adamw_torch"] < 0.27


def test_gpt2s_conv1d_layers_take_lora_targets_and_4_bit(tmp_path, capsys):
    """GPT-2's usual LoRA target is c_attn, a Conv1D: it was refused ("names no linear module; use
    some of: lm_head"), and --trainable qlora stopped with a traceback."""
    gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 256, "n_layer": 2, "n_head": 4,
            "vocab_size": 512, "n_positions": 1024, "bos_token_id": 0, "eos_token_id": 0}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(gpt2))
    weights = {}
    for trainable in (["lora"], ["lora", "--lora-targets", "c_attn"], ["qlora"]):
        assert main(["estimate", "--model", str(path), "--seq", "32", "--device", "cpu", "--json",
                     "--precision", "bf16-mixed", "--trainable", *trainable]) == 0
        out = json.loads(capsys.readouterr().out)
        weights[" ".join(trainable)] = out["predictions"][0]["weights_bytes"]
    lora, c_attn, qlora = weights.values()
    assert c_attn < lora  # adapters on c_attn only: fewer LoRA weights than on every linear layer
    # the 2 blocks' 8 linear layers (1,572,864 fp32 weights, 6 MiB) become 4-bit (0.75 MiB + statistics)
    saved = 1_572_864 * 4 - 1_572_864 // 2
    assert saved - 64 * 2**10 < lora - qlora < saved  # less the quantization statistics (kept small)


def test_a_strategy_the_model_cannot_take_is_one_line(tmp_path, capsys):
    """BitFit on a model without biases (Llama) ended in a traceback."""
    llama = {**TINY, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(llama))
    assert main(["estimate", "--model", str(path), "--seq", "32", "--trainable", "bitfit"]) == 2
    err = capsys.readouterr().err
    assert err == "workbench estimate: LlamaForCausalLM has no bias parameters, so BitFit has nothing to train\n"


@pytest.mark.parametrize("args, message", [
    (["--rung", "fp64"], "unknown rung 'fp64'"),
    (["--budget-mib", "0"], "--budget-mib must be a positive number"),
    (["--budget-mib", "-5", "--auto-fit"], "--budget-mib must be a positive number"),
    (["--budget-mib", "inf"], "--budget-mib must be a positive number"),  # was an OverflowError's traceback
    (["--batch", "0"], "--batch must be a positive integer"),
    (["--seq", "4096"], "sequence length 4096 is longer than"),
])
def test_bad_arguments_are_one_clear_line(tiny_config, capsys, args, message):
    assert main(["estimate", "--model", tiny_config, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["estimate", "--model", "m", "--batch", "x"],
     "workbench estimate: error: argument --batch: invalid int value: 'x'"),
    (["estimate", "--batch", "2"], "workbench estimate: error: the following arguments are required: --model"),
    (["ladder", "--nosuch"], "workbench ladder: error: unrecognized arguments: --nosuch"),
    (["nosuch"], "workbench: error: argument COMMAND: invalid choice: 'nosuch'"),
])
def test_what_argparse_refuses_is_one_line_naming_where_the_options_are(capsys, argv, message):
    """argparse printed the command's whole usage block (a dozen lines for estimate) above its error."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(message) and len(err.splitlines()) == 1, err
    command = "workbench" if argv == ["nosuch"] else f"workbench {argv[0]}"
    assert err.endswith(f"(`{command} --help` lists the options)\n"), err


def test_a_sequence_past_a_rotary_models_positions_says_how_to_predict_a_context_extension(tmp_path, capsys):
    """Llama-3-8B's config states 8,192 positions; RoPE has no position table, so 16k tokens is a
    context extension, which raises the config's limit. GPT-2's learned table ends there."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "max_position_embeddings": 64}))
    assert main(["estimate", "--model", str(path), "--seq", "128"]) == 2
    assert capsys.readouterr().err.strip().endswith("or raise max_position_embeddings in its config (with rope "
                                                    "scaling) to predict a context extension")
    gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_positions": 64, "n_embd": 64, "n_layer": 2,
            "n_head": 4, "vocab_size": 512}
    path.write_text(json.dumps(gpt2))
    assert main(["estimate", "--model", str(path), "--seq", "128"]) == 2
    assert capsys.readouterr().err.strip().endswith("use a sequence length of at most 64")


def test_a_config_that_is_not_a_model_config(tmp_path, capsys):
    path = tmp_path / "train_config.json"
    path.write_text(json.dumps({"learning_rate": 1e-4, "epochs": 3}))
    assert main(["estimate", "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not a model config" in err and "Traceback" not in err
    assert main(["estimate", "--model", str(tmp_path / "missing_dir")]) == 2
    assert "missing_dir': no such file or directory" in capsys.readouterr().err


def test_a_model_that_is_not_a_causal_lm(tmp_path, capsys):
    vit = {"model_type": "vit", "architectures": ["ViTForImageClassification"], "hidden_size": 768,
           "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072, "image_size": 224,
           "patch_size": 16, "num_channels": 3}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(vit))
    assert main(["estimate", "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert "'vit' model (ViTForImageClassification), not a causal language model" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_sequence_longer_than_the_positions_is_refused_naming_the_limit(tmp_path, capsys):
    gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "n_head": 4,
            "vocab_size": 512, "n_positions": 1024, "bos_token_id": 0, "eos_token_id": 0}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(gpt2))
    assert main(["estimate", "--model", str(path), "--seq", "4096"]) == 2
    err = capsys.readouterr().err
    assert "sequence length 4096" in err and "(1024 positions)" in err and len(err.strip().splitlines()) == 1
    assert main(["estimate", "--model", str(path), "--seq", "1024", "--json"]) == 0  # the limit itself is fine


@pytest.mark.parametrize("args, message", [
    (["--precision", "fp64"], "unknown precision 'fp64'; choose one of: fp32, bf16-mixed"),
    (["--optimizer", "sgd"], "unknown optimizer 'sgd'; choose one of: adamw_torch"),
    (["--trainable", "lora", "--lora-targets", "query,value"], "names no linear module of this model; use some of:"),
    (["--precision", "fp16-mixed", "--device", "cpu"], "fp16-mixed needs --device cuda"),
    # the same setup by its rung: a search from it had offered fp16-mixed setups on the CPU
    (["--rung", "fp16", "--device", "cpu", "--search", "--budget-mib", "10"], "--rung fp16 needs --device cuda"),
    (["--rung", "zero_offload", "--device", "cpu"], "--rung zero_offload splits a card's memory from the host's; "
     "with --device cpu they are one memory: use --device cuda"),
    (["--card", "0.0001"], "estimate: 0.0001 GiB card (0.1 MiB) is smaller than the weights alone"),
    (["--card", "GTX 9999"], "unknown card 'GTX 9999'"),
    (["--trainable", "lora", "--lora-rank", "100000"], "lora_rank 100,000 is more than any layer LoRA adapts can use"),
    (["--card", "inf"], "--card must be a card name or its size in GiB (more than 0, at most 1,024), got 'inf'"),
    # a terabyte of headroom had been printed; GB is not GiB, so "8GB" is no size (a user-journey audit)
    (["--card", "1e9"], "--card must be a card name or its size in GiB (more than 0, at most 1,024), got '1e9'"),
    # a card's number alone is a size of GiB past the largest: the card it names is offered
    (["--card", "4090"], "--card must be a card name or its size in GiB (more than 0, at most 1,024), got '4090'; "
                         "did you mean 'RTX 4090 24GB'?"),
    (["--card", "8GB"], "unknown card '8GB'; give its size as a number of GiB (e.g. 8) or one of: RTX 3060 12GB"),
    (["--card", "A100"], "unknown card 'A100' (it begins A100 40GB, A100 80GB); give its size as a number of GiB"),
    (["--trainable", "lora", "--lora-targets", " , "], "--lora-targets ' , ' names no module; give comma-separated"),
    (["--rung", "bf16", "--precision", "fp32"], "--rung and --precision both describe the setup"),
    (["--batch", "4", "--micro-batch", "3"], "--micro-batch 3 must divide --batch 4"),
    (["--batch", "4", "--micro-batch", "0"], "--micro-batch must be a positive integer, got 0"),
    (["--auto-fit"], "--auto-fit needs --budget-mib or --card"),
    # each had been ignored without a word (a user-journey audit)
    (["--trainable", "full", "--lora-rank", "4"], "--lora-rank: LoRA's, not --trainable full's; use lora or qlora"),
    (["--allow-lora", "--card", "8"], "--allow-lora is an option of --search (LoRA may replace full fine-tuning): "
     "add --search"),
    (["--auto-fit", "--card", "8", "--precision", "bf16-true"], "--auto-fit picks among the named rungs; to search "
     "from a setup of your own, use --search"),
    (["--snapshot", "."], "--snapshot . is a folder; name a file in it, e.g. step.pickle"),
    (["--snapshot", ""], "--snapshot needs a file name, e.g. --snapshot step.pickle"),  # it read "--snapshot . is a folder"
    # it wrote a 24 MiB CUDA timeline of a step whose prediction puts nothing on the card
    (["--rung", "cpu", "--snapshot", "/tmp/wb-test-cpu-rung.pickle"], "the cpu rung trains on the CPU with nothing on "
     "the card; pick a setup that trains on the card"),
])
def test_bad_setups_are_one_line_naming_the_fix(tiny_config, capsys, args, message):
    assert main(["estimate", "--model", tiny_config, "--seq", "32", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_snapshot_that_cannot_be_written_after_the_check_is_one_line(tiny_config, tmp_path, capsys, monkeypatch):
    """A full disk or a read-only file system passes the check made before the prediction; the write
    then ended in an OSError traceback."""
    import errno

    from workbench.studies.ladder import cli as estimate_cli

    def full(snapshot, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(estimate_cli, "dump", full)
    path = tmp_path / "step.pickle"
    assert main(["estimate", "--model", tiny_config, "--seq", "32", "--snapshot", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"workbench estimate: --snapshot {path}: cannot write it (No space left on device)\n", err


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_moe_model_whose_experts_the_grouped_kernel_refuses_is_one_line(tmp_path, capsys, device):
    """Expert rows that are not 16-byte aligned (an intermediate size of 6 in fp32) are refused by
    torch._grouped_mm, the real kernel and the prediction's alike: that ended `estimate` in a RuntimeError
    traceback. One line now, naming the sizes to use."""
    from conftest import tiny_moe_config

    path = tmp_path / "config.json"
    path.write_text(tiny_moe_config("mixtral").to_json_string())
    assert main(["estimate", "--model", str(path), "--seq", "16", "--device", device]) == 0  # 48 wide: runs
    capsys.readouterr()
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "intermediate_size": 6}))
    assert main(["estimate", "--model", str(path), "--seq", "16", "--device", device]) == 2
    err = capsys.readouterr().err
    assert "not a multiple of 16 bytes" in err and "multiples of 8" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_lora_flag_alone_means_lora_with_its_rank(tiny_config, capsys):
    """--lora-rank 4 alone had predicted full fine-tuning (the rank dropped), while --lora-targets alone
    meant LoRA: each alone means LoRA now, with the rank given (the adapters' AdamW state says which)."""
    state = {}
    for flags in [(), ("--lora-rank", "4"), ("--lora-rank", "8"), ("--lora-targets", "q_proj")]:
        assert main(["estimate", "--model", tiny_config, "--seq", "32", "--device", "cpu", *flags, "--json"]) == 0
        state[flags[:2]] = json.loads(capsys.readouterr().out)["predictions"][0]["optimizer_state_bytes"]
    assert state[("--lora-rank", "4")] < state[("--lora-rank", "8")] < state[()], state
    assert state[("--lora-targets", "q_proj")] < state[("--lora-rank", "8")], state  # one target of the seven


def test_a_setup_from_flags_on_a_card(tiny_config, capsys):
    args = ["estimate", "--model", tiny_config, "--batch", "4", "--seq", "32", "--precision", "bf16-true",
            "--trainable", "lora", "--lora-targets", "q_proj,v_proj", "--checkpointing", "--micro-batch", "2",
            "--card", "RTX 4060 Ti 8GB", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    (p,) = out["predictions"]
    assert out["device"] == "cuda" and p["method"] == "predicted" and p["card"] == "RTX 4060 Ti 8GB"
    assert p["fits_card"] is True and p["nvidia_smi_bytes"] == p["reserved_peak_bytes"] + p["context_bytes"]
    assert p["reserved_peak_bytes"] >= p["allocated_peak_bytes"] >= p["peak_bytes"]
    assert out["labels"]["reserved_peak_bytes"].startswith("modelled")
    assert main(args[:-3] + ["--device", "cpu"]) == 0  # the same setup as a CPU step: live bytes only
    out = capsys.readouterr().out
    assert "on cpu: predicted peak 0." in out  # the CPU's fit figure: live bytes
    # each category labelled, as the CUDA output's are (its lines had no label)
    cats = [line for line in out.splitlines() if line.split() and line.split()[0] in CATEGORIES]
    assert len(cats) == len(CATEGORIES) and all(line.endswith(" MiB  simulated") for line in cats), cats
    # on a card the headline's live bytes are not what fits compares (the reserved peak): said (a user-journey audit)
    assert main(args[:-1]) == 0
    assert "on cuda: predicted peak of live tensors " in capsys.readouterr().out


def test_the_fits_column_keeps_the_predictions_measured_margin(tiny_config, capsys):
    base = ["estimate", "--model", tiny_config, "--batch", "2", "--seq", "32", "--rung", "bf16_true", "--json"]
    assert main(base) == 0
    (p,) = json.loads(capsys.readouterr().out)["predictions"]
    margin = prediction_margin(RUNGS["bf16_true"], device="cuda")[0]
    assert margin > 0
    need = p["fit_bytes"]  # the reserved peak, which a budget caps; the least cap is at most that
    assert p["needed_reserved_bytes"] <= need == p["reserved_peak_bytes"]
    between = need * (1 + margin / 2) / 2**20  # fits without the margin, not with it
    assert main(base + ["--budget-mib", f"{between:.3f}"]) == 0
    (p,) = json.loads(capsys.readouterr().out)["predictions"]
    assert p["fits_budget"] is False and p["margin"] == pytest.approx(margin)
    assert main(base + ["--budget-mib", f"{need * (1 + margin) / 2**20 + 1:.3f}"]) == 0
    assert json.loads(capsys.readouterr().out)["predictions"][0]["fits_budget"] is True
    # on a card as well, the two verdicts are two keys: the card's (no margin) was overwritten by the budget's
    assert main(base + ["--card", "80", "--budget-mib", f"{between:.3f}"]) == 0
    (p,) = json.loads(capsys.readouterr().out)["predictions"]
    assert p["fits_card"] is True and p["fits_budget"] is False and "fits" not in p
    assert main(base[:-1] + ["--rung", "all", "--budget-mib", f"{between:.3f}"]) == 0
    table = capsys.readouterr().out
    assert "fits (with margin)" in table and f"no ({margin:.1%})" in table


def test_the_cpu_rung_is_a_cpu_step_whatever_the_card(tiny_config, capsys):
    """The cpu rung trains on the CPU: with --device cuda it was simulated with CUDA's attention kernel
    (less saved for backward), so its host memory was a CUDA step's; its single-rung output put the
    whole step at 0 MiB with no host figure and said nothing of the card."""
    common = ["estimate", "--model", tiny_config, "--batch", "4", "--seq", "64", "--rung", "cpu", "--steps", "3"]
    host = {}
    for device in ("cpu", "cuda"):
        assert main([*common, "--device", device, "--json"]) == 0
        (p,) = json.loads(capsys.readouterr().out)["predictions"]
        assert p["predicted_peak_bytes"] == 0 and p["host_bytes"] > 0
        # for the table: rounded as the single-rung line rounds it (a tiny model's 1.2 MiB had read "1 MiB" here)
        assert p["host_bytes"] < 100 * 2**20 and f"host memory {p['host_bytes'] / 2**20:,.1f} MiB at its own peak" in p["note"]
        host[device] = p["host_bytes"]
    assert host["cuda"] == host["cpu"]
    assert main([*common, "--card", "4"]) == 0
    out = capsys.readouterr().out
    assert f"predicted peak 0 MiB on the device (CPU only); host memory {host['cpu'] / 2**20:,.1f} MiB" in out
    assert "card 4 GiB card (4,096 MiB): fits, headroom 4,096.0 MiB (nothing of this setup is on the card)" in out
    assert out.count(" MiB  host\n") == 5  # the host's categories at its peak


def test_one_prediction_says_in_a_terminal_what_its_seconds_are_for(tiny_config, capsys, monkeypatch):
    """A 7B model's one prediction is 20-25 s with nothing on the screen (several rungs have a bar);
    in a terminal it says what it is doing first. Piped or captured, stderr stays for errors."""
    import sys

    assert main(["estimate", "--model", tiny_config, "--seq", "32", "--rung", "bf16"]) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    for setup, name in ((["--rung", "bf16"], "bf16"), (["--precision", "bf16-true"], "custom")):
        assert main(["estimate", "--model", tiny_config, "--seq", "32", *setup]) == 0
        out = capsys.readouterr()
        assert out.err == (f"estimate: simulating {name} on fake tensors (no weights read): seconds, tens of them "
                           "for billions of parameters\n") and name in out.out
