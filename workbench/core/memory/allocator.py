"""The CUDA caching allocator, modelled: what `max_memory_allocated` and `max_memory_reserved` report.

    from workbench.core.memory.allocator import replay, least_reserved, CachingAllocator
    report = replay(timeline, roles, workspaces, steps_of=steps, until="steady")
    report.allocated_peak_bytes, report.reserved_peak_bytes, report.replayed_steps, report.steady

`CachingAllocator` follows c10/cuda/CUDACachingAllocator.cpp in its default configuration;
`replay` runs a simulated step's allocation timeline through it, `least_reserved` finds the least
cap on reserved bytes it runs under (what a card needs); the played CPU budget and the snapshot
export use the allocator online. The cache carries what each step left, so the reserved peak of
two steps need not be a run's: `until="steady"` repeats the last simulated step (`StepTemplate`,
relative to the step before) until the allocator is in a state it was in at the end of an earlier
step, from where the steps since repeat for ever.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

import torch

from workbench.core.common import MiB
from workbench.core.memory.accounting import EMPTY_CACHE
from workbench.core.memory.segments import reserved_by_stream, segment_sizes


MIN_BLOCK = 512  # kMinBlockSize: every size rounds up to a multiple of 512 bytes
SMALL_SIZE = 1 * MiB  # kSmallSize: requests up to 1 MiB come from the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: small-pool segments
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: segments for 1-10 MiB requests
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge: larger requests get their own segment rounded to 2 MiB


def round_size(n: int) -> int:
    return MIN_BLOCK if n < MIN_BLOCK else MIN_BLOCK * ((n + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(n: int) -> int:
    """cudaMalloc size for a rounded request that no cached block can serve (get_allocation_size)."""
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((n + ROUND_LARGE - 1) // ROUND_LARGE)


class _Block:
    __slots__ = ("seg", "offset", "size", "free", "prev", "next", "id", "tag")  # tag: who holds it (replay's)

    def __init__(self, seg, offset, size, bid):
        self.seg, self.offset, self.size, self.free, self.prev, self.next, self.id, self.tag = \
            seg, offset, size, True, None, None, bid, None


class CachingAllocator:
    """Best-fit among cached blocks (smallest size, then lowest address), split when the rest is
    >= 512 B (small pool) or > 1 MiB (large pool), freed blocks merge with free neighbours; without
    a limit or an empty_cache, reserved memory only grows. Each segment belongs to the stream its
    first allocation ran on, and a freed block is reused only by allocations on that stream ("Once
    freed, blocks can be re-allocated on the same stream, but not on any other stream",
    CUDACachingAllocator.cpp); `stream` names one (0: the default stream). Streams are assumed in
    step: a block freed after use on another stream (record_stream) is reused as soon as it is free.

    Used online too (malloc(n) -> block, free(block), .allocated, .reserved): with `limit` (bytes,
    what set_per_process_memory_fraction allows) a malloc that needs a new segment past the limit
    first releases the wholly free cached segments (release_cached_blocks; with the default
    max_split_size, release_available_cached_blocks does nothing), then raises OutOfMemoryError."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self._pools: dict[tuple, list] = {}  # (small?, stream): sorted (size, seg, offset, id, block) of free blocks
        self._ids = itertools.count()
        self._segs = itertools.count()
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.segments = 0
        self.bases: dict[tuple, int] = {}  # segment -> its (modelled) device address
        self.heads: dict[tuple, _Block] = {}  # segment -> its first block
        self.new_segment = 0  # bytes of the segment the last malloc had to cudaMalloc (0: none)
        self._next_addr = 0x7F0000000000

    def _insert(self, b, pool_key):
        bisect.insort(self._pools.setdefault(pool_key, []), (b.size, b.seg, b.offset, b.id, b))

    def _remove(self, b, pool_key):
        pool = self._pools[pool_key]
        i = bisect.bisect_left(pool, (b.size, b.seg, b.offset, b.id))
        assert pool[i][4] is b
        pool.pop(i)

    def malloc(self, nbytes: int, stream: int = 0) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._pools.setdefault((small, stream), [])
        i = bisect.bisect_left(pool, (size,))
        self.new_segment = 0
        if i < len(pool):
            b = pool.pop(i)[4]
        else:
            seg = segment_size(size)
            if self.limit is not None and self.reserved + seg > self.limit:
                self.release_cached()
            if self.limit is not None and self.reserved + seg > self.limit:
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory (modelled caching allocator): tried to allocate {size / MiB:.2f} MiB "
                    f"(a new {seg / MiB:.0f} MiB segment); {self.reserved / MiB:.1f} MiB reserved, "
                    f"{self.allocated / MiB:.1f} MiB allocated, limit {self.limit / MiB:.1f} MiB")
            b = _Block((small, stream, next(self._segs)), 0, seg, next(self._ids))
            self.bases[b.seg], self.heads[b.seg] = self._next_addr, b
            self._next_addr += seg
            self.new_segment = seg
            self.reserved += seg
            self.segments += 1
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = b.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            r = _Block(b.seg, b.offset + size, rest, next(self._ids))
            r.prev, r.next = b, b.next
            if b.next is not None:
                b.next.prev = r
            b.next, b.size = r, size
            self._insert(r, b.seg[:2])
        b.free = False
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return b

    def free(self, b: _Block) -> None:
        pool_key = b.seg[:2]
        self.allocated -= b.size
        b.free = True
        for nb in (b.prev, b.next):
            if nb is not None and nb.free:
                self._remove(nb, pool_key)
                if nb is b.prev:
                    b.offset, b.prev = nb.offset, nb.prev
                    if nb.prev is not None:
                        nb.prev.next = b
                    else:
                        self.heads[b.seg] = b
                else:
                    b.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = b
                b.size += nb.size
        self._insert(b, pool_key)

    def release_cached(self) -> None:
        """Give back every segment that is one free block (release_cached_blocks, empty_cache)."""
        for seg, head in list(self.heads.items()):
            if head.free and head.next is None:
                self._remove(head, seg[:2])
                del self.heads[seg], self.bases[seg]
                self.reserved -= head.size

    def address(self, b: _Block) -> int:
        return self.bases[b.seg] + b.offset

    def segment_blocks(self):
        """(segment key, base address, size, [blocks in address order]) for every segment."""
        for seg, head in self.heads.items():
            blocks, b = [], head
            while b is not None:
                blocks.append(b)
                b = b.next
            yield seg, self.bases[seg], sum(x.size for x in blocks), blocks


STEADY = "steady"  # replay(until=STEADY): repeat the last step until the allocator's state repeats
MAX_STEPS = 64  # at most this many steps in all, steady or not


@dataclass
class AllocatorReport:
    allocated_peak_bytes: int  # max of the allocator's allocated bytes (rounded blocks)
    reserved_peak_bytes: int  # max of its segments' bytes
    segments: int
    by_category_at_peak: dict[str, int]  # rounded allocated bytes per category at the (steady) allocated peak
    steady_allocated_peak_bytes: int  # the same peaks from `steady_from` on (the last step, and any repeated)
    steady_reserved_peak_bytes: int
    reserved_by_stream: dict[int, int] = field(default_factory=dict)  # segments' bytes per stream, at the end
    segment_sizes: dict[str, int] = field(default_factory=dict)  # segments at the end: size in MiB -> how many
    replayed_steps: int = 0  # training steps replayed (0: the timeline as given, not counted in steps)
    steady: bool | None = None  # until=STEADY: whether the state repeated within MAX_STEPS (None: not asked)


@dataclass(frozen=True)
class StepTemplate:
    """One training step as allocations and frees relative to the step before it, to be repeated:
    ("a", j) makes the step's j-th allocation, ("f", j, 0) frees it, ("f", j, 1) frees the j-th
    allocation of the step before, ("e",) is an empty_cache."""

    ops: tuple
    sizes: tuple[int, ...]
    roles: tuple[str, ...]
    streams: tuple[int, ...]
    serials: tuple[tuple[int, ...], tuple[int, ...]]  # (the step before's, this step's) allocations

    @classmethod
    def of(cls, events, steps_of, roles: dict[int, str], streams: dict[int, int], step: int) -> StepTemplate | None:
        """Step `step` of a timeline, relative to step `step - 1`; None where it cannot be repeated:
        the two steps do not allocate the same sizes on the same streams in the same order, or
        `step` frees something made before the step before it."""
        size = {serial: n for serial, n in events if n >= 0}
        prev = [serial for (serial, n), k in zip(events, steps_of) if k == step - 1 and n >= 0]
        mine = [(serial, n) for (serial, n), k in zip(events, steps_of) if k == step]
        cur = [serial for serial, n in mine if n >= 0]
        if not cur or [(size[x], streams.get(x, 0)) for x in prev] != [(size[x], streams.get(x, 0)) for x in cur]:
            return None
        at_prev, at_cur = {x: j for j, x in enumerate(prev)}, {x: j for j, x in enumerate(cur)}
        ops = []
        for serial, n in mine:
            if n == EMPTY_CACHE:
                ops.append(("e",))
            elif n >= 0:
                ops.append(("a", at_cur[serial]))
            elif serial in at_cur:
                ops.append(("f", at_cur[serial], 0))
            elif serial in at_prev:
                ops.append(("f", at_prev[serial], 1))
            elif serial in size:
                return None  # frees what an earlier step made: the steps differ
        return cls(tuple(ops), tuple(size[x] for x in cur), tuple(roles.get(x, "temporaries") for x in cur),
                   tuple(streams.get(x, 0) for x in cur), (tuple(prev), tuple(cur)))


def replay(events, roles: dict[int, str], extra_allocs=(), steady_from: int = 0,
           outside: tuple[str, ...] = (), limit: int | None = None, streams: dict[int, int] | None = None, *,
           steps_of: list[int] | None = None, simulated_steps: int = 0, until: int | str | None = None,
           max_steps: int = MAX_STEPS) -> AllocatorReport:
    """Replay a timeline of (serial, nbytes) allocations, (serial, -1) frees and (0, EMPTY_CACHE)
    empty_cache calls through the allocator.

    `extra_allocs`: (name, nbytes) made before the step, or (name, nbytes, i) made right after event
    i (a fresh process's cuBLAS workspaces, made inside the first matmul of their thread:
    cuda_model.workspaces_in), and never freed.
    `steady_from`: the event index the last step starts at (its peaks are reported separately).
    `outside`: categories, or the serials of allocations, made outside torch's allocator (a paged
    optimizer's state lives in CUDA managed memory, cudaMallocManaged): left out of the replay, as
    max_memory_allocated does.
    `limit`: a cap on reserved bytes (a card's memory, set_per_process_memory_fraction): cached
    segments are given back before it is passed; torch.OutOfMemoryError where that is not enough.
    `streams`: the stream of each allocation not made on the default one (serial -> stream).
    `steps_of` (the training step of each event, `simulated_steps` of them) and `until`: None
    replays the timeline as given; n replays n training steps (the simulated ones, cut after step
    n or with the last one repeated); STEADY repeats the last simulated step until the allocator's
    state at the end of a step (each segment, each block's size and which allocation of how many
    steps ago holds it) is one it was in at the end of an earlier step, from where the steps since
    repeat for ever; at most `max_steps` in all (`steady` says whether it got there).
    """
    a = CachingAllocator(limit)
    streams = streams or {}
    live: dict = {}  # key -> its block
    role_of: dict = {}  # key -> its category
    cat = dict.fromkeys(("weights", "gradients", "optimizer_state", "activations", "temporaries", "workspace"), 0)
    state = {"best": dict(cat), "alloc": 0, "res": 0}
    first, after = _placed(extra_allocs)
    cat["workspace"] += sum(a.malloc(n).size for n in first)

    def act(key, n, role, stream, steady):
        if n == EMPTY_CACHE:
            a.release_cached()
        elif outside and (role in outside or key in outside):
            return None
        elif n >= 0:
            b = live[key] = a.malloc(n, stream)
            role_of[key] = role
            cat[role] += b.size
            if steady and a.allocated >= state["alloc"]:  # the categories at the peak reported
                state["best"] = dict(cat)
        else:
            b = live.pop(key, None)
            if b is None:
                return None
            cat[role_of.pop(key)] -= b.size
            a.free(b)
        if steady:
            state["alloc"], state["res"] = max(state["alloc"], a.allocated), max(state["res"], a.reserved)
        return None if n < 0 else live[key]

    body, template, replayed, steady = events, None, 0, None
    if until is not None and steps_of is not None and simulated_steps:
        body, replayed = _replayed(events, steps_of, simulated_steps, until)
        if (until == STEADY or int(until) > simulated_steps) and simulated_steps >= 2:
            template = StepTemplate.of(events, steps_of, roles, streams, simulated_steps - 1)
        steady = False if until == STEADY else None
    if template:  # each block's holder: (step, j) for the repeated step's allocations, else the serial
        made = {x: (simulated_steps - 2 + age, j) for age in (0, 1) for j, x in enumerate(template.serials[age])}
    for i, (serial, n) in enumerate(body):
        b = act(serial, n, roles.get(serial, "temporaries"), streams.get(serial, 0), i >= steady_from)
        if template and b is not None:
            b.tag = made.get(serial, serial)
        cat["workspace"] += sum(a.malloc(w).size for w in after.get(i, ()))

    def signature(step):
        return tuple((base, seg[:2], total, tuple((b.size, None if b.free else _relative(b.tag, step))
                                                   for b in blocks))
                     for seg, base, total, blocks in sorted(a.segment_blocks(), key=lambda s: s[1]))

    if template:
        keys = [list(template.serials[0]), list(template.serials[1])]
        seen = {signature(replayed - 1)}
        while replayed < max_steps and (until == STEADY or replayed < int(until)):
            step, keys[0], keys[1] = replayed, keys[1], [None] * len(template.sizes)
            for op in template.ops:
                if op[0] == "e":
                    act(None, EMPTY_CACHE, "", 0, True)
                elif op[0] == "a":
                    j = op[1]
                    keys[1][j] = (step, j)
                    b = act((step, j), template.sizes[j], template.roles[j], template.streams[j], True)
                    if b is not None:
                        b.tag = (step, j)
                else:
                    key = keys[1 - op[2]][op[1]]
                    act(key, -1, "", 0, True)
            replayed += 1
            if until == STEADY:
                now = signature(step)
                if now in seen:  # a state seen before: every later step repeats the steps since
                    steady = True
                    break
                seen.add(now)
    segments = [{"stream": seg[1], "total_size": total} for seg, _, total, _ in a.segment_blocks()]
    return AllocatorReport(a.peak_allocated, a.peak_reserved, a.segments, state["best"], state["alloc"], state["res"],
                           reserved_by_stream(segments), segment_sizes(segments), replayed_steps=replayed, steady=steady)


def _replayed(events, steps_of, simulated_steps: int, until: int | str | None) -> tuple[list, int]:
    """The simulated events a replay of `until` steps runs (all, or cut after step n), and how many steps."""
    if until is None or steps_of is None or not simulated_steps:
        return events, 0
    stop = simulated_steps if until == STEADY else min(int(until), simulated_steps)
    return events[:next((i for i, k in enumerate(steps_of) if k >= stop), len(events))], stop


def _placed(extra_allocs) -> tuple[list[int], dict[int, list[int]]]:
    """extra_allocs as (bytes made before the first event, {event index: bytes made right after it})."""
    first, after = [], {}
    for _, n, *at in extra_allocs:
        (after.setdefault(at[0], []) if at and at[0] is not None else first).append(n)
    return first, after


def live_rounded_peak(events, roles: dict[int, str], extra_allocs=(), outside: tuple[str, ...] = ()) -> int:
    """The most bytes live at once, each allocation rounded as the allocator rounds it: a lower
    bound of its allocated (and so reserved) bytes under any cap, whatever it caches or splits."""
    first, after = _placed(extra_allocs)
    live, now = {}, sum(round_size(n) for n in first)
    peak = now
    for i, (serial, n) in enumerate(events):
        if n >= 0 and not (outside and (roles.get(serial, "temporaries") in outside or serial in outside)):
            live[serial] = round_size(n)
            now += live[serial]
        elif n < 0:  # a free (what was left out is not live), or an empty_cache (serial 0: nothing)
            now -= live.pop(serial, 0) if n != EMPTY_CACHE else 0
        now += sum(round_size(w) for w in after.get(i, ()))
        peak = max(peak, now)
    return peak


def _relative(tag, step):
    """A block's holder as the state signature sees it: (how many steps ago, j) for the repeated
    step's allocations, so one step's state can equal the next's; a serial (weights, state) as is."""
    return (step - tag[0], tag[1]) if isinstance(tag, tuple) else tag


def least_cap(runs, lo: int, hi: int, step: int) -> tuple[int, list[tuple[int, bool]]]:
    """Bisection: the least multiple of `step` above `lo` at which `runs(cap)` is true, given that it
    is true at `hi` (not tried) and taken as false at `lo`; with every cap tried and whether it ran.
    A cap that suffices almost always leaves a larger one sufficing too."""
    a, b = lo // step, -(-hi // step)
    tried = []
    while b - a > 1:
        mid = (a + b) // 2
        ok = runs(mid * step)
        tried.append((mid * step, ok))
        a, b = (a, mid) if ok else (mid, b)
    return b * step, tried


def least_reserved(events, roles: dict[int, str], extra_allocs=(), outside: tuple[str, ...] = (), *,
                   upper: int, streams: dict[int, int] | None = None, **steps) -> int:
    """The smallest cap on reserved bytes (to 2 MiB) under which the timeline replays without an
    out-of-memory error: what the step needs from a card, where `upper` (the uncapped reserved peak,
    what a large card shows) also counts the cached blocks the allocator gives back under pressure.
    `steps`: replay's steps_of, simulated_steps and until (how many steps the cap must hold for)."""
    def runs(cap: int) -> bool:
        try:
            replay(events, roles, extra_allocs, outside=outside, limit=cap, streams=streams, **steps)
        except torch.OutOfMemoryError:
            return False
        return True

    # no cap below the bytes live at once in the simulated steps runs (nor below those of a longer run)
    body = _replayed(events, steps.get("steps_of"), steps.get("simulated_steps", 0), steps.get("until"))[0]
    lower = live_rounded_peak(body, roles, extra_allocs, outside) - 1
    return least_cap(runs, max(0, lower), upper, ROUND_LARGE)[0]  # upper runs: nothing was ever given back
