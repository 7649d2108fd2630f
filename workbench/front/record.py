"""The notebook side of a sweep: record a run's scalar results (the standard library only: a
sweep's notebook imports it in a cell that papermill's per-cell timeout, --timeout, also bounds).

    from workbench.front.record import record
    record(ppl_after=31.2, status_note="fit")     # one column each in the sweep's runs.csv

Inside a sweep the point's folder is $WORKBENCH_SWEEP_DIR (also the kernel's working directory);
outside one, sweep_result.json goes to the working directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from workbench.core.files import atomic_write_json

RESULT_FILE = "sweep_result.json"
SWEEP_DIR_ENV = "WORKBENCH_SWEEP_DIR"   # set in each kernel: the point's folder


def record(**values: Any) -> Path:
    """Record scalar results of this run; each becomes a column of the sweep's runs.csv.

    Call it from a notebook: `record(ppl_after=31.2, status_note="fit")`. Outside a sweep it
    writes sweep_result.json into the working directory. Values must be scalars.
    """
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
