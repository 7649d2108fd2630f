"""The `workbench` command line.

    workbench reproduce            # every study notebook headless on the embedded default, then the report
    workbench reproduce --quick    # the same on tiny parameters (a minute or two)
    workbench estimate --help      # memory prediction for any model config, no GPU needed
    workbench sweep --help         # papermill sweeps over a grid

Each subcommand lives beside the code it drives; a module adds itself with `register(sub)`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that add subcommands, in the order `--help` lists them. A module that is missing
# (a study not built yet) is left out of the menu rather than breaking the others.
_COMMAND_MODULES = (
    "workbench.front.reproduce",
    "workbench.studies.ladder.cli",
    "workbench.studies.split.cli",
    "workbench.front.sweep",
    "workbench.front.dashboard",
    "workbench.front.gpu_check",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="workbench",
        description="Experiments for training language models on GPUs that are too small: "
        "transfer strategies with device fallback, the memory ladder, the adaptive GPU/CPU split.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from workbench.core.config import ConfigError
    from workbench.core.data import CorpusError
    from workbench.core.models import ModelNotFoundError

    try:
        return int(args.func(args) or 0)
    except (ConfigError, ModelNotFoundError, CorpusError) as e:
        print(f"workbench {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"workbench {args.command}: interrupted; finished runs are kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
