import pandas as pd
import pytest
import torch
from conftest import ARCHS, tiny_config
from transformers import AutoModelForCausalLM, Qwen2Config

from workbench.core.config import ConfigError
from workbench.core.memory.plan import quantize_4bit
from workbench.core.results import StudyResult
from workbench.core.trainable import STRATEGIES, StrategyNotApplicable, apply_strategy, model_parts
from workbench.core.training import evaluate_perplexity
from workbench.studies.strategies.figures import findings


def fresh(arch):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch))


def trainable_ids(model):
    return {id(p) for p in model.parameters() if p.requires_grad}


def ids(params):
    return {id(p) for p in params}


@pytest.mark.parametrize("arch", ARCHS)
def test_parts_are_found_structurally(arch):
    m = fresh(arch)
    parts = model_parts(m)
    assert len(parts.layers) == 6
    assert parts.input_embeddings is m.get_input_embeddings()
    assert parts.tied == (arch in ("qwen2", "gpt2", "opt"))
    assert (len(parts.position_embeddings) == 1) == (arch in ("gpt2", "opt"))


@pytest.mark.parametrize("arch", ARCHS)
def test_selected_sets(arch):
    layers_of = lambda m, idx: ids(p for i in idx for p in model_parts(m).layers[i].parameters())  # noqa: E731

    m, sel = apply_strategy(fresh(arch), "adapter")
    parts = model_parts(m)
    head = ids(parts.head.parameters())
    emb = ids(parts.input_embeddings.parameters())
    got = trainable_ids(m)
    assert layers_of(m, [4, 5]) <= got and not (layers_of(m, [0, 1, 2, 3]) & got)
    assert head <= got and ids(parts.others) <= got
    assert (emb <= got) == parts.tied  # a tied head *is* the embedding

    m, _ = apply_strategy(fresh(arch), "freeze_lower")
    got = trainable_ids(m)
    # upper half trains; with a substring match on "layers.1", layer 1 would have trained instead
    assert layers_of(m, [3, 4, 5]) <= got and not (layers_of(m, [0, 1, 2]) & got)

    m, sel = apply_strategy(fresh(arch), "freeze_embeddings")
    parts = model_parts(m)
    got = trainable_ids(m)
    frozen = ids(parts.input_embeddings.parameters()) | ids(p for e in parts.position_embeddings for p in e.parameters())
    assert not (frozen & got) and layers_of(m, range(6)) <= got
    assert ("frozen too" in " ".join(sel.notes)) == parts.tied

    m, sel = apply_strategy(fresh(arch), "full")
    assert sel.trainable_share == 1.0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["adapter", "freeze_lower", "freeze_embeddings", "full", "lora", "bitfit"])
def test_counts_are_elements_with_tied_weights_once(arch, name):
    try:
        m, sel = apply_strategy(fresh(arch), name)
    except StrategyNotApplicable:
        assert name == "bitfit" and arch == "llama"  # Llama has no biases
        return
    unique = {id(p): p for p in m.parameters()}.values()
    assert sel.total_params == sum(p.numel() for p in unique)
    assert sel.trainable_params == sum(p.numel() for p in unique if p.requires_grad)
    assert sel.trainable_tensors < sel.trainable_params  # elements, not tensors
    assert 0 < sel.trainable_share <= 1


@pytest.mark.parametrize("arch", ARCHS)
def test_a_lora_rank_no_layer_can_use_is_refused_before_the_adapters_are_made(arch):
    model = fresh(arch)
    head = model.get_output_embeddings()
    usable = max(min(m.weight.shape) for m in model.modules()
                 if m is not head and isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")
    with pytest.raises(ConfigError, match=rf"^lora_rank {usable + 1:,} is more than any layer LoRA adapts can use: "
                                          rf".* {usable:,} here; use a smaller lora_rank$"):
        apply_strategy(fresh(arch), "lora", lora_rank=usable + 1)
    apply_strategy(model, "lora", lora_rank=usable)  # full rank for the widest: allowed


def test_unknown_strategy():
    with pytest.raises(ValueError, match="unknown strategy 'frezee'"):
        apply_strategy(fresh("qwen2"), "frezee")
    assert set(STRATEGIES) >= {"adapter", "freeze_lower", "freeze_embeddings", "full", "lora", "bitfit", "qlora"}


@pytest.mark.parametrize("layers", [4, 6])
def test_two_strategies_that_train_the_same_parameters_are_said_to(layers):
    """With 4 decoder layers, 'the last 2' (adapter) is 'the upper half' (freeze_lower): the study
    says it has one experiment under two names instead of presenting two results."""
    config = tiny_config("qwen2")
    config.num_hidden_layers = layers
    sels = {}
    for name in ("adapter", "freeze_lower", "full"):
        torch.manual_seed(0)
        _, sels[name] = apply_strategy(AutoModelForCausalLM.from_config(config), name)
    assert (sels["adapter"].trainable_set == sels["freeze_lower"].trainable_set) == (layers == 4)
    assert sels["full"].trainable_set != sels["adapter"].trainable_set
    # the same parameters trained over a base of another kind (QLoRA's 4-bit, here bf16) is another experiment
    torch.manual_seed(0)
    _, lora = apply_strategy(AutoModelForCausalLM.from_config(config), "lora")
    torch.manual_seed(0)
    _, lora_bf16 = apply_strategy(AutoModelForCausalLM.from_config(config).to(torch.bfloat16), "lora")
    assert lora.trainable_params == lora_bf16.trainable_params and lora.trainable_set != lora_bf16.trainable_set
    summary = pd.DataFrame([{**s.as_row(), "ppl_before": 100.0, "ppl_after_mean": 90.0 + i, "improvement_mean_pct": 10.0,
                             "seeds": 1} for i, s in enumerate(sels.values())])
    said = [f for f, _ in findings(StudyResult("strategies", runs=pd.DataFrame(), tables={"summary": summary}))]
    same = [f for f in said if "train the same" in f]
    if layers == 4:
        assert same == [f"adapter and freeze_lower train the same {sels['adapter'].trainable_params:,} parameters on "
                        "this model: one experiment under 2 names, not 2 results."]
    else:
        assert same == []


def test_the_fallback_finding_says_which_runs_ran_out_and_which_were_kept_off():
    """A run the pre-flight prediction kept off the budgeted device never ran out of memory there;
    the finding said all of them had."""
    summary = pd.DataFrame([{"strategy": "lora", "ppl_before": 100.0, "ppl_after_mean": 90.0,
                             "improvement_mean_pct": 10.0, "seeds": 2}])
    runs = pd.DataFrame([
        {"strategy": "full", "seed": 0, "status": "fallback", "device_history": "cpu@13: skipped in preflight -> cpu: ok"},
        {"strategy": "full", "seed": 1, "status": "fallback", "device_history": "cpu@13: oom in backward -> cpu: ok"},
        {"strategy": "bitfit", "seed": 0, "status": "fallback", "device_history": "cpu@13: oom in forward -> cpu: ok"},
        {"strategy": "lora", "seed": 0, "status": "ok", "device_history": "cpu@13: ok"}])
    said = [f for f, _ in findings(StudyResult("strategies", runs=runs, tables={"summary": summary}))]
    assert said[-1] == ("3 run(s) did not fit the device budget and finished on the next device: 2 ran out of "
                        "memory (bitfit, full); 1 was kept off it by the pre-flight prediction (full).")
    # beside it, the published runs that fell back, from the claims file (it named adapter alone, of three)
    from workbench.core.claims import study1_comparison
    claims = study1_comparison(summary)
    published = findings(StudyResult("strategies", runs=runs, tables={"summary": summary, "claims": claims}))[-1][1]
    assert published == "the published adapter, freeze_embeddings, full runs fell back from GPU to CPU"
    claims["published_device"] = "GPU"
    assert findings(StudyResult("strategies", runs=runs, tables={"summary": summary, "claims": claims}))[-1][1] == ""


def _qlora_grads(evaluate_first: bool) -> dict[str, torch.Tensor]:
    """The LoRA gradients of one step of a small 4-bit QLoRA model, with or without a held-out
    evaluation (eval mode, no grad: what study 1 does before training) before the step. Layers are
    128 wide: bitsandbytes repacks only layers at least one 64-element quantization block wide."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=96, hidden_size=128, intermediate_size=256,
                                                         num_hidden_layers=2, num_attention_heads=4,
                                                         num_key_value_heads=2, tie_word_embeddings=True))
    assert quantize_4bit(model, torch.float32) > 0
    model, _ = apply_strategy(model, "qlora", lora_rank=4)
    blocks = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    if evaluate_first:
        evaluate_perplexity(model, blocks, batch_size=2, device="cpu")
    model.train()
    model(input_ids=blocks, labels=blocks).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_the_4bit_layers_never_take_the_cpu_inference_kernel(monkeypatch):
    """What the next test checks end to end, where the CPU has AVX512-BF16 (it skips elsewhere): a
    4-bit layer bitsandbytes marks for its CPU inference kernel (it marks every one on such a CPU) is
    unmarked by the 4-bit load and again by the qlora strategy."""
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)  # as on a CPU that has it
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=96, hidden_size=128, intermediate_size=256,
                                                         num_hidden_layers=1, num_attention_heads=4,
                                                         num_key_value_heads=2))

    def marked():
        return [m.support_avx512bf16_for_cpu for m in model.modules() if type(m).__name__ == "Linear4bit"]

    assert quantize_4bit(model, torch.float32) == 7 and marked() == [False] * 7
    for m in model.modules():  # a model loaded 4-bit another way (transformers' own loader) keeps the mark
        if type(m).__name__ == "Linear4bit":
            m.support_avx512bf16_for_cpu = True
    model, _ = apply_strategy(model, "qlora", lora_rank=4)
    assert marked() == [False] * 7


def test_qlora_gets_the_same_gradient_after_a_held_out_evaluation():
    """bitsandbytes repacked 4-bit layers for its CPU inference kernel at the first eval-mode pass
    (on CPUs with AVX512-BF16; this test skips on one without) and training then got no gradient through them:
    study 1's QLoRA rows trained every adapter below the top layer on a wrong gradient. (This
    model's biased q/k/v layers make the same path raise instead; either way, the test fails.)"""
    from bitsandbytes.functional import has_avx512bf16

    if not has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes has no inference kernel to repack for here")
    before, after = _qlora_grads(False), _qlora_grads(True)
    assert before.keys() == after.keys() and len(before) > 4
    lowest = next(n for n in before if ".layers.0." in n and "lora_B" in n)  # (A starts with no gradient: B = 0)
    assert before[lowest].abs().sum() > 0
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=1e-4, atol=1e-6, msg=name)


def tiny_jamba():
    """A hybrid causal LM: Jamba's decoder list mixes Mamba and attention layers (one expert: plain MLPs;
    a fake-tensor step of its mixture of experts needs bf16)."""
    from transformers import JambaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(JambaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4,
        mamba_d_conv=2, mamba_expand=2, mamba_dt_rank=4))


@pytest.mark.parametrize("name", ["adapter", "freeze_lower", "freeze_embeddings"])
def test_a_hybrid_without_a_uniform_decoder_stack_is_not_applicable_to_the_layer_strategies(name):
    """A hybrid's layer strategies ended `workbench strategies` with a ValueError traceback; not applicable,
    they are a skipped row with the reason, and the strategies that pick no layers train it."""
    with pytest.raises(StrategyNotApplicable, match=r"^JambaForCausalLM has no stack of identical decoder layers "
                                                    r"\(its layers: JambaMambaDecoderLayer, JambaAttentionDecoderLayer\)"
                                                    r": the strategies that select from it \(adapter, freeze_lower, "
                                                    r"freeze_embeddings\) need one; full, lora and bitfit do not$"):
        apply_strategy(tiny_jamba(), name)
    for other in ("full", "lora", "bitfit"):
        _, sel = apply_strategy(tiny_jamba(), other)
        assert 0 < sel.trainable_params <= sel.total_params


def test_the_shown_summary_gives_the_improvement_in_percent():
    """The summary's improvement columns were improvement_pct_mean / _std, which the shown table's rounding
    (units read from a name's end) left without a unit: they end in _pct, shown as (%)."""
    from workbench.studies.strategies.figures import summary_table
    from workbench.studies.strategies.runner import summarize

    runs = pd.DataFrame([{"strategy": "lora", "seed": seed, "status": "ok", "device": "cpu", "device_history": "cpu: ok",
                          "ppl_before": 100.0, "ppl_after": after, "improvement_pct": 100.0 - after}
                         for seed, after in enumerate((80.0, 90.0))])
    shown = summary_table(StudyResult("strategies", runs=runs, tables={"summary": summarize(runs)}))
    assert shown.loc[0, ["improvement_mean (%)", "improvement_std (%)"]].tolist() == pytest.approx([15.0, 7.1], abs=0.05)
    # the trainable share's denominator beside it: LoRA's is the model with its adapters (the others', the base)
    lora = runs.assign(trainable_params=32_768, total_params=214_080, trainable_share=32_768 / 214_080)
    shown = summary_table(StudyResult("strategies", runs=lora, tables={"summary": summarize(lora)}))
    assert list(shown.columns[4:7]) == ["trainable_params", "total_params", "trainable (%)"], list(shown.columns)
    assert shown.loc[0, "total_params"] == 214_080
    assert not [c for c in shown.columns if c.startswith("improvement") and "(%)" not in c]
    # seeds that finished apart: the means mix a card's and the CPU's figures, and the table says where each
    # finished (device_history is the first seed's alone)
    apart = runs.assign(device=["cuda@2", "cpu"])
    shown = summary_table(StudyResult("strategies", runs=apart, tables={"summary": summarize(apart)}))
    assert shown.loc[0, "devices"] == "cpu, cuda@2" and shown.loc[0, "device_history"] == "cpu: ok"


def test_the_summary_aggregates_each_column_over_the_seeds_that_finished():
    """One strategy's row over its seeds: the spread of the improvement (not of the perplexity, which the
    test above could not tell apart: its base was 100), the highest peak, and no figure from a run that
    ran out of memory (its status is listed)."""
    from workbench.studies.strategies.runner import summarize

    rows = [{"strategy": "full", "seed": seed, "status": status, "device": "cpu", "device_history": "cpu: ok",
             "ppl_before": 200.0, "ppl_after": after, "improvement_pct": 100 * (1 - after / 200), "peak_mem_mib": peak}
            for seed, (status, after, peak) in enumerate((("ok", 80.0, 10.0), ("fallback", 120.0, 20.0),
                                                          ("oom", float("nan"), 99.0)))]
    row = summarize(pd.DataFrame(rows)).set_index("strategy").loc["full"]
    assert row.improvement_mean_pct == pytest.approx(50.0) and row.ppl_after_mean == pytest.approx(100.0)
    assert row.improvement_std_pct == pytest.approx(pd.Series([60.0, 40.0]).std())  # 14.1, not the ppl's 28.3
    assert row.ppl_after_std == pytest.approx(pd.Series([80.0, 120.0]).std())
    assert row.peak_mem_mib == 20.0 and row.seeds == 2  # the oom run's 99 MiB is not a finished run's peak
    assert row.statuses == "fallback, ok, oom"


def test_a_summary_written_under_the_old_names_is_summarized_again_when_read_back(results_dir):
    """A results folder from before the rename: its summary.csv has improvement_pct_mean, and the findings,
    which read improvement_mean_pct, would end the report with a KeyError."""
    from workbench.studies.strategies.figures import findings
    from workbench.studies.strategies.runner import load_result, summarize

    runs = pd.DataFrame([{"run_id": "lora-s0-x", "strategy": "lora", "seed": 0, "status": "ok", "device": "cpu",
                          "device_history": "cpu: ok", "ppl_before": 100.0, "ppl_after": 80.0, "improvement_pct": 20.0,
                          "seeds": 1, "finished": "2026-11-20T00:00:00"}])
    (results_dir / "strategies").mkdir(parents=True)
    runs.to_csv(results_dir / "strategies" / "runs.csv", index=False)
    old = summarize(runs).rename(columns={"improvement_mean_pct": "improvement_pct_mean"})
    old.to_csv(results_dir / "strategies" / "summary.csv", index=False)
    result = load_result()
    assert result.tables["summary"].loc[0, "improvement_mean_pct"] == 20.0
    assert "(20.0% better; 1 seed)" in findings(result)[0][0]
    # a held-out perplexity that rose is said to be worse (it read "-238.3% better")
    worse = runs.assign(ppl_after=338.3, improvement_pct=-238.3)
    said = findings(StudyResult("strategies", runs=worse, tables={"summary": summarize(worse)}))[0][0]
    assert "100.0 -> 338.3 (238.3% worse; 1 seed)" in said, said


def test_the_notes_name_what_trains_outside_the_layers():
    """freeze_lower and adapter train every parameter outside the decoder layers and embeddings; their notes
    said "the final norm", and Bloom's include its input-side word_embeddings_layernorm. Bloom ties its head
    to the input embedding, which trains too: the notes and the strategies' help say so."""
    from transformers import BloomConfig

    torch.manual_seed(0)
    bloom = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=128, hidden_size=32, n_layer=6, n_head=4))
    emb_norm = ids(bloom.transformer.word_embeddings_layernorm.parameters())
    m, sel = apply_strategy(bloom, "freeze_lower")
    assert sel.notes[0] == ("trains decoder layers 3..5 of 6, transformer.word_embeddings_layernorm, transformer.ln_f "
                            "and the head")
    assert "training the LM head trains the input embedding too" in sel.notes[1]
    assert emb_norm | ids(m.get_input_embeddings().parameters()) <= trainable_ids(m)  # as before: what trains is unchanged
    _, sel = apply_strategy(fresh("qwen2"), "adapter")
    assert sel.notes[0] == "trains the last 2 decoder layers, model.norm and the head"
    for name in ("freeze_lower", "adapter"):
        assert "a tied head is the input embedding, which then trains too" in STRATEGIES[name].help


def test_study_1s_figures_say_where_their_figures_come_from():
    """Studies 2 and 3 title their figures with their provenance; study 1's said nothing of it."""
    from workbench.studies.strategies import figures as s1

    runs = pd.DataFrame({"strategy": ["full", "lora"], "status": ["ok", "fallback"], "ppl_after": [20.0, 30.0],
                         "ppl_before": [50.0, 50.0]})
    steps = pd.DataFrame({"strategy": ["full", "full"], "seed": [0, 0], "tokens": [10, 20], "loss": [3.0, 2.5]})
    assert s1.perplexity_spread(runs).layout.title.text.endswith("(measured on this machine)")
    assert s1.loss_curves(steps).layout.title.text == "Training loss per strategy (measured on this machine)"


def _embeddings(model) -> dict[str, torch.nn.Parameter]:
    """Every embedding table of `model` by name (input tokens, positions), found apart from model_parts."""
    return {f"{n}.{pn}": p for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)
            for pn, p in m.named_parameters(recurse=False)}


@pytest.mark.parametrize("strategy", ["freeze_lower", "adapter"])
@pytest.mark.parametrize("arch, tied, input_name", [
    ("gpt2", False, "transformer.wte.weight"), ("gpt2", True, "transformer.wte.weight"),
    ("opt", False, "model.decoder.embed_tokens.weight"), ("qwen2", True, "model.embed_tokens.weight")])
def test_the_layer_strategies_train_the_input_embedding_only_when_it_is_the_head(strategy, arch, tied, input_name):
    """freeze_lower freezes the embeddings: a tied head is the input embedding, so that one trains (the
    README says so); an untied model's input embedding and every model's position embedding stay frozen.
    Only the layers were checked: training every embedding on every architecture passed."""
    config = tiny_config(arch)
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    m, sel = apply_strategy(AutoModelForCausalLM.from_config(config), strategy)
    embeddings = _embeddings(m)
    assert input_name in embeddings and len(embeddings) == (2 if arch in ("gpt2", "opt") else 1)  # + positions
    trained = {n for n, p in embeddings.items() if p.requires_grad}
    assert trained == ({input_name} if tied else set()), trained
    assert m.get_output_embeddings().weight.requires_grad  # the head trains either way
    assert ("trains the input embedding too" in " ".join(sel.notes)) == tied


@pytest.mark.parametrize("arch", ARCHS)
def test_bitfit_trains_exactly_the_bias_vectors(arch):
    """BitFit trains every bias and nothing else (no norm weight, no embedding); a model without biases
    (Llama's) is not applicable. Nothing held which parameters it trained: also training norm weights passed."""
    model = fresh(arch)
    biases = {id(m.bias) for m in model.modules() if isinstance(getattr(m, "bias", None), torch.nn.Parameter)}
    if arch == "llama":
        assert not biases
        with pytest.raises(StrategyNotApplicable, match=r"^LlamaForCausalLM has no bias parameters, so BitFit has "
                                                        r"nothing to train$"):
            apply_strategy(model, "bitfit")
        return
    m, sel = apply_strategy(model, "bitfit")
    assert biases and trainable_ids(m) == biases
    assert sel.trainable_params == sum(p.numel() for p in m.parameters() if id(p) in biases)
    assert sel.trainable_tensors == len(biases) and sel.notes == ["trains bias vectors only (BitFit)"]


def test_qlora_counts_the_elements_its_4bit_weights_stand_for(tmp_path):
    """A 4-bit weight is stored packed, two elements a byte: QLoRA's total must count the unquantized
    model's elements (its `quant_state.shape`), so QLoRA and LoRA report the same trainable share. The
    model is loaded in 4 bits as study 1 loads it (transformers + bitsandbytes, on this CPU)."""
    from workbench.core.memory.plan import bnb_4bit_config

    config = Qwen2Config(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    _, lora = apply_strategy(AutoModelForCausalLM.from_pretrained(tmp_path), "lora", lora_rank=4)
    q4 = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=bnb_4bit_config(torch.float32),
                                              device_map={"": "cpu"})
    packed = [p for p in q4.parameters() if getattr(p, "quant_state", None) is not None]
    assert len(packed) == 14 and all(2 * p.numel() == torch.Size(p.quant_state.shape).numel() for p in packed)
    q4, qlora = apply_strategy(q4, "qlora", lora_rank=4)
    assert qlora.total_params == lora.total_params == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(
        tmp_path).parameters()) + lora.trainable_params
    assert qlora.trainable_params == lora.trainable_params and qlora.trainable_share == lora.trainable_share


def test_the_overlap_table_says_whether_the_models_pretraining_text_was_checked(tiny_base):
    """Held-out text is checked against the training text, and the embedded base's pretraining text; a
    hub model's pretraining text is not at hand, so its table says the model may have seen the text
    (the report's heading 'unseen in content' had stood without that caveat)."""
    import types

    from workbench.core.data import Corpus, Overlap
    from workbench.studies.strategies import figures, runner
    from workbench.studies.strategies.config import StrategiesConfig

    corpus = Corpus("target", ("some training text " * 10,), ("other held-out text " * 10,),
                    Overlap(0.0, 0.0, 0, 3, 300, 100, ("a.py",), 2))
    hub = runner.corpus_overlap(StrategiesConfig(model="Qwen/Qwen2-0.5B"), corpus)
    assert hub["pretraining_text"].tolist() == [
        "not known: Qwen/Qwen2-0.5B may have seen the held-out text in pretraining (its pretraining text is not "
        "at hand to check)"]
    assert "pretraining_text" in figures.overlap_table(types.SimpleNamespace(tables={"corpus_overlap": hub}))
    # the embedded base's was checked, on both rows (the target's and the source it was pretrained on)
    ours = runner.corpus_overlap(StrategiesConfig(base_size="tiny"), corpus)
    assert ours["pretraining_text"].tolist() == [
        "checked: held-out paragraphs that share a window with it are left out"] * 2, ours
    # how many held-out paragraphs that check left out: the target's, counted; a hub model's, not known
    table = figures.overlap_table(types.SimpleNamespace(tables={"corpus_overlap": ours}))
    assert table["seen_by_model_paragraphs"].iloc[0] == 2 and table["heldout_paragraphs_left_out"].iloc[0] == 3
    assert hub["seen_by_model_paragraphs"].isna().all()
    # the source's: every paragraph it left out (its training text is the base's pretraining text; the cell was empty)
    assert table["seen_by_model_paragraphs"].iloc[1] == table["heldout_paragraphs_left_out"].iloc[1] > 0


def test_the_device_chart_names_where_each_run_finished():
    """Its bars, all of one height, said where a run finished only on hover."""
    from workbench.studies.strategies.figures import device_timeline

    runs = pd.DataFrame([{"strategy": "full", "seed": 0, "status": "fallback", "device": "cpu",
                          "device_history": "cpu@13: oom in backward -> cpu: ok"},
                         {"strategy": "lora", "seed": 0, "status": "ok", "device": "cpu@13",
                          "device_history": "cpu@13: ok"},
                         {"strategy": "qlora", "seed": 0, "status": "oom", "device": None,
                          "device_history": "cpu@13: oom"}])
    bars = {t.name: list(t.text) for t in device_timeline(runs).data}
    assert bars == {"fallback": ["cpu"], "ok": ["cpu@13"], "oom": ["nowhere"]}


def test_the_loss_curves_are_the_finished_attempts_alone(results_dir):
    """A run that ran out of memory on the played card and fell back to the CPU logged steps on both: its
    loss curves and steps table are the CPU attempt's (nothing held this: a fault audit)."""
    import json

    from workbench.studies.strategies.tables import steps_frame

    run = results_dir / "strategies" / "r1"
    run.mkdir(parents=True)
    rows = [{"strategy": "full", "seed": 0, "step": s, "loss": 5.0 - s, "tokens": 64 * s, "device": d}
            for d, steps in (("cpu@10", (1, 2)), ("cpu", (1, 2, 3))) for s in steps]
    (run / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = steps_frame(pd.DataFrame({"run_id": ["r1"], "device": ["cpu"]}))
    assert got["step"].tolist() == [1, 2, 3] and set(got["device"]) == {"cpu"}


def test_freeze_lower_on_an_odd_number_of_layers_trains_the_larger_upper_half():
    """The test models have 4 and 6 layers, where n // 2 and n - n // 2 agree (a fault audit): on 5, the
    layers it trains and the note saying which must agree, and leave no layer of the upper half frozen."""
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=5, num_attention_heads=4,
                                                     num_key_value_heads=2))
    m, sel = apply_strategy(m, "freeze_lower")
    layers = model_parts(m).layers
    trained = [i for i, layer in enumerate(layers) if all(p.requires_grad for p in layer.parameters())]
    assert trained == [2, 3, 4] and not any(p.requires_grad for i in (0, 1) for p in layers[i].parameters())
    assert any(note.startswith("trains decoder layers 2..4 of 5") for note in sel.notes), sel.notes
