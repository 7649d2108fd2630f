"""`workbench split`: run study 3 (the adaptive accelerator/host update split) from the shell.

    workbench split --quick                                   # tiny settings, ~10 s
    workbench split --set iterations=20 --set 'k_sweep=[0, 0.5, 1]' --set profiles='["H100-SXM"]'
    workbench split --published                               # only the seed's operating point

Each --set NAME=VALUE is a SplitConfig field (VALUE read as JSON, else as a string); unknown
names and wrong types are refused. Results go to results/split/ (or $WORKBENCH_RESULTS/split/).
"""

from __future__ import annotations

import argparse
import json

from workbench.core.config import ConfigError

# Tiny settings for `--quick`, `workbench reproduce --quick` and the notebook test.
QUICK = {"iterations": 6, "warmup": 1, "k_sweep": [0.0, 0.5, 1.0], "modelled_k_points": 6, "eval_blocks": 8}


def register(sub) -> None:
    from workbench.studies.split.config import SplitConfig

    fields = "\n".join(f"  {n:<18} {h}" for n, h in SplitConfig.help().items())
    p = sub.add_parser(
        "split",
        help="study 3: how much speed an adaptive GPU/CPU split of the Adam update wins back",
        description=__doc__,
        epilog=f"fields (--set NAME=VALUE):\n{fields}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="tiny settings (a few seconds)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a SplitConfig field")
    p.add_argument("--published", action="store_true",
                   help="print the seed's operating point as modelled and the verdict on its k band, then stop")
    p.add_argument("--json", action="store_true", help="print the runs table as JSON records")
    p.set_defaults(func=main)


def parse_sets(items: list[str]) -> dict:
    out = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--set expects NAME=VALUE, got {item!r}")
        try:
            out[name] = json.loads(raw)
        except json.JSONDecodeError:
            out[name] = raw
    return out


def main(args) -> int:
    from workbench.studies.split.config import SplitConfig

    if args.published:
        from workbench.studies.split.perf_model import published_operating_point

        from workbench.studies.split.perf_model import seed_verdict

        op = published_operating_point()
        print(json.dumps(op, indent=2, default=str))
        print(seed_verdict()["text"])
        return 0
    values = {**(QUICK if args.quick else {}), **parse_sets(args.set)}
    cfg = SplitConfig.from_dict(values)
    from workbench.studies.split.runner import run_split_study

    df = run_split_study(cfg)
    if args.json:
        print(df.to_json(orient="records", indent=1))
        return 0
    cols = ["source", "run", "k_actual", "tokens_per_s", "tflops", "accel_idle_share",
            "host_done_before_bwd_end_share", "status"]
    with __import__("pandas").option_context("display.width", 200, "display.max_rows", 200):
        print(df[[c for c in cols if c in df]].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    bad = df["status"].isin(["error"]).sum()
    return 1 if bad else 0
