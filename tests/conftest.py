"""Test fixtures: a tiny embedded base built once per session, results in a temporary folder.

Every test runs the real entry points on tiny models on the CPU. The environment variables are
set before any workbench import, so notebook kernels started by papermill inherit them too.
"""

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

# A second import of this file (as `tests.conftest`, which some modules import by that name, or in a
# child process a test starts) shares the session's folder and keeps the environment it was given.
_SESSION_ENV = "WORKBENCH_TEST_SESSION_DIR"
_OWNER = _SESSION_ENV not in os.environ
_SESSION_DIR = Path(tempfile.mkdtemp(prefix="workbench-tests-") if _OWNER else os.environ[_SESSION_ENV])
if _OWNER:
    os.environ[_SESSION_ENV] = str(_SESSION_DIR)
    os.environ.setdefault("WORKBENCH_CACHE", str(_SESSION_DIR / "cache"))
    os.environ["WORKBENCH_RESULTS"] = str(_SESSION_DIR / "results")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test may wait on the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from workbench.core.parallel import thread_env, threads_per_worker  # noqa: E402

# Each of pytest-xdist's workers takes its share of the cores (at most 2 threads). Two workers of 2
# threads each on 2 cores built the tiny base in 353 s, not 18 s (1 thread each): OpenMP's threads
# spin waiting for cores the other worker holds (parallel.py measured 14x for Dask workers so).
# The `python -c` children of subprocess_env take the share too; notebook kernels keep torch's
# default. Two runs of the suite with the share in the environment of everything a test starts
# gained nothing measurable (the ZeRO-Offload test's minutes are DeepSpeed's builds, see
# subprocess_env) and each failed: the study-notebook sweep hung in one, the Voila page's widgets
# never drew in the other. The sweep's hang is not the share's (its kernels take their own,
# 1 thread here, either way; it came back once in 113 runs of that test alone beside a load, 30, 48
# and 35, in the study's cell after its results were written; cause not found yet: the test now
# aborts its kernels past 600 s so that they print their stacks, and the Voila test loads a page
# whose widgets never drew once more, keeping what the first showed).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_SHARE = min(2, threads_per_worker(_WORKERS))
torch.set_num_threads(_SHARE)


def pytest_sessionfinish(session, exitstatus):
    """The session's folder (the tiny base, the results) goes when the session that made it ends."""
    if _OWNER:
        shutil.rmtree(_SESSION_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_base():
    """Path of the tiny embedded base (built once per session)."""
    from workbench.core.models import TINY_SPEC, ensure_embedded_base

    return ensure_embedded_base(TINY_SPEC, progress=False)


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    """A fresh results folder for this test (notebook kernels inherit it)."""
    d = tmp_path / "results"
    monkeypatch.setenv("WORKBENCH_RESULTS", str(d))
    return d


WSL2_RELEASE = "5.15.167.4-microsoft-standard-WSL2"  # Linux under Windows: "microsoft" in the kernel's release
LINUX_RELEASE = "6.8.0-49-generic"


def played_uname(release: str):
    """A stand-in for platform.uname on a Linux machine whose kernel is `release` (common.in_wsl reads it)."""
    import platform

    return lambda: platform.uname_result("Linux", "host", release, "#1 SMP", "x86_64")


def unavailable_here(what: str, why: str) -> None:
    """Skip a test whose library cannot run on this machine, saying why; but where the run says it
    installed that library (`make test` sets WORKBENCH_TESTS_NEED=deepspeed, as `make setup` installs
    it), fail: a DeepSpeed whose JIT build broke had read as a skip, and its tests could not fail."""
    if what in os.environ.get("WORKBENCH_TESTS_NEED", "").split(","):
        pytest.fail(f"{what} is installed for these tests (WORKBENCH_TESTS_NEED) but cannot run here: {why}")
    pytest.skip(why)


def subprocess_env(root: Path) -> dict[str, str]:
    """This environment for a `python -c` child that imports the project from `root`, with any
    PYTHONPATH already set kept after it (packages on PYTHONPATH, as a lent card's bundle puts them);
    beside other test workers, with this worker's share of the cores (DeepSpeed's CPU Adam, for one,
    reads OMP_NUM_THREADS). The ZeRO-Offload parity test's 115-126 s in a fresh clone's suite is not
    threads: a new virtual environment makes DeepSpeed build its cpu_adam and shm_comm ops again
    (about 100 s each, two compile jobs; the test took 202 s alone with an empty TORCH_EXTENSIONS_DIR,
    29 s with the ops built), and the first test to use them pays."""
    return {**os.environ, **(thread_env(_SHARE) if _WORKERS > 1 else {}),
            "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}


def play_cores(monkeypatch, n: int) -> None:
    """workbench.core.parallel counts `n` cores, as on a larger machine (how many workers to start),
    while the worker processes it starts take one thread each: they run on this machine's cores beside
    the other test worker, where 2 threads each spin (see the top of this file)."""
    from workbench.core import parallel

    monkeypatch.setattr(parallel, "cores", lambda: n)
    monkeypatch.setattr(parallel, "threads_per_worker", lambda workers: 1)


class OomDeepSpeedEngine:
    """A stand-in for `deepspeed.initialize`'s engine whose backward runs out of memory as on a card;
    it counts `destroy()` calls (DeepSpeed's gradient hooks hold the model until it is destroyed)."""

    device, destroyed = torch.device("cpu"), 0

    def __init__(self, model=None):
        if model is not None:  # as ZeRO-3's engine does (DeepSpeedZeRoOffload's setup); destroy() leaves it there
            from deepspeed.runtime.zero import parameter_offload

            parameter_offload.FWD_MODULE_STACK.append(model)

    def __call__(self, **kw):
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(loss=torch.tensor(1.0, requires_grad=True))

    def backward(self, loss):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def destroy(self):
        self.destroyed += 1


def tiny_config(arch: str):
    """Tiny random configs of the five architectures study 1 must handle."""
    import transformers as T

    common = dict(vocab_size=128)
    if arch == "qwen2":
        return T.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                             num_key_value_heads=2, tie_word_embeddings=True, **common)
    if arch == "llama":
        return T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                             num_key_value_heads=2, **common)
    if arch == "gpt2":
        return T.GPT2Config(n_embd=32, n_layer=6, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0, **common)
    if arch == "opt":
        return T.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=6, num_attention_heads=4,
                           max_position_embeddings=64, word_embed_proj_dim=32, bos_token_id=0, eos_token_id=0,
                           pad_token_id=1, **common)
    if arch == "gpt_neox":
        return T.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                               max_position_embeddings=64, bos_token_id=0, eos_token_id=0, **common)
    raise ValueError(arch)


ARCHS = ("qwen2", "llama", "gpt2", "opt", "gpt_neox")


def tiny_moe_config(arch: str):
    """Tiny random mixture-of-experts configs (transformers 5 runs their experts through torch._grouped_mm)."""
    import transformers as T

    common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2)
    if arch == "mixtral":
        return T.MixtralConfig(intermediate_size=48, num_local_experts=4, **common)
    if arch == "qwen2_moe":  # routed experts beside a shared one
        return T.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=48,
                                num_experts=4, **common)
    raise ValueError(arch)


PLOTLY = "application/vnd.plotly.v1+json"


def executed_plots(path):
    """(live chart outputs, other plotly outputs) of an executed study notebook.

    The live chart is the output of the cell that builds a LiveChart; it is redrawn in place, so
    that cell must hold exactly one plotly output, its final state.
    """
    import nbformat

    nb = nbformat.read(path, as_version=4)
    live_cell = next(i for i, c in enumerate(nb.cells) if "LiveChart(" in c.source)
    plots = [(i, o["data"][PLOTLY]) for i, c in enumerate(nb.cells) if c.cell_type == "code"
             for o in c.get("outputs", []) if PLOTLY in o.get("data", {})]
    return [p for i, p in plots if i == live_cell], [p for i, p in plots if i != live_cell]


def connection_info_notebook(path: Path) -> Path:
    """A notebook whose kernel writes its own connection info (transport, address, and the mode of
    the sockets' folder when they are Unix sockets) to the file named by its parameter `out`."""
    import nbformat

    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(f"out = {str(path.with_suffix('.json'))!r}",
                                          metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell(
                    "import json, os, ipykernel.connect as c\n"
                    "info = c.get_connection_info(unpack=True)\n"
                    "if info['transport'] == 'ipc':\n"
                    "    info['mode'] = oct(os.stat(os.path.dirname(info['ip'])).st_mode & 0o777)\n"
                    "open(out, 'w').write(json.dumps(info, default=str))")]
    nbformat.write(nb, path)
    return path


def abort_kernels_with_their_stacks() -> int:
    """SIGABRT every notebook kernel this process started (at any depth); returns how many. Started with
    PYTHONFAULTHANDLER=1, each writes all its threads' stacks to its stderr as it dies: a hung test's
    kernels say where they were (pytest-timeout shows only the test's own process)."""
    import psutil

    aborted = 0
    for child in psutil.Process().children(recursive=True):
        try:
            if any("ipykernel" in part for part in child.cmdline()):
                child.send_signal(signal.SIGABRT)
                aborted += 1
        except psutil.Error:
            pass
    return aborted
