"""A sweep's points: the grid that makes them, their validation and keys, the table of their runs.

    points = combine(load_grid("grid.yaml"), points_from_options(["lr=1e-3", "lr=3e-4"]))
    path, planned = plan("01_strategies", points)     # one ConfigError listing every bad point
    df = collect(out, planned)                        # one row per point, from its folder's files

The grid syntax, the points' validation and their keys are in workbench.front.sweep's docstring (`workbench
sweep --help`). The tables (runs.csv, study_runs.csv) are rebuilt from the points' folders, never from memory,
so they survive any stop.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import re
import shutil
import socket
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
import yaml

from workbench.core.config import ConfigError
from workbench.core.results import atomic_write_csv, atomic_write_json, now, read_table
from workbench.front.notebooks import STUDIES, find
from workbench.front.record import RESULT_FILE


# ------------------------------------------------------------------------------------------------
# Grids: files and -p options -> a list of points (dicts of parameters)


class _Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where `1e-3` (no dot) is a string; people write learning rates so."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789."))


def parse_value(text: str) -> Any:
    """A `-p` value: a YAML scalar or flow list (`2000`, `1e-3`, `tiny`, `[0, 1]`, `true`)."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]  # the parser's "while parsing ..." says less
        raise ConfigError(f"cannot parse value {text!r} as YAML ({problem}): close its brackets and quotes, or quote "
                          f"the whole NAME=VALUE for the shell, e.g. 'seeds=[0, 1]'") from None


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


def _combined_form(data: dict) -> bool:
    """Whether a mapping uses the combined form's keys as that form does (`grid`/`fixed` a mapping,
    `points` a list of mappings), whatever other keys it has."""
    return (any(isinstance(data.get(k), dict) for k in ("grid", "fixed"))
            or (isinstance(data.get("points"), list) and any(isinstance(p, dict) for p in data["points"])))


def points_from_grid(data: Any, where: str = "grid") -> list[dict[str, Any]]:
    """Expand a loaded grid file (see the module docstring for the three forms)."""
    if isinstance(data, list):
        explicit, axes, fixed = data, {}, {}
    elif isinstance(data, dict) and data and set(data) <= {"grid", "points", "fixed"}:
        explicit, axes, fixed = data.get("points") or [], data.get("grid") or {}, data.get("fixed") or {}
        if not isinstance(axes, dict) or not isinstance(fixed, dict) or not isinstance(explicit, list):
            raise ConfigError(f"{where}: `grid` and `fixed` must be mappings and `points` a list")
    elif isinstance(data, dict) and _combined_form(data):
        extra = ", ".join(sorted(set(data) - {"grid", "points", "fixed"}))
        raise ConfigError(f"{where}: a grid file with `grid`, `points` or `fixed` has no other keys, got {extra}; "
                          f"put a parameter under `grid` (an axis) or `fixed` (the same for every point)")
    elif isinstance(data, dict):
        explicit, axes, fixed = [], data, {}
    elif data is None:  # an empty file, or one of comments only
        raise ConfigError(f"{where} is empty: give a mapping of parameter -> list of values, or a list of points "
                          f"(`workbench sweep --help`)")
    else:
        raise ConfigError(f"{where}: expected a mapping of parameter -> values or a list of points, "
                          f"got {type(data).__name__}")
    for i, p in enumerate(explicit):
        if not isinstance(p, dict):
            raise ConfigError(f"{where}: point {i + 1} is not a mapping of parameter -> value: {p!r}")
    points = (product(axes, where) if axes else []) + [dict(p) for p in explicit]
    if not points and not fixed:  # `[]`, `{}`, `grid: {}`: it ran the study's defaults, a long run nobody asked for
        raise ConfigError(f"{where} names no parameter and no point: give a mapping of parameter -> list of values, "
                          f"or a list of points (`workbench sweep --help`)")
    return [{**fixed, **p} for p in points] or [dict(fixed)]


def load_grid(path: str | Path) -> list[dict[str, Any]]:
    """Read a YAML or JSON grid file into a list of points; a malformed file is a ConfigError."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read grid file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"grid file {path} is not text (UTF-8): give a YAML or JSON file") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.load(text, Loader=_Loader)
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
    path = Path(notebook)
    if path.is_file():
        return path.resolve()
    try:
        return find(str(notebook)).path
    except KeyError as e:
        raise ConfigError(f"no notebook {str(notebook)!r}: not a file, and {e.args[0]}") from None


def study_of(path: Path):
    return STUDIES.get(path.stem)


def plan(notebook: str | Path, points: list[dict[str, Any]]) -> tuple[Path, list[Point]]:
    """Validate every point and key it; raise one ConfigError listing all bad points."""
    import papermill as pm  # here, not at the top: ~1.7 s to import (nbformat, jsonschema)

    path = resolve_notebook(notebook)
    study, known = study_of(path), None
    if study is None:
        try:
            with warnings.catch_warnings():  # papermill's, of a name not ending .ipynb, came before the one line
                warnings.simplefilter("ignore", UserWarning)
                known = set(pm.inspect_notebook(str(path)))
        except Exception as e:  # nbformat's NotJSONError, a JSON or schema error: not a notebook
            why = " ".join(str(e).split())[:120] or type(e).__name__
            raise ConfigError(f"{path} cannot be read as a Jupyter notebook ({why}): give a notebook saved by "
                              f"Jupyter, with a cell tagged `parameters`") from None
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
                    has = ", ".join(sorted(known)) or "none (no cell tagged `parameters`, or one with no names)"
                    raise ConfigError(f"unknown parameter{'s' * (len(unknown) > 1)} {', '.join(unknown)}; "
                                      f"the notebook's parameters cell has: {has}")
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
    if errors:  # a grid file's list is the values swept: a setting that takes a list needs a list of lists
        listed = next((m[1] for e in errors if (m := re.search(r"(\w+): expected a list, got", e))), None)
        raise ConfigError("\n  ".join([f"{len(errors)} of {len(points)} points are invalid; nothing was run:", *errors]
                                       + [f"({listed} takes a list: in a grid file each of its values is a list, "
                                          f"{listed}: [[a, b]]; with -p, -p '{listed}=[a, b]')"] * bool(listed)))
    return path, planned


# ------------------------------------------------------------------------------------------------
# The tables: rebuilt from the points' folders


def read_status(point_dir: Path, name: str = "status.json") -> dict[str, Any] | None:
    """The point's status.json, or another of its JSON files: point.json (its notebook, parameters, key,
    timeout), its RUNNING lock (who runs it)."""
    try:
        return json.loads((point_dir / name).read_text())
    except (OSError, json.JSONDecodeError):
        return None


class SweepBusy(RuntimeError):
    """Another sweep holds this output folder, or a live run one of its points."""


RUNNING = ".running.lock"  # flock'd by the process running the point; says who: pid, host, sweep call


def hold(point_dir: Path, call: str | None):
    """The point's lock for one run, with who holds it written in (an open file: closing it, or the
    holder's death, frees it, so a dead run's lock is taken over), or None where a live run holds it."""
    f = open(point_dir / RUNNING, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "call": call, "started": now()}))
    f.flush()
    return f


def holder(point_dir: Path) -> dict[str, Any] | None:
    """Who is running the point now ({pid, host, call, started}), or None where no live process is."""
    if not (point_dir / RUNNING).exists():
        return None
    with open(point_dir / RUNNING, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # released when the file closes
        except BlockingIOError:  # who is not written yet where it was taken a moment ago
            return read_status(point_dir, RUNNING) or {"pid": "?", "host": "?", "started": "?"}


def began(point_dir: Path, call: str) -> bool:
    """Whether the sweep call `call` began running the point (took its lock)."""
    return (read_status(point_dir, RUNNING) or {}).get("call") == call


def check_points(out: Path, notebook: Path, planned: list[Point], rerun: bool) -> None:
    """Before a sweep writes anything: `out` holds no other notebook's points (only this sweep's folders had been
    checked: one of another notebook's sweep there took runs.csv over), nor is a live process running one of its
    points (a stopped sweep's run on a scheduler's worker): a ConfigError, or SweepBusy."""
    mine = {p.key for p in planned}
    theirs = sorted((d.name not in mine, d.name, s["notebook"]) for d in out.iterdir()
                    if (s := read_status(d, "point.json") or {}).get("notebook", str(notebook)) != str(notebook))
    if theirs and not rerun:  # named: one of this sweep's own points first (the one it would take over)
        _, key, other = theirs[0]
        raise ConfigError(f"--out {out} holds runs of another notebook, {other} (point {key}), not {notebook}: "
                          f"give this sweep an --out of its own (or --rerun to run it there anyway)")
    for p in planned:
        who = holder(out / p.key)
        if who:
            raise SweepBusy(f"point {p.key} in {out} is still being run by pid {who['pid']} on {who['host']} "
                                  f"(since {who['started']}): wait for it to end, or end it, then run the sweep again")


PREVIOUS = ".previous"  # a finished point's outputs while it is run again (--rerun)


def output_names(stem: str) -> tuple[str, ...]:
    """What a run of notebook `stem` writes in its point's folder."""
    return "status.json", RESULT_FILE, f"{stem}.ipynb", f".{stem}.partial.ipynb", "stderr.log", "results"


def set_aside(point_dir: Path, names: tuple[str, ...]) -> None:
    """Before a point runs: its outputs `names` go, except a finished (ok) run's, which move into
    `PREVIOUS` until the new run finishes; a stopped rerun gives them back (`give_back`)."""
    prev = point_dir / PREVIOUS
    if (point_dir / "status.json").exists():  # a rerun killed after its status, before it removed the run it
        shutil.rmtree(prev, ignore_errors=True)  # replaced: that run is stale (a failure here had brought it back)
    if keep := not prev.exists() and (read_status(point_dir) or {}).get("status") == "ok":
        prev.mkdir()
    for name in names:
        if keep and (point_dir / name).exists():
            os.replace(point_dir / name, prev / name)
        else:
            _remove(point_dir / name)


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def give_back(point_dir: Path, names: tuple[str, ...] = ()) -> bool:
    """A rerun that did not finish: its partial outputs `names` go and the finished run's come back
    (each over what the rerun left of the same name). False where nothing was set aside."""
    prev = point_dir / PREVIOUS
    if not prev.is_dir():
        return False
    for path in [point_dir / n for n in names] + [point_dir / p.name for p in prev.iterdir()]:
        _remove(path)
    for p in sorted(prev.iterdir(), key=lambda p: p.name == "status.json"):  # its status last: then it is whole
        os.replace(p, point_dir / p.name)
    prev.rmdir()
    return True


def keep_previous(point_dir: Path, names: tuple[str, ...], failed: dict[str, Any]) -> dict[str, Any] | None:
    """A rerun that failed (an error, a timeout, a dead kernel or worker): the finished run it was redoing
    is back, its status noting the failure (`rerun`); it had been deleted. None where none was set aside."""
    if not give_back(point_dir, names):
        return None
    rerun = {k: failed.get(k) for k in ("error", "traceback", "seconds", "started", "finished", "worker")}
    atomic_write_json(point_dir / "status.json", status := {**(read_status(point_dir) or {}), "rerun": rerun})
    return status


BOOKKEEPING = ("point", "status", "seconds", "error", "notebook", "finished", "kernel_threads", "reused")


def collect(out: Path, planned: list[Point], reused: set[str] = frozenset()):
    """The tidy table: one row per point, in grid order; unfinished points are `pending`; a point whose
    rerun by this call failed is its kept run's row, the rerun's error its error. A parameter named like
    a bookkeeping column is `param_<name>` (a swept `threads` had been overwritten by the kernel's thread count)."""
    rows = []
    for p in planned:
        st = read_status(out / p.key) or {}
        rerun = st.get("rerun") if p.key not in reused else None  # an earlier call's is not this table's
        row = {"point": p.key, **{f"param_{k}" if k in BOOKKEEPING else k: v for k, v in p.parameters.items()},
               "status": st.get("status", "pending"), "seconds": st.get("seconds"),
               "error": f"rerun failed (the earlier run is kept): {rerun['error']}" if rerun else st.get("error"),
               "notebook": str(out / p.key / st["notebook"]) if st.get("notebook") else None,
               "finished": st.get("finished"), "kernel_threads": st.get("threads"), "reused": p.key in reused}
        for name, v in (st.get("results") or {}).items() if st.get("status") == "ok" else ():
            row[f"result_{name}" if name in row else name] = v
        rows.append(row)
    df = pd.DataFrame(rows)
    for col in df.columns:  # list-valued parameters are written as JSON, not Python reprs
        if df[col].map(lambda v: isinstance(v, (list, dict))).any():
            df[col] = df[col].map(_cell)
    return df


def _varying(planned: list[Point]) -> list[str]:
    """The parameters whose value differs between the points (the grid's axes), in first-seen order."""
    names = list(dict.fromkeys(k for p in planned for k in p.parameters))
    return [k for k in names if len({json.dumps(p.parameters.get(k), sort_keys=True) for p in planned}) > 1]


def _cell(v: Any) -> Any:
    return json.dumps(v) if isinstance(v, (list, dict)) else v


def write_tables(out: Path, planned: list[Point], reused: set[str]):
    """runs.csv (returned) and study_runs.csv, written atomically from the points' folders."""
    df = collect(out, planned, reused)
    atomic_write_csv(out / "runs.csv", df)
    # A study's own per-run tables, stacked: the finer-grained view of the same sweep. Each row leads with its
    # point and the grid's varying parameters (a study 1 row has no learning rate of its own; a column it has
    # keeps its value).
    parts = []
    axes = _varying(planned)
    for p in planned:
        if (read_status(out / p.key) or {}).get("status") != "ok":
            continue
        for f in sorted((out / p.key / "results").glob("*/runs.csv")):
            try:
                runs = read_table(f)  # its keys as text, as every results table is read
            except pd.errors.ParserError:
                continue
            lead = {"point": p.key, "study": f.parent.name,
                    **{k: _cell(p.parameters.get(k)) for k in axes if k not in runs.columns}}
            parts.append(pd.concat([pd.DataFrame([lead] * len(runs), index=runs.index), runs], axis=1))
    if parts:
        atomic_write_csv(out / "study_runs.csv", pd.concat(parts, ignore_index=True))
    else:  # no point of this grid recorded runs: an earlier grid's must not stand for them
        (out / "study_runs.csv").unlink(missing_ok=True)
    return df
