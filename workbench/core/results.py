"""Where results go, and how they are written so that nothing is lost or half-written.

    results/<study>/<run_id>/config.json, steps.jsonl, summary.json
    results/<study>/runs.csv      one row per run: config fields + metrics + status

Every whole-file write goes to a temporary file in the same folder and is renamed into place,
so a crash leaves the old file or the new one, never a torn one. `steps.jsonl` is appended one
flushed line per step, so a crash keeps every step written so far. A run's status is one of
ok, oom, fallback, skipped or error, and a failed run is a row, never a gap.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
from workbench.core.common import PROJECT_ROOT

STATUSES = ("ok", "oom", "fallback", "skipped", "error")
_UMASK = os.umask(0)
os.umask(_UMASK)


def results_root() -> Path:
    """The results folder: $WORKBENCH_RESULTS, else ./results beside the project."""
    env = os.environ.get("WORKBENCH_RESULTS")
    if env:
        return Path(env)
    return PROJECT_ROOT / "results"


def atomic_write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; results are for everyone who can read the folder
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def atomic_write_csv(path: str | Path, df: pd.DataFrame) -> Path:
    return atomic_write_text(path, df.to_csv(index=False))


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


_ENV_CACHE: dict[str, Any] | None = None


def environment() -> dict[str, Any]:
    """Versions and hardware every result row carries."""
    global _ENV_CACHE
    if _ENV_CACHE is None:
        import torch
        import transformers

        env = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
            "git_commit": git_commit(),
        }
        try:
            import peft

            env["peft"] = peft.__version__
        except ImportError:
            pass
        _ENV_CACHE = env
    return dict(_ENV_CACHE)


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
    """One run's folder: config.json at the start, steps.jsonl as it goes, summary.json at the end."""

    def __init__(self, study: str, run_id: str, root: str | Path | None = None):
        self.study = study
        self.run_id = run_id
        self.path = Path(root or results_root()) / study / run_id
        self.path.mkdir(parents=True, exist_ok=True)

    def write_config(self, config: dict[str, Any]) -> None:
        atomic_write_json(self.path / "config.json", {**config, "env": environment(), "started": now()})

    def steps_sink(self) -> JsonlSink:
        """The run's steps.jsonl, started afresh: a retried run replaces the steps of the try before."""
        return JsonlSink(self.path / "steps.jsonl", fresh=True)

    def write_summary(self, summary: dict[str, Any]) -> None:
        status = summary.get("status")
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        atomic_write_json(self.path / "summary.json", {**summary, "finished": now()})

    def summary(self) -> dict[str, Any] | None:
        p = self.path / "summary.json"
        return json.loads(p.read_text()) if p.exists() else None


RERUN_ENV = "WORKBENCH_RERUN"


def reuse_finished_runs() -> bool:
    """False when $WORKBENCH_RERUN is set (`workbench sweep --rerun` sets it for its notebooks):
    then a study retrains a finished run instead of reading its summary back."""
    return os.environ.get(RERUN_ENV, "").strip().lower() not in ("1", "true", "yes")


@contextlib.contextmanager
def locked(path: str | Path):
    """An exclusive lock (fcntl, a `.lock` file beside `path`) for read-modify-write of a shared table.

    The OS releases it when the holder dies, so a crash never leaves the table locked."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_runs_table(study_dir: str | Path, rows: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Write `runs.csv` (one row per run, environment columns added) atomically."""
    env = environment()
    df = pd.DataFrame([{**row, **{f"env_{k}": v for k, v in env.items()}} for row in rows])
    atomic_write_csv(Path(study_dir) / "runs.csv", df)
    return df


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
    full = {"when": now(), **row, **{f"env_{k}": v for k, v in environment().items()}}
    with locked(path):
        old = pd.read_csv(path) if path.exists() and path.stat().st_size else pd.DataFrame()
        atomic_write_csv(path, pd.concat([old, pd.DataFrame([full])], ignore_index=True))
    return path
