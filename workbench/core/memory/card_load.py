"""How a training run's weights reach the card, replayed before its steps (the allocator's cache
keeps what the load left: a segment a converted weight took part of is not given back).

    from workbench.core.memory.predict import predict
    predict(config, "qlora", device="cuda", load="host")   # as this workbench's runs load a plan now

`load` (predict's argument, LOADS):
- "dtype" (the default): every weight reaches the card in the dtype it trains in, QLoRA's already in
  4 bits, one tensor at a time in module order: a model loaded on the host and moved with
  `model.to("cuda")` (the timeline as simulated, nothing added). `from_pretrained` with a device_map
  (which a bitsandbytes-quantized model always gets) first reserves one block the size of the model
  (transformers' `caching_allocator_warmup`) and cuts the weights from it: not modelled
  (tools/warmup_probe.py replays such a block; docs/prediction.md gives what it showed);
- "host": as this workbench's own runs load a plan (ladder.rungs.measure, since 2026-11-26, after
  that day's card record): converted on the host (a pure-half plan's cast), QLoRA's linear layers
  quantized onto the card one at a time (`quantize_onto_card`), the rest moved after, then
  `torch.cuda.empty_cache()`;
- "card": as those runs loaded a plan before (the card records of 2026-11-22 and 2026-11-26): the
  whole model moved to the card in fp32 and converted there (`cast_on_card`).
"""

from __future__ import annotations

import math

from workbench.core.memory.accounting import EMPTY_CACHE, EMPTY_CACHE_SERIAL
from workbench.core.memory.live_bytes import model_tensors

LOADS = ("dtype", "host", "card")


def loaded_on_card(model, half_dtype, serials_of) -> tuple:
    """What a load converts (cast_on_card, quantize_onto_card), in `model.to("cuda")`'s order:
    (serials, fp32 bytes, held) per tensor or group of `model` as apply_trainable made it. fp32
    bytes > 0: a weight that reaches the card in fp32 and is converted there: cast to `half_dtype`
    (`Module._apply` frees each fp32 copy at once), or quantize_4bit's 4-bit weight and state (held:
    on the card path its loop keeps every replaced layer, so the fp32 weights go when it returns);
    0: a frozen tensor moved as it is (QLoRA's embedding, norms, biases). Trained tensors (adapters,
    made after it) are left out. () if nothing is converted."""
    groups = {}
    for m in model.modules():  # a 4-bit weight and its quantization state (as live_bytes.model_tensors walks it)
        if (qs := getattr(getattr(m, "weight", None), "quant_state", None)) is not None:
            own = len([*m.parameters(), *m.buffers()])
            groups[id(m.weight)] = ([m.weight, *model_tensors(m)[own:]], 4 * math.prod(qs.shape), True)
    units, seen = [], set()
    for t in (t for m in model.modules() for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]):
        tensors, fp32, held = groups.get(id(t)) or ([t], 4 * t.numel() if t.dtype == half_dtype else 0, False)
        if (fp32 or not t.requires_grad) and (ss := tuple(s for s in serials_of(tensors) if s not in seen)):
            seen.update(ss)
            units.append((ss, fp32, held))
    return tuple(units) if any(fp32 for _, fp32, _ in units) else ()


def cast_on_card(events, steps_of, ops, roles: dict, casts, made):
    """The timeline of a setup loaded as the measured runs load a plan (`model.to("cuda")`, then
    apply_trainable converts: a pure-half plan's cast, QLoRA's quantize_4bit). `casts` (loaded_on_card):
    each tensor as it reaches the card (a converted one in fp32), then each conversion (its tensors
    made, the fp32 one freed then, or after the last if held), then empty_cache, which keeps a segment
    a converted weight took part of (on the H200 the fp32 embedding's, where the forward's cuBLAS
    workspace then went). Not replayed: quantize_4bit's temporaries (an fp32 absmax, 1/64 of a
    weight's elements); adapters made before the runs' empty_cache, and peft's 16-bit adapters
    before it casts them to fp32 (small pool: the H200's figures stay). `made` is shifted with the
    events. Returns (events, steps_of, roles, made)."""
    n, setup, units = _setup_of(events, ops, casts)
    if not any(fp32 for _, fp32, _ in units):
        return events, steps_of, roles, made  # nothing converted (an fp32 or mixed-precision plan): as it is
    twin = {ss[0]: -(10**12) - ss[0] for ss, fp32, _ in units if fp32}  # serials no event uses (after_a_run: -1 down)
    load, late = [(twin[ss[0]], fp32) if fp32 else (ss[0], setup[ss[0]]) for ss, fp32, _ in units], []
    for ss, _, held in (u for u in units if u[1]):  # each conversion: its tensors made, the fp32 one freed
        load += [(s, setup[s]) for s in ss]
        (late if held else load).append((twin[ss[0]], -1))
    load += late + [(EMPTY_CACHE_SERIAL, EMPTY_CACHE)]
    placed = {s for ss, _, _ in units for s in ss}
    rest = [(s, nb) for s, nb in events[:n] if not (nb > 0 and s in placed)]
    return _loaded(load + rest, n, events, steps_of, roles, twin.values(), made)


def _setup_of(events, ops, casts):
    """(index of the step's first op, the load's allocations {serial: bytes}, the units of `casts`
    that allocate in the load, each (serials, fp32 bytes, held))."""
    # the load: everything before a step's first op (a free in it is tagged "", not "setup")
    n = next((i for i, op in enumerate(ops) if op.startswith(("forward", "backward", "optimizer"))), len(events))
    setup = {s: nb for s, nb in events[:n] if nb > 0}
    return n, setup, [u for u in ((tuple(s for s in ss if s in setup), *more) for ss, *more in casts) if u[0]]


def _loaded(load, n, events, steps_of, roles: dict, twins, made):
    """The timeline with `load` in place of its first `n` events (the load as simulated): (events,
    steps_of, roles with the fp32 copies' `twins` as weights, `made` shifted with the events)."""
    shift = len(load) - n
    return (load + list(events[n:]), [steps_of[0] if steps_of else 0] * len(load) + list(steps_of[n:]),
            {**roles, **{t: "weights" for t in twins}},
            [(w[0], w[1], w[2] + shift) if len(w) == 3 and w[2] is not None else w for w in made])


def quantize_onto_card(events, steps_of, ops, roles: dict, casts, made):
    """The timeline of a setup loaded as this workbench's runs load a plan now (`load="host"`): the
    model stays on the host while apply_trainable converts it there, and quantize_4bit (given the
    card) quantizes each QLoRA linear layer onto it in turn: the weight's fp32 copy reaches the card,
    its 4-bit weight and quantization state are made there, the copy is freed (bitsandbytes'
    `Params4bit._quantize`), so the card holds one fp32 weight at a time. Then an empty_cache (peft's
    prepare_model_for_kbit_training calls one after its fp32 casts), peft's adapters (made on the card,
    beside their 4-bit base layers), `model.to("cuda")`'s move of the rest as it is, and another
    empty_cache (measure()'s, before the steps). A setup with no 4-bit weight converts nothing on the
    card: its timeline is returned as it is (the "dtype" load). Not replayed: quantize_4bit's
    temporaries (an fp32 absmax, 1/64 of a weight's elements); peft's 16-bit adapters before it casts
    them to fp32 (small pool). `made` is shifted with the events.
    Returns (events, steps_of, roles, made)."""
    n, setup, units = _setup_of(events, ops, casts)
    quantized = [u for u in units if u[1] and u[2]]  # held: quantize_4bit's 4-bit groups (a pure-half cast is not)
    if not quantized:
        return events, steps_of, roles, made
    twin = {ss[0]: -(10**12) - ss[0] for ss, _, _ in quantized}  # serials no event uses (after_a_run: -1 down)
    load = []
    for ss, fp32, _ in quantized:
        load += [(twin[ss[0]], fp32), *((s, setup[s]) for s in ss), (twin[ss[0]], -1)]
    load.append((EMPTY_CACHE_SERIAL, EMPTY_CACHE))  # prepare_model_for_kbit_training's (auto_clear_cache)
    # peft's adapters, then model.to's move of the frozen rest; what else came before the step (train()'s
    # small temporaries) after measure()'s empty_cache, as cast_on_card places it
    placed = {s for ss, _, _ in units for s in ss}
    rest = [(s, nb) for s, nb in events[:n] if not (nb > 0 and s in placed)]
    load += [e for e in rest if roles.get(e[0]) == "weights"]
    load += [(s, setup[s]) for ss, fp32, held in units if not (fp32 and held) for s in ss]
    load += [(EMPTY_CACHE_SERIAL, EMPTY_CACHE)] + [e for e in rest if roles.get(e[0]) != "weights"]
    return _loaded(load, n, events, steps_of, roles, twin.values(), made)


def replay_load(how: str, events, steps_of, ops, roles: dict, casts, made):
    """The timeline with the load `how` (LOADS) before the steps: (events, steps_of, roles, made)."""
    if how == "card":
        return cast_on_card(events, steps_of, ops, roles, casts, made)
    if how == "host":
        return quantize_onto_card(events, steps_of, ops, roles, casts, made)
    return events, steps_of, roles, made
