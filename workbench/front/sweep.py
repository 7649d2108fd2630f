"""Papermill sweeps on Dask: one headless run of a notebook per grid point, N at a time, resumable.

    workbench sweep 01_strategies --grid grid.yaml --workers 2
    workbench sweep 01_strategies -p base_size=tiny -p token_budget=2000 -p seeds=[0] -p seeds=[1]
    workbench sweep 02_ladder --quick micro_batch=1 micro_batch=2     # two tiny ladders: minutes
    workbench sweep tests/notebooks/sweep_point.ipynb -p x=1 -p x=2 -p x=3 --out /tmp/sw   # seconds
    workbench sweep 01_strategies --grid grid.yaml --scheduler tcp://10.0.0.5:8786     # a cluster

Grid (YAML or JSON; `-p NAME=VALUE` values are parsed as YAML, `1e-3` included):
- a mapping of parameter -> list of values is expanded as a cartesian product; a value that is not a list is the
  same for every point. A list-valued parameter needs a list of lists: `seeds: [[0], [1]]` is two points, `[[0, 1]]` one.
- a list of mappings is an explicit list of points.
- a mapping with only the keys `grid` (a product, as above), `points` (explicit points) and
  `fixed` (merged into every point) combines both: the product's points, then the explicit ones.
- repeated `-p` options with the same name are one more axis of the product; `-p` options are
  crossed with the grid file's points and override its values.

Every point is validated before anything runs: a study notebook's parameters must build its config (unknown names,
wrong types and bad values are errors); any other notebook's parameters must be names of its cell tagged `parameters`.
One bad point is a ConfigError that lists it; nothing runs.

Layout (default `<out>` = results/sweeps/<notebook stem>/):

    <out>/runs.csv                 one row per point of the latest call's grid: point, parameters, status, seconds,
                                   error, notebook, finished, kernel_threads, reused, recorded results
    <out>/study_runs.csv           the same points' results/*/runs.csv stacked, each row led by its
                                   point, study and the parameters that vary across the grid (a
                                   point of an earlier call's grid keeps its folder, not its rows)
    <out>/<key>/point.json         the notebook and parameters of this point
    <out>/<key>/<stem>.ipynb       the executed notebook (also for a failed run: it shows the error)
    <out>/<key>/sweep_result.json  scalars the notebook recorded (see `record`)
    <out>/<key>/results/           $WORKBENCH_RESULTS of this run (a study's own tables)
    <out>/<key>/stderr.log         the kernel's and papermill's own warnings
    <out>/<key>/status.json        written last, atomically: status ok or error, seconds, error
    <out>/<key>/.previous/         a finished point's files while --rerun runs it again (back if stopped or failed)

`<key>` is the study config's `.hash()` for a study notebook (so points that spell the same config differently are one
run), else a hash of the sorted parameters. Results: a notebook records scalars with
`workbench.front.record.record(loss=1.2)` into $WORKBENCH_SWEEP_DIR's `sweep_result.json` (the point's folder, the
kernel's working directory): runs.csv's columns (`result_` if taken).

Engine: each point is one Dask task (workbench.core.parallel) that runs papermill in a worker process, one run at a
time per process; the notebook's kernel is a child of that worker. By default a LocalCluster of N single-thread worker
processes, listening on 127.0.0.1 only, no dashboard; with `--scheduler ADDRESS` an existing scheduler's workers (e.g.
dask-jobqueue's SLURMCluster or PBSCluster) run the points: they need this package installed and `<out>` and the
notebook at the same paths (a shared filesystem). A failed run is a row (status error, the error's one line); so is a
run whose worker died, or one that took longer than --timeout (its kernel is killed).

Resuming: a point whose status.json says ok, made by this code, libraries and notebook text, is not run again (others
and a failed point are run; --rerun redoes every point; a finished point's files are kept aside until its new run
finishes, and a rerun that fails or is stopped any way gives them back, by itself or at the next call: a failed one's
row is the kept run's, ok, with the rerun's error, and the sweep exits 1). An `<out>` holding another notebook's
points (one of the same file name elsewhere) is refused, unless --rerun; so is a point a live run still holds (its
`.running.lock`: a stopped sweep's run on a scheduler's worker; a dead holder's lock is taken over). A point's
status.json is written last, after its executed notebook is complete and renamed into place, and runs.csv is rebuilt
from the points' folders (after each finished point and by every call): a sweep killed any way (Ctrl-C, SIGTERM,
SIGKILL, a crash) loses no finished run, and redoes a run stopped halfway. Ctrl-C and SIGTERM stop the running points
(their kernels are killed, on a scheduler's workers too; a point not begun never begins) and write runs.csv with the
unfinished points `pending` (as are those a dead worker had not begun); on SIGKILL a LocalCluster's workers exit with
the sweep process, and their kernels with them.

`--quick`: a study notebook's points start from its tiny settings (`workbench STUDY --quick`'s), their own values on
top. Progress: a tqdm bar over the points (finished ones count as done). `--dry-run` lists the points and which a run
reuses. Torch processes that share cores must share threads (14x slower if not, here): each kernel gets
OMP/MKL/OPENBLAS_NUM_THREADS = max(1, cores // N) (on a scheduler: its host's cores // its worker processes).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from workbench.core import parallel
from workbench.core.common import environ
from workbench.core.config import ConfigError, check_scheduler
from workbench.core.parallel import threads_per_worker
from workbench.core.results import RERUN_ENV, atomic_write_json, check_folder, made_by, now, results_root
from workbench.front.notebooks import STUDIES, failure, no_run_finished, run_notebook
from workbench.front.record import RESULT_FILE, SWEEP_DIR_ENV, record  # noqa: F401  (record: the notebook side)
from workbench.front.sweep_points import (PREVIOUS, SweepBusy, began, check_points, combine, give_back, hold, keep_previous,
                                          load_grid, output_names, plan, points_from_options, read_status, resolve_notebook,
                                          set_aside, study_of, write_tables)

SWEEP_OUT_ENV = "WORKBENCH_SWEEP_OUT"   # set in each kernel: the sweep's folder
SWEEP_CALL_ENV = "WORKBENCH_SWEEP_CALL"  # and the sweep call's id (what a stop abandons)
# A run is killed this long after --timeout if papermill's per-cell timeout did not stop it first.
KILL_GRACE_S = 10.0


# ------------------------------------------------------------------------------------------------
# One point: the task a Dask worker runs (the notebook side, recording results: workbench.front.record)

# papermill changes the working directory and the kernel inherits os.environ: one run per process.
_ONE_AT_A_TIME = threading.Lock()
_ABANDONED: set[str] = set()  # ids of the sweep calls stopped: their runs write no status, and none begins


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """This process's fd 2 -> `path` during a run: the kernel inherits it (its warnings, a crash's
    last words, papermill's), and they do not garble the sweep's progress bar."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def abandon_points(out: str, call: str) -> int:
    """In a worker: stop the sweep call `call` writing to `out`: its running points are killed and
    leave no status, and its points not yet begun (queued behind them here) never begin."""
    _ABANDONED.add(call)
    return parallel.kill_children(SWEEP_OUT_ENV, out)


def run_point(point_dir: str | Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Execute one point (its point.json) in this process and write its status.json last.

    `env` is added to the kernel's environment (which also inherits this process's thread
    variables). Returns the status, or (nothing written) {"status": "abandoned"} if the sweep
    stopped this run or stopped before it began, {"status": "busy"} if a live run holds the point.
    """
    point_dir, call = Path(point_dir), (env or {}).get(SWEEP_CALL_ENV)
    with _ONE_AT_A_TIME:
        if call in _ABANDONED:  # stopped while this task waited here: it never begins
            return {"status": "abandoned"}
        lock = hold(point_dir, call)  # held until this run's status is written
        if lock is None:  # a stopped sweep's run still going (on a scheduler's worker): not twice at once
            return {"status": "busy"}
        with lock:
            return _run(point_dir, env, call)


def _run(point_dir: Path, env: dict[str, str] | None, call: str | None) -> dict[str, Any]:
    """run_point's work, with the point's lock and this process's one run held."""
    spec = json.loads((point_dir / "point.json").read_text())
    stem, timeout_s = Path(spec["notebook"]).stem, spec.get("timeout_s")
    timeout_s = math.ceil(timeout_s) if timeout_s else None  # papermill's is whole seconds
    outputs = output_names(stem)  # status.json, sweep_result.json, the notebook, its partial copy, stderr.log, results
    final, partial = point_dir / outputs[2], point_dir / outputs[3]
    if (read_status(point_dir) or {}).get("status") != "ok":
        outputs = outputs[:-1]  # a failed or stopped run's results/ stay: its study reads finished runs back
    set_aside(point_dir, outputs)  # a finished run's: kept until this one finishes
    timed_out, done = threading.Event(), threading.Event()

    def watch():  # papermill's timeout is per cell; this one is for the whole run. And the sweep's
        # stop: a kernel that was starting when abandon_points looked is killed once it is there.
        deadline = time.perf_counter() + timeout_s + KILL_GRACE_S if timeout_s else math.inf
        while not done.wait(0.2):
            if time.perf_counter() > deadline:
                timed_out.set()
            if timed_out.is_set() or call in _ABANDONED:
                parallel.kill_children(SWEEP_DIR_ENV, str(point_dir))

    watchdog = threading.Thread(target=watch, daemon=True)
    started, t0, error, trace = now(), time.perf_counter(), None, None
    # The kernel inherits this environment at start: the point's folder and results root.
    kernel_env = {**(env or {}), SWEEP_DIR_ENV: str(point_dir), "WORKBENCH_RESULTS": str(point_dir / "results")}
    with environ(kernel_env), _stderr_to(point_dir / "stderr.log"):
        watchdog.start()
        try:
            run_notebook(spec["notebook"], spec["parameters"], partial, cwd=point_dir, timeout_s=timeout_s)
            error = no_run_finished(stem, spec["parameters"])  # read from the point's results
        except Exception as e:  # a cell's error, a dead kernel, a cell timeout: this run failed
            error, trace = failure(e)
        finally:
            done.set()
    if error and call in _ABANDONED:  # killed by the sweep's stop: no status, redone later
        give_back(point_dir, outputs)  # a stopped --rerun: the finished run it was redoing is back
        return {"status": "abandoned"}
    if timed_out.is_set():
        error, trace = f"TimeoutError: the run passed --timeout {timeout_s:g} s; its kernel was killed", None
    seconds = time.perf_counter() - t0
    if partial.exists():  # papermill saves as it goes; only a finished notebook gets the real name
        os.replace(partial, final)
    results = json.loads((point_dir / RESULT_FILE).read_text()) if not error and (point_dir / RESULT_FILE).exists() else {}
    worker = parallel.current_worker()
    status = {"status": "error" if error else "ok", "error": error, "seconds": round(seconds, 3),
              "started": started, "finished": now(), "notebook": final.name if final.exists() else None,
              "threads": os.environ.get("OMP_NUM_THREADS"), "results": results, "traceback": trace,
              "worker": worker.address if worker is not None else None, **made_by(spec["notebook"])}
    if error and (kept := keep_previous(point_dir, outputs, status)):  # a failed rerun had deleted the finished
        return kept  # run it was redoing (a timeout, a dead kernel): it is back, its status noting the failure
    atomic_write_json(point_dir / "status.json", status)  # last: a status here means finished
    shutil.rmtree(point_dir / PREVIOUS, ignore_errors=True)  # the run it replaces
    return status


# ------------------------------------------------------------------------------------------------
# The sweep


def _lock(out: Path):
    f = open(out / ".sweep.lock", "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise SweepBusy(f"another sweep is running in {out}") from None
    return f


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """Ctrl-C and SIGTERM (handled alike: stop the runs, keep what finished) raise KeyboardInterrupt
    and set the event, which the wait loop checks too: Python drops an exception raised while a
    library's gc callback runs, and distributed has one."""
    stop = threading.Event()

    def handler(signum, frame):
        stop.set()
        raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _outcome(future, point_dir: Path, call: str, stem: str) -> str:
    """The status of a point whose task is done ("error" for a failed rerun, its finished run kept). A task that did
    not return (its worker died, the scheduler dropped it) is an error row, written here (or a rerun's finished run
    given back), unless its run wrote ok first, or never began (its worker died running another): pending, run later."""
    st = future.result() if future.status == "finished" else read_status(point_dir) or {}
    if future.status == "finished" or st.get("status") == "ok":
        return "error" if st.get("rerun") else st["status"]
    if not began(point_dir, call):
        return "pending"
    died = {"status": "error", "error": parallel.failure(future), "seconds": None, "finished": now(), "results": {}}
    if not keep_previous(point_dir, output_names(stem), died):
        atomic_write_json(point_dir / "status.json", died)
    return "error"


def sweep_folder(path: Path, out: str | Path | None) -> Path:
    """`out`, or results/sweeps/<the notebook's stem>/; absolute, the path the workers see."""
    return (Path(out) if out else results_root() / "sweeps" / path.stem).resolve()


def run_sweep(notebook: str | Path, points: list[dict[str, Any]], workers: int = 1,
              out: str | Path | None = None, timeout_s: float | None = None, progress: bool = True,
              rerun: bool = False, scheduler: str | None = None):
    """Run `notebook` once per point (skipping finished ones) and return the runs table.

    On a LocalCluster of `workers` processes, or on the Dask scheduler at `scheduler`. Raises ConfigError before
    running anything if a point is invalid or `out` holds another notebook's points, SweepBusy if another sweep holds
    `out` or a live run one of its points, and KeyboardInterrupt (after stopping the runs and writing runs.csv) on
    Ctrl-C or SIGTERM.
    """
    path, planned = plan(notebook, points)
    named, out = out, sweep_folder(path, out)
    check_folder(out, "--out" if named else "the sweep's folder (in WORKBENCH_RESULTS)")  # a traceback had said so
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file of that name made since
        raise ConfigError(f"--out {out}: cannot make the sweep's folder there ({e.strerror}); name another") from None
    lock = _lock(out)  # released in the finally below, or by the OS if this process dies
    try:  # another notebook's points, or points a stopped sweep's runs still hold: refused, nothing written
        check_points(out, path, planned, rerun)
    except BaseException:
        lock.close()
        raise
    for p in planned:  # a rerun killed before it could give a finished run back (SIGKILL): given back now,
        if not (out / p.key / "status.json").exists():  # and its half-run notebook goes (it had stayed)
            give_back(out / p.key, output_names(path.stem))
    made = {"status": "ok", **made_by(path)}  # a point finished by other code, libraries or notebook text runs again
    reused = set() if rerun else {p.key for p in planned if (read_status(out / p.key) or {}).items() >= made.items()}
    todo = [p for p in planned if p.key not in reused]
    workers = max(1, min(workers, len(todo) or 1))
    call = uuid.uuid4().hex
    env = {SWEEP_OUT_ENV: str(out), SWEEP_CALL_ENV: call}
    timeout_s = math.ceil(timeout_s) if timeout_s else None  # papermill takes whole seconds (30.5: a TraitError)
    if rerun:  # the studies inside the notebooks retrain too, instead of reading finished runs back
        env[RERUN_ENV] = "1"
    if progress:
        where = (f"on the Dask scheduler {scheduler}" if scheduler else
                 f"{workers} worker{'s' * (workers > 1)} x {threads_per_worker(workers)} thread(s)")
        print(f"sweep {path.stem}: {len(planned)} points, {len(reused)} already finished, {where} -> {out}",
              file=sys.stderr, flush=True)
    for p in todo:  # a finished point run again keeps its outputs aside until the new run finishes
        (out / p.key).mkdir(exist_ok=True)
        atomic_write_json(out / p.key / "point.json", {"notebook": str(path), "parameters": p.parameters,
                                                       "key": p.key, "timeout_s": timeout_s})
        if (st := read_status(out / p.key) or {}).pop("rerun", None):  # an earlier call's failed rerun: not this one's
            atomic_write_json(out / p.key / "status.json", st)
    try:
        if todo:
            with _stop_on_signals() as stop, parallel.cluster(workers, scheduler) as client:
                runs = parallel.Runs(client, functools.partial(run_point, env=env), [str(out / p.key) for p in todo],
                                     threads=None if scheduler else threads_per_worker(workers),
                                     tasks_per_worker=1, desc=f"sweep {path.stem}", total=len(planned),
                                     initial=len(reused), progress=progress, stop=stop)
                try:
                    for i, future in runs:
                        runs.failed += _outcome(future, out / todo[i].key, call, path.stem) == "error"
                        write_tables(out, planned, reused)
                except KeyboardInterrupt:
                    # Stop the running points now (a worker would finish its run before closing, and a
                    # scheduler's workers outlive this sweep): their kernels are killed, no status written.
                    with contextlib.suppress(Exception):
                        client.run(abandon_points, str(out), call, on_error="ignore")
                    raise
    finally:
        df = write_tables(out, planned, reused)
        lock.close()
    df.attrs["out"] = str(out)
    return df


# ------------------------------------------------------------------------------------------------
# Command line


def register(sub) -> None:
    p = sub.add_parser("sweep", help="run a notebook once per grid point with papermill (parallel, resumable)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebook", help="a study notebook's name (01_strategies) or the path of any notebook "
                                    "with a cell tagged `parameters`")
    p.add_argument("assignments", nargs="*", default=[], metavar="NAME=VALUE",  # a default: not "required" when
                   help="a parameter value (YAML), the same syntax as `workbench STUDY NAME=VALUE`; repeat a name "
                        "for several values")
    p.add_argument("--grid", metavar="FILE", help="YAML or JSON grid file (see above)")
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                   help="the same as a NAME=VALUE argument (papermill's spelling)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="parallel papermill runs on a local Dask cluster of N processes; each kernel gets "
                        "cores // N threads (default 1)")
    p.add_argument("--scheduler", metavar="ADDRESS",
                   help="run the points on this existing Dask scheduler's workers (e.g. tcp://10.0.0.5:8786, "
                        "from dask-jobqueue's SLURMCluster) instead of a local cluster")
    p.add_argument("--out", metavar="DIR", help="output folder (default results/sweeps/<notebook stem>/)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="a run taking longer than this is stopped and recorded as an error (whole seconds: 30.5 is 31)")
    p.add_argument("--rerun", action="store_true", help="redo every point, finished ones too (kept if the rerun fails)")
    p.add_argument("--dry-run", action="store_true", help="validate and list the points (and which a run reuses)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--quick", action="store_true", help="a study notebook's points start from its tiny settings "
                                                        "(`workbench STUDY --quick`'s), their own values on top")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.workers is not None and args.scheduler:
        raise ConfigError("--workers and --scheduler: the scheduler's workers run the sweep; give one of them")
    if args.workers is not None and args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    if args.scheduler:
        check_scheduler(args.scheduler, "--scheduler")
    if args.timeout is not None and not 0 < args.timeout < float("inf"):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    points = combine(load_grid(args.grid) if args.grid else None, points_from_options([*args.assignments, *args.param]))
    if args.quick:
        if (study := study_of(resolve_notebook(args.notebook))) is None:
            raise ConfigError(f"--quick starts from a study notebook's tiny settings; {args.notebook} is not one "
                              f"({', '.join(STUDIES)})")
        points = [study.quick_under(point) for point in points]
    if args.dry_run:
        path, planned = plan(args.notebook, points)
        out, made = sweep_folder(path, args.out), {"status": "ok", **made_by(path)}  # what a run would reuse
        done = {p.key for p in planned if not args.rerun and (read_status(out / p.key) or {}).items() >= made.items()}
        said = "all run again (--rerun)" if args.rerun else f"{len(done)} of them finished"
        print(*(" ".join([p.key, json.dumps(p.parameters)] + ["(finished: a run reuses it)"] * (p.key in done))
                for p in planned), f"{len(planned)} point(s) of {path.name}, {said} in {out}", sep="\n")
        return 0
    try:
        df = run_sweep(args.notebook, points, workers=args.workers or 1, out=args.out, timeout_s=args.timeout,
                       progress=not args.quiet, rerun=args.rerun, scheduler=args.scheduler)
    except SweepBusy as e:
        print(f"workbench sweep: {e}", file=sys.stderr)
        return 1
    failed, pending = df[(df.status == "error") | df.error.notna()], df[df.status == "pending"]  # pending: not begun
    kept = int((failed.status == "ok").sum())  # failed reruns: their points' finished runs are kept (status ok)
    print(f"sweep: {len(df) - len(failed) - len(pending)} ok, {len(failed)} failed"
          + (f" (of which {kept} rerun{'s' * (kept > 1)}, the earlier run kept)" if kept else "")
          + (f", {len(pending)} not run (run the sweep again)" if len(pending) else "")
          + f" -> {Path(df.attrs['out']) / 'runs.csv'}")
    for _, row in failed.iterrows():
        print(f"  {row.point} {row.status}: {row.error}")
    return 1 if len(failed) or len(pending) else 0
