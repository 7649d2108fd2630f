"""Names every layer shares: byte units, the row sink, where the project lives.

    MiB, GiB     bytes in a mebibyte and a gibibyte (every memory figure is shown in MiB)
    Sink         a callable that receives one row (a dict) per step or event: live charts,
                 steps.jsonl, the dashboard
    PROJECT_ROOT the checkout (data/, notebooks/, results/ and .cache/ live beside workbench/)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

MiB = 2**20
GiB = 2**30
Sink = Callable[[dict[str, Any]], None]
PROJECT_ROOT = Path(__file__).resolve().parents[2]
