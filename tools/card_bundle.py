"""Pack what `workbench gpu-check` needs beyond a lent GPU machine's own image into one file that
a device call carries: `.whl/site.tar.xz` (git-ignored), unpacked there with

    tar -xJf .whl/site.tar.xz -C /tmp && export PYTHONPATH=/tmp/site:$PWD

The lent machine (the device tool's nvidia-h200: Python 3.12, CUDA 13.0, torch 2.11, no network)
has transformers 5.17, accelerate and pandas but no bitsandbytes, DeepSpeed, torchao, papermill or
Jupyter kernel; a call carries at most 64 MiB, and the wheels alone are more than that
(bitsandbytes' is 41 MiB: its libraries for every CUDA and ROCm version). So the bundle is the
installed packages, not their wheels, with bitsandbytes' libraries cut to the card's CUDA and the
CPU's, compressed with xz (27.5 MiB on 2026-11-23).

What travels: the dependency closure of the project's own pins (pyproject.toml, as this checkout's
.venv installed them) and of DeepSpeed and torchao, less torch (the machine's CUDA build stays) and
less every package the image already holds (`tools/h200_image.txt`), except those whose version
matters here and differs there (`FORCED`). Run it with the .venv's Python (the versions are read
from it; DeepSpeed is built into a wheel against its torch):

    .venv/bin/python tools/card_bundle.py [--python 3.12] [--cuda 130] [--out .whl/site.tar.xz]

`--python` is the card's Python (the compiled wheels are chosen for it); a bundle for this
machine's Python (`--python 3.11`) is how the set is checked here without a card.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
IMAGE = ROOT / "tools" / "h200_image.txt"
# not carried: the machine's own CUDA torch; the Jupyter server and Voila (gpu-check runs the
# notebooks through papermill, no server); litgpt (only the published-peaks validation, CPU work)
EXCLUDE = {"torch", "jupyterlab", "voila", "litgpt"}
# needed by gpu-check and not among the project's install_requires
EXTRA = {"deepspeed": "deepspeed==0.19.8",  # the ZeRO rungs and the split baseline (pyproject's extra)
         "torchao": "torchao==0.18.0"}      # the split baseline's CPUOffloadOptimizer (gpu-check only)
# in the image, but not at this project's pins (transformers 5.17 there) or at a version not recorded (peft)
FORCED = {"transformers", "peft"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
LIMIT_BYTES = 48 * 2**20  # of the 64 MiB a call carries, room for the working tree beside it


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = IMAGE) -> set[str]:
    return {norm(line.strip()) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}


def project_roots() -> list[str]:
    """The project's own requirements, as this environment installed them (no extras)."""
    deps = [Requirement(r) for r in md.requires("workbench") or []]
    return [norm(r.name) for r in deps if r.marker is None and norm(r.name) not in EXCLUDE]


def target_environment(python: str) -> dict[str, str]:
    """The environment markers of the card's interpreter (CPython `python` on x86-64 Linux)."""
    return {"python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
            "os_name": "posix", "platform_machine": "x86_64", "extra": ""}


def closure(roots: list[str], requires, exclude: set[str], python: str) -> list[str]:
    """Every distribution reachable from `roots` through `requires(name)` (its requirement strings;
    None for one not installed here, which a root may be: it is then taken without requirements),
    not passing through `exclude`. A requirement counts when its marker holds on the card's Python
    (no extras)."""
    env = target_environment(python)
    seen: set[str] = set()
    stack = [norm(r) for r in roots]
    while stack:
        name = stack.pop()
        if name in seen or name in exclude:
            continue
        seen.add(name)
        for r in map(Requirement, requires(name) or []):
            if r.marker is None or r.marker.evaluate(env):
                stack.append(norm(r.name))
    return sorted(seen)


def installed_requires(name: str) -> list[str] | None:
    try:
        return md.requires(name) or []
    except md.PackageNotFoundError:
        return None


def carried(roots: list[str], image: set[str], python: str, requires=installed_requires) -> list[str]:
    """The distributions to carry: the closure of `roots`, stopping at torch and at what the image
    holds (its own version brings its own requirements), except FORCED, so that a newer
    transformers rides on the image's tokenizers and hub."""
    return closure(roots, requires, EXCLUDE | (image - FORCED), python)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True)


def _target_options(python: str) -> list[str]:
    out = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for p in PLATFORMS:
        out += ["--platform", p]
    return out


def prune(site: Path, cuda: str) -> int:
    """Drop what the card cannot use: bitsandbytes' libraries for other CUDA and ROCm versions and
    for Intel GPUs, and bytecode caches. Returns the bytes removed."""
    removed = 0
    keep = {f"libbitsandbytes_cuda{cuda}.so", "libbitsandbytes_cpu.so"}
    doomed = [p for p in (site / "bitsandbytes").glob("libbitsandbytes_*.so") if p.name not in keep]
    doomed += list(site.rglob("__pycache__"))
    for p in doomed:
        removed += sum(f.stat().st_size for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return removed


def build(out: Path, python: str, cuda: str) -> Path:
    names = carried(project_roots() + list(EXTRA), image_packages(), python)
    here = {norm(d.metadata["Name"]) for d in md.distributions()}
    # each at the version installed here; one not installed here at its pin (torchao), else the
    # newest (a requirement only the card's Python has)
    specs = [f"{n}=={md.version(n)}" if n in here else EXTRA.get(n, n) for n in names]
    if unpinned := [n for n in names if n not in here and n not in EXTRA]:
        print(f"not installed here, carried at their newest: {' '.join(unpinned)}", flush=True)
    print(f"carrying {len(specs)} distributions for CPython {python}, CUDA {cuda}: {' '.join(specs)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels, site = Path(tmp) / "wheels", Path(tmp) / "site"
        source_built = [s for s in specs if s.startswith("deepspeed==")]  # DeepSpeed ships no wheel
        print("building DeepSpeed's wheel, downloading the others ...", flush=True)
        for s in source_built:
            _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), s)
        _pip("download", "--no-deps", *_target_options(python), "-d", str(wheels),
             *[s for s in specs if s not in source_built])
        _pip("install", "--no-deps", "--no-index", "--no-compile", *_target_options(python), "--target", str(site),
             *map(str, sorted(wheels.glob("*.whl"))))
        saved = prune(site, cuda)
        print("compressing (xz, about a minute) ...", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")
        with tarfile.open(partial, "w:xz") as tar:
            tar.add(site, arcname="site")
        size = partial.stat().st_size
        if size > LIMIT_BYTES:  # before it replaces a bundle a call can carry
            partial.unlink()
            raise SystemExit(f"{out.name} would be {size / 2**20:.1f} MiB, over the {LIMIT_BYTES / 2**20:.0f} MiB a "
                             f"device call can spare: carry less ({'the earlier bundle is kept' if out.exists() else 'none written'})")
        partial.replace(out)
    print(f"{out}: {size / 2**20:.1f} MiB ({saved / 2**20:.0f} MiB of other CUDA versions' libraries and caches left out)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default="3.12", help="the card's Python, major.minor (default 3.12)")
    p.add_argument("--cuda", default="130", help="the card's torch.version.cuda without the dot (default 130)")
    p.add_argument("--out", default=str(ROOT / ".whl" / "site.tar.xz"), help="the bundle (default .whl/site.tar.xz)")
    args = p.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python) or not args.cuda.isdigit():
        p.error("--python is like 3.12 and --cuda like 130")
    build(Path(args.out), args.python, args.cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main())
