"""What a played card ('cpu@N:cuda') needs: the CPU's step, the card's caching allocator.

    from workbench.core.memory.played import played_card_peaks
    allocated, needed = played_card_peaks(config, plan, batch=4, seq=128, n_blocks=4, steps=10)

A CPU budget with `allocator="cuda"` (budget.PlayedCudaAllocator) feeds every storage of the CPU's
step to the modelled caching allocator and caps its reserved bytes. This predicts that run without
running it: the step simulated on fake tensors as the budget's live-bytes count runs it, its
allocation timeline replayed through the same allocator model (one stream, no cuBLAS workspaces: the
CPU makes none), and the least cap on reserved bytes it runs under found by replays under caps.
"""

from __future__ import annotations

from workbench.core.memory import allocator
from workbench.core.memory.plan import Plan
from workbench.core.memory.predict import simulate


def played_card_peaks(config, plan: Plan, *, batch: int, seq: int, n_blocks: int, steps: int) -> tuple[int, int]:
    """A run of `steps` optimizer steps on a played card. Returns (the allocated peak, which the run
    reports; the least cap on reserved bytes it runs under, which the budget is), in bytes."""
    simulated = min(steps, 3)  # the third step is the one the replay repeats (relative to the second)
    report = simulate(config, plan, batch=batch, seq=seq, steps=simulated, n_blocks=n_blocks, instrumented=True,
                      timeline=True)
    events, roles = report.timeline, report.timeline_roles
    run = dict(steps_of=report.timeline_steps, simulated_steps=report.steps, until=steps)
    alloc = allocator.replay(events, roles, **run)
    return alloc.allocated_peak_bytes, allocator.least_reserved(events, roles, upper=alloc.reserved_peak_bytes, **run)
