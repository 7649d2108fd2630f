"""How much would transformers' load with a device_map change the reserved prediction? (a probe of the model)

    .venv/bin/python tools/warmup_probe.py [RUNG ...]     # from the checkout's root (2 min here)

RUNG: default bf16_true bf16 lora qlora.

`from_pretrained(..., device_map=...)` first reserves one block the size of the model on the card
(transformers' `caching_allocator_warmup`: an fp16 tensor of the model's bytes, freed at once) and
then cuts the weights from it. The prediction's default load (`load="dtype"`) does not model that:
each weight arrives alone, as `model.to("cuda")` moves a model loaded on the host. This probe
replays the same simulated step twice, for Qwen2-0.5B at 4 x 512 on an RTX 4090 24GB: as predicted,
and with such a block allocated and freed before the load (its size: the bytes of the weights the
load places on the card). Both figures are modelled; no card measured either. The block's size is
approximate: transformers counts each parameter's bytes once (tied ones once) at the quantized
size for QLoRA, and does not shrink it for a fresh process.
"""

import sys

from workbench.core.memory import card_load
from workbench.core.memory import cuda_model
from workbench.core.memory.predict import predict

MiB = 2**20
BLOCK = -(10**13)  # a serial no event of the step uses
as_predicted = card_load.replay_load


def with_a_block_first(how, events, steps_of, ops, roles, casts, made):
    """The default load's timeline with the warm-up block allocated and freed before it."""
    events, steps_of, roles, made = as_predicted("dtype", events, steps_of, ops, roles, casts, made)
    n = next((i for i, op in enumerate(ops) if op.startswith(("forward", "backward", "optimizer"))), len(events))
    block = sum(nb for s, nb in events[:n] if nb > 0 and roles.get(s) == "weights")
    return card_load._loaded([(BLOCK, block), (BLOCK, -1), *events[:n]], n, events, steps_of, roles, [BLOCK], made)


card = cuda_model.card("RTX 4090 24GB")
print("Qwen2-0.5B, 4 x 512, RTX 4090 24GB; reserved MiB, modelled")
for rung in sys.argv[1:] or ["bf16_true", "bf16", "lora", "qlora"]:
    kw = dict(batch=4, seq=512, device="cuda", card=card)
    alone = predict("data/configs/qwen2-0.5b.json", rung, **kw)
    card_load.replay_load = with_a_block_first
    try:
        block = predict("data/configs/qwen2-0.5b.json", rung, **kw)
    finally:
        card_load.replay_load = as_predicted
    a, b = alone.reserved_peak_bytes, block.reserved_peak_bytes
    print(f"{rung:<12} each weight alone {a / MiB:>9,.0f}   one block first {b / MiB:>9,.0f}   "
          f"({100 * (a / b - 1):+.1f}%)", flush=True)
