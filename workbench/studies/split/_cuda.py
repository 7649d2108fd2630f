"""The few pieces only a CUDA machine runs: pinned staging chunks, copy side streams, events.

Kept apart so that the engine reads the same on both devices and so that what the CPU-only
tests cannot reach is small and in one place. Every class here has a CPU twin in the same
class (pinned=False / device "cpu": plain host memory, synchronous copies, perf_counter), so the
chunking and the clock run in the CPU tests; only the CUDA branches need a GPU.
"""

from __future__ import annotations

import threading
import time

import torch


def alloc(shape, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """Every host buffer of the engine comes from here (the tests count what would be pinned)."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned)


def host_empty_like(t: torch.Tensor, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """A host buffer shaped like `t` (page-locked only when asked: the engine asks only for the
    bounded staging ring, never for parameter-sized buffers)."""
    return alloc(t.shape, dtype, pinned)


_HELD = object()  # a chunk some thread is filling or draining


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class Ring:
    """A fixed set of equal staging chunks (one allocation), reused in turn.

    Gradients reach the host and weights leave it through these chunks, `chunk_elems` elements
    at a time, so the pinned memory is `nbytes` whatever the model's size (the caching host
    allocator rounds a pinned block up to a power of two: the block is sized to one already, its
    chunk size and its number of chunks each rounded up, so that what it pins is what it uses).
    A chunk is handed out by `acquire()`, which waits until the copy that last used it has
    finished (its CUDA event; on the CPU copies are synchronous and there is nothing to wait for).
    Thread-safe: the copy thread and the host Adam workers share the rings.
    """

    def __init__(self, n_chunks: int, chunk_bytes: int, dtype: torch.dtype, pinned: bool):
        if n_chunks < 1 or chunk_bytes < dtype.itemsize:
            raise ValueError("a ring needs at least one chunk of at least one element")
        chunk_bytes, n_chunks = _pow2_at_least(chunk_bytes), _pow2_at_least(n_chunks)
        self.chunk_elems = chunk_bytes // dtype.itemsize
        self.n_chunks, self.dtype, self.pinned = n_chunks, dtype, pinned
        block = alloc((n_chunks * self.chunk_elems,), dtype, pinned)
        self.chunks = list(block.view(n_chunks, self.chunk_elems).unbind(0))
        self.nbytes = block.numel() * block.element_size()
        self._busy: list[object] = [None] * n_chunks  # CUDA event of the copy using each chunk
        self._next = 0
        self._lock = threading.Lock()
        self._free = threading.Semaphore(n_chunks)  # chunks not held by a thread right now

    def acquire(self) -> int:
        """Index of the next chunk in turn, once no thread holds it and its last copy is done."""
        self._free.acquire()
        with self._lock:
            i = self._next
            while self._busy[i] is _HELD:  # held by another thread: take the next one not held
                i = (i + 1) % self.n_chunks
            self._next = (i + 1) % self.n_chunks
            ev, self._busy[i] = self._busy[i], _HELD
        if ev is not None:
            ev.synchronize()  # the device copy that read / wrote this chunk last has finished
        return i

    def release(self, i: int, event=None) -> None:
        """Give chunk i back; `event` (CUDA) marks when the copy still reading it will be done."""
        with self._lock:
            self._busy[i] = event
        self._free.release()

    def spans(self, numel: int):
        """(start, end) element ranges of a flat tensor, one chunk each."""
        for a in range(0, numel, self.chunk_elems):
            yield a, min(numel, a + self.chunk_elems)


def staging_bytes(n_chunks: int, chunk_bytes: int, dtype: torch.dtype) -> int:
    """What both rings hold (gradients in, weights out), whatever the model: the pinned budget."""
    per_ring = _pow2_at_least(n_chunks) * (_pow2_at_least(chunk_bytes) // dtype.itemsize) * dtype.itemsize
    return 2 * per_ring


class Copier:
    """Device->host gradient copies and host->device weight copies through the staging rings,
    on their own streams on CUDA so that they run beside the backward kernels; synchronous
    copies on the CPU (the CPU twin runs the same chunking)."""

    def __init__(self, device: torch.device, n_chunks: int, chunk_bytes: int, dtype: torch.dtype,
                 pinned: bool | None = None):
        self.device = device
        self.cuda = device.type == "cuda"
        pinned = self.cuda if pinned is None else pinned  # pinned=True on the CPU: tests only (count)
        self.grads = Ring(n_chunks, chunk_bytes, dtype, pinned=pinned)  # device -> host
        self.weights = Ring(n_chunks, chunk_bytes, dtype, pinned=pinned)  # host -> device
        self.pinned_bytes = self.grads.nbytes + self.weights.nbytes if pinned else 0
        self.staging_bytes = self.grads.nbytes + self.weights.nbytes
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)

    def ready_event(self):
        """Called by the gradient hook (autograd's device thread on CUDA, whose current stream is
        the one backward runs on): marks when the gradient is complete."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def to_host(self, grad: torch.Tensor, ready, dst: torch.Tensor):
        """Copy a device gradient into a pageable fp32 host buffer, chunk by chunk through the
        gradient ring (upcast on the host). Returns when `dst` holds the whole gradient. Up to
        n_chunks copies are in flight at once; each chunk is drained into `dst` as it lands.
        Returns when the copies could start (CUDA: an event on the copy stream once the gradient
        is ready, so a transfer's span leaves out the wait for backward to produce it; the CPU:
        None, the gradient is ready when the hook runs)."""
        out, ring = dst.view(-1), self.grads
        if not self.cuda:
            src = grad.detach().reshape(-1)
            for a, b in ring.spans(src.numel()):
                i = ring.acquire()
                try:  # a chunk held by a copy that raised would be lost to the ring: its next acquire() waits for good
                    ring.chunks[i][: b - a].copy_(src[a:b])
                    out[a:b].copy_(ring.chunks[i][: b - a])
                finally:
                    ring.release(i)
            return None
        inflight = []
        try:
            with torch.cuda.stream(self.d2h):
                self.d2h.wait_event(ready)  # the gradient was produced on the compute stream
                started = torch.cuda.Event(enable_timing=True)  # completes once `ready` has
                started.record(self.d2h)
                src = grad.detach().reshape(-1)  # (a copy, if any, runs on this stream: after `ready`)
                for a, b in ring.spans(src.numel()):
                    if len(inflight) == ring.n_chunks:
                        self._drain(inflight.pop(0), out)
                    i = ring.acquire()
                    try:
                        ring.chunks[i][: b - a].copy_(src[a:b], non_blocking=True)
                    except BaseException:
                        ring.release(i)  # nothing in flight on it
                        raise
                    ev = torch.cuda.Event()
                    ev.record(self.d2h)
                    inflight.append((i, a, b, ev))
            while inflight:
                self._drain(inflight.pop(0), out)
        except BaseException:  # the chunks still in flight go back, each reusable once its copy is done
            for i, _, _, ev in inflight:
                ring.release(i, ev)
            raise
        return started

    def _drain(self, item, out: torch.Tensor) -> None:
        i, a, b, ev = item
        try:
            ev.synchronize()
            out[a:b].copy_(self.grads.chunks[i][: b - a])
        finally:
            self.grads.release(i)

    def to_device(self, src: torch.Tensor, dst: torch.Tensor):
        """Copy fp32 host weights into the device's training copy, chunk by chunk through the
        weight ring (downcast on the host). Returns the CUDA event of the last copy (None on the
        CPU, where the copy is done on return); the caller's thread does not wait for the copies."""
        flat, out, ring = src.detach().view(-1), dst.view(-1), self.weights
        last = None
        for a, b in ring.spans(flat.numel()):
            i = ring.acquire()
            chunk = ring.chunks[i][: b - a]
            try:
                chunk.copy_(flat[a:b])
                if not self.cuda:
                    out[a:b].copy_(chunk)
                else:
                    with torch.cuda.stream(self.h2d):
                        out[a:b].copy_(chunk, non_blocking=True)
                        last = torch.cuda.Event(enable_timing=True)  # also ends the transfer's span
                        last.record(self.h2d)
            except BaseException:
                ring.release(i)  # a copy that raised: nothing in flight on it, not lost to the ring
                raise
            ring.release(i, last)  # CUDA: reusable once this copy has read it
        return last

    def wait(self, event) -> None:
        """Make the compute stream of this device wait for a copy (no host block)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


class Clock:
    """Milliseconds on ONE time base.

    CPU: perf_counter for everything. CUDA: the device's clock (CUDA events) for everything.
    Device-side moments (end of forward, of backward, of a copy, and the compute stream's idle
    span while a forward pre-hook waits for weights) are events on the stream that does the work;
    host-side moments (a host Adam update starting or ending, a copy thread's span) are events
    recorded on a dedicated marker stream that never has work queued, so the
    GPU timestamps them as soon as the host records them (a few microseconds of launch latency).
    All times are `elapsed_time` from one origin event on that stream: no host and device clocks
    are ever mixed.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._t0 = time.perf_counter()
        if self.cuda:
            torch.cuda.synchronize(device)
            self._marker = torch.cuda.Stream(device)
            self._e0 = torch.cuda.Event(enable_timing=True)
            self._e0.record(self._marker)
            self._e0.synchronize()

    def mark(self):
        """Now on the accelerator's compute stream: a float (ms) on CPU, an event on CUDA."""
        if not self.cuda:
            return self.host_mark()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def host_mark(self):
        """Now on the host (any thread): a float (ms) on CPU, an event on the idle marker stream on CUDA."""
        if not self.cuda:
            return (time.perf_counter() - self._t0) * 1e3
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self._marker)
        return ev

    def ms(self, mark) -> float:
        if mark is None or isinstance(mark, float):
            return mark
        mark.synchronize()
        return self._e0.elapsed_time(mark)
