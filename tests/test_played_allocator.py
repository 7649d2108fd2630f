"""The played CPU budget with allocator="cuda": it caps the modelled caching allocator's reserved
bytes, as set_per_process_memory_fraction caps a card's, instead of the live bytes.

    .venv/bin/python -m pytest tests/test_played_allocator.py -q        # a few seconds
"""

from __future__ import annotations

import gc
import math
import threading

import pytest
import torch

from workbench.core.memory import allocator
from workbench.core.memory.accounting import MemoryAccounting
from workbench.core.memory.budget import PlayedCudaAllocator, device_budget
from workbench.core.memory.live_bytes import LiveBytes
from workbench.front.live import LiveChart

MiB = 2**20


def fragment(then_mib: int = 16):
    """Eight 3 MiB tensors (two 20 MiB segments: 6 fit in the first), every other one freed: 12 MiB
    live, 40 MiB reserved, no segment wholly free, the largest free block 14 MiB (the second
    segment's tail); then one `then_mib` MiB tensor (16: a segment of its own)."""
    keep = [torch.empty(3 * MiB, dtype=torch.uint8) for _ in range(8)]
    del keep[::2]
    big = torch.empty(then_mib * MiB, dtype=torch.uint8)
    return keep, big


def test_live_bytes_fit_but_reserved_bytes_do_not():
    # live peak 28 MiB (4 x 3 + 16) fits 48 MiB; reserved 40 + 16 does not
    with device_budget("cpu", 48) as b:
        fragment()
    assert b.peak_mib == 28 and math.isnan(b.peak_reserved_mib)
    with pytest.raises(torch.OutOfMemoryError, match="modelled caching allocator"):
        with device_budget("cpu", 48, allocator="cuda") as b:
            fragment()
    with device_budget("cpu", 56, allocator="cuda") as b:  # exactly the modelled reserved peak
        fragment()
    assert (b.peak_mib, b.peak_reserved_mib) == (28, 56)


def test_freed_whole_segments_are_released_before_the_oom():
    """A cached segment with nothing in use is given back (release_cached_blocks) before the
    allocator gives up: 12 MiB freed, then 14 MiB needs a new segment, 26 > 15 MiB, but 14 fits."""
    with device_budget("cpu", 15, allocator="cuda") as b:
        a = torch.empty(12 * MiB, dtype=torch.uint8)
        del a
        c = torch.empty(14 * MiB, dtype=torch.uint8)
        assert b.live.model.reserved == 14 * MiB
        del c
        d = torch.empty(MiB // 2, dtype=torch.uint8)  # a 2 MiB small segment: 16 > 15, 14 goes back
        assert b.live.model.reserved == 2 * MiB and b.current_mib == 0.5
        del d
    assert b.peak_reserved_mib == 14


def test_the_played_figures_equal_the_offline_replay():
    """A small training step; the timeline the played budget saw, replayed offline, gives the same
    allocated and reserved peaks."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters())
    with device_budget("cpu", allocator="cuda") as b:
        b.live.events = []
        b.track_module(model)
        for _ in range(2):
            model(torch.randn(64, 256)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            fragment(then_mib=1)
    report = allocator.replay(b.live.events, {})
    assert report.allocated_peak_bytes == b.peak_mib * MiB
    assert report.reserved_peak_bytes == b.peak_reserved_mib * MiB
    assert b.peak_reserved_mib > b.peak_mib >= b.live.peak_mib


def test_an_empty_tensor_takes_no_block():
    """A card's allocator makes no block for 0 bytes (CUDACachingAllocator's allocate: `if (size != 0)`), and the
    predicted timeline leaves them out: the played one counted a 512-byte block for each (and 2 MiB of
    segment for the first)."""
    with device_budget("cpu", allocator="cuda") as b:
        empty = [torch.empty(0) for _ in range(3)]
        assert (b.live.model.allocated, b.live.model.reserved) == (0, 0)
        one = torch.empty(100)
        del empty
        assert (b.live.model.allocated, b.live.model.reserved) == (512, 2 * MiB)
        del one
    assert b.peak_mib * MiB == 512


def test_default_and_bad_allocator():
    with device_budget("cpu", 30) as b:
        assert type(b.live).__name__ == "LiveBytes"
        with pytest.raises(torch.OutOfMemoryError, match="MiB live > budget"):
            torch.empty(31 * MiB, dtype=torch.uint8)
    with pytest.raises(ValueError, match="allocator"):
        device_budget("cpu", 30, allocator="caching")


def test_live_chart_plots_the_cuda_columns_when_rows_carry_them():
    live = LiveChart(display=False, min_interval_s=0)
    live({"step": 1, "loss": 2.0, "mem_mib": 10.0, "strategy": "a"})  # a CPU row: three traces
    assert len(live.fig.data) == 3
    for step in (1, 2):
        live({"step": step, "loss": 2.0, "mem_mib": 10.0, "strategy": "b", "cuda_peak_allocated_mib": 11.0,
              "cuda_peak_reserved_mib": 20.0, "nvml_used_mib": 520.0})
    fig = live.close()
    extra = {t.name: list(t.y) for t in fig.data[6:]}
    assert extra == {"b allocated": [11.0, 11.0], "b reserved": [20.0, 20.0], "b NVML used": [520.0, 520.0]}
    assert all(t.xaxis == fig.data[4].xaxis for t in fig.data[6:])  # the memory panel


class _Cycle:
    pass


@pytest.mark.parametrize("books", [PlayedCudaAllocator, MemoryAccounting, LiveBytes])
def test_a_storage_a_garbage_collection_frees_mid_count_is_forgotten_without_a_hang(books):
    """A counted tensor held in a reference cycle dies when a gc runs, and a gc runs at an allocation,
    also one made while the books are being changed (the played allocator's model allocates there on
    every malloc). Its weakref callback then runs on that same thread: with a plain lock the thread
    waited on itself for ever (the played allocator did, within a few thousand tensors). The gc threshold is varied so collections land at
    many points of the count; the books must balance afterwards."""
    kw = {"timeline": True} if books is MemoryAccounting else {}
    done, kept = threading.Event(), []
    old = gc.get_threshold()

    def count():
        with books("cpu", **kw) as lb:
            for i in range(3000):
                gc.set_threshold(1 + i % 37)
                cycle = _Cycle()
                cycle.me, cycle.t = cycle, torch.ones(16) * 2  # a counted storage only a gc frees
                del cycle
                kept.append(torch.ones(4) + 1)
            gc.set_threshold(*old)
            gc.collect()
            kept.append(lb)
        done.set()

    worker = threading.Thread(target=count, daemon=True)
    try:
        worker.start()
        worker.join(120)
    finally:
        gc.set_threshold(*old)
    assert done.is_set(), "the count hung: a storage's death waited on the books' own lock"
    lb = kept.pop()
    live = sum(t.untyped_storage().nbytes() for t in kept)
    assert lb.current_bytes == live == 3000 * 16  # every cycle's 64 B forgotten, every kept tensor counted
    if books is PlayedCudaAllocator:
        assert lb.model.allocated == 3000 * 512  # each 16 B storage is one 512 B block of the model
    if books is MemoryAccounting:  # each free after its malloc, the three timeline lists aligned
        assert len(lb.timeline) == len(lb.timeline_steps) == len(lb.timeline_ops)
        seen = set()
        for serial, n in lb.timeline:
            assert (serial in seen) == (n == -1)
            seen.add(serial)


def test_a_played_cards_step_rows_carry_its_allocated_and_reserved_peaks():
    """Each training step's row of a played card carries the allocator model's allocated peak (mem_mib, the kind
    the run's peak is) and its reserved peak (modelled_reserved_mib, what the budget caps); the live chart draws
    both beside the budget. They had carried the live bytes, below a budget line that caps reserved bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from workbench.core.training import TrainSettings, train

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4))
    rows = []
    with device_budget("cpu", 64, allocator="cuda") as b:
        b.track_module(model)
        train(model, torch.randint(0, 96, (8, 32)), TrainSettings(steps=3, micro_batch=2), device="cpu",
              sinks=[rows.append], memory_probe=b.step_memory, extra={"device": "cpu@64:cuda", "budget_mib": 64})
    allocated, reserved = [r["mem_mib"] for r in rows], [r["modelled_reserved_mib"] for r in rows]
    assert max(allocated) == b.peak_mib and max(reserved) == b.peak_reserved_mib  # the run's peaks, step by step
    assert b.live.peak_bytes < b.peak_mib * MiB and all(a * MiB % 512 == 0 and a < r for a, r in zip(allocated, reserved))
    chart = LiveChart(display=False, min_interval_s=0)
    for r in rows:
        chart(r)
    memory = {t.name: list(t.y) for t in chart.close().data if t.xaxis == "x2"}  # the memory panel
    assert memory == {"cpu@64:cuda": allocated, "cpu@64:cuda reserved (modelled)": reserved}
    with device_budget("cpu", 64) as plain:  # a live-bytes budget: its own figure, and no reserved column
        assert set(plain.step_memory()) == {"mem_mib"}


def test_a_steps_window_starts_at_what_the_card_holds_when_the_step_begins():
    """A step's row counts what is allocated when it begins, though the step frees it and allocates less:
    the window restarts at the allocator's current bytes, not at nothing."""
    with device_budget("cpu", 64, allocator="cuda") as b:
        big = torch.empty(8 * MiB, dtype=torch.uint8)
        first = b.step_memory()
        del big  # the next step begins holding 8 MiB, frees it, then holds 2 MiB at most
        small = torch.empty(2 * MiB, dtype=torch.uint8)
        second = b.step_memory()
        third = b.step_memory()  # nothing happened: what is held now, 2 MiB
        del small
    assert first["mem_mib"] == second["mem_mib"] == 8 and third["mem_mib"] == 2
    assert first["modelled_reserved_mib"] == second["modelled_reserved_mib"] == third["modelled_reserved_mib"] >= 8


def test_a_played_cards_need_is_the_least_cap_its_step_runs_under_not_its_reserved_peak(monkeypatch):
    """A played card's pre-flight holds a run to the least reserved cap its replayed step runs under: the allocator
    gives back a wholly free cached segment before it runs out. Held to the reserved peak (a card with room), a run
    that fits the budget would be skipped. The step here: 30 MiB freed, then 40 MiB."""
    import types

    from workbench.core.memory import played

    events = [(1, 30 * MiB), (2, 512), (1, -1), (3, 40 * MiB)]
    given = {}

    def simulate(config, plan, **kw):
        given.update(kw)
        return types.SimpleNamespace(timeline=events, timeline_roles={}, timeline_steps=[0] * 4, steps=kw["steps"])

    monkeypatch.setattr(played, "simulate", simulate)
    allocated, needed = played.played_card_peaks("unused", "plan", batch=1, seq=8, n_blocks=1, steps=5)
    assert allocated == 40 * MiB + 512 and needed == 2 * MiB + 40 * MiB  # not 72 MiB: the 30 MiB segment given back
    assert needed < allocator.replay(events, {}).reserved_peak_bytes
    assert given["steps"] == 3 and given["instrumented"] and given["timeline"]  # as the budget's count runs it
    played.played_card_peaks("unused", "plan", batch=1, seq=8, n_blocks=1, steps=2)
    assert given["steps"] == 2
