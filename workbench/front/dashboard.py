"""`workbench dashboard`: the study notebooks as Voila apps, for teaching and demos.

    workbench dashboard --quick        # tiny parameters: each app opens in about a minute
    workbench dashboard --port 8866    # default parameters (each app runs its full study on open)

Each study notebook is copied with its parameters injected (papermill's prepare-only mode: no code
runs) into results/dashboard/, and Voila serves that folder; the apps' runs are written under
results/dashboard/results/, apart from the studies' own results and the report. Voila runs a
notebook when its page is opened and shows only the outputs: the live charts update as the study
runs, and the knobs panel at the end re-runs it with other settings. The server binds to 127.0.0.1
and asks for a token (printed with the URL); nothing else on the network can reach it. The token
never appears on a command line (where `ps` shows it to every user of the machine): it is
$WORKBENCH_TOKEN or a random one, and reaches Voila through a voila.json readable only by you, in a
private folder that is Voila's working directory, removed when the server stops; Voila's log writes
a request's token `[secret]`. Voila is told not to move to another port: a busy port is a one-line
error before anything starts, so the printed address is always the server's (a browser sent to a
moved server's old port would hand the token to whatever listens there). The apps' kernels talk to
Voila over Unix sockets in its connection folder (mode 0700), not TCP ports on 127.0.0.1, whose
output stream any user of a shared machine could read. The pages ask nothing of any other host:
Voila is given its lab template less the links to Font Awesome on jsdelivr (see TEMPLATES).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote

from workbench.core.config import ConfigError
from workbench.core.results import results_root
from workbench.front.notebooks import available, kernel_transport

# a Jupyter data folder holding the apps' Voila template, `workbench`: Voila's lab page less its links
# to Font Awesome on a CDN (an offline classroom's page waited on them; Voila's bundle carries the font)
TEMPLATES = Path(__file__).with_name("jupyter")


def register(sub) -> None:
    p = sub.add_parser("dashboard", help="serve the study notebooks as Voila apps on 127.0.0.1 (token required)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny parameters, so each app opens in about a minute")
    p.add_argument("--port", type=int, default=8866, help="port on 127.0.0.1 (default 8866); it must be free")
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


def port_in_use(port: int) -> bool:
    """Whether 127.0.0.1:`port` cannot be bound (tornado binds with SO_REUSEADDR, so do the same)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def check_port(port: int) -> None:
    """A one-line error for a port Voila could not serve on, naming a free one."""
    if not 1 <= port <= 65535:
        raise ConfigError(f"--port must be between 1 and 65535, got {port}")
    if port_in_use(port):
        free = next((p for p in range(port + 1, min(port + 50, 65536)) if not port_in_use(p)), None)
        fix = f"pass --port {free}" if free else "pass another --port"
        raise ConfigError(f"port {port} on 127.0.0.1 is in use (another dashboard or server?); {fix}")


def voila_command(folder: Path, port: int) -> list[str]:
    """The Voila server's command line: no token on it (see `private_config`), and no moving to
    another port when `port` is taken (Voila's default tries 50 others)."""
    # -P: the working directory (the private config folder, with its voila.py) is not on sys.path,
    # where `-m voila` would import that file as the package
    return [sys.executable, "-P", "-m", "voila", str(Path(folder).resolve()), "--no-browser", "--Voila.ip=127.0.0.1",
            f"--port={port}", "--Voila.port_retries=0", "--theme=light", "--template=workbench"]


def private_config(token: str) -> Path:
    """A folder only this user can read, holding voila.json with the token and the kernels' Unix
    socket transport; Voila reads its config from its working directory, so start it there."""
    folder = Path(tempfile.mkdtemp(prefix="workbench-voila-"))  # mode 0700
    path = folder / "voila.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"Voila": {"token": token}, **kernel_transport()}, f)
    # Voila logs a refused or missing page's URL, `?token=...` and all, through tornado's summary of a
    # request (its access log and its HTTP errors' warnings): in Voila's process, that summary writes
    # the token `[secret]`, as Jupyter Server's own log does (code, so a .py config beside the JSON)
    (folder / "voila.py").write_text(
        "import re\nimport tornado.web\n\n_summary = tornado.web.RequestHandler._request_summary\n"
        "tornado.web.RequestHandler._request_summary = lambda self: re.sub(r'(token=)[^&\\s]*', r'\\1[secret]', "
        "_summary(self))\n")
    return folder


def start_voila(folder: Path, port: int, token: str, **popen_kw) -> subprocess.Popen:
    """Voila on 127.0.0.1:`port` serving `folder`, asking for `token` (never on a command line).
    Stop it with `stop_voila`, which also removes the token's private folder. The apps' studies write
    under `folder`/results, not the studies' own results/<study>/ (a demo's run had become what the
    report read as the study's latest result)."""
    config = private_config(token)
    env = {**(popen_kw.pop("env", None) or os.environ), "WORKBENCH_RESULTS": str(Path(folder).absolute() / "results")}
    env["JUPYTER_PATH"] = os.pathsep.join(filter(None, (str(TEMPLATES), env.get("JUPYTER_PATH"))))
    try:
        proc = subprocess.Popen(voila_command(folder, port), cwd=config, env=env, **popen_kw)
    except BaseException:
        shutil.rmtree(config, ignore_errors=True)
        raise
    proc.config_dir = config
    return proc


def stop_voila(proc: subprocess.Popen, timeout: float = 10) -> int:
    """Stop the server (if it still runs) and remove the folder holding its token."""
    try:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        shutil.rmtree(proc.config_dir, ignore_errors=True)
    return proc.returncode


def main(args) -> int:
    if not args.prepare_only:
        check_port(args.port)  # before the seconds of preparing
    folder = prepare(args.quick)
    print(f"workbench dashboard: apps written to {folder}", flush=True)
    if args.prepare_only:
        return 0
    token = os.environ.get("WORKBENCH_TOKEN") or secrets.token_urlsafe(16)
    check_port(args.port)  # again: preparing took seconds
    # quoted: a $WORKBENCH_TOKEN with '&', '#' or a space made an address that asked for the token again
    print(f"open http://127.0.0.1:{args.port}/?token={quote(token, safe='')}  (Ctrl-C stops the server)", flush=True)
    proc = start_voila(folder, args.port, token)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # `kill`, a closed terminal: stop Voila, remove the token
        signal.signal(sig, _exit_on)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        stop_voila(proc)
        print("workbench dashboard: stopped (the server, its kernels and its token's folder are gone)",
              file=sys.stderr, flush=True)


def _exit_on(signum, frame):
    raise SystemExit(128 + signum)
