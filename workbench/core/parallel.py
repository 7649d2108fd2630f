"""Independent runs side by side: in this process, on a LocalCluster, or on any Dask scheduler.

    from workbench.core.parallel import run_many
    rows = run_many(train_one, configs)                      # here, one after another (no Dask at all)
    rows = run_many(train_one, configs, workers=2)           # 2 processes x max(1, cores // 2) threads
    rows = run_many(train_one, configs, scheduler="tcp://10.0.0.5:8786")   # e.g. dask-jobqueue's SLURMCluster

The question it answers: how do independent CPU-bound torch runs (study 1's strategy x seed runs,
gpu-check's predictions, a sweep's points) share a machine or a cluster without fighting over its
cores? Torch processes that share cores must share threads (measured here: 14x slower if each takes
them all), so:
- a LocalCluster has `workers` single-thread worker processes, and each gets
  OMP/MKL/OPENBLAS_NUM_THREADS = max(1, cores // workers) in its environment (and
  torch.set_num_threads to match when torch is already imported); on a machine with several GPUs
  each worker sees one of them in turn (CUDA_VISIBLE_DEVICES), so no card idles while another
  takes two runs;
- on an existing scheduler each task takes max(1, cores of its host // tasks that can run at once
  on that host), counted from the scheduler's list of workers when the task starts.

run_many is the whole API for a study. `fn` and the items are pickled to the workers (cloudpickle:
lambdas and functions defined in a notebook work; on a remote cluster `workbench` must be
importable there). Results come back in the order of `items`. The first exception a run raises is
raised here with its own type (the runs not finished are cancelled); a worker process that dies
(killed, out of memory) raises distributed's KilledWorker: a LocalCluster does not retry a run
that killed its worker. Underneath, `cluster` makes the Client and `Runs` submits the tasks and
shows a tqdm bar (runs done and the time left, running=R failed=F); the sweep uses both directly.

Security: a LocalCluster's scheduler, workers and HTTP endpoint listen on 127.0.0.1 only, and the
dashboard is off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import uuid
import warnings
from typing import Any, Callable, Iterable, Iterator

import dask
import psutil
from distributed import (Client, Future, KilledWorker, LocalCluster, WorkerPlugin, as_completed, get_client,
                         get_worker)
from distributed.comm import get_address_host, parse_address, resolve_address
from tqdm.auto import tqdm

from workbench.core.config import ConfigError

# How long to try to reach an existing scheduler before saying it cannot be reached.
SCHEDULER_TIMEOUT_S = 30

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

# A LocalCluster's scheduler: a worker holds exactly one task (runs are long and uneven, so no
# task waits behind another on a busy worker while a free one idles), and a run that killed its
# worker is an error, not retried three times.
_LOCAL_CONFIG = {"distributed.scheduler.worker-saturation": 1.0, "distributed.scheduler.allowed-failures": 0,
                 # their HTTP endpoints serve no route: /info (logs, call stacks) and /metrics had no token,
                 # open to every user of this machine (127.0.0.1 is theirs too)
                 "distributed.scheduler.http.routes": [], "distributed.worker.http.routes": []}


# ------------------------------------------------------------------------------------------------
# Threads: each run's share of its host's cores


def cores() -> int:
    """CPU cores this process may use (its affinity mask: a SLURM job's cpuset, a taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_worker(workers: int) -> int:
    """Threads each of `workers` processes sharing this machine's cores should use."""
    return max(1, cores() // max(1, workers))


def thread_env(threads: int) -> dict[str, str]:
    return {v: str(threads) for v in THREAD_VARS}


def threads_here(tasks_per_worker: int | None = None) -> int:
    """Threads for a task running now: this host's cores // tasks that can run at once on it.

    In a Dask worker the host's tasks are counted from the scheduler's list of workers (each runs
    up to its nthreads tasks, or `tasks_per_worker` if that is fewer); outside one, all cores.
    """
    worker = current_worker()
    if worker is None:
        return cores()
    host = get_address_host(worker.address)
    workers = get_client().scheduler_info(n_workers=-1)["workers"]
    slots = sum(min(w["nthreads"], tasks_per_worker or w["nthreads"])
                for address, w in workers.items() if get_address_host(address) == host)
    return max(1, cores() // max(1, slots))


def set_threads(threads: int) -> None:
    """Use `threads` threads from now on: the BLAS/OpenMP variables (read by torch at import, and
    inherited by subprocesses such as notebook kernels) and torch itself if already imported."""
    os.environ.update(thread_env(threads))
    torch = sys.modules.get("torch")  # not imported here: a task that never uses torch pays nothing
    if torch is not None:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------
# Worker processes: what a task may change and stop


def kill_children(name: str, value: str) -> int:
    """Kill this process's descendants (a task's notebook kernel, say) whose environment has
    name=value; returns how many."""
    killed = 0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.environ().get(name) == value:
                child.kill()
                killed += 1
    return killed


def current_worker():
    """The Dask worker running this code, or None outside a Dask task."""
    try:
        return get_worker()
    except ValueError:
        return None


# ------------------------------------------------------------------------------------------------
# Clusters


class _IgnoreInterrupt(WorkerPlugin):
    """Ctrl-C in a terminal reaches the whole process group; only the sweep or study process
    should get it (it then closes the cluster), not the workers it started."""

    def setup(self, worker) -> None:
        with contextlib.suppress(ValueError):  # not the worker process's main thread
            signal.signal(signal.SIGINT, signal.SIG_IGN)


class _OneCardEach(WorkerPlugin):
    """On a machine with several GPUs (Kaggle's two T4s), LocalCluster worker i sees only card
    i mod cards (CUDA_VISIBLE_DEVICES, set before the worker starts CUDA): two workers train on both
    cards, not both on the first, each run on a card of its own where there are as many as workers.
    It is set when the worker joins, before its first task: a worker that starts CUDA before that (a
    preload of its own) keeps every card. In a worker "cuda:1" names no card: name "cuda"."""

    def __init__(self, cards: list[str]):
        self.cards = cards

    def setup(self, worker) -> None:
        os.environ["CUDA_VISIBLE_DEVICES"] = self.cards[int(worker.name) % len(self.cards)]


def visible_cards() -> list[str]:
    """The CUDA cards this process may use, as CUDA_VISIBLE_DEVICES names them; [] without CUDA."""
    import torch  # a cluster's parent only: its tasks need not import it

    n = torch.cuda.device_count()
    named = [c.strip() for c in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if c.strip()]
    return named[:n] if named else [str(i) for i in range(n)]


@contextlib.contextmanager
def cluster(workers: int = 1, scheduler: str | None = None) -> Iterator[Client]:
    """A Client on `scheduler`, or on a new LocalCluster of `workers` single-thread processes, each
    with max(1, cores // workers) threads in its environment and, with several GPUs, a card of the
    machine's in turn (closed on exit, its processes too). An existing scheduler's workers keep the
    cards their launcher gave them."""
    if scheduler:
        try:  # an address checked first: a Client that fails on one hangs for a minute when collected
            scheme = parse_address(resolve_address(scheduler))[0]
            client = Client(scheduler, set_as_default=False, timeout=SCHEDULER_TIMEOUT_S)
        except (OSError, ValueError) as e:  # not an address (ValueError), unknown host or unreachable (OSError)
            raise ConfigError(f"cannot use the Dask scheduler {scheduler!r}: {' '.join(str(e).split())} "
                              f"(start it first, e.g. `dask scheduler`, and pass its address, "
                              f"tcp://HOST:8786)") from None
        if scheme == "tcp":  # said once connected (one that cannot be used is its one-line error alone)
            warnings.warn(f"the Dask scheduler {scheduler} speaks plain TCP: whoever reaches it can run code "
                          "on its workers, and one posing as it on the network, in this process; use tls:// "
                          "with Dask's distributed.comm.tls settings", stacklevel=3)
        with client:
            yield client
        return
    workers = max(1, workers)
    if workers > max(here := cores(), len(visible_cards())):  # (several cards: a worker for each is their use)
        warnings.warn(f"{workers} workers on {here} cores: they share the cores, no faster than {here} side by side, and "
                      f"each worker process holds its own torch and model in memory; workers={here} at most")
    with dask.config.set(_LOCAL_CONFIG):
        local = LocalCluster(
            n_workers=workers, processes=True, threads_per_worker=1, memory_limit=0,
            # TLS with a certificate made for this cluster (Security.temporary): on 127.0.0.1 alone any
            # process of any user here could connect to plain TCP and run code as this user
            host="127.0.0.1", security=True,
            dashboard_address=None,  # no dashboard; its HTTP endpoint (serving no route) on a free local port:
            scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
            env=thread_env(threads_per_worker(workers)),
            silence_logs=logging.CRITICAL,  # a run's exception is raised here, not logged twice
        )
    try:
        with Client(local, set_as_default=False) as client:
            client.register_plugin(_IgnoreInterrupt(), name="workbench-ignore-sigint")
            if len(cards := visible_cards()) > 1:  # one card: every worker shares it, as before
                client.register_plugin(_OneCardEach(cards), name="workbench-one-card-each")
            yield client
    finally:
        local.close(timeout=30)


# ------------------------------------------------------------------------------------------------
# Runs


def failure(future: Future) -> str:
    """One line for a run that did not return: its exception, or why there is none."""
    if future.status == "error":
        exc = future.exception()
        if isinstance(exc, KilledWorker):
            return "its Dask worker process died during the run (killed, or out of memory)"
        return f"{type(exc).__name__}: {exc}"
    return f"the run was {future.status} by the Dask scheduler"  # cancelled, lost


def _call(fn: Callable[[Any], Any], item: Any, threads: int | None, tasks_per_worker: int | None,
          topic: str, index: int) -> Any:
    worker = current_worker()
    if worker is not None:  # tell the display this run is running (events keep their order)
        worker.log_event(topic, ("start", index))
    try:
        set_threads(threads or threads_here(tasks_per_worker))
        return fn(item)
    finally:
        if worker is not None:
            worker.log_event(topic, ("end", index))


class Runs:
    """fn(item) for each item as a task on `client`; iterate to get (index, future) as each
    finishes, with a tqdm bar: runs done (tqdm's rate gives the time left), running, failed.

    threads: torch/BLAS threads per run (None: this host's cores // its tasks, counted per task,
    with at most `tasks_per_worker` per worker). The caller adds to `failed` what it counts as one.
    stop: an event (set by a signal handler) that makes the iteration raise KeyboardInterrupt.
    """

    def __init__(self, client: Client, fn: Callable[[Any], Any], items: Iterable[Any], *,
                 threads: int | None = None, tasks_per_worker: int | None = None, desc: str = "runs",
                 total: int | None = None, initial: int = 0, progress: bool = True,
                 stop: threading.Event | None = None):
        items = list(items)
        self.client, self.failed, self.stop, self._postfix = client, 0, stop, ""
        self.topic = f"workbench-{uuid.uuid4().hex[:12]}"
        self._running: set[int] = set()  # indices; the client's event thread changes it, ours reads
        self._lock = threading.Lock()
        client.subscribe_topic(self.topic, self._on_event)
        self.futures = [client.submit(_call, fn, item, threads, tasks_per_worker, self.topic, i,
                                      key=f"{desc}-{i}-{self.topic}", pure=False)
                        for i, item in enumerate(items)]
        self._index = {f.key: i for i, f in enumerate(self.futures)}
        self.bar = tqdm(total=total if total is not None else len(items), initial=initial, desc=desc,
                        unit="run", disable=not progress, file=sys.stderr)

    def _on_event(self, event: tuple[float, tuple[str, int]]) -> None:
        what, index = event[1]
        with self._lock:
            (self._running.add if what == "start" else self._running.discard)(index)

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._running)

    def _show(self) -> None:
        postfix = f"running={self.running} failed={self.failed}"
        if postfix != self._postfix:  # redraw on a change only (a log file gets one line per change)
            self._postfix = postfix
            self.bar.set_postfix_str(postfix)

    def __iter__(self) -> Iterator[tuple[int, Future]]:
        finished = as_completed(self.futures, loop=self.client.loop)
        try:
            self._show()
            while not finished.is_empty():
                if self.stop is not None and self.stop.is_set():
                    raise KeyboardInterrupt
                done = finished.next_batch(block=False)
                if not done:  # poll: the display shows the running count within a fraction of a second
                    time.sleep(0.2)
                for future in sorted(done, key=lambda f: self._index[f.key]):
                    i = self._index[future.key]
                    with self._lock:  # its worker may have died before saying so
                        self._running.discard(i)
                    yield i, future
                    self.bar.update()
                self._show()
        finally:
            self.bar.close()
            self.client.unsubscribe_topic(self.topic)
            self.client.cancel([f for f in self.futures if not f.done()])


def run_many(fn: Callable[[Any], Any], items: Iterable[Any], *, workers: int = 0,
             scheduler: str | None = None, desc: str = "runs", progress: bool = True, done: int = 0) -> list:
    """[fn(item) for item in items], on `workers` > 1 processes or on `scheduler`; the bar counts `done`
    runs finished before (read back, not run again) among its total.

    workers <= 1 and no scheduler: in this process, in order, no Dask at all (a study's default).
    """
    items = list(items)
    if scheduler is None and workers <= 1:
        results = []
        for item in tqdm(items, desc=desc, unit="run", disable=not progress or not items, file=sys.stderr,
                         initial=done, total=done + len(items)):
            results.append(fn(item))
        return results
    if not items:
        return []
    n = min(workers, len(items))
    with cluster(n, scheduler) as client:
        runs = Runs(client, fn, items, threads=None if scheduler else threads_per_worker(n),
                    desc=desc, progress=progress, total=done + len(items), initial=done)
        for _, future in runs:
            if future.status != "finished":
                future.result()  # raises the run's own exception with its traceback (the rest are cancelled)
        return client.gather(runs.futures)


def run_ahead(fn: Callable[[Any], Any], items: dict[Any, Any], *, desc: str = "runs") -> tuple[dict, str]:
    """({key: fn(item)}, how) on a LocalCluster of half this machine's cores (at least two), for CPU work
    to be done before work that needs the machine to itself (gpu-check predicts every rung so, then
    measures them on the card). Where there are fewer than 4 cores, or the cluster or a worker fails:
    ({}, why), and the caller runs fn itself. `fn` must catch its own errors (the first one raised ends all)."""
    workers = min(len(items), cores() // 2)
    if workers < 2:
        return {}, "in this process"
    try:
        results = run_many(fn, list(items.values()), workers=workers, desc=desc, progress=False)
    except Exception as e:  # a cluster that cannot start here (a bare image), a worker killed
        return {}, f"in this process ({workers} Dask workers failed: {type(e).__name__}: {e})"[:300]
    return dict(zip(items, results)), f"ahead, on {workers} Dask workers"
