"""What trains under each transfer strategy, chosen from the model's structure, not its names.

    parts = model_parts(model)                       # layers, embeddings, head, tied?
    model, sel = apply_strategy(model, "freeze_lower")
    sel.trainable_params, sel.trainable_share       # in elements, not tensors

The published study picked layers by substring ("layers.1" also matched layers 10-19) and
counted tensors. Here the decoder stack is found as the model's largest ModuleList of identical
blocks, the embeddings and head through transformers' `get_input_embeddings` /
`get_output_embeddings`, and tied weights by identity. This works for Qwen2, Llama, GPT-2, OPT,
GPT-NeoX and any other causal LM built the same way. A hybrid (Jamba: Mamba and attention layers in
one list) has no such stack: the strategies chosen from it are not applicable (a skipped row in study
1), and full fine-tuning, LoRA and BitFit, which need no stack, still train it.

Tied embeddings (Qwen2-0.5B, GPT-2, OPT): the LM head *is* the input embedding. A strategy that
trains the head therefore trains the embedding too, and one that freezes the embedding freezes
the head; the selection says so in `notes`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from workbench.core.config import ConfigError


@dataclass
class ModelParts:
    layers: nn.ModuleList
    layers_name: str
    input_embeddings: nn.Embedding
    position_embeddings: list[nn.Module]
    head: nn.Module | None
    tied: bool
    others: list[nn.Parameter]  # final norms, projections: neither layers, embeddings nor head


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in module.parameters()}.values())


def model_parts(model: nn.Module) -> ModelParts:
    """Find the decoder stack, embeddings, head and tying of a causal LM structurally."""
    stacks = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            kinds = {type(m) for m in mod}
            if len(kinds) == 1:
                size = sum(p.numel() for p in mod.parameters())
                stacks.append((size, name, mod))
    if not stacks:  # a hybrid (Jamba: Mamba and attention layers in one list) has no uniform decoder stack
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
        biggest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=[])
        kinds = ", ".join(dict.fromkeys(type(m).__name__ for m in biggest)) or "no layer list"
        raise StrategyNotApplicable(
            f"{type(model).__name__} has no stack of identical decoder layers (its layers: {kinds}): the strategies "
            f"that select from it (adapter, freeze_lower, freeze_embeddings) need one; full, lora and bitfit do not")
    _, layers_name, layers = max(stacks, key=lambda t: t[0])
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is emb.weight
    in_layers = {id(p) for p in layers.parameters()}
    positional = [
        m for m in model.modules()
        if isinstance(m, nn.Embedding) and m is not emb and all(id(p) not in in_layers for p in m.parameters())
    ]
    named = {id(p) for p in emb.parameters()}
    named |= {id(p) for m in positional for p in m.parameters()}
    named |= {id(p) for p in head.parameters()} if head is not None else set()
    others = [p for p in _unique_params(model) if id(p) not in in_layers and id(p) not in named]
    return ModelParts(layers, layers_name, emb, positional, head, tied, others)


@dataclass
class Selection:
    """What a strategy trains, counted in elements (tied weights once)."""

    strategy: str
    trainable_params: int
    total_params: int
    trainable_tensors: int
    total_tensors: int
    notes: list[str] = field(default_factory=list)
    trainable_set: str = ""  # a fingerprint of which parameters train and of what every one is: equal, one experiment

    @property
    def trainable_share(self) -> float:
        return self.trainable_params / self.total_params if self.total_params else 0.0

    def as_row(self) -> dict:
        return {
            "strategy": self.strategy,
            "trainable_params": self.trainable_params,
            "total_params": self.total_params,
            "trainable_share": self.trainable_share,
            "trainable_tensors": self.trainable_tensors,
            "total_tensors": self.total_tensors,
            "notes": "; ".join(self.notes),
            "trainable_set": self.trainable_set,
        }


def n_elements(p: torch.Tensor) -> int:
    """Elements a parameter stands for: a 4-bit packed weight counts its unpacked shape."""
    qs = getattr(p, "quant_state", None)
    if qs is not None and getattr(qs, "shape", None) is not None:
        return int(torch.Size(qs.shape).numel())
    return p.numel()


def count_selection(model: nn.Module, strategy: str, notes: list[str] | None = None) -> Selection:
    params = _unique_params(model)
    train = [p for p in params if p.requires_grad]
    # what trains, and what the frozen rest is made of (QLoRA's 4-bit base is not LoRA's fp32 one)
    kinds = "\n".join(sorted(f"{n}:{p.requires_grad}:{p.dtype}:{type(p).__name__}" for n, p in model.named_parameters()))
    return Selection(
        strategy,
        sum(n_elements(p) for p in train),
        sum(n_elements(p) for p in params),
        len(train),
        len(params),
        notes or [],
        hashlib.sha1(kinds.encode()).hexdigest()[:12],
    )


def _set_trainable(model: nn.Module, trainable: list[nn.Parameter]) -> None:
    keep = {id(p) for p in trainable}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)


def _head_params(parts: ModelParts, notes: list[str]) -> list[nn.Parameter]:
    if parts.head is None:
        return []
    if parts.tied:
        notes.append("tied embeddings: training the LM head trains the input embedding too, "
                     "and backward runs through every frozen layer")
    return _unique_params(parts.head)


def _full(model, parts, notes):
    return _unique_params(model)


def _freeze_embeddings(model, parts, notes):
    frozen = {id(p) for p in parts.input_embeddings.parameters()}
    frozen |= {id(p) for m in parts.position_embeddings for p in m.parameters()}
    if parts.tied:
        notes.append("tied embeddings: the LM head is the input embedding, so it is frozen too")
    return [p for p in _unique_params(model) if id(p) not in frozen]


def _upper_layers(parts: ModelParts, n: int, notes: list[str]) -> list[nn.Parameter]:
    chosen = list(parts.layers)[-n:] if n > 0 else []
    return [p for layer in chosen for p in layer.parameters()]


def _others_named(model: nn.Module, parts: ModelParts) -> str:
    """The modules of `parts.others`, by name: ", model.norm" on Qwen2; Bloom's also hold its input-side
    word_embeddings_layernorm, OPT's project_in (not only "the final norm")."""
    names = {id(p): n for n, p in model.named_parameters()}
    return "".join(f", {m}" for m in dict.fromkeys(names[id(p)].rpartition(".")[0] for p in parts.others))


def _freeze_lower(model, parts, notes):
    n = len(parts.layers)
    upper = n - n // 2
    notes.append(f"trains decoder layers {n - upper}..{n - 1} of {n}{_others_named(model, parts)} and the head")
    return _upper_layers(parts, upper, notes) + parts.others + _head_params(parts, notes)


def _adapter(model, parts, notes):
    n = min(2, len(parts.layers))
    notes.append(f"trains the last {n} decoder layers{_others_named(model, parts)} and the head")
    return _upper_layers(parts, n, notes) + parts.others + _head_params(parts, notes)


def _bitfit(model, parts, notes):
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    if not biases:
        raise StrategyNotApplicable(f"{type(model).__name__} has no bias parameters, so BitFit has nothing to train")
    notes.append("trains bias vectors only (BitFit)")
    return biases


def _is_4bit(model: nn.Module) -> bool:
    return any(type(m).__name__ == "Linear4bit" for m in model.modules())


def keep_4bit_backward(model: nn.Module) -> int:
    """Stop bitsandbytes from repacking a 4-bit layer for CPU inference; returns the layers changed.

    On a CPU with AVX512-BF16, bitsandbytes 0.50's `Linear4bit.forward` in eval mode without grad
    (a held-out evaluation before training) repacks the weight for its inference kernel, for
    good. Training afterwards runs that kernel, which has no backward: no gradient flows through
    the frozen 4-bit layers (torch warns "gemv_4bit: an autograd kernel was not registered"), so
    every LoRA adapter below the last layer learns from a wrong gradient, with no error. Measured
    here: the input's gradient through one layer went from a sum of 3,725 to None after one eval
    pass. With the CPU kernel switched off, evaluation takes bitsandbytes' plain 4-bit path."""
    n = 0
    for m in model.modules():
        if type(m).__name__ == "Linear4bit" and getattr(m, "support_avx512bf16_for_cpu", False):
            m.support_avx512bf16_for_cpu = False
            n += 1
    return n


class StrategyNotApplicable(ValueError):
    """The strategy cannot apply to this model (BitFit without biases, QLoRA without bitsandbytes)."""


@dataclass(frozen=True)
class Strategy:
    name: str
    help: str
    select: Callable | None = None  # (model, parts, notes) -> trainable params; None: see `apply_strategy`
    by_structure: bool = True  # picks by layers/embeddings/head (model_parts); full and BitFit need none


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("adapter", "last 2 decoder layers + what is outside the layers and embeddings (the final norm; "
                            "on some models input-side norms or projections) + LM head; a tied head is the input "
                            "embedding, which then trains too", _adapter),
        Strategy("freeze_lower", "freeze embeddings and the lower half of the decoder; the upper half, what is "
                                 "outside the layers and embeddings (the final norm; on some models input-side norms "
                                 "or projections) and the LM head train, and a tied head is the input embedding, "
                                 "which then trains too", _freeze_lower),
        Strategy("freeze_embeddings", "train everything but the input (and position) embeddings", _freeze_embeddings),
        Strategy("full", "full fine-tuning", _full, by_structure=False),
        Strategy("lora", "LoRA (peft) on every linear layer of the decoder (rank: lora_rank, 8 by default)", None),
        Strategy("bitfit", "biases only (where the model has biases)", _bitfit, by_structure=False),
        Strategy("qlora", "4-bit NF4 base (bitsandbytes) + LoRA (rank: lora_rank, 8 by default)", None),
    )
}
PAPER_STRATEGIES = ("adapter", "freeze_lower", "freeze_embeddings", "full")


def lora_config(model: nn.Module, rank: int, targets: str | list[str]):
    """peft's LoraConfig as the workbench sets it: alpha 2 x rank, no dropout, `targets` as peft
    reads them. `fan_in_fan_out` is on when the model has transformers' Conv1D layers (GPT-2's, whose
    weight is stored in x out): peft turned it on for them anyway, after a warning on every GPT-2
    LoRA run. A 4-bit model's layers are Linear4bit by then (quantized transposed), so it stays off."""
    from peft import LoraConfig
    from transformers.pytorch_utils import Conv1D

    conv1d = any(isinstance(m, Conv1D) for m in model.modules())
    _check_lora_rank(model, rank, targets, Conv1D)
    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets,
                      task_type="CAUSAL_LM", fan_in_fan_out=conv1d)


def names_module(name: str, targets) -> bool:
    """Whether one of LoRA's `targets` names the module called `name`, as peft matches a list of
    target names: the whole name, or its last dotted parts."""
    return any(name == t or name.endswith("." + t) for t in targets)


def check_lora_rank(config, rank: int, *, trust_remote_code: bool = False) -> None:
    """`lora_config`'s check of `rank`, from a model config alone (a meta model: no weights): a study
    says a bad lora_rank before its first run, not when its first LoRA run starts after the others."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    _check_lora_rank(model, rank, "all-linear", Conv1D)


def _check_lora_rank(model: nn.Module, rank: int, targets: str | list[str], conv1d: type) -> None:
    """A rank-r update of an in x out layer has rank at most min(in, out): a lora_rank above that for
    every layer LoRA adapts is a mistake (a typed 100000 ran for minutes before anything was said)."""
    if isinstance(targets, str) and targets != "all-linear":  # a regular expression: peft's to match
        return
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    usable = 0
    for name, m in model.named_modules():
        if targets == "all-linear":
            chosen = m is not head
        else:
            chosen = names_module(name, targets)
        if chosen and isinstance(m, nn.Linear):
            usable = max(usable, min(m.in_features, m.out_features))
        elif chosen and isinstance(m, conv1d):
            usable = max(usable, min(m.weight.shape))
    if usable and rank > usable:
        raise ConfigError(f"lora_rank {rank:,} is more than any layer LoRA adapts can use: an update of an "
                          f"in x out layer has rank at most min(in, out), {usable:,} here; use a smaller lora_rank")


def apply_strategy(model: nn.Module, name: str, *, lora_rank: int = 8) -> tuple[nn.Module, Selection]:
    """Mark what trains under `name`; returns the (possibly wrapped) model and its selection.

    The model is changed in place; start each strategy from a fresh copy of the base.
    """
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
    notes: list[str] = []
    if name in ("lora", "qlora"):
        from peft import get_peft_model

        if name == "qlora":
            if not _is_4bit(model):
                raise StrategyNotApplicable("qlora needs a model loaded in 4-bit (bitsandbytes); "
                                            "load it with a BitsAndBytesConfig(load_in_4bit=True) first")
            keep_4bit_backward(model)
            notes.append("base weights quantized to 4-bit NF4 by bitsandbytes; LoRA adapters in fp32")
        model = get_peft_model(model, lora_config(model, lora_rank, "all-linear"))
        notes.append(f"LoRA rank {lora_rank} on every linear layer of the decoder (head excluded)")
        return model, count_selection(model, name, notes)
    parts = model_parts(model) if STRATEGIES[name].by_structure else None
    _set_trainable(model, STRATEGIES[name].select(model, parts, notes))
    return model, count_selection(model, name, notes)
