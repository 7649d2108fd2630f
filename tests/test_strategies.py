import pytest
import torch
from conftest import ARCHS, tiny_config
from transformers import AutoModelForCausalLM

from workbench.core.trainable import STRATEGIES, StrategyNotApplicable, apply_strategy, model_parts


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


def test_unknown_strategy():
    with pytest.raises(ValueError, match="unknown strategy 'frezee'"):
        apply_strategy(fresh("qwen2"), "frezee")
    assert set(STRATEGIES) >= {"adapter", "freeze_lower", "freeze_embeddings", "full", "lora", "bitfit", "qlora"}
