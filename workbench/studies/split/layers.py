"""What is a "layer" for the split, and which layers' gradients arrive last in backward?

A layer is one block of the model's decoder stack (found structurally: the largest
`nn.ModuleList` of same-class children), or, outside the stack, the parameters one module owns
directly (embeddings, final norm, an untied LM head). A tied parameter is listed once, under
the first module that owns it; its gradient is final only at the end of backward, so it
arrives last whatever its position.

The arrival order is first guessed (reverse of registration, tied parameters last) and then
replaced by the order the engine's gradient hooks measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass
class Layer:
    name: str
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    tied: bool = False  # holds a parameter that more than one module uses

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.params)


def find_block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The decoder stack: the ModuleList of same-class modules holding the most parameters."""
    best, best_n = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            if len({type(m) for m in mod}) != 1:
                continue
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n = (name, mod), n
    return best


def owners(model: nn.Module) -> dict[nn.Parameter, list[str]]:
    """Every module (by name) that registers each parameter directly."""
    out: dict[nn.Parameter, list[str]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for _, p in mod.named_parameters(recurse=False):
            names = out.setdefault(p, [])
            if mname not in names:
                names.append(mname)
    return out


def split_layers(model: nn.Module, trainable_only: bool = True) -> list[Layer]:
    """Layers in registration order (roughly forward order), each parameter exactly once."""
    blocks = find_block_list(model)
    block_prefix = blocks[0] + "." if blocks else None
    own = owners(model)
    layers: dict[str, Layer] = {}
    for pname, p in model.named_parameters():  # deduplicated: a tied parameter appears once
        if trainable_only and not p.requires_grad:
            continue
        if block_prefix and pname.startswith(block_prefix):
            idx = pname[len(block_prefix):].split(".", 1)[0]
            key = f"{blocks[0]}.{idx}"
        else:
            key = pname.rsplit(".", 1)[0] if "." in pname else pname
        layer = layers.setdefault(key, Layer(key))
        layer.params.append((pname, p))
        layer.tied |= len(own.get(p, ())) > 1
    return list(layers.values())


def guessed_arrival_order(layers: list[Layer]) -> list[str]:
    """Backward visits layers in reverse; tied layers finish at the very end."""
    rev = [l.name for l in reversed(layers)]
    return [n for n in rev if not _is_tied(layers, n)] + [n for n in rev if _is_tied(layers, n)]


def _is_tied(layers: list[Layer], name: str) -> bool:
    return next(l for l in layers if l.name == name).tied


def last_arriving(order: list[str], sizes: dict[str, int], k: float) -> tuple[set[str], float]:
    """The layers whose gradients arrive last, holding as close to a share k of the parameters
    as whole layers allow (a layer goes in when at least half of it fits under k).

    Returns (layer names, the share of parameters they actually hold).
    """
    total = sum(sizes.values())
    chosen: set[str] = set()
    held = 0
    if k >= 1.0:
        return set(order), 1.0
    for name in reversed(order):
        n = sizes[name]
        if held + n / 2 <= k * total:
            chosen.add(name)
            held += n
        else:
            break
    return chosen, held / total if total else 0.0



def probe_k(order: list[str], sizes: dict[str, int], k_actual: float, step: float, spread: float) -> float:
    """A k to move to once, to measure backward at a second share: `step` from the share in use
    (downward where it can: less on the accelerator, no more memory there), farther where whole
    layers would round the share back to within `spread` of it (a fit needs that spread)."""
    down = k_actual >= step
    k = k_actual - step if down else k_actual + step
    while 0.0 < k < 1.0:
        if abs(last_arriving(order, sizes, k)[1] - k_actual) >= spread:
            return k
        k = round(k - 0.05 if down else k + 0.05, 6)
    return 0.0 if down else 1.0
