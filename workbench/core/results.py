"""Where results go, and how they are written so that nothing is lost or half-written.

    results/<study>/<run_id>/config.json, steps.jsonl, summary.json
    results/<study>/runs.csv      one row per run: its key, metrics, status (the ladder's: its config too)

Every whole-file write goes to a temporary file in the same folder and is renamed into place,
so a crash leaves the old file or the new one, never a torn one. A run's steps are appended one
flushed line per step, so a crash keeps every step written so far (in steps.partial.jsonl until the
run's summary puts them in place: RunDir). A run's status is one of
ok, oom, fallback, skipped or error, and a failed run is a row, never a gap.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from workbench.core.common import PROJECT_ROOT, environ
from workbench.core.config import ConfigError
from workbench.core.files import atomic_write_json, atomic_write_text  # noqa: F401  (callers' import too)

STATUSES = ("ok", "oom", "fallback", "skipped", "error")
# columns that hold keys: read as text (a hash of digits, or digits around one 'e', read as a number:
# 012345678901 became 12345678901 and 1e3456789012 inf, and the same settings added a second row)
KEY_COLUMNS = ("run_id", "study_key", "point")


def results_root() -> Path:
    """The results folder: $WORKBENCH_RESULTS (a relative one from the working folder), else
    ./results beside the project."""
    env = os.environ.get("WORKBENCH_RESULTS")
    if env:
        return Path(env).absolute()
    return PROJECT_ROOT / "results"


def atomic_write_csv(path: str | Path, df: pd.DataFrame) -> Path:
    return atomic_write_text(path, df.to_csv(index=False))


def git_commit() -> str:
    """The checkout's commit, with "+changes" when the package or its data differ from it (a result
    made by edited code is not that commit's); "unknown" outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=PROJECT_ROOT, capture_output=True,
                             text=True, timeout=5)
        commit = out.stdout.strip()
        if not commit:
            return "unknown"
        edited = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "workbench", "data"], cwd=PROJECT_ROOT,
                                capture_output=True, timeout=5).returncode == 1
        return commit + ("+changes" if edited else "")
    except Exception:
        return "unknown"


_ENV_CACHE: dict[str, Any] | None = None


def environment() -> dict[str, Any]:
    """Versions and hardware every result row carries.

    Versions come from the installed packages' metadata, so writing a result never imports transformers
    (torch comes with the workbench's config module: core.data); the torch thread count
    and the GPU's name are read from torch when the process has imported it (it has, wherever
    anything trained), else they are left empty."""
    global _ENV_CACHE
    if _ENV_CACHE is None:
        _ENV_CACHE = {
            "python": platform.python_version(),
            **{lib: _version(lib) for lib in ("torch", "transformers", "peft")},
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        }
    torch = sys.modules.get("torch")  # imported by whatever trained; never imported just to describe it
    # the code is read on every call: a kernel that reloaded edited modules is another code (~4 ms)
    live = {"git_commit": git_commit(), "workbench_code": code_fingerprint(),
            "torch_threads": torch.get_num_threads() if torch else None,
            "gpu": (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none") if torch else None}
    return {**_ENV_CACHE, **live}


# what a finished run's figures depend on beyond the workbench's own code: training, memory and kernels
KEY_LIBRARIES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "deepspeed")


def library_versions() -> str:
    """The installed versions of the libraries a run's figures depend on, as one key ("torch 2.13.0,
    transformers 5.0.0, ..."): a finished run is read back only under the same ones, so an upgrade
    (another attention kernel, another optimizer, another allocator) measures again."""
    return ", ".join(f"{lib} {_version(lib)}" for lib in KEY_LIBRARIES)


def _version(lib: str) -> str:
    try:
        return importlib.metadata.version(lib)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class JsonlSink:
    """A training sink writing one flushed JSON line per row."""

    def __init__(self, path: str | Path, *, fresh: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w" if fresh else "a", buffering=1)

    def __call__(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps(row, default=float) + "\n")

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


class RunDir:
    """One run's folder: config.json at the start, steps.jsonl as it goes, summary.json at the end.
    The folder is made by the first file written to it: looking for a finished run makes nothing.

    A try writes its config and steps as config.partial.json and steps.partial.jsonl, which its summary
    puts in place: a try killed part-way (a finished run trained again with WORKBENCH_RERUN=1) leaves the
    finished try's config, steps and summary as they were. Its truncated steps had stood beside the old
    summary, which said the run was finished, and every later call reused the run with them."""

    def __init__(self, study: str, run_id: str, root: str | Path | None = None):
        self.study = study
        self.run_id = run_id
        self.path = Path(root or results_root()) / study / run_id

    _TRY_FILES = ("config.json", "steps.jsonl")  # written as <stem>.partial<suffix> until the summary

    def partial(self, name: str) -> Path:
        """Where this try writes `name` until its summary puts it in place."""
        stem, _, suffix = name.partition(".")
        return self.path / f"{stem}.partial.{suffix}"

    def write_config(self, config: dict[str, Any]) -> None:
        atomic_write_json(self.partial("config.json"), {**config, "env": environment(), "started": now()})

    def steps_sink(self) -> JsonlSink:
        """This try's steps (steps.partial.jsonl, started afresh), put in place by its summary."""
        return JsonlSink(self.partial("steps.jsonl"), fresh=True)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """The summary, with this try's config and steps put in place first; the old summary goes before
        them: a kill in between leaves a run without a summary (not finished), never a mix of two tries."""
        status = summary.get("status")
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        tried = [name for name in self._TRY_FILES if self.partial(name).exists()]
        if tried:
            (self.path / "summary.json").unlink(missing_ok=True)
        for name in tried:
            os.replace(self.partial(name), self.path / name)
        atomic_write_json(self.path / "summary.json", {**summary, "finished": now()})

    def summary(self) -> dict[str, Any] | None:
        p = self.path / "summary.json"
        return json.loads(p.read_text()) if p.exists() else None

    def training(self):
        """Held while this process trains the run (a lock in its folder, released if the process dies):
        another process given the same run at once waits for it, then finds it finished. Two had
        trained it side by side, appending to one steps.jsonl."""
        return locked(self.path / "training", waiting=f"{self.study} run {self.run_id} is being trained by "
                                                       f"another process; waiting for it to finish")

    def config(self) -> dict[str, Any] | None:
        p = self.path / "config.json"
        return json.loads(p.read_text()) if p.exists() else None


RERUN_ENV = "WORKBENCH_RERUN"


def check_folder(path: Path, name: str) -> None:
    """A one-line ConfigError naming `name` where a folder could not be made or written at `path`;
    nothing is made. A command checks its output folder so before its work (a file there had been
    found after it)."""
    there = next(a for a in (path, *path.parents) if a.exists())  # the deepest part that exists
    if not there.is_dir():
        why = "it is a file" if there == path else f"{there} is a file"
    elif not os.access(there, os.W_OK | os.X_OK):
        why = f"{there} is not writable by you"
    else:
        return
    raise ConfigError(f"{name} {path}: {why}; name a folder you can write")


def made_by(notebook: str | Path) -> dict[str, str]:
    """What a notebook's run depends on beyond its parameters: this package's code, the key libraries'
    versions and the notebook's own text. A sweep reads a finished point back only when all match (a
    pull, an upgrade or an edited notebook had had the old run's figures reused under its parameters)."""
    return {"code": code_fingerprint(), "libraries": library_versions(),
            "notebook_text": hashlib.sha256(Path(notebook).read_bytes()).hexdigest()[:12]}


def code_fingerprint(package: Path = PROJECT_ROOT / "workbench") -> str:
    """A key of the code that made a result: every module of the package, by path and content.

    Part of a finished run's inputs beside the version: a checkout that pulled new code keeps its
    version string, and a run made by the old code would otherwise be read back as current (its
    rows without what the new code adds to them, its figures from the old code). Read on every call
    (about 4 ms), not once a process: a notebook kernel that reloaded edited modules had kept the
    old code's key and read back the old code's runs."""
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(f"{path.relative_to(package).as_posix()}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def reuse_finished_runs() -> bool:
    """False when $WORKBENCH_RERUN is set (`workbench sweep --rerun` sets it for its notebooks):
    then a study retrains a finished run instead of reading its summary back."""
    return os.environ.get(RERUN_ENV, "").strip().lower() not in ("1", "true", "yes")


def results_under(path: str | Path):
    """A context in which study runs write under `path` instead of results/ and always run again
    (a finished run read back is not a run: `workbench gpu-check` measures, it does not recall)."""
    return environ({"WORKBENCH_RESULTS": str(path), RERUN_ENV: "1"})


@contextlib.contextmanager
def locked(path: str | Path, waiting: str | None = None):
    """An exclusive lock (fcntl, a `.lock` file beside `path`) for read-modify-write of a shared table,
    or for a run while it trains; `waiting` is said (one line) when another holder makes this one wait.

    The OS releases it when the holder dies, so a crash never leaves the table locked."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                print(f"workbench: {waiting}", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass
class StudyResult:
    """What a study's runner returns: its runs table, its step rows and its named side tables.

        result = run_split_study(cfg)
        result.runs                      # one row per run (rung, strategy, k, ...)
        result.steps                     # one row per training step of every run
        result.tables["timeline"]        # side tables, by name (`result.table(name)` says which exist)
        result.facts["host_and_published"]  # facts (study 3's host rates; the ladder has none)
        result.paths                     # where each of them was written
    """

    study: str
    runs: pd.DataFrame
    steps: pd.DataFrame = field(default_factory=pd.DataFrame)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)

    def table(self, name: str) -> pd.DataFrame:
        if name not in self.tables:
            raise KeyError(f"{self.study} has no table {name!r}; it has: {', '.join(self.tables) or 'none'}")
        return self.tables[name]


class ResultsWriter:
    """The one way a study's results reach disk: results/<study>/[<run>/]<name>.{csv,json}.

    Every file is written atomically (a temporary file renamed into place), and `runs.csv` is
    only ever updated by `update_runs`: under the study's lock, rows whose key matches a new row
    are replaced and every other row is kept, so runs of other settings (or of another process
    finishing at the same time) are never lost.
    """

    def __init__(self, study: str, root: str | Path | None = None):
        self.study = study
        self.dir = Path(root or results_root()) / study

    def _path(self, name: str, suffix: str, run: str | None) -> Path:
        return (self.dir / run if run else self.dir) / f"{name}{suffix}"

    def table(self, name: str, df: pd.DataFrame, *, run: str | None = None) -> Path:
        return atomic_write_csv(self._path(name, ".csv", run), df)

    def json(self, name: str, obj: Any, *, run: str | None = None) -> Path:
        return atomic_write_json(self._path(name, ".json", run), obj)

    def update_runs(self, rows: Iterable[dict[str, Any]], *, key: str | tuple[str, ...] = "run_id") -> pd.DataFrame:
        """Put `rows` into runs.csv (`recorded` added, and this process's environment columns where a
        row does not carry its own), replacing rows with the same `key`; returns the whole table."""
        keys = (key,) if isinstance(key, str) else tuple(key)
        env = {f"env_{k}": v for k, v in environment().items()}
        stamp = now()
        new = [{**env, **row, "recorded": stamp} for row in rows]
        path = self.dir / "runs.csv"
        with locked(path):
            old = read_table(path, keys)
            if len(old) and new and all(k in old for k in keys):
                taken = {tuple(str(r.get(k)) for k in keys) for r in new}
                old = old[[tuple(str(v) for v in vals) not in taken
                           for vals in old[list(keys)].itertuples(index=False, name=None)]]
            df = pd.concat([old, pd.DataFrame(new)], ignore_index=True) if len(old) else pd.DataFrame(new)
            atomic_write_csv(path, df)
        return df

    def write(self, result: StudyResult, *, run: str | None = None, runs_key: str | tuple[str, ...] = "run_id") -> StudyResult:
        """Write a result: its steps and every side table and fact (in the run's folder when `run` is
        given), then its runs into runs.csv (`update_runs`), last: a crash in between leaves runs.csv
        without the rows whose tables it did not finish, never rows whose tables are missing.
        Records the paths."""
        result.paths["runs"] = str(self.dir / "runs.csv")
        # even with no rows: an earlier call's steps left in place were read back beside these runs
        result.paths["steps"] = str(self.table("steps", result.steps, run=run))
        for name, df in result.tables.items():
            result.paths[name] = str(self.table(name, df, run=run))
        for name, obj in result.facts.items():
            result.paths[name] = str(self.json(name, obj, run=run))
        self.update_runs(result.runs.to_dict("records"), key=runs_key)
        return result


def latest(runs: pd.DataFrame, key: str) -> pd.DataFrame:
    """The rows of runs.csv written by the most recent call (the latest `recorded` value of `key`;
    of calls in the same second, the one written last: update_runs appends)."""
    if runs.empty or key not in runs or "recorded" not in runs:
        return runs
    last = runs.sort_values("recorded", kind="stable")[key].dropna()
    return runs[runs[key] == last.iloc[-1]] if len(last) else runs


# hashes and commits: "1e23456" read as a number is inf, "0123" is 123 (and any column ending in _hash or _fingerprint)
TEXT_COLUMNS = ("config_hash", "trainable_set", "workbench_code", "git_commit", "corpus_fingerprint", "model_fingerprint")
ENV_NUMBERS = ("env_cpu_count", "env_torch_threads")  # every other env_* is text (commits, versions, names)


def read_table(path: str | Path, keys: Iterable[str] = ()) -> pd.DataFrame:
    """A results CSV, its key columns (KEY_COLUMNS and `keys`), hashes and environment's text columns as
    text (a commit such as 1e23456 read as a number had become inf, and was written back so by the
    next update); a missing or empty file (a table with no rows) is an empty DataFrame."""
    try:
        header = pd.read_csv(path, nrows=0).columns
        text = {*KEY_COLUMNS, *keys, *TEXT_COLUMNS}
        return pd.read_csv(path, dtype={c: str for c in header if c in text or c.endswith(("_hash", "_fingerprint"))
                                        or (c.startswith("env_") and c not in ENV_NUMBERS)})
    except (FileNotFoundError, pd.errors.EmptyDataError):
        return pd.DataFrame()


def read_steps(path: str | Path) -> pd.DataFrame:
    """Read a steps.jsonl, ignoring a final line torn by a crash."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return pd.DataFrame(rows)


def append_benchmark_row(row: dict[str, Any]) -> Path:
    """Add one row to results/benchmarks.csv, with the environment, under a file lock.

    Benchmarks have different columns, so the file is read, extended and rewritten atomically
    (a crash never leaves a torn file; two benchmarks at once do not lose each other's rows).
    """
    path = results_root() / "benchmarks.csv"
    full = {"when": now(), **{f"env_{k}": v for k, v in environment().items()}, **row}  # a row's own env_* kept
    with locked(path):
        old = read_table(path)  # hashes as text: a plain read made 0012e45 1.2e+46 at the next row
        atomic_write_csv(path, pd.concat([old, pd.DataFrame([full])], ignore_index=True))
    return path
