import json
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from workbench.core import models
from workbench.core.common import PROJECT_ROOT
from workbench.core.hub import hub_constants, not_found_message
from workbench.core.models import (
    TINY_SPEC,
    ModelNotFoundError,
    cache_is_valid,
    embedded_metrics,
    ensure_embedded_base,
    load_config,
    load_model,
    model_fingerprint,
)


def test_embedded_base_loads_through_auto_classes(tiny_base):
    model, tok = load_model("embedded", spec=TINY_SPEC)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert (tiny_base / "model.safetensors").exists() and not list(tiny_base.glob("*.bin"))
    ids = tok("def f(x):\n    return x", return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]) == "def f(x):\n    return x"  # byte-level BPE round-trips code
    out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss)


def test_tiny_base_is_a_language_model(tiny_base):
    m = embedded_metrics(TINY_SPEC)
    # far below a uniform guess over the vocabulary, and below a unigram model
    assert m["heldout_perplexity"] < m["unigram_perplexity"] < TINY_SPEC.vocab_size


def test_estimating_the_embedded_base_does_not_pretrain_it_and_predicts_as_the_built_one(tiny_base, tmp_path,
                                                                                         monkeypatch, capsys):
    """`workbench estimate --model embedded` pretrained the base for minutes to read its config; the
    config is the spec's, so the unbuilt base's prediction is the built one's, byte for byte."""
    from workbench.cli import main
    from workbench.core.memory.plan import rung
    from workbench.core.memory.predict import predict

    built = load_config("embedded", spec=TINY_SPEC)
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))  # nothing built here
    monkeypatch.setattr(models, "_build_embedded", lambda *a, **k: pytest.fail("pretrained the base to estimate it"))
    unbuilt = load_config("embedded", spec=TINY_SPEC)
    for device in ("cpu", "cuda"):
        a, b = (predict(c, rung("fp32"), batch=2, seq=32, device=device) for c in (built, unbuilt))
        figures = [(p.peak_bytes, p.breakdown, p.allocated_peak_bytes, p.reserved_peak_bytes) for p in (a, b)]
        assert figures[0] == figures[1] and a.peak_bytes > 0
    assert main(["estimate", "--model", "embedded", "--seq", "32", "--json"]) == 0
    weights = json.loads(capsys.readouterr().out)["predictions"][0]["weights_bytes"]
    assert 3.215e6 * 4 < weights < 3.225e6 * 4  # the default base's 3.22M parameters in fp32
    assert not list(tmp_path.iterdir())


def test_cache_is_reused_and_a_corrupt_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    spec = replace(TINY_SPEC, steps=3, source_mib=0.1)
    builds = []
    real_build = models._build_embedded
    monkeypatch.setattr(models, "_build_embedded", lambda *a, **k: (builds.append(1), real_build(*a, **k)))
    path = ensure_embedded_base(spec, progress=False)
    assert cache_is_valid(path) and len(builds) == 1
    # the build leaves the window set of its pretraining text, which study 1's held-out text is checked against
    assert (tmp_path / f"pretraining-windows-{spec.key()}.npy").stat().st_size > 1000
    assert ensure_embedded_base(spec, progress=False) == path and len(builds) == 1  # reused
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a partial write
    assert not cache_is_valid(path)
    ensure_embedded_base(spec, progress=False)
    assert len(builds) == 2 and cache_is_valid(path)
    (path / "manifest.json").unlink()  # an interrupted build leaves no manifest
    ensure_embedded_base(spec, progress=False)
    assert len(builds) == 3


def test_a_killed_builds_temporary_folder_is_removed_by_the_next_build(tmp_path, monkeypatch):
    """A build killed outright runs no `finally`: its folder is removed by the next build, while a
    folder of a build still running (this process) is kept."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    spec = replace(TINY_SPEC, steps=3, source_mib=0.1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    killed = tmp_path / f".embedded-{spec.key()}.{dead}.abc123"
    running = tmp_path / f".embedded-{spec.key()}.{os.getpid()}.def456"
    for d in (killed, running):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    path = ensure_embedded_base(spec, progress=False)
    assert cache_is_valid(path)
    assert not killed.exists() and running.exists()


def test_local_directory_and_config_file(tiny_base, tmp_path):
    model, _ = load_model(str(tiny_base))
    assert model.config.hidden_size == TINY_SPEC.hidden_size
    cfg = load_config(str(tiny_base / "config.json"))
    assert cfg.model_type == "qwen2"
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ModelNotFoundError, match="not a model config"):
        load_config(str(bad))


def test_an_architecture_of_a_repositorys_own_code_is_refused_saying_so():
    """With trust_remote_code a repository's own causal LM (its config's auto_map) loads its config, and was
    then called "not a causal language model": the studies and the prediction build transformers' own."""
    from transformers import PretrainedConfig

    from workbench.core.models import NotACausalLMError, check_causal_lm

    class Mine(PretrainedConfig):
        model_type = "mytiny"

    own = Mine(auto_map={"AutoModelForCausalLM": "modeling_mytiny.MyTinyForCausalLM"}, architectures=["MyTinyForCausalLM"])
    with pytest.raises(NotACausalLMError, match="a causal LM whose architecture is its repository's own code"):
        check_causal_lm(own, "someone/mytiny")
    with pytest.raises(NotACausalLMError, match="'mytiny' model \\(no architectures listed\\), not a causal language model"):
        check_causal_lm(Mine(), "someone/mytiny")


def test_a_path_from_the_home_folder_loads(tiny_base, tmp_path, monkeypatch):
    """"~/models/x" in a notebook's parameters or --model=~/x (no shell expands it there): the checks
    expanded "~", transformers was handed the name unexpanded and read it as a bad hub id."""
    import shutil

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(tiny_base, tmp_path / "m")
    assert load_config("~/m").hidden_size == TINY_SPEC.hidden_size
    assert load_config("~/m/config.json").model_type == "qwen2"
    model, _ = load_model("~/m")
    assert model.config.hidden_size == TINY_SPEC.hidden_size


@pytest.mark.parametrize("name", ["nope.json", "./nope", "data/configs/nope-0.5b", "~/no-such-model-here"])
def test_a_missing_path_is_said_at_once_without_asking_the_hub(name, monkeypatch):
    import transformers

    def hub(*a, **k):
        raise AssertionError("asked the hub for a local path")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", hub)
    for load in (load_config, load_model):
        with pytest.raises(ModelNotFoundError, match=rf"'{re.escape(name)}': no such file or directory") as e:
            load(name)
        assert "\n" not in str(e.value)


def test_missing_model_names_the_model_and_the_fix(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"'nobody/no-such-model'.*local directory"):
        load_model("nobody/no-such-model")
    empty = tmp_path / "empty_model"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="holds no loadable model"):
        load_model(str(empty))


def test_a_file_or_folder_that_is_not_a_model_says_which_and_what_it_needs(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text("lr: [1e-3]\n")
    for load in (load_config, load_model):
        with pytest.raises(ModelNotFoundError, match="is a file but not a model's config.json") as e:
            load(str(grid))
        assert "folder exists" not in str(e.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match=r"holds no loadable model \(needs a config.json\): no config.json in"):
        load_config(str(empty))  # a config is all a prediction needs: no weights asked for
    # a good config.json where a whole model is needed: it had been called "not a model's config.json"
    with pytest.raises(ModelNotFoundError, match=r"is a config.json alone: this needs a folder holding config.json, "
                                                 r"tokenizer files and \*.safetensors weights"):
        load_model(str(PROJECT_ROOT / "data" / "configs" / "gpt2.json"))
    # ... and not where a config is all that is needed (a config file of an unknown model_type)
    odd = tmp_path / "cfgfile"
    odd.write_text('{"model_type": "no-such-type"}')
    assert "config.json alone" not in not_found_message(str(odd), ValueError("unknown"), needs="a config.json")


def test_a_hub_model_found_but_not_loadable_says_why(monkeypatch):
    """A cached hub model whose weights are a Git LFS pointer, or without tokenizer files, was said to be
    'not in the local Hugging Face cache' (the message a missing model gets), its cause left out."""
    from safetensors import SafetensorError

    from workbench.core.hub import NoTokenizer

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    for err, cause in ((SafetensorError("HeaderTooLarge"), "HeaderTooLarge"), (NoTokenizer("no tokenizer files"),
                                                                                 "no tokenizer files")):
        said = not_found_message("someorg/somemodel", err)
        assert said.startswith("model 'someorg/somemodel' was found but holds no loadable model") and \
            said.endswith(cause) and "cache" not in said


@pytest.mark.parametrize("field, value", [("vocab_size", 0), ("hidden_size", -64), ("num_hidden_layers", 1.5)])
def test_a_config_of_impossible_sizes_is_one_line(tmp_path, field, value, capsys):
    """vocab_size 0 ended `workbench estimate` in torch's reshape error, deep in a fake-tensor step."""
    from workbench.cli import main

    cfg = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, field: value}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ModelNotFoundError, match=rf"(its config's {field} must be a positive integer, got {value}$|"
                                                 rf"is not a valid qwen2 config: .*'{field}' expected int)"):
        load_config(str(path))
    assert main(["estimate", "--model", str(path), "--seq", "16", "--rung", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_config_files_fingerprint_follows_its_content(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "gpt2", "n_layer": 2}')
    first = model_fingerprint(str(path))
    path.write_text('{"model_type": "gpt2", "n_layer": 4}')  # same name, another model: results not reused
    assert model_fingerprint(str(path)) != first


def test_a_hub_models_fingerprint_follows_its_cached_revision(tmp_path, monkeypatch):
    """A hub id was keyed as given: a new revision of the model (or its tokenizer) pulled into the cache
    reused the old revision's runs. The key holds the commit of the cached snapshot."""
    from huggingface_hub import constants

    repo = tmp_path / "models--org--tiny"
    for commit in ("a" * 40, "b" * 40):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    keys = []
    for commit in ("a" * 40, "b" * 40):
        (repo / "refs" / "main").write_text(commit)
        keys.append(model_fingerprint("org/tiny"))
    assert keys[0] != keys[1] and model_fingerprint("org/other") != keys[0]  # not cached: the id alone
