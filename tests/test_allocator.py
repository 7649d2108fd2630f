"""The allocator model over a long run: the last simulated step repeated until the cache is steady.

    .venv/bin/python -m pytest tests/test_allocator.py -q        # about half a minute
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import tiny_config
from workbench.core.memory import allocator
from workbench.core.config import ConfigError
from workbench.core.memory.accounting import EMPTY_CACHE
from workbench.core.memory.plan import rung
from workbench.core.memory.predict import predict, simulate

MiB = 2**20


def steps_timeline(steps: int, *, keep_each_step: bool, free_last_kept: bool = False):
    """A synthetic training loop: weights (12 MiB), then per step a 4 MiB and a 6 MiB temporary and
    a 12 MiB tensor the step keeps (a loss kept on the card, say): either kept forever (a list that
    grows) or freed by the next step (`free_last_kept`)."""
    events, steps_of, serial = [(1, 12 * MiB)], [0], 1
    kept_before = None
    for step in range(steps):
        a, b, kept = serial + 1, serial + 2, serial + 3
        serial += 3
        ops = [(a, 4 * MiB), (b, 6 * MiB), (a, -1)]
        if keep_each_step:
            ops.append((kept, 12 * MiB))
            if free_last_kept and kept_before is not None:
                ops.append((kept_before, -1))
            kept_before = kept
        ops.append((b, -1))
        events += ops
        steps_of += [step] * len(ops)
    return events, steps_of


def test_a_step_that_keeps_a_tensor_for_good_never_settles_and_one_that_frees_it_does():
    events, steps_of = steps_timeline(3, keep_each_step=True)
    leak = allocator.replay(events, {}, steps_of=steps_of, simulated_steps=3, until=allocator.STEADY, max_steps=20)
    assert leak.steady is False and leak.replayed_steps == 20
    # one 12 MiB segment per step kept, the weights' own, and the 20 MiB one the temporaries share
    assert leak.reserved_peak_bytes == 12 * MiB + 20 * MiB + 20 * 12 * MiB
    events, steps_of = steps_timeline(3, keep_each_step=True, free_last_kept=True)
    fine = allocator.replay(events, {}, steps_of=steps_of, simulated_steps=3, until=allocator.STEADY, max_steps=20)
    assert fine.steady is True and fine.replayed_steps < 20
    assert fine.reserved_peak_bytes == 12 * MiB + 20 * MiB + 2 * 12 * MiB  # this step's kept and the last one's
    # a set number of steps: that many, cut or repeated
    assert allocator.replay(events, {}, steps_of=steps_of, simulated_steps=3, until=5).replayed_steps == 5
    two = allocator.replay(events, {}, steps_of=steps_of, simulated_steps=3, until=1)
    assert (two.replayed_steps, two.reserved_peak_bytes) == (1, 12 * MiB + 20 * MiB + 12 * MiB)


def test_a_step_that_does_not_repeat_the_one_before_is_not_repeated():
    events, steps_of = steps_timeline(3, keep_each_step=False)
    events, steps_of = events + [(99, 30 * MiB), (99, -1)], steps_of + [2, 2]  # step 2 allocates more than step 1
    assert allocator.StepTemplate.of(events, steps_of, {}, {}, 2) is None
    r = allocator.replay(events, {}, steps_of=steps_of, simulated_steps=3, until=allocator.STEADY)
    assert (r.replayed_steps, r.steady) == (3, False)  # the simulated steps only, and said
    events, steps_of = steps_timeline(3, keep_each_step=False)
    events, steps_of = events + [(1, -1)], steps_of + [2]  # step 2 frees the weights, made before step 1
    assert allocator.StepTemplate.of(events, steps_of, {}, {}, 2) is None
    events, steps_of = steps_timeline(3, keep_each_step=False)
    events.insert(len(events) - 1, (0, EMPTY_CACHE))
    steps_of.insert(len(steps_of) - 1, 2)
    assert ("e",) in allocator.StepTemplate.of(events, steps_of, {}, {}, 2).ops


def random_loop(rng: random.Random, steps: int = 3):
    """A random training loop: a weight, then `steps` identical steps of 3-9 allocations of 12, 24
    or 36 MiB, each freed later in its step or (seven in ten) at a random point of the next step."""
    n = rng.randint(3, 9)
    sizes = [rng.choice((12, 24, 36)) * MiB for _ in range(n)]
    carried = [rng.random() < 0.7 for _ in range(n)]
    ops = [("a", j) for j in range(n)]
    for j in range(n):
        if carried[j]:
            ops.insert(rng.randint(0, len(ops)), ("free the step before's", j))
        else:
            ops.insert(rng.randint(ops.index(("a", j)) + 1, len(ops)), ("free", j))
    events, steps_of, prev = [(1, rng.choice((12, 24, 36)) * MiB)], [0], None
    for step in range(steps):
        cur = [2 + step * n + j for j in range(n)]
        for kind, j in ops:
            if kind == "a":
                events.append((cur[j], sizes[j]))
            elif kind == "free":
                events.append((cur[j], -1))
            elif prev is not None:
                events.append((prev[j], -1))
            else:
                continue
            steps_of.append(step)
        prev = cur
    return events, steps_of


def test_a_steady_replay_has_the_peaks_of_the_longest_run():
    """Steady means every later step repeats: its peaks are those of replaying all MAX_STEPS. The
    state must say which allocation holds each block, not only the sizes: in seed 93 two steps end
    with the same sizes in the same places, held by allocations freed in a different order next
    step (sizes alone stop after 7 steps at 204 MiB reserved; the run reaches 240 MiB)."""
    settled = 0
    for seed in [*range(60), 93]:
        events, steps_of = random_loop(random.Random(seed))
        steady = allocator.replay(events, {}, steps_of=steps_of, simulated_steps=3, until=allocator.STEADY)
        full = allocator.replay(events, {}, steps_of=steps_of, simulated_steps=3, until=allocator.MAX_STEPS)
        assert full.replayed_steps == allocator.MAX_STEPS
        if steady.steady:
            settled += 1
            assert (steady.allocated_peak_bytes, steady.reserved_peak_bytes) == (
                full.allocated_peak_bytes, full.reserved_peak_bytes), seed
    assert settled >= 50  # the check is not vacuous: most loops settle
    events, steps_of = random_loop(random.Random(93))
    assert allocator.replay(events, {}, steps_of=steps_of, simulated_steps=3,
                            until=allocator.STEADY).reserved_peak_bytes == 240 * MiB


@pytest.mark.parametrize("name", ["fp32", "bf16_true_lora"])
def test_repeating_the_last_simulated_step_replays_what_simulating_more_steps_gives(name):
    """Six steps simulated over fake tensors against three simulated and repeated: at every step
    the same peaks, segments and per-stream cache."""
    config = tiny_config("qwen2")
    six = simulate(config, rung(name), batch=2, seq=32, steps=6, target="cuda", sm=90)
    three = simulate(config, rung(name), batch=2, seq=32, steps=3, target="cuda", sm=90)
    for k in range(2, 7):
        want = allocator.replay(six.timeline, six.timeline_roles, steps_of=six.timeline_steps, simulated_steps=6, until=k)
        got = allocator.replay(three.timeline, three.timeline_roles, steps_of=three.timeline_steps, simulated_steps=3,
                               until=k)
        assert got.replayed_steps == want.replayed_steps == k
        assert (got.allocated_peak_bytes, got.reserved_peak_bytes, got.segments, got.reserved_by_stream) == (
            want.allocated_peak_bytes, want.reserved_peak_bytes, want.segments, want.reserved_by_stream), k


def test_a_cuda_prediction_replays_until_the_cache_is_steady_or_as_many_steps_as_asked():
    config = tiny_config("qwen2")
    p = predict(config, "fp32", batch=2, seq=32, device="cuda", card="RTX 4090 24GB")
    assert p.steady is True and p.replayed_steps >= 3 and "still changing" not in p.note
    q = predict(config, "fp32", batch=2, seq=32, device="cuda", card="RTX 4090 24GB", replay_steps=2)
    assert (q.replayed_steps, q.steady) == (2, None)
    assert q.reserved_peak_bytes <= p.reserved_peak_bytes  # reserved never shrinks without empty_cache
    # the segments it ends with (what a card's memory_snapshot lists) add up to that reserved peak
    assert sum(float(size) * n for size, n in p.segment_sizes.items()) * MiB == p.reserved_peak_bytes
    assert p.row()["segment_sizes"] == p.segment_sizes and "20" in p.segment_sizes
    short = predict(config, "fp32", batch=2, seq=32, steps=2, device="cuda")  # no two like steps to repeat
    assert short.steady is False and "still changing after 2" in short.note


def test_the_least_reserved_cap_is_the_least_cap_a_replay_runs_under():
    """least_reserved (a bisection from the bytes live at once up to the uncapped peak) against
    every 2 MiB cap tried in turn from zero, over random loops replayed until steady."""
    def runs(events, steps_of, cap):
        try:
            allocator.replay(events, {}, steps_of=steps_of, simulated_steps=3, until=allocator.STEADY, limit=cap)
        except torch.OutOfMemoryError:
            return False
        return True

    for seed in range(8):
        events, steps_of = random_loop(random.Random(seed))
        upper = allocator.replay(events, {}, steps_of=steps_of, simulated_steps=3,
                                 until=allocator.STEADY).reserved_peak_bytes
        scanned = next(cap for cap in range(0, upper + 1, 2 * MiB) if runs(events, steps_of, cap))
        lower = allocator.live_rounded_peak(events, {})
        assert lower <= scanned <= upper
        assert allocator.least_reserved(events, {}, upper=upper, steps_of=steps_of, simulated_steps=3,
                                        until=allocator.STEADY) == scanned, seed


def test_a_fresh_process_makes_the_backward_workspace_inside_a_freed_block_and_pays_a_segment():
    """What the H200's allocator trace showed (2026-11-26): the backward's first matmul makes its
    32 MiB cuBLAS workspace after its output, from the freed 298 MiB logits block; the rest of that
    segment cannot take the next step's logits, which need a new one. Made before the step ("held"),
    the workspace has a segment of its own and the logits' segment is reused."""
    MiB = 2**20
    logits, grad, ws = 297 * MiB, 400 * MiB, 32 * MiB  # grad: the first mm's output (fp32's tied embedding's)
    step = [(1, logits), (1, -1), (2, grad), (3, logits), (2, -1), (3, -1)]  # forward, backward's first mm, next step
    # made right after event 2, the first mm's output
    fresh = allocator.replay(step, {}, [("cuBLAS workspace (backward)", ws, 2)])
    held = allocator.replay(step, {}, [("cuBLAS workspace (backward)", ws)])
    assert held.reserved_peak_bytes == (32 + 298 + 400) * MiB  # the logits' segment is reused
    assert fresh.reserved_peak_bytes == (298 + 400 + 298) * MiB  # the workspace split the cached 298 MiB block
    assert fresh.allocated_peak_bytes == held.allocated_peak_bytes
    # the lower bound of the least cap counts the workspace from where it is made
    assert allocator.live_rounded_peak(step, {}, [("w", ws, 2)]) == logits + grad + ws
    assert allocator.live_rounded_peak([(1, logits), (1, -1), (2, grad)], {}, [("w", ws, 2)]) == grad + ws
    assert allocator.live_rounded_peak([(1, logits), (1, -1), (2, 8 * MiB)], {}, [("w", ws, 2)]) == logits


def test_the_workspaces_are_placed_after_the_first_cublas_op_of_forward_and_of_backward():
    from workbench.core.memory import cuda_model as cm

    card = cm.card("H100 80GB")
    ops = ["setup", "forward: embedding.default", "forward: addmm.default", "forward: mm.default", "",
           "backward: _log_softmax_backward_data.default", "backward: mm.default", "backward: bmm.default"]
    (f, nf, at_f), (b, nb, at_b) = cm.workspaces_in(card, ops)
    assert (at_f, at_b) == (2, 6) and nf == nb == card.cublas_workspace_bytes and "backward" in b
    assert [len(w) for w in cm.workspaces_in(card, ops, "held")] == [2, 2]  # before the step
    assert cm.workspaces_in(card, None) == card.cublas_workspaces
    with pytest.raises(ValueError):
        cm.workspaces_in(card, ops, "warm")


def test_a_cuda_prediction_is_of_a_fresh_process_by_default_and_places_the_same_bytes():
    """Both states, predicted for one tiny model step; the default is the fresh process."""
    kw = dict(batch=2, seq=64, device="cuda", card="H100 80GB", replay_steps=3)
    fresh, held = (predict(tiny_config("qwen2"), "lora", workspaces=w, **kw) for w in ("fresh", "held"))
    assert predict(tiny_config("qwen2"), "lora", **kw).reserved_peak_bytes == fresh.reserved_peak_bytes
    assert fresh.allocated_peak_bytes == held.allocated_peak_bytes  # the same bytes, placed elsewhere
    with pytest.raises(ConfigError, match="unknown workspaces 'warm'"):
        predict(tiny_config("qwen2"), "lora", workspaces="warm", **kw)


def test_a_held_workspace_stays_where_a_run_before_made_it():
    """"held" (a process that ran the step before): the first step replayed fresh, all it made freed,
    the cache emptied, then the step. The backward's workspace keeps the 298 MiB segment it was cut
    from, so the step's logits need one more; a workspace made before the step in a segment of its own
    (the model before 2026-11-26) lets them reuse it."""
    from workbench.core.memory import cuda_model as cm
    from workbench.core.memory.accounting import EMPTY_CACHE_SERIAL

    MiB = 2**20
    events = [(1, 297 * MiB), (1, -1), (2, 400 * MiB), (2, -1), (3, 297 * MiB), (3, -1)]
    steps = [0, 0, 0, 0, 1, 1]
    ev, st, roles, streams, n = cm.after_a_run(events, steps, {1: "activations"}, None)
    assert ev[:n] == [(-2, 297 * MiB), (-2, -1), (-3, 400 * MiB), (-3, -1), (EMPTY_CACHE_SERIAL, EMPTY_CACHE)]
    assert ev[n:] == events and st == [-1] * n + steps and roles[-2] == "activations" and streams is None
    ev2, *_, n2 = cm.after_a_run([(1, MiB), (2, MiB), (2, -1), (3, MiB)], [0, 0, 0, 1], {}, {2: 7})
    assert ev2[:n2] == [(-2, MiB), (-3, MiB), (-3, -1), (-2, -1), (EMPTY_CACHE_SERIAL, EMPTY_CACHE)]  # live: freed
    ws = [("cuBLAS workspace (backward)", 32 * MiB, 2)]  # made after the first step's grad (event 2)
    held = allocator.replay(ev, roles, ws, steady_from=n)
    assert held.steady_reserved_peak_bytes == (298 + 298 + 400) * MiB  # the workspace's 298 MiB segment kept
    before = allocator.replay(events, {}, [("cuBLAS workspace (backward)", 32 * MiB)])
    assert before.reserved_peak_bytes == (32 + 298 + 400) * MiB


def test_weights_cast_on_the_card_leave_the_fp32_segment_a_16_bit_weight_took():
    """The ladder's runs load a pure-half plan in fp32 onto the card and cast it there
    (card_load.cast_on_card). The fp32 embedding's segment, freed by its cast, gives the next cast
    weight a block, so empty_cache keeps it, and the step's 300 MiB activation is cut from its free
    room instead of a segment of its own (on the H200 this made bf16_true_lora's segments the card's
    but one 2 MiB one). LoRA's fp32 adapter (serial 3) is not cast: peft makes it after the cast."""
    from workbench.core.memory import card_load as cl
    from workbench.core.memory.accounting import EMPTY_CACHE_SERIAL

    events = [(1, 260 * MiB), (2, 8 * MiB), (3, MiB), (4, 300 * MiB), (4, -1)]
    steps, ops = [0, 0, 0, 0, 0], ["setup"] * 3 + ["forward: mm.default", "forward: mm.default"]
    made = [("cuBLAS workspace (forward)", 32 * MiB, 3), ("held", 32 * MiB)]
    casts = (((1,), 520 * MiB, False), ((2,), 16 * MiB, False))  # (serials, fp32 bytes, freed after the last)
    ev, st, roles, ws = cl.cast_on_card(events, steps, ops, {3: "weights"}, casts, made)
    t1, t2 = ev[0][0], ev[1][0]
    assert ev[:2] == [(t1, 520 * MiB), (t2, 16 * MiB)] and t1 < 0 and t2 < 0  # the fp32 model on the card first
    assert ev[2:8] == [(1, 260 * MiB), (t1, -1), (2, 8 * MiB), (t2, -1), (EMPTY_CACHE_SERIAL, EMPTY_CACHE), (3, MiB)]
    assert ev[8:] == events[3:] and st == [0] * len(ev) and roles[t1] == roles[t2] == "weights" == roles[3]
    assert ws == [("cuBLAS workspace (forward)", 32 * MiB, 3 + 5), ("held", 32 * MiB)]  # after event 3, as before
    direct = allocator.replay(events, {}, [])
    cast = allocator.replay(ev, roles, [])
    assert sorted(direct.segment_sizes.items()) == [("2", 1), ("20", 1), ("260", 1), ("300", 1)]
    # the 300 MiB activation went in the 520 MiB segment's room
    assert sorted(cast.segment_sizes.items()) == [("2", 1), ("260", 1), ("520", 1)]
    # a free during the load (its op is "", not "setup") does not end it: the weight after it is cast too
    ev2, *_ = cl.cast_on_card([(1, 2 * MiB), (9, MiB), (9, -1), (2, 2 * MiB), (4, MiB)], [0] * 5,
                              ["setup", "setup", "", "setup", "forward: mm.default"], {},
                              (((1,), 4 * MiB, False), ((2,), 4 * MiB, False)), [])
    assert [nb for s, nb in ev2 if s < -1 and nb > 0] == [4 * MiB, 4 * MiB]
    # nothing to cast (an fp32 plan): the timeline as it was
    assert cl.cast_on_card(events, steps, ops, {}, (), made) == (events, steps, {}, made)


def test_qlora_loads_its_weights_in_fp32_and_quantizes_them_on_the_card():
    """measure() moves QLoRA's fp32 model to the card, then quantize_4bit replaces each linear weight
    by its 4-bit weight and quantization state, made there while the fp32 weights are alive: its
    loop keeps every replaced layer (`list(model.named_modules())`), so they are freed together
    when it returns, and no 4-bit weight is cut from a freed fp32 one. The fp32 embedding and a bias
    are moved as they are, in their place in the load; the adapter (serial 6) comes after empty_cache."""
    from workbench.core.memory import card_load as cl
    from workbench.core.memory.accounting import EMPTY_CACHE_SERIAL

    events = [(1, 100 * MiB), (2, 2 * MiB), (3, 64 * 1024), (4, 4096), (5, 2 * MiB), (6, MiB), (7, 17 * MiB)]
    ops = ["setup"] * 6 + ["forward: mm.default"]
    casts = (((1,), 0, False), ((2, 3), 16 * MiB, True), ((4,), 0, False), ((5,), 16 * MiB, True))
    ev, st, roles, _ = cl.cast_on_card(events, [0] * 7, ops, {6: "weights"}, casts, [])
    t2, t5 = ev[1][0], ev[3][0]
    assert ev == [(1, 100 * MiB), (t2, 16 * MiB), (4, 4096), (t5, 16 * MiB),  # as model.to("cuda") moves them
                  (2, 2 * MiB), (3, 64 * 1024), (5, 2 * MiB),  # quantized, the fp32 weights alive
                  (t2, -1), (t5, -1),  # freed when quantize_4bit returns
                  (EMPTY_CACHE_SERIAL, EMPTY_CACHE), (6, MiB), (7, 17 * MiB)]
    assert t2 < 0 and t5 < 0 and roles[t2] == roles[t5] == "weights"
    # the fp32 weights' segments all go back: the cache is the direct load's
    direct, loaded = allocator.replay(events, {}, []), allocator.replay(ev, roles, [])
    assert sorted(loaded.segment_sizes.items()) == sorted(direct.segment_sizes.items()) == [
        ("100", 1), ("18", 1), ("2", 1), ("20", 1)]
    # freed one at a time instead (as a cast frees them), the second 4-bit weight would keep the first
    # fp32 weight's 16 MiB segment: not what the card does
    each = tuple((ss, fp32, False) for ss, fp32, _ in casts)
    assert allocator.replay(cl.cast_on_card(events, [0] * 7, ops, {6: "weights"}, each, [])[0], roles,
                            []).segment_sizes.get("16") == 1
    # a prediction: each 4-bit weight with its quantization state, from an fp32 weight of its shape,
    # held; the frozen fp32 tensors as they are; LoRA's adapters not in the load
    cfg = tiny_config("qwen2")
    report = simulate(cfg, rung("qlora"), batch=1, seq=32, steps=2, target="cuda", sm=90)
    sizes = {s: nb for s, nb in report.timeline if nb > 0}
    groups = [(ss, fp32, held) for ss, fp32, held in report.timeline_casts if fp32]
    kept = [ss[0] for ss, fp32, _ in report.timeline_casts if not fp32]
    linears = cfg.num_hidden_layers * 7  # q, k, v, o, gate, up, down
    assert len(groups) == linears and all(len(ss) == 6 and held for ss, _, held in groups)  # weight, state's 5
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * hidden // cfg.num_attention_heads
    assert sum(fp32 for _, fp32, _ in groups) == 4 * cfg.num_hidden_layers * (2 * hidden * hidden + 2 * hidden * kv
                                                                              + 3 * hidden * inter)
    assert all(sizes[ss[0]] * 8 == fp32 for ss, fp32, _ in groups)  # 4 bits a weight, from 32
    assert cfg.vocab_size * hidden * 4 in [sizes[s] for s in kept]  # the fp32 embedding, as it is
    trained = sum(nb for s, nb in sizes.items() if report.timeline_roles.get(s) == "weights") - sum(
        sizes[s] for ss, _, _ in report.timeline_casts for s in ss)
    assert trained > 0  # the adapters: after the load


def test_qlora_quantized_onto_the_card_from_the_host_holds_one_fp32_weight_at_a_time():
    """measure() now quantizes QLoRA's linear layers onto the card from the host (quantize_4bit's
    device): each fp32 weight reaches the card alone, its 4-bit weight and state are made, the fp32
    copy freed; then peft's empty_cache, its adapter (serial 6) made on the card, model.to's move of
    the frozen embedding and bias, and measure()'s empty_cache. The card no longer holds every fp32
    weight at once."""
    from workbench.core.memory import card_load as cl
    from workbench.core.memory.accounting import EMPTY_CACHE_SERIAL

    events = [(1, 100 * MiB), (2, 2 * MiB), (3, 64 * 1024), (4, 4096), (5, 2 * MiB), (6, MiB), (8, 512),
              (7, 17 * MiB)]  # 8: a temporary train() makes before the step's first op
    ops = ["setup"] * 6 + ["", "forward: mm.default"]
    casts = (((1,), 0, False), ((2, 3), 16 * MiB, True), ((4,), 0, False), ((5,), 16 * MiB, True))
    made = [("cuBLAS workspace (forward)", 32 * MiB, 7)]
    ev, st, roles, ws = cl.replay_load("host", events, [0] * 8, ops, {6: "weights"}, casts, made)
    t2, t5 = ev[0][0], ev[4][0]
    assert ev == [(t2, 16 * MiB), (2, 2 * MiB), (3, 64 * 1024), (t2, -1),  # one layer quantized onto the card
                  (t5, 16 * MiB), (5, 2 * MiB), (t5, -1),  # then the next
                  (EMPTY_CACHE_SERIAL, EMPTY_CACHE),  # peft's prepare_model_for_kbit_training empties the cache
                  (6, MiB), (1, 100 * MiB), (4, 4096),  # the adapter, then model.to's frozen rest
                  (EMPTY_CACHE_SERIAL, EMPTY_CACHE), (8, 512), (7, 17 * MiB)]  # measure()'s, then train()
    assert t2 < 0 and t5 < 0 and roles[t2] == roles[t5] == "weights" and st == [0] * len(ev)
    assert ws == [("cuBLAS workspace (forward)", 32 * MiB, 7 + 6)]  # still after the forward's first event
    # a pure-half QLoRA: the frozen bias (4) is cast to 16 bits on the host and moved with the rest, as it is
    half = (((1,), 0, False), ((2, 3), 16 * MiB, True), ((4,), 8192, False), ((5,), 16 * MiB, True))
    assert cl.replay_load("host", events, [0] * 8, ops, {6: "weights"}, half, made)[0] == ev

    def load_peak(timeline):
        live, peak = {}, 0
        for s, nb in timeline[:-1]:  # all but the forward's
            live.pop(s) if nb == -1 else live.__setitem__(s, nb) if nb > 0 else None
            peak = max(peak, sum(live.values()))
        return peak

    on_card = cl.replay_load("card", events, [0] * 8, ops, {6: "weights"}, casts, made)[0]
    assert load_peak(on_card) == (100 + 16 + 16 + 2 + 2) * MiB + 64 * 1024 + 4096  # every fp32 weight at once
    assert load_peak(ev) == (100 + 2 + 2 + 1) * MiB + 64 * 1024 + 4096 + 512  # the frozen rest, after the copies
    # the second layer's copy is cut from the first's freed segment, which peft's empty_cache gives back
    assert sorted(allocator.replay(ev, roles, []).segment_sizes.items()) == [("100", 1), ("18", 1), ("2", 1),
                                                                            ("20", 1)]
    # a setup with no 4-bit weight converts nothing on the card (a pure-half plan is cast on the host)
    cast = (((1,), 200 * MiB, False),)
    assert cl.replay_load("host", events, [0] * 8, ops, {}, cast, made) == (events, [0] * 8, {}, made)
    assert cl.replay_load("dtype", events, [0] * 8, ops, {}, casts, made) == (events, [0] * 8, {}, made)
    # a prediction: the tiny QLoRA model's linear layers, one fp32 copy on the card at a time
    cfg = tiny_config("qwen2")
    report = simulate(cfg, rung("qlora"), batch=1, seq=32, steps=2, target="cuda", sm=90)
    ev, *_ = cl.replay_load("host", report.timeline, report.timeline_steps, report.timeline_ops,
                            report.timeline_roles, report.timeline_casts, [])
    copies, live = [], set()
    for s, nb in ev:
        if s < -(10**11):  # a copy's serial (no event of the step uses one)
            live.symmetric_difference_update({s})
            copies.append(len(live))
    assert max(copies) == 1 and len(copies) == 2 * cfg.num_hidden_layers * 7
    with pytest.raises(ConfigError, match="unknown load 'gpu'; choose dtype, host, card"):
        predict(cfg, "qlora", device="cuda", load="gpu")


def test_a_prediction_casts_only_the_16_bit_weights_and_only_when_asked():
    """predict(load="card") for a pure-half plan: the 16-bit weights (not LoRA's fp32 adapters);
    an fp32 plan has none to cast, so its prediction is the same."""
    cfg = tiny_config("qwen2")
    lora = simulate(cfg, rung("bf16_true_lora"), batch=1, seq=32, steps=3, target="cuda", sm=90)
    full = simulate(cfg, rung("bf16_true"), batch=1, seq=32, steps=3, target="cuda", sm=90)
    assert simulate(cfg, rung("fp32"), batch=1, seq=32, steps=3, target="cuda", sm=90).timeline_casts == ()
    sizes = dict(full.timeline)
    cast_bytes = sum(sizes[s] for ss, _, _ in full.timeline_casts for s in ss)
    weights = sum(nb for s, nb in full.timeline if nb > 0 and full.timeline_roles.get(s) == "weights")
    assert 0 < cast_bytes == weights  # every weight of a pure-bf16 plan is cast, from fp32 of twice its bytes
    assert all(len(ss) == 1 and fp32 == 2 * sizes[ss[0]] and not held for ss, fp32, held in full.timeline_casts)
    lora_sizes = dict(lora.timeline)
    lora_weights = sum(nb for s, nb in lora.timeline if nb > 0 and lora.timeline_roles.get(s) == "weights")
    # the adapters are not in the load: peft makes them after it
    assert sum(lora_sizes[s] for ss, _, _ in lora.timeline_casts for s in ss) == cast_bytes < lora_weights
    kw = dict(batch=1, seq=32, device="cuda", card=8)
    a, b = predict(cfg, "fp32", load="card", **kw), predict(cfg, "fp32", **kw)
    assert (a.reserved_peak_bytes, a.allocated_peak_bytes) == (b.reserved_peak_bytes, b.allocated_peak_bytes)


def test_held_workspaces_after_another_setup_replay_that_setups_first_step(monkeypatch):
    """gpu-check's ladder ran its rungs one after another in one process, so a later rung found the
    cuBLAS workspaces where the first rung's first step made them: after_a_run(before=...) replays
    that setup's first step instead of the rung's own (predict(workspaces="held", after=...))."""
    from workbench.core.memory import cuda_model as cm
    from workbench.core.memory.accounting import EMPTY_CACHE_SERIAL

    other = ([(1, 297 * MiB), (1, -1), (2, 400 * MiB), (2, -1), (3, 297 * MiB), (3, -1)], [0, 0, 0, 0, 1, 1],
             {1: "activations"})
    events, steps = [(1, 100 * MiB), (1, -1), (2, 100 * MiB), (2, -1)], [0, 0, 1, 1]
    ev, st, roles, streams, n = cm.after_a_run(events, steps, {2: "temporaries"}, {1: 5}, before=other)
    assert ev[:n] == [(-2, 297 * MiB), (-2, -1), (-3, 400 * MiB), (-3, -1), (EMPTY_CACHE_SERIAL, EMPTY_CACHE)]
    assert ev[n:] == events and st == [-1] * n + steps and streams == {1: 5}  # the other's events on the default stream
    assert roles[-2] == "activations" and roles[2] == "temporaries"
    cfg = tiny_config("qwen2")
    kw = dict(batch=1, seq=32, device="cuda", card=8, workspaces="held")
    seen = []
    real = cm.after_a_run

    def spy(*args):
        seen.append(args[4])
        return real(*args)

    monkeypatch.setattr(cm, "after_a_run", spy)
    predict(cfg, "lora", **kw)
    predict(cfg, "lora", after="fp32", **kw)
    fp32 = simulate(cfg, rung("fp32"), batch=1, seq=32, steps=3, target="cuda", sm=cm.DEFAULT_SM)
    assert seen[0] is None  # held after its own step
    assert seen[1][0] == fp32.timeline and seen[1][1] == fp32.timeline_steps  # after fp32's: its timeline
    with pytest.raises(ConfigError, match="only a setup trained on the card"):
        predict(cfg, "lora", after="zero_offload", **kw)
    with pytest.raises(ConfigError, match="unknown"):
        predict(cfg, "lora", after="fp33", **kw)
    with pytest.raises(ConfigError, match="use it with workspaces='held'"):
        predict(cfg, "lora", after="fp32", **{**kw, "workspaces": "fresh"})


def test_a_large_block_splits_only_when_more_than_1_mib_would_be_left():
    """torch's rule for the large pool (CUDACachingAllocator.cpp, shouldSplit: remaining > kSmallSize):
    a 19 MiB request in its 20 MiB segment keeps the whole block (exactly 1 MiB left: allocated counts
    20 MiB); 18.5 MiB leaves 1.5 MiB, which splits off. No other test told > from >=."""
    mib = 2**20
    for request, block, free_left in ((19 * mib, 20 * mib, 0), (int(18.5 * mib), int(18.5 * mib), int(1.5 * mib))):
        a = allocator.CachingAllocator()
        b = a.malloc(request)
        assert (a.reserved, a.allocated, b.size) == (20 * mib, block, block)
        if free_left:  # the split-off rest serves the next request of its size: no new segment
            a.malloc(free_left)
            assert (a.reserved, a.allocated) == (20 * mib, 20 * mib)


def test_the_cublas_workspace_is_torchs_default_for_the_cards_architecture():
    """torch 2.13's parseChosenWorkspaceSize: 4096 KiB x 2 + 16 KiB x 8 (8.125 MiB) before Hopper, 32 MiB on
    sm_90, sm_10x and sm_12x. The tests compared the size with the same property; 32 MiB on an A100 passed."""
    from workbench.core.memory import cuda_model as cm

    assert cm.card("A100 40GB").cublas_workspace_bytes == 8_519_680 == cm.card("RTX 4090 24GB").cublas_workspace_bytes
    assert cm.card("H100 80GB").cublas_workspace_bytes == 32 * 2**20
    assert [w for _, w in cm.card("RTX 3060 12GB").cublas_workspaces] == [8_519_680] * 2
