"""Whole-file writes that a crash cannot tear, on the standard library alone (a sweep's notebook
imports them through front.record in its first cell, inside papermill's per-cell timeout: they must
not bring torch or pandas with them).

A write goes to a hidden temporary file beside the target, named with the writing host and process
(.summary.json.<host>-<pid>.<random>.tmp), and is renamed into place: a crash leaves the old file or
the new one. A process killed mid-write (SIGKILL: no `except` runs) leaves its temporary behind;
the next write of the same file on that host removes it once its process is gone.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

_UMASK = os.umask(0)
os.umask(_UMASK)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def _host() -> str:
    return socket.gethostname().replace(".", "_")  # a name's dots would split the temporary's name


def clear_stale_temporaries(path: str | Path) -> list[Path]:
    """Remove the temporaries of `path` left by writers on this host that are no longer running
    (another host's, on a shared folder, are not this host's to judge); the ones removed."""
    path, host = Path(path), _host()
    gone = []
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        writer = tmp.name[len(path.name) + 2:].split(".", 1)[0]  # <host>-<pid>
        name, _, pid = writer.rpartition("-")
        if name == host and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)
            gone.append(tmp)
    return gone


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    return atomic_write_text(path, data)


def atomic_write_text(path: str | Path, text: str | bytes) -> Path:
    """`text` (or bytes) into `path` through a temporary beside it: a crash leaves the old file or the new."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clear_stale_temporaries(path)
    prefix = f".{path.name}.{_host()}-{os.getpid()}."
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
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
