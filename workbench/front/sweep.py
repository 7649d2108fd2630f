"""Papermill sweeps: one headless run of a notebook per grid point, N at a time, resumable.

    workbench sweep 01_strategies --grid grid.yaml --workers 2
    workbench sweep 01_strategies -p base_size=tiny -p token_budget=2000 -p seeds=[0] -p seeds=[1]
    workbench sweep tests/notebooks/sweep_point.ipynb -p x=1 -p x=2 -p x=3 --out /tmp/sw   # seconds

Grid (YAML or JSON; `-p NAME=VALUE` values are parsed as YAML, `1e-3` included):
- a mapping of parameter -> list of values is expanded as a cartesian product; a value that is not
  a list is the same for every point. A list-valued parameter needs a list of lists:
  `seeds: [[0], [1]]` is two points, `seeds: [[0, 1]]` one.
- a list of mappings is an explicit list of points.
- a mapping with only the keys `grid` (a product, as above), `points` (explicit points) and
  `fixed` (merged into every point) combines both: the product's points, then the explicit ones.
- repeated `-p` options with the same name are one more axis of the product; `-p` options are
  crossed with the grid file's points and override its values.

Every point is validated before anything runs: a study notebook's parameters must build its config
(unknown names, wrong types and bad values are errors); any other notebook's parameters must be
names of its cell tagged `parameters`. One bad point is a ConfigError that lists it; nothing runs.

Layout (default `<out>` = results/sweeps/<notebook stem>/):

    <out>/runs.csv                 one row per point of the latest call's grid: point, parameters,
                                   status, seconds, error, notebook, recorded results, reused
    <out>/study_runs.csv           every point's results/*/runs.csv stacked, with a `point` column
    <out>/<key>/point.json         the notebook and parameters of this point
    <out>/<key>/<stem>.ipynb       the executed notebook (also for a failed run: it shows the error)
    <out>/<key>/sweep_result.json  scalars the notebook recorded (see `record`)
    <out>/<key>/results/           $WORKBENCH_RESULTS of this run (a study's own tables)
    <out>/<key>/status.json        written last, atomically: status ok or error, seconds, error

`<key>` is the study config's `.hash()` for a study notebook (so points that spell the same config
differently are one run), else a hash of the sorted parameters.

Results convention: a notebook records scalar results with `workbench.front.sweep.record(loss=1.2)`,
which writes `sweep_result.json` into $WORKBENCH_SWEEP_DIR (the point's folder, also the kernel's
working directory). They become columns of runs.csv (prefixed `result_` if a name is taken).

Resuming: a point whose status.json says ok is not run again (a failed point is retried; --rerun
redoes every point, e.g. after the notebook changed, since the key is the parameters only). A
point's status.json is written only after its executed notebook is complete and renamed into
place, so a run stopped halfway (Ctrl-C, SIGTERM, SIGKILL, a crash) has none and is redone.

Threads: torch processes that share cores must share threads (FIELD_NOTES: 14x slower if not), so
each of the N workers' kernels gets OMP_NUM_THREADS = max(1, cores // N) through its environment.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from workbench.core.config import ConfigError
from workbench.core.results import RERUN_ENV

RESULT_FILE = "sweep_result.json"
SWEEP_DIR_ENV = "WORKBENCH_SWEEP_DIR"   # set in each kernel: the point's folder
SWEEP_OUT_ENV = "WORKBENCH_SWEEP_OUT"   # set in each worker and kernel: the sweep's folder
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# A run is killed this long after --timeout if papermill's per-cell timeout did not stop it first.
KILL_GRACE_S = 10.0


# ------------------------------------------------------------------------------------------------
# The notebook side: recording results


def record(**values: Any) -> Path:
    """Record scalar results of this run; each becomes a column of the sweep's runs.csv.

    Call it from a notebook: `record(ppl_after=31.2, status_note="fit")`. Outside a sweep it
    writes sweep_result.json into the working directory. Values must be scalars.
    """
    from workbench.core.results import atomic_write_json

    path = Path(os.environ.get(SWEEP_DIR_ENV, ".")) / RESULT_FILE
    clean = {}
    for name, v in values.items():
        if hasattr(v, "item") and callable(v.item):  # numpy / torch scalars
            v = v.item()
        if v is not None and not isinstance(v, (bool, int, float, str)):
            raise TypeError(f"record({name}=...): a sweep result must be a scalar, got {type(v).__name__}")
        clean[name] = v
    old = json.loads(path.read_text()) if path.exists() else {}
    return atomic_write_json(path, {**old, **clean})


# ------------------------------------------------------------------------------------------------
# Grids: files and -p options -> a list of points (dicts of parameters)


def _yaml_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    # PyYAML follows YAML 1.1, where `1e-3` (no dot) is a string; people write learning rates so.
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )
    return Loader


def parse_value(text: str) -> Any:
    """A `-p` value: a YAML scalar or flow list (`2000`, `1e-3`, `tiny`, `[0, 1]`, `true`)."""
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse value {text!r}: {str(e).splitlines()[0]}") from None


def product(axes: dict[str, Any], where: str = "grid") -> list[dict[str, Any]]:
    """The cartesian product of a mapping parameter -> list of values (non-lists are fixed)."""
    names, choices = [], []
    for name, values in axes.items():
        if not isinstance(name, str):
            raise ConfigError(f"{where}: parameter names must be strings, got {name!r}")
        if isinstance(values, list):
            if not values:
                raise ConfigError(f"{where}: {name} has an empty list of values")
            choices.append(values)
        else:
            choices.append([values])
        names.append(name)
    return [dict(zip(names, combo)) for combo in itertools.product(*choices)]


def points_from_grid(data: Any, where: str = "grid") -> list[dict[str, Any]]:
    """Expand a loaded grid file (see the module docstring for the three forms)."""
    if isinstance(data, list):
        explicit, axes, fixed = data, {}, {}
    elif isinstance(data, dict) and data and set(data) <= {"grid", "points", "fixed"}:
        explicit, axes, fixed = data.get("points") or [], data.get("grid") or {}, data.get("fixed") or {}
        if not isinstance(axes, dict) or not isinstance(fixed, dict) or not isinstance(explicit, list):
            raise ConfigError(f"{where}: `grid` and `fixed` must be mappings and `points` a list")
    elif isinstance(data, dict):
        explicit, axes, fixed = [], data, {}
    else:
        raise ConfigError(f"{where}: expected a mapping of parameter -> values or a list of points, "
                          f"got {type(data).__name__}")
    for i, p in enumerate(explicit):
        if not isinstance(p, dict):
            raise ConfigError(f"{where}: point {i + 1} is not a mapping of parameter -> value: {p!r}")
    points = (product(axes, where) if axes else []) + [dict(p) for p in explicit]
    return [{**fixed, **p} for p in points] or [dict(fixed)]


def load_grid(path: str | Path) -> list[dict[str, Any]]:
    """Read a YAML or JSON grid file into a list of points; a malformed file is a ConfigError."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read grid file {path}: {e.strerror}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.load(text, Loader=_yaml_loader())
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"malformed grid file {path}: {' '.join(str(e).split())}") from None
    return points_from_grid(data, where=f"grid file {path}")


def points_from_options(options: Iterable[str]) -> list[dict[str, Any]]:
    """Repeated `-p NAME=VALUE` options -> points (a name given twice is an axis)."""
    axes: dict[str, list[Any]] = {}
    for opt in options:
        name, eq, text = opt.partition("=")
        if not eq or not name.strip():
            raise ConfigError(f"-p {opt!r}: expected NAME=VALUE")
        axes.setdefault(name.strip(), []).append(parse_value(text))
    return product(axes, where="-p options")


def combine(grid_points: list[dict] | None, option_points: list[dict] | None) -> list[dict]:
    """Cross the grid file's points with the -p points (-p values win)."""
    return [{**g, **o} for g in (grid_points or [{}]) for o in (option_points or [{}])]


# ------------------------------------------------------------------------------------------------
# Validation and keys


@dataclass(frozen=True)
class Point:
    key: str
    parameters: dict[str, Any]


def resolve_notebook(notebook: str | Path) -> Path:
    """A path to a notebook, or a study notebook's name ('01_strategies')."""
    from workbench.front.notebooks import find

    path = Path(notebook)
    if path.is_file():
        return path.resolve()
    try:
        return find(str(notebook)).path
    except KeyError as e:
        raise ConfigError(f"no notebook {str(notebook)!r}: not a file, and {e.args[0]}") from None


def _study(path: Path):
    from workbench.front.notebooks import STUDIES

    return STUDIES.get(path.stem)


def plan(notebook: str | Path, points: list[dict[str, Any]]) -> tuple[Path, list[Point]]:
    """Validate every point and key it; raise one ConfigError listing all bad points."""
    path = resolve_notebook(notebook)
    study = _study(path)
    known = None
    if study is None:
        import papermill as pm

        known = set(pm.inspect_notebook(str(path)))
    errors, planned, seen = [], [], {}
    for i, params in enumerate(points):
        try:
            json.dumps(params)  # point.json and papermill need plain values
        except TypeError as e:
            errors.append(f"point {i + 1} {params!r}: {e}")
            continue
        try:
            if study is not None:
                key = study.check(params).hash()
            else:
                unknown = sorted(set(params) - known)
                if unknown:
                    raise ConfigError(f"unknown parameter{'s' * (len(unknown) > 1)} {', '.join(unknown)}; "
                                      f"the notebook's parameters cell has: {', '.join(sorted(known)) or 'none'}")
                key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
        except ConfigError as e:
            errors.append(f"point {i + 1} {json.dumps(params)}: {e}")
            continue
        if key in seen:  # the same config spelt twice: one run
            print(f"sweep: point {i + 1} is the same run as point {seen[key] + 1}; running it once",
                  file=sys.stderr)
            continue
        seen[key] = i
        planned.append(Point(key, params))
    if errors:
        raise ConfigError(f"{len(errors)} of {len(points)} points are invalid; nothing was run:\n  "
                          + "\n  ".join(errors))
    return path, planned


def read_status(point_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((point_dir / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def threads_per_worker(workers: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, workers))


# ------------------------------------------------------------------------------------------------
# The worker: a long-lived process that imports papermill once and runs one point per request.
# Its protocol: the parent writes a point folder per line on stdin; the worker answers one JSON
# line per finished point on the original stdout (papermill's own output goes to stderr).


class _Stop(BaseException):
    """SIGTERM in a worker: abandon the run without writing its status."""


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)


def run_point(point_dir: Path) -> dict[str, Any]:
    """Execute one point (its point.json) and write its status.json last."""
    from papermill.exceptions import PapermillExecutionError

    from workbench.front.notebooks import run_notebook
    from workbench.core.results import atomic_write_json, now

    spec = json.loads((point_dir / "point.json").read_text())
    stem = Path(spec["notebook"]).stem
    final, partial = point_dir / f"{stem}.ipynb", point_dir / f".{stem}.partial.ipynb"
    for stale in (point_dir / "status.json", point_dir / RESULT_FILE, final, partial):
        stale.unlink(missing_ok=True)
    # The kernel inherits this process's environment at start: the point's folder and results root.
    os.environ[SWEEP_DIR_ENV] = str(point_dir)
    os.environ["WORKBENCH_RESULTS"] = str(point_dir / "results")
    started, t0 = now(), time.perf_counter()
    error, trace = None, None
    try:
        run_notebook(spec["notebook"], spec["parameters"], partial, cwd=point_dir,
                     timeout_s=spec.get("timeout_s"))
    except PapermillExecutionError as e:
        error, trace = f"{e.ename}: {e.evalue}", _strip_ansi("\n".join(e.traceback))
    except Exception as e:  # a dead kernel, a cell timeout, an unreadable notebook: this run failed
        error = f"{type(e).__name__}: {e}"
    seconds = time.perf_counter() - t0
    if partial.exists():  # papermill saves as it goes; only a finished notebook gets the real name
        os.replace(partial, final)
    results = {}
    if error is None and (point_dir / RESULT_FILE).exists():
        results = json.loads((point_dir / RESULT_FILE).read_text())
    status = {"status": "error" if error else "ok", "error": error, "seconds": round(seconds, 3),
              "started": started, "finished": now(), "notebook": final.name if final.exists() else None,
              "threads": os.environ.get("OMP_NUM_THREADS"), "results": results, "traceback": trace}
    atomic_write_json(point_dir / "status.json", status)  # last: a status here means finished
    return {"dir": str(point_dir), "status": status["status"]}


def _worker_main() -> int:
    def stop(signum, frame):
        raise _Stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (papermill, warnings) must not corrupt the protocol
    sys.stdout = sys.stderr
    import papermill  # noqa: F401  (imported once here, not once per run)

    try:
        for line in sys.stdin:
            reply.write(json.dumps(run_point(Path(line.strip()))) + "\n")
    except _Stop:
        return 143
    return 0


def _die_with_parent() -> None:
    """In a worker, before exec: get SIGTERM when the sweep process dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass  # not Linux: workers still exit when their stdin closes


class _Worker:
    def __init__(self, env: dict[str, str], log: Path):
        self.log = open(log, "a")
        # Own session: a terminal's Ctrl-C reaches only the sweep, which stops workers in order.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workbench.front.sweep", "--worker"],
            stdin=-1, stdout=-1, stderr=self.log, env=env, text=True, bufsize=1,
            start_new_session=True, preexec_fn=_die_with_parent,
        )
        self.point: Point | None = None
        self.started = 0.0

    def send(self, point: Point, point_dir: Path) -> None:
        self.point, self.started = point, time.monotonic()
        self.proc.stdin.write(f"{point_dir}\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def reap(self, deadline: float) -> None:
        try:
            self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:
            self.proc.kill()  # its kernel notices its parent is gone and exits too
            self.proc.wait()
        self.log.close()


# ------------------------------------------------------------------------------------------------
# The sweep


class SweepBusy(RuntimeError):
    """Another sweep holds this output folder."""


def _lock(out: Path):
    import fcntl

    f = open(out / ".sweep.lock", "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise SweepBusy(f"another sweep is running in {out}") from None
    return f


def collect(out: Path, planned: list[Point], reused: set[str] = frozenset()):
    """The tidy table: one row per point, in grid order; unfinished points are `pending`."""
    import pandas as pd

    rows = []
    for p in planned:
        st = read_status(out / p.key) or {}
        row = {"point": p.key, **p.parameters, "status": st.get("status", "pending"),
               "seconds": st.get("seconds"), "error": st.get("error"),
               "notebook": str(out / p.key / st["notebook"]) if st.get("notebook") else None,
               "finished": st.get("finished"), "threads": st.get("threads"), "reused": p.key in reused}
        for name, v in (st.get("results") or {}).items() if st.get("status") == "ok" else ():
            row[f"result_{name}" if name in row else name] = v
        rows.append(row)
    df = pd.DataFrame(rows)
    for col in df.columns:  # list-valued parameters are written as JSON, not Python reprs
        if df[col].map(lambda v: isinstance(v, (list, dict))).any():
            df[col] = df[col].map(lambda v: json.dumps(v) if isinstance(v, (list, dict)) else v)
    return df


def _write_tables(out: Path, planned: list[Point], reused: set[str]):
    import pandas as pd

    from workbench.core.results import atomic_write_csv

    df = collect(out, planned, reused)
    atomic_write_csv(out / "runs.csv", df)
    # A study's own per-run tables, stacked: the finer-grained view of the same sweep.
    parts = []
    for p in planned:
        if (read_status(out / p.key) or {}).get("status") != "ok":
            continue
        for f in sorted((out / p.key / "results").glob("*/runs.csv")):
            try:
                parts.append(pd.read_csv(f).assign(point=p.key, study=f.parent.name))
            except (pd.errors.EmptyDataError, pd.errors.ParserError):
                continue
    if parts:
        atomic_write_csv(out / "study_runs.csv", pd.concat(parts, ignore_index=True))
    return df


class _Progress:
    def __init__(self, name: str, total: int, reused: int, workers: int, enabled: bool):
        self.name, self.total, self.workers, self.enabled = name, total, workers, enabled
        self.done, self.failed, self.reused, self.times = reused, 0, reused, []

    def finished(self, status: str, seconds: float) -> None:
        self.done += 1
        self.failed += status != "ok"
        self.times.append(seconds)

    def show(self, running: int, note: str = "") -> None:
        if not self.enabled:
            return
        left = self.total - self.done
        if self.times:
            eta = f"~{sum(self.times) / len(self.times) * left / self.workers:.0f} s left"
        else:
            eta = "time left unknown" if left else "done"
        print(f"sweep {self.name}: {self.done}/{self.total} done ({self.failed} failed, {self.reused} "
              f"reused), {running} running, {eta}{'  ' + note if note else ''}", file=sys.stderr, flush=True)


def run_sweep(notebook: str | Path, points: list[dict[str, Any]], workers: int = 1,
              out: str | Path | None = None, timeout_s: float | None = None, progress: bool = True,
              rerun: bool = False):
    """Run `notebook` once per point (skipping finished ones) and return the runs table.

    Raises ConfigError before running anything if a point is invalid, SweepBusy if another sweep
    holds `out`, and KeyboardInterrupt (after stopping the workers and writing runs.csv) on Ctrl-C
    or SIGTERM.
    """
    import selectors

    from workbench.core.results import atomic_write_json, now, results_root

    path, planned = plan(notebook, points)
    out = Path(out) if out else results_root() / "sweeps" / path.stem
    out.mkdir(parents=True, exist_ok=True)
    lock = _lock(out)  # released in the finally below, or by the OS if this process dies
    reused = set() if rerun else {p.key for p in planned if (read_status(out / p.key) or {}).get("status") == "ok"}
    todo = [p for p in planned if p.key not in reused]
    workers = max(1, min(workers, len(todo) or 1))
    threads = threads_per_worker(workers)
    env = {**os.environ, **{v: str(threads) for v in THREAD_VARS}, SWEEP_OUT_ENV: str(out)}
    if rerun:  # the studies inside the notebooks retrain too, instead of reading finished runs back
        env[RERUN_ENV] = "1"
    bar = _Progress(path.stem, len(planned), len(reused), workers, progress)
    if progress:
        print(f"sweep {path.stem}: {len(planned)} points, {len(reused)} already finished, "
              f"{workers} worker(s) x {threads} thread(s) -> {out}", file=sys.stderr, flush=True)

    pool: list[_Worker] = []
    spawned = itertools.count(1)
    sel = selectors.DefaultSelector()
    pending = list(reversed(todo))  # pop() from the end = grid order
    logs = out / "logs"  # workers' stderr: papermill's and the kernels' warnings
    logs.mkdir(exist_ok=True)

    def spawn() -> _Worker:
        w = _Worker(env, logs / f"worker-{next(spawned)}.log")
        pool.append(w)
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        return w

    def retire(w: _Worker) -> None:
        sel.unregister(w.proc.stdout)
        pool.remove(w)
        w.stop()
        w.reap(time.monotonic() + 5)

    def fail(point: Point, message: str, seconds: float) -> None:
        # The worker could not write a status (it died or was killed): write the error row here,
        # unless it finished the run just before it was stopped.
        if (read_status(out / point.key) or {}).get("status") == "ok":
            bar.finished("ok", seconds)
            return
        atomic_write_json(out / point.key / "status.json",
                          {"status": "error", "error": message, "seconds": round(seconds, 3),
                           "finished": now(), "notebook": None, "results": {}})
        bar.finished("error", seconds)

    # SIGTERM is handled like Ctrl-C: stop the workers, keep what finished (main thread only).
    def on_term(signum, frame):
        raise KeyboardInterrupt

    old_term = None
    if threading.current_thread() is threading.main_thread():
        old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        for _ in range(workers if todo else 0):
            spawn()
        while pending or any(w.point for w in pool):
            for w in pool:
                if w.point is None and pending:
                    p = pending.pop()
                    d = out / p.key
                    d.mkdir(exist_ok=True)
                    (d / "status.json").unlink(missing_ok=True)
                    atomic_write_json(d / "point.json", {"notebook": str(path), "parameters": p.parameters,
                                                         "key": p.key, "timeout_s": timeout_s})
                    w.send(p, d)
                    bar.show(sum(1 for x in pool if x.point), f"started {p.key} {json.dumps(p.parameters)}")
            for key, _ in sel.select(timeout=1.0):
                w: _Worker = key.data
                line = w.proc.stdout.readline()
                p, dt = w.point, time.monotonic() - w.started
                w.point = None
                if line:
                    st = read_status(out / p.key) or {}
                    bar.finished(st.get("status", "error"), dt)
                    note = f"{p.key} {st.get('status')}" + (f": {st.get('error')}" if st.get("error") else "")
                else:  # the worker died (killed from outside, out of memory)
                    retire(w)
                    if pending:
                        spawn()
                    if p is None:
                        continue
                    fail(p, f"sweep worker exited with code {w.proc.returncode} during the run", dt)
                    note = f"{p.key} error: worker died"
                _write_tables(out, planned, reused)
                bar.show(sum(1 for x in pool if x.point), note)
            for w in list(pool):
                if timeout_s and w.point and time.monotonic() - w.started > timeout_s + KILL_GRACE_S:
                    p, dt = w.point, time.monotonic() - w.started
                    retire(w)
                    fail(p, f"timed out after {timeout_s:g} s", dt)
                    if pending:
                        spawn()
                    _write_tables(out, planned, reused)
                    bar.show(sum(1 for x in pool if x.point), f"{p.key} error: timed out")
    finally:
        # Stop every worker; its kernel exits with it (ipykernel watches its parent process).
        # In-flight runs leave no status.json, so the next call redoes them.
        for w in pool:
            w.stop()
        deadline = time.monotonic() + 10
        for w in pool:
            w.reap(deadline)
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        df = _write_tables(out, planned, reused)
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
    p.add_argument("--grid", metavar="FILE", help="YAML or JSON grid file (see above)")
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                   help="a parameter value (YAML); repeat a name for several values")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="parallel papermill runs; each kernel gets cores // N threads (default 1)")
    p.add_argument("--out", metavar="DIR", help="output folder (default results/sweeps/<notebook stem>/)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="a run taking longer than this is stopped and recorded as an error")
    p.add_argument("--rerun", action="store_true", help="run every point again, even finished ones")
    p.add_argument("--dry-run", action="store_true", help="validate and list the points; run nothing")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    points = combine(load_grid(args.grid) if args.grid else None, points_from_options(args.param))
    if args.dry_run:
        path, planned = plan(args.notebook, points)
        for p in planned:
            print(p.key, json.dumps(p.parameters))
        print(f"{len(planned)} point(s) of {path.name}")
        return 0
    try:
        df = run_sweep(args.notebook, points, workers=args.workers, out=args.out,
                       timeout_s=args.timeout, progress=not args.quiet, rerun=args.rerun)
    except SweepBusy as e:
        print(f"workbench sweep: {e}", file=sys.stderr)
        return 1
    failed = df[df.status != "ok"]
    print(f"sweep: {len(df) - len(failed)} ok, {len(failed)} failed -> {Path(df.attrs['out']) / 'runs.csv'}")
    for _, row in failed.iterrows():
        print(f"  {row.point} {row.status}: {row.error}")
    return 1 if len(failed) else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        sys.exit(_worker_main())
    from workbench.cli import main as cli_main

    sys.exit(cli_main(["sweep", *sys.argv[1:]]))
