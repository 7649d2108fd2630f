"""`workbench dashboard`: the study notebooks as Voila apps, for teaching and demos.

    workbench dashboard --quick        # tiny parameters: each app opens in about a minute
    workbench dashboard --port 8866    # default parameters (each app runs its full study on open)

Each study notebook is copied with its parameters injected (papermill's prepare-only mode: no
code runs) into results/dashboard/, and Voila serves that folder. Voila runs a notebook when its
page is opened and shows only the outputs: the live charts update as the study runs, and the
knobs panel at the end re-runs it with other settings. The server binds to 127.0.0.1 and asks
for a token (printed with the URL); nothing else on the network can reach it. The token never
appears on a command line (where `ps` shows it to every user of the machine): it is $WORKBENCH_TOKEN
or a random one, and reaches Voila through a voila.json readable only by you, in a private folder
that is Voila's working directory.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

from workbench.core.results import results_root
from workbench.front.notebooks import available


def register(sub) -> None:
    p = sub.add_parser("dashboard", help="serve the study notebooks as Voila apps on 127.0.0.1 (token required)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny parameters, so each app opens in about a minute")
    p.add_argument("--port", type=int, default=8866)
    p.add_argument("--prepare-only", action="store_true", help="write the app notebooks and exit")
    p.set_defaults(func=main)


def prepare(quick: bool, out: Path | None = None) -> Path:
    """Write each available study notebook, parameters injected, into the dashboard folder."""
    import papermill as pm  # here, not at the top: ~1.7 s to import (nbformat, jsonschema)

    out = Path(out or results_root() / "dashboard")
    out.mkdir(parents=True, exist_ok=True)
    for nb in available():
        params = dict(nb.quick) if quick else {}
        nb.check(params)
        pm.execute_notebook(str(nb.path), str(out / nb.path.name), parameters=params, prepare_only=True,
                            kernel_name="python3", progress_bar=False)
    return out


def voila_command(folder: Path, port: int) -> list[str]:
    """The Voila server's command line: no token on it (see `private_config`)."""
    return [sys.executable, "-m", "voila", str(Path(folder).resolve()), "--no-browser", "--Voila.ip=127.0.0.1",
            f"--port={port}", "--theme=light"]


def private_config(token: str) -> Path:
    """A folder only this user can read, holding voila.json with the token; Voila reads its config
    from its working directory, so start it there."""
    folder = Path(tempfile.mkdtemp(prefix="workbench-voila-"))  # mode 0700
    path = folder / "voila.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"Voila": {"token": token}}, f)
    return folder


def start_voila(folder: Path, port: int, token: str, **popen_kw) -> subprocess.Popen:
    """Voila on 127.0.0.1:`port` serving `folder`, asking for `token` (never on a command line)."""
    return subprocess.Popen(voila_command(folder, port), cwd=private_config(token), **popen_kw)


def main(args) -> int:
    folder = prepare(args.quick)
    print(f"workbench dashboard: apps written to {folder}", flush=True)
    if args.prepare_only:
        return 0
    token = os.environ.get("WORKBENCH_TOKEN") or secrets.token_urlsafe(16)
    print(f"open http://127.0.0.1:{args.port}/?token={token}  (Ctrl-C stops the server)", flush=True)
    proc = start_voila(folder, args.port, token)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait(timeout=10)
        return 130
