"""`workbench reproduce`: every study notebook headless on the embedded default, then the report.

    workbench reproduce               # full default parameters (about 25 minutes on 2 CPU cores, 31 with setup)
    workbench reproduce --quick       # tiny parameters: checks the whole pipeline in a few minutes
    workbench reproduce --only 01_strategies
    workbench reproduce --report-only   # rewrite results/index.html from the results already there

Executed notebooks go to results/notebooks/, each study's tables to results/<study>/, and the
report to results/index.html. A failing notebook is reported and the others still run; the exit
code says whether all succeeded. A cell's error is one line here; its traceback is in the executed
notebook and in results/reproduce.json. The kernel process's own output (its log lines, a crash's last
words) goes to results/notebooks/<notebook>.kernel.log, kept where it is not empty.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from workbench.core.config import ConfigError
from workbench.core.models import TINY_SPEC, EmbeddedSpec, embedded_metrics, ensure_embedded_base
from workbench.core.results import atomic_write_json, check_folder, environment, locked, now, results_root
from workbench.front.notebooks import available, failure, find, no_run_finished, run_notebook
from workbench.front.report import write_report


def register(sub) -> None:
    p = sub.add_parser("reproduce", help="run every study notebook headless, then write results/index.html",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny parameters (pipeline check, minutes)")
    p.add_argument("--only", nargs="+", metavar="NOTEBOOK", help="run only these notebooks (e.g. 01_strategies)")
    p.add_argument("--no-report", action="store_true", help="skip writing results/index.html")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write results/index.html from the results already there (after a study run "
                        "from the shell, a notebook or a sweep's point)")
    p.set_defaults(func=main)


def _earlier_entries(path: Path) -> list[dict]:
    """The notebooks an earlier call ran, as reproduce.json lists them: a call of some (--only) keeps the
    others' rows (the log had listed this call's alone, and the report lost the others' runs)."""
    try:
        rows = json.loads(path.read_text()).get("notebooks", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [r for r in rows if isinstance(r, dict) and "name" in r] if isinstance(rows, list) else []


def main(args) -> int:
    if args.report_only:
        given = [o for o, v in (("--quick", args.quick), ("--only", args.only), ("--no-report", args.no_report)) if v]
        if given:
            raise ConfigError(f"--report-only runs nothing and takes no {' or '.join(given)}")
        check_folder(results_root(), "the results folder (WORKBENCH_RESULTS)")
        print(f"report: {write_report()}")
        return 0
    try:
        notebooks = [find(n) for n in args.only] if args.only else available()
    except KeyError as e:  # an unknown --only name: one line, before the base is built
        raise ConfigError(e.args[0]) from e
    root = results_root()
    check_folder(root, "the results folder (WORKBENCH_RESULTS)")  # before the base's minutes, not in a traceback after
    print(f"workbench reproduce: {len(notebooks)} notebook(s) -> {root}", flush=True)
    # Build (or verify) the embedded base here, where its progress bar is visible.
    spec = TINY_SPEC if args.quick else EmbeddedSpec()
    ensure_embedded_base(spec)
    m = embedded_metrics(spec)
    print(f"embedded base: {m['params']:,} params, held-out perplexity {m['heldout_perplexity']:.1f} "
          f"vs unigram {m['unigram_perplexity']:.1f}", flush=True)
    log = {"started": now(), "quick": args.quick, "env": environment(), "embedded_base": m}
    failed = 0

    def entry(row: dict) -> None:  # this call's row for the notebook, in place of an earlier call's
        # merged into the log as it is now, under its lock: read once at the start, two calls at once
        # (--only 02, --only 03) had each rewritten the log from its own copy, and 03's row was lost
        with locked(root / "reproduce.json"):
            rows = _earlier_entries(root / "reproduce.json")
            mine = next((i for i, n in enumerate(rows) if n["name"] == row["name"]), None)
            if mine is None:
                rows.append(row)
            else:
                rows[mine] = row
            atomic_write_json(root / "reproduce.json", {**log, "notebooks": rows})

    for nb in notebooks:
        params = {**nb.reproduce, **(nb.quick if args.quick else {})}
        out = root / "notebooks" / f"{nb.name}.ipynb"
        # papermill writes as it goes: into a partial file, renamed when the run ends, so a failed or
        # interrupted run does not replace the last good executed notebook
        partial = out.with_name(f".{nb.name}.partial.ipynb")
        # the kernel's own stderr, not this terminal's: on ^C it printed a ZMQError traceback above the one line
        kernel_log = out.with_name(f"{nb.name}.kernel.log")
        t0 = time.perf_counter()
        print(f"[{nb.name}] running{' (quick)' if args.quick else ''} ...", flush=True)
        started = now()  # said before it runs: a call killed part-way leaves 'not finished', not the old row
        entry({"name": nb.name, "status": "not finished", "started": started, "quick": args.quick,
               "parameters": params})
        status, error, trace = "ok", None, None
        try:
            run_notebook(nb.path, params, partial, progress=f"[{nb.name}] cells", kernel_log=kernel_log)
            os.replace(partial, out)
            out.with_name(f"{nb.name}.failed.ipynb").unlink(missing_ok=True)  # an earlier failure's
            if error := no_run_finished(nb.name, params):  # it ran to its end, each run a row saying why
                failed += 1
                status = "error"
                print(f"[{nb.name}] {error}", file=sys.stderr, flush=True)
        except Exception as e:  # a failing notebook is reported; the others still run
            failed += 1
            status, (error, trace) = "error", failure(e)
            out = out.with_name(f"{nb.name}.failed.ipynb") if partial.exists() else None  # beside the last good one
            if out:
                os.replace(partial, out)
            if trace is None:  # not a cell's error (a dead kernel, the workbench itself): its traceback
                traceback.print_exc()
                if kernel_log.exists() and kernel_log.stat().st_size:
                    print(f"[{nb.name}] the kernel's own output: {kernel_log}", file=sys.stderr, flush=True)
            else:  # a cell's error: one line; its traceback is in the executed notebook and the log
                print(f"[{nb.name}] {error}", file=sys.stderr, flush=True)
        except BaseException:  # ^C, SIGTERM: the half-executed notebook is not kept (hidden, it stayed for good)
            partial.unlink(missing_ok=True)
            raise
        finally:  # an empty one is no news
            if kernel_log.exists() and not kernel_log.stat().st_size:
                kernel_log.unlink()
        dt = time.perf_counter() - t0
        print(f"[{nb.name}] {status} in {dt:.0f} s" + (f" -> {out}" if out else ""), flush=True)
        entry({"name": nb.name, "status": status, "started": started, "quick": args.quick, "seconds": round(dt, 1),
               "output": str(out) if out else None, "parameters": params, "error": error, "traceback": trace})
    if not args.no_report:
        path = write_report()
        print(f"report: {path}", flush=True)
    if failed:
        print(f"workbench reproduce: {failed} notebook(s) failed", file=sys.stderr)
    return 1 if failed else 0
