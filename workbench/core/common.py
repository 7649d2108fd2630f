"""Names every layer shares: byte units, the row sink, where the project lives.

    MiB, GiB     bytes in a mebibyte and a gibibyte (memory is shown in MiB; study 3's modelled
                 card memory in GiB)
    mib_text     a MiB figure for a sentence: whole MiB from 100 up, one decimal below
    Sink         a callable that receives one row (a dict) per step or event: live charts,
                 steps.jsonl, the dashboard
    PROJECT_ROOT the checkout (data/, notebooks/, results/ and .cache/ live beside workbench/)
    environ      os.environ with some values for a while (subprocesses started meanwhile inherit them)
    one_line     an exception as one line: its type and its message's first line
    clear_stale_build_lock  the lock a killed JIT build of a C++ op left (every later build waits on it)
    in_wsl       whether this is Linux under Windows (WSL2: pinned host memory is limited)
    single_process_env  the torch.distributed variables of a one-process group (rank 0 of 1) on a
                 free local port, for DeepSpeed
    single_process_group  that group, made with an in-memory store and loopback sockets (no port
                 open to the network); dist_backend: its backend for a device
    stdout_to_stderr  standard output sent to standard error for a while (a `--json` command's
                 work: its stdout carries the JSON alone)
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil

from workbench.core.config import ConfigError

MiB = 2**20
GiB = 2**30
Sink = Callable[[dict[str, Any]], None]
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def check_writable_file(path: str, option: str, example: str) -> None:
    """A one-line ConfigError where `path`, given to `option`, is no file this process can write: empty, a
    folder, or under a folder (the deepest that exists) it cannot write. Said before the work, not after."""
    if not str(path).strip():
        raise ConfigError(f"{option} needs a file name, e.g. {option} {example}")
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{option} {p} is a folder; name a file in it, e.g. {p / example}")
    folder = next(a for a in (p.parent, *p.parent.parents) if a.exists())
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"{option} {p}: cannot write there; name a file in a folder you can write")


def mib_text(mib: float) -> str:
    """`mib` rounded for a sentence: whole MiB from 100 up, one decimal below (a tiny model's
    "2 MiB + 1% = 2 MiB <= 3 MiB" hides the sums it states), two significant digits below 0.05
    (a budget of 0.01 MiB read "nothing fits 0.0 MiB", where 0 means no budget)."""
    if mib and abs(mib) < 0.05:
        return f"{mib:.2g}"
    return f"{mib:,.0f}" if abs(mib) >= 100 else f"{mib:,.1f}"


def figure_text(v: float) -> str:
    """A measured or modelled figure for a table or a derivation: whole from 100 up (thousands
    separated), else three significant digits, the trailing zeros rounding made kept (a modelled
    alpha of 0.09998 is 0.100, not 0.1); a figure given with fewer digits (a claim's 0.083) as it is."""
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}" if float(f"{v:.3g}") == v else f"{v:#.3g}"


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` (inherited by subprocesses started meanwhile), restored after: a
    worker process outlives the task that changed it."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# A JIT build of a C++ op (DeepSpeed's CPU Adam: a minute or two on first use) holds a lock file
# that only the build's own `finally` removes. A process killed during it (a notebook kernel
# restarted while it seemed stuck, a lent card's hard limit) leaves the lock, and every later build
# of that op waits on it forever without a word (torch.utils.file_baton.FileBaton.wait).
STALE_BUILD_LOCK_S = 600


def clear_stale_build_lock(op: str = "cpu_adam") -> str | None:
    """Remove the lock a killed JIT build of `op` left (older than STALE_BUILD_LOCK_S), saying so
    in a warning; returns what was removed, or None. Where torch builds `op` is torch's own rule."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(op, verbose=False)) / "lock"
    try:
        age_s = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if age_s < STALE_BUILD_LOCK_S:  # a build under way (here or in another process): left to finish
        warnings.warn(f"{lock} is {age_s:,.0f} s old: a build of {op} is under way (a first one takes minutes) "
                      f"and this run waits for it; if none is running, a killed build left it: remove it",
                      stacklevel=2)
        return None
    lock.unlink(missing_ok=True)
    said = f"removed {lock}: a build of {op} killed {age_s / 60:,.0f} min ago left it, and every build waited on it"
    warnings.warn(said, stacklevel=2)
    return said


def in_wsl() -> bool:
    """Whether this is Linux under Windows' WSL2, where the CUDA driver is Windows' and pinned host
    memory is limited (NVIDIA's "CUDA on WSL" guide, known limitations): a large pinned buffer can
    fail as "CUDA error: out of memory", which reads as the card's."""
    return "microsoft" in platform.uname().release.lower()


def single_process_env() -> dict[str, str]:
    """RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT of a process group of one process
    (DeepSpeed's rendezvous reads them) on 127.0.0.1 and a port free now: a fixed port would fail
    whenever another process on the machine held it. Callers set them with os.environ.setdefault, so
    a launcher's own values win."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def dist_backend(device) -> str:
    """torch.distributed backend for a one-process DeepSpeed run on `device`: DeepSpeed's CUDA
    accelerator expects NCCL (gloo has no CUDA collectives for ZeRO's reduce paths); gloo on the CPU."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def single_process_group(device) -> None:
    """A torch.distributed group of this process alone (rank 0 of 1) for DeepSpeed, unless one exists
    (a launcher's). Its store is in memory: DeepSpeed's own rendezvous (env://) starts a TCPStore
    that listens on every interface, whatever MASTER_ADDR says (that is where clients connect),
    unauthenticated, for the rest of the process. Gloo's and NCCL's sockets are on the loopback
    interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME: lo, where not set already). The variables of
    `single_process_env` are set too, where unset: DeepSpeed reads RANK and LOCAL_RANK."""
    import torch.distributed as dist

    for k, v in single_process_env().items():
        os.environ.setdefault(k, v)
    if dist.is_initialized():
        return
    backend = dist_backend(device)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # read when NCCL makes its first communicator
    with environ({"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}):  # read as the group is made
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


# every part of gpu-check that --time-budget kept from beginning says so with these words: such a part
# was not measured, so a run short only of those is incomplete, not failed (gpu_report.summarize)
OUT_OF_TIME = "the time budget (--time-budget) was spent"


def host_free_mib() -> float:
    """The memory this machine has free now, in MiB (psutil's `available`). A CPU run past it does
    not raise an OutOfMemoryError: the kernel's OOM killer kills the process (or it swaps)."""
    return psutil.virtual_memory().available / MiB


def past_free_memory(need_mib: float, *, drop: Callable[[], bool] | None = None) -> str | None:
    """"N MiB > the M MiB this machine has free" when a step needing `need_mib` would not fit in the
    memory free now; None when it would (a study's reason for not running it says the rest).
    drop: where it would not fit, what gives memory back first (a kept model's `load.drop`: True where
    it gave any), and then the memory free is read again."""
    free = host_free_mib()
    if need_mib > free and drop is not None and drop():
        free = host_free_mib()
    return None if need_mib <= free else f"{need_mib:,.1f} MiB > the {free:,.0f} MiB this machine has free"


def one_line(e: BaseException, limit: int = 300) -> str:
    """'TypeName: first line of the message' (at most `limit` characters of the message)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:limit] if text else ''}"


@contextlib.contextmanager
def stdout_to_stderr(enabled: bool = True) -> Iterator[None]:
    """While it lasts, what is written to standard output goes to standard error: Python's `print`,
    a library's log handler bound to `sys.stdout` at import (DeepSpeed's logger is one) and C code
    writing to file descriptor 1. A `--json` command does its work inside it and prints the JSON
    after, so `... --json | jq` reads JSON only."""
    if not enabled:
        yield
        return
    streams = [s for s in (sys.stdout, sys.__stdout__) if s is not None]
    for s in streams:
        s.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no descriptor 1 (a closed stdout): Python's stdout is still redirected
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        for s in streams:
            with contextlib.suppress(ValueError, OSError):
                s.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
