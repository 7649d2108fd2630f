"""The `workbench` command line (also `python -m workbench`).

    workbench reproduce                  # every study notebook headless on the embedded default, then the report
    workbench reproduce --quick          # the same on tiny parameters (a few minutes)
    workbench strategies NAME=VALUE ...  # one study from the shell (also: ladder, split)
    workbench estimate --help            # memory prediction for any model config, no GPU needed
    workbench sweep --help               # papermill sweeps over a grid, on Dask
    workbench dashboard                  # the study notebooks as Voila apps
    workbench gpu-check                  # every GPU path on this card (one line without CUDA)

Each subcommand lives beside the code it drives and adds itself with `register(sub)`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import warnings
from pathlib import Path

from workbench.core.config import ConfigError
from workbench.core.data import CorpusError
from workbench.core.models import ModelNotFoundError
from workbench.core.results import results_root
from workbench.core.trainable import StrategyNotApplicable
from workbench.core.training import LossDiverged
from workbench.front import commands, dashboard, gpu_check, reproduce, sweep
from workbench.studies.ladder import cli as estimate

# in the order `--help` lists them
COMMAND_MODULES = (reproduce, commands, estimate, sweep, dashboard, gpu_check)
PACKAGE = Path(__file__).resolve().parent  # a warning raised from a file under it is the workbench's own


class OneLineParser(argparse.ArgumentParser):
    """A bad option is one line naming the command and where its options are listed, as the
    workbench's other errors are (argparse prints the command's whole usage block before it);
    the subcommands' parsers are of this class too (`add_subparsers` makes its parent's kind)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="workbench",
        description="Experiments for training language models on GPUs that are too small: "
        "transfer strategies with device fallback, the memory ladder, the adaptive GPU/CPU split.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    parser.commands = sub.choices  # name -> the command's parser (its usage for its errors)
    return parser


def _one_line_warnings(command: str):
    """A warning the workbench itself raises (a corpus whose held-out text repeated its training
    text, say) is one line naming the command, as its errors are, not Python's file, line and
    source; a library's warning is shown as Python shows it."""
    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if Path(filename).resolve().is_relative_to(PACKAGE):
            print(f"workbench {command}: warning: {message}", file=file or sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    return show


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is."""


def _terminate(signum, frame):
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # NAME=VALUE after an option (`sweep 01_strategies --workers 2 seeds=[0]`): argparse fills a
    # positional list from one run of positionals only and leaves the rest unrecognized
    if hasattr(args, "assignments"):
        args.assignments = [*args.assignments, *(e for e in extra if "=" in e and not e.startswith("-"))]
        extra = [e for e in extra if e not in args.assignments]
    if extra:  # with the command's usage, not the top level's
        parser.commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if os.environ.get("WORKBENCH_RESULTS"):  # relative: the caller's folder, also for kernels run in notebooks/
        os.environ["WORKBENCH_RESULTS"] = str(results_root())
    # SIGTERM (`kill`, `timeout`) as ^C is: the `finally`s run (a DeepSpeed build's lock is released; it had
    # been left, and every later build waited on it) and the run says so; it had ended without a word
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warnings(args.command)
            return int(args.func(args) or 0)
    except (ConfigError, ModelNotFoundError, CorpusError, StrategyNotApplicable, LossDiverged) as e:
        print(f"workbench {args.command}: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if not (e.filename and Path(str(e.filename)).absolute().is_relative_to(results_root())):
            raise
        print(f"workbench {args.command}: cannot write the results folder {results_root()}: {e.strerror} "
              "(set WORKBENCH_RESULTS to a folder you can write)", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        kept = {"estimate": "", "gpu-check": "; the checks it finished are written",  # no runs to keep
                "split": "; study 3 reuses no run: a rerun measures them again"}
        how = "terminated" if isinstance(e, _Terminated) else "interrupted"
        print(f"workbench {args.command}: {how}{kept.get(args.command, '; finished runs are kept')}", file=sys.stderr)
        return 143 if isinstance(e, _Terminated) else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
