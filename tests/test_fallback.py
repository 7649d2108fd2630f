"""Device fallback and the CPU-played memory budget."""

import gc
import re

import psutil
import pytest
import torch

from workbench.cli import main
from workbench.core.config import ConfigError
from workbench.core.fallback import Attempt, default_attempts, run_with_fallback, unavailable
from workbench.core.memory.budget import DeviceBudget, device_budget
from workbench.core.memory.live_bytes import LiveBytes
from workbench.front.gpu_check import NO_GPU_LINE
from workbench.studies.split.config import SplitConfig
from workbench.studies.split.preflight import failure
from tests.conftest import LINUX_RELEASE, WSL2_RELEASE, played_uname


def test_budget_raises_the_same_error_as_cuda_and_releases_memory():
    with LiveBytes() as outer:
        start = outer.current_bytes
        with pytest.raises(torch.OutOfMemoryError, match="budget exceeded"):
            with device_budget("cpu", budget_mib=1.0):
                [torch.zeros(64 * 1024) for _ in range(8)]  # 2 MiB in 256 KiB pieces, all alive at once
        gc.collect()
        assert outer.current_bytes == start


def test_live_bytes_counts_storages_once_and_frees_them():
    with LiveBytes() as lb:
        a = torch.zeros(1024)  # 4 KiB
        v = a.view(32, 32)  # a view shares the storage: not counted again
        b = a + 1
        assert lb.current_bytes == 8192
        del a, v
        assert lb.current_bytes == 4096  # the view kept nothing alive once both were gone
        del b
    assert lb.current_bytes == 0 and lb.peak_bytes == 8192


def test_a_view_of_a_tensor_made_before_the_mode_is_not_new_memory():
    """Study 1's played GPU counted the whole held-out token tensor (host data on a card) when the
    evaluation sliced it: a view's storage was counted as if the op had allocated it."""
    held, idx = torch.zeros(1024, dtype=torch.int64), torch.tensor([0, 1])  # made before the attempt
    with LiveBytes() as lb:
        first, parts = held[:16], held.split(8)
        held.add_(0)  # in place: no new memory either
        assert lb.current_bytes == 0
        batch = held[idx]  # indexing copies: new memory, counted
        assert lb.current_bytes == batch.nbytes == 16
        del first, parts, batch


def _job_needing(mib):
    def job(attempt, budget, phase):
        phase("forward")
        x = torch.zeros(int(mib * 2**18))  # mib MiB of fp32
        phase("backward")
        y = x + 1
        return float(y[0])
    return job


def test_fallback_goes_to_the_next_attempt_and_records_the_phase():
    attempts = (Attempt.parse("cpu@3"), Attempt.parse("cpu"))
    out = run_with_fallback(attempts, _job_needing(2))  # 2 MiB fits once, not twice
    assert out.status == "fallback" and str(out.attempt) == "cpu"
    assert out.history[0]["result"] == "oom" and out.history[0]["phase"] == "backward"
    assert out.history_text() == "cpu@3: oom in backward -> cpu: ok"
    assert out.value == 1.0


def test_first_attempt_fitting_is_ok_and_preflight_skips():
    attempts = (Attempt.parse("cpu@8"), Attempt.parse("cpu"))
    assert run_with_fallback(attempts, _job_needing(2)).status == "ok"
    out = run_with_fallback(attempts, _job_needing(2), preflight=lambda a: (100.0, "test"))
    assert out.history[0]["result"] == "skipped" and "predicted peak 100.0 MiB" in out.history[0]["reason"]
    assert out.status == "fallback"
    # held to the budget in its own unit, MiB: 2% over is skipped, 2% under runs (read as MB, 8 MiB let 8.39 through)
    over = run_with_fallback(attempts, _job_needing(2), preflight=lambda a: (8 * 1.02, "test"))
    assert over.history[0]["result"] == "skipped" and "> budget 8 MiB" in over.history[0]["reason"]
    assert run_with_fallback(attempts, _job_needing(2), preflight=lambda a: (8 * 0.98, "test")).status == "ok"


def test_a_cpu_attempt_without_a_budget_is_held_to_the_memory_this_machine_has_free():
    """Past the machine's memory a CPU run is not an OutOfMemoryError but the process killed by the
    kernel's OOM killer (a micro_batch of 100,000 on the tiny base took the whole study with it)."""
    free = psutil.virtual_memory().available / 2**20
    ran = []

    def job(attempt, budget, phase):
        ran.append(str(attempt))
        return 1.0

    out = run_with_fallback((Attempt.parse("cpu"),), job, preflight=lambda a: (2 * free, "test"))
    assert out.status == "oom" and ran == []  # nothing was allocated for it
    # the CPU named with its index is the same CPU (it had been let through unchecked)
    spelled = run_with_fallback((Attempt.parse("cpu:0"),), job, preflight=lambda a: (2 * free, "test"))
    assert spelled.status == "oom" and ran == [] and spelled.history[0]["phase"] == "preflight"
    (h,) = out.history
    assert h["result"] == "skipped" and h["phase"] == "preflight"
    assert re.fullmatch(r"predicted peak [\d,.]+ MiB \(test\) > the [\d,]+ MiB this machine has free "
                        r"\(preflight=False runs it anyway\)", h["reason"]), h["reason"]
    assert run_with_fallback((Attempt.parse("cpu"),), job, preflight=lambda a: (free / 4, "test")).status == "ok"
    assert ran == ["cpu"]


def test_an_out_of_memory_error_without_a_message_falls_back():
    """A bare torch.OutOfMemoryError() (no text) ended the study with an IndexError reading its first line."""
    def job(attempt, budget, phase):
        if attempt.budget_mib is not None:
            raise torch.OutOfMemoryError()
        return 1.0

    out = run_with_fallback((Attempt.parse("cpu@8"), Attempt.parse("cpu")), job)
    assert out.status == "fallback" and out.history[0]["reason"] == "OutOfMemoryError"


def test_nothing_fits_is_an_oom_outcome_not_a_crash():
    attempts = (Attempt.parse("cpu@1"), Attempt.parse("cpu@2"))
    with LiveBytes() as outer:
        start = outer.current_bytes
        out = run_with_fallback(attempts, _job_needing(4))
        gc.collect()
        assert outer.current_bytes == start
    assert out.status == "oom" and [h["result"] for h in out.history] == ["oom", "oom"]


def test_a_device_this_machine_lacks_is_passed_over_not_a_crash(monkeypatch):
    """devices=[cuda, cpu] on a machine without a GPU: the CPU runs, and it is not a fallback (nothing
    ran out of memory); devices=[cuda] alone: a skipped run that says why. It used to be
    torch's 'Torch not compiled with CUDA enabled' traceback."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = run_with_fallback((Attempt.parse("cuda"), Attempt.parse("cpu")), _job_needing(1))
    assert out.status == "ok" and str(out.attempt) == "cpu" and out.value == 1.0
    assert out.history_text() == "cuda: unavailable -> cpu: ok"
    assert out.history[0]["reason"].startswith("no CUDA device on this machine (torch ")
    alone = run_with_fallback((Attempt.parse("cuda@4096"),), _job_needing(1))
    assert alone.status == "skipped" and alone.attempt is None and "no CUDA device" in alone.value["notes"]
    # a device that is missing, then one that runs out: out of memory, not skipped
    assert run_with_fallback((Attempt.parse("cuda"), Attempt.parse("cpu@1")), _job_needing(4)).status == "oom"
    # and after an OOM on a device that exists, a later success is a fallback still
    out = run_with_fallback((Attempt.parse("cpu@1"), Attempt.parse("cuda"), Attempt.parse("cpu")), _job_needing(2))
    assert out.status == "fallback" and out.history_text() == "cpu@1: oom in forward -> cuda: unavailable -> cpu: ok"


def test_which_devices_are_unavailable_and_the_split_study_says_so_in_one_line(monkeypatch):
    assert unavailable("cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert unavailable("cuda") is None and unavailable("cuda:0") is None
    assert unavailable("cuda:3") == "cuda:3 does not exist: this machine has 1 GPU(s), cuda:0 first"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^device=cuda: no CUDA device on this machine .*; use device=cpu or "
                                          r"device=auto$"):
        SplitConfig(device="cuda").resolved_device()
    assert SplitConfig(device="auto").resolved_device() == "cpu"


def test_a_card_this_torch_has_no_kernels_for_is_unavailable_and_says_which_build_has(monkeypatch, capsys):
    """torch's CUDA 12.9 and 13 builds start at sm_75: on a GTX 1080 (sm_61) or a V100 (sm_70) torch
    only warns, is_available() says True, and the first kernel fails with "no kernel image is
    available", which no fallback catches: study 1 crashed where it should have run on the CPU."""
    card = {"cc": (6, 1), "name": "NVIDIA GeForce GTX 1080"}
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: card["cc"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: card["name"])
    monkeypatch.setattr(torch.cuda, "_host_arch_key", lambda: "x86_64")
    why = unavailable("cuda")
    assert why.startswith("torch ") and "has no kernels for NVIDIA GeForce GTX 1080 (sm_61; built for sm_75, sm_80, " \
        "sm_86, sm_90, sm_100, sm_120)" in why
    assert "for CUDA 12.6 (--index-url https://download.pytorch.org/whl/cu126)" in why  # torch's own table
    assert default_attempts(None) == (Attempt("cpu"),) and default_attempts(48)[0] == Attempt("cpu", 48.0)
    assert SplitConfig(device="auto").resolved_device() == "cpu"
    out = run_with_fallback((Attempt.parse("cuda"), Attempt.parse("cpu")), _job_needing(1))
    assert out.status == "ok" and out.history_text() == "cuda: unavailable -> cpu: ok"
    assert main(["gpu-check"]) == 1 and capsys.readouterr().out.strip() == f"workbench gpu-check: {why}"
    card.update(cc=(7, 5), name="Tesla T4")  # a card the build has kernels for
    assert unavailable("cuda") is None and default_attempts(None)[0] == Attempt("cuda")
    assert SplitConfig(device="auto").resolved_device() == "cuda"
    # two cards, the second current (torch.cuda.set_device(1)): plain "cuda" is that one, as the runs use it
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (6, 1) if index == 1 else (7, 5))
    assert "has no kernels for" in unavailable("cuda") and "has no kernels for" in unavailable("cuda:1")
    assert unavailable("cuda:0") is None


def test_a_cuda_budget_says_when_the_process_already_holds_a_model_on_the_card(monkeypatch):
    """A notebook's earlier cell left a model on the card: its bytes count in every peak and, under
    torch's per-process fraction, against the budget, so strategies that fit fall back. Said in one
    line; the cuBLAS workspaces a process keeps are not worth one."""
    import warnings

    held = {"bytes": 1900 * 2**20}
    for name, fn in dict(current_device=lambda: 0, empty_cache=lambda: None,
                         reset_peak_memory_stats=lambda d=None: None, memory_allocated=lambda d=None: held["bytes"],
                         get_per_process_memory_fraction=lambda d: 1.0,
                         set_per_process_memory_fraction=lambda f, d: None,
                         get_device_properties=lambda d: type("P", (), {"total_memory": 16 * 2**30})()).items():
        monkeypatch.setattr(torch.cuda, name, fn)
    with pytest.warns(UserWarning, match=r"cuda:0 already holds 1,900 MiB of this process's memory .* counts in "
                                         r"every run's peak and against a CUDA budget; free it"):
        device_budget("cuda", budget_mib=4096).__enter__()
    held["bytes"] = 64 * 2**20  # two 32 MiB cuBLAS workspaces
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        device_budget("cuda", budget_mib=4096).__enter__()


def test_a_driver_older_than_the_torch_build_is_said_and_gpu_check_fails(monkeypatch, capsys):
    """PyPI's torch is a CUDA 13 build; a notebook platform's driver may run CUDA 12.8 at most. torch
    then warns, is_available() says False, and the studies said "CUDA finds no GPU" and gpu-check
    "needs a GPU" (exit 0) on a machine with one. Played: the driver's answers to torch."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_isDriverSufficient", lambda: False, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 12080, raising=False)
    import sys
    import types

    def no_nvml():
        raise OSError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=no_nvml))
    real_table = torch.cuda.PYTORCH_RELEASES_CODE_CC  # without NVML the driver's CUDA alone picks the build
    monkeypatch.setattr(torch.cuda, "PYTORCH_RELEASES_CODE_CC", {"12.6": {}, "12.9": {}, "13.0": {}, "13.2": {}})
    why = unavailable("cuda")
    assert why == (f"CUDA cannot start on this machine's GPU (torch {torch.__version__}): the NVIDIA driver runs "
                   "CUDA 12.8 at most, older than this build's 13.0: install torch 2.13.0 for CUDA 12.9 "
                   "(--index-url https://download.pytorch.org/whl/cu129) or a newer driver")
    assert main(["gpu-check"]) == 1 and capsys.readouterr().out.startswith("workbench gpu-check: the NVIDIA driver")
    opened = []  # NVML counts its inits: each one shut down again (it had been left open)
    nvml = types.SimpleNamespace(nvmlInit=lambda: opened.append(1), nvmlShutdown=lambda: opened.append(-1),
                                 nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: i,
                                 nvmlDeviceGetCudaComputeCapability=lambda h: (6, 0))  # Kaggle's P100, without CUDA
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "PYTORCH_RELEASES_CODE_CC", real_table)
    monkeypatch.setattr(torch.cuda, "_host_arch_key", lambda: "x86_64")
    assert unavailable("cuda").endswith("install torch 2.13.0 for CUDA 12.6 (--index-url "
                                        "https://download.pytorch.org/whl/cu126) or a newer driver")  # not 12.9's
    assert opened == [1, -1]
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 11040, raising=False)  # no build of this release
    assert unavailable("cuda").endswith("older than this build's 13.0: install a newer NVIDIA driver")
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 0, raising=False)  # no driver: no GPU
    assert unavailable("cuda") == f"no CUDA device on this machine (torch {torch.__version__}: CUDA finds no GPU)"
    assert main(["gpu-check"]) == 0 and capsys.readouterr().out.strip() == NO_GPU_LINE


def test_other_errors_are_not_swallowed():
    def job(attempt, budget, phase):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        run_with_fallback((Attempt.parse("cpu@8"), Attempt.parse("cpu")), job)
    with pytest.raises(RuntimeError, match="shape"):
        run_with_fallback((Attempt.parse("cpu@8"), Attempt.parse("cpu")),
                          _raising(RuntimeError("shape '[2, 3]' is invalid")))


def _raising(error):
    def job(attempt, budget, phase):  # the first attempt fails with `error`, the next one runs
        phase("backward")
        if attempt.budget_mib is not None:
            raise error
        return 1.0
    return job


def test_an_error_that_follows_an_out_of_memory_error_a_library_caught_falls_back_too(monkeypatch):
    """transformers' loader catches a 4-bit weight's failed quantization (the device full) and ends the
    load with a RuntimeError of its own that says nothing of memory: study 1's QLoRA row ended the
    study there. A RuntimeError with no out-of-memory error before it in its phase, or another error,
    still propagates: a bug after an out-of-memory error a library recovered from is still a bug."""
    def caught_then(error, later_phase=None):
        def job(attempt, budget, phase):
            phase("load")
            if attempt.budget_mib is not None:
                try:
                    [torch.zeros(64 * 1024) for _ in range(8)]  # 2 MiB alive at once, past the 1 MiB budget
                except torch.OutOfMemoryError:
                    pass  # as a library's error handling does
                if later_phase:
                    phase(later_phase)
                raise error
            return 1.0
        return job

    job = caught_then(RuntimeError("We encountered some issues during automatic conversion of the weights."))

    out = run_with_fallback((Attempt.parse("cpu@1"), Attempt.parse("cpu")), job)
    assert out.status == "fallback" and str(out.attempt) == "cpu" and out.value == 1.0
    assert out.history_text() == "cpu@1: oom in load -> cpu: ok"
    assert out.history[0]["reason"] == ("ran out of memory, then RuntimeError: We encountered some issues during "
                                        "automatic conversion of the weights.")
    with pytest.raises(RuntimeError, match="automatic conversion"):  # no out-of-memory error first: a bug
        run_with_fallback((Attempt.parse("cpu@8"), Attempt.parse("cpu")),
                          _raising(RuntimeError("We encountered some issues during automatic conversion")))
    # a later phase, another error, or a RuntimeError subclass (NotImplementedError: an op missing, not memory)
    for bug, later in ((RuntimeError("shape '[2, 3]' is invalid"), "train"), (KeyError("a bug"), None),
                       (NotImplementedError("aten::_foo is not implemented for 'Half'"), None)):
        with pytest.raises(type(bug)):
            run_with_fallback((Attempt.parse("cpu@1"), Attempt.parse("cpu")), caught_then(bug, later))
    # on a card the allocator's own count says so (torch.cuda.memory_stats' num_ooms)
    ooms = iter([3, 3, 4])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_ooms": next(ooms)})
    card = DeviceBudget(torch.device("cuda", 0), None, ooms_before=torch.cuda.memory_stats()["num_ooms"])
    assert card.ooms() == 0 and card.ooms() == 1


@pytest.mark.parametrize("message", [
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call"])
def test_cudas_own_out_of_memory_errors_fall_back_too(message):
    """Memory CUDA takes outside torch's allocator fails as a RuntimeError, not an OutOfMemoryError:
    a cuBLAS handle, made at the first matmul of each thread (autograd's backward thread too), on a
    card the step has filled. Study 1 ended there instead of going on to the CPU."""
    out = run_with_fallback((Attempt.parse("cpu@8"), Attempt.parse("cpu")), _raising(RuntimeError(message)))
    assert out.status == "fallback" and str(out.attempt) == "cpu"
    assert out.history[0]["result"] == "oom" and out.history[0]["phase"] == "backward"
    assert out.history[0]["reason"] == message.splitlines()[0]
    assert failure(RuntimeError(message))["status"] == "oom" and failure(RuntimeError("shape"))["status"] == "error"


def test_a_cpu_allocation_the_system_refuses_is_an_out_of_memory_row():
    """A CPU allocation past what the system will commit (one 4 EiB tensor here; on a machine with a
    ulimit -v, far less) is a RuntimeError from c10's CPU allocator, not an OutOfMemoryError: it had
    ended the study with a traceback instead of an `oom` row. Allocated for real."""
    def job(attempt, budget, phase):
        phase("forward")
        return torch.empty(2**62, dtype=torch.uint8)

    out = run_with_fallback((Attempt.parse("cpu"),), job)
    assert out.status == "oom" and out.history[0]["result"] == "oom" and out.history[0]["phase"] == "forward"
    assert "can't allocate memory" in out.history[0]["reason"]


def test_attempt_parsing():
    assert Attempt.parse("cuda:1@512") == Attempt("cuda:1", 512.0)
    assert str(Attempt.parse("cpu@48")) == "cpu@48"
    for bad, fix in (("gpu", "use cpu, cuda or cuda:N"), ("mps", "'mps' is not a device the workbench runs on"),
                     ("cpu@-1", "must be a positive, finite number of MiB"), ("cpu@lots", "number of MiB"),
                     # nan ended in int()'s ValueError when run; inf skipped the free-memory preflight
                     ("cpu@nan", r"finite number of MiB \(e.g. cpu@8192\), or none \(cpu\)$"),
                     ("cuda@inf", r"finite number of MiB \(e.g. cuda@8192\)")):
        with pytest.raises(ConfigError, match=fix):
            Attempt.parse(bad)
    if not torch.cuda.is_available():
        assert default_attempts(48) == (Attempt("cpu", 48.0), Attempt("cpu"))


def test_a_played_card_can_model_the_caching_allocator():
    """'cpu@48:cuda': the same budget, but over the modelled reserved bytes (as a card's budget is)."""
    assert str(Attempt.parse("cpu@48:cuda")) == "cpu@48:cuda" and Attempt.parse("cpu@48:cuda").allocator == "cuda"
    assert Attempt.parse("cpu@48").allocator == "live"
    with pytest.raises(ConfigError, match="a real GPU uses its own"):
        Attempt.parse("cuda@48:cuda")
    MiB = 2**20

    def job(attempt, budget, phase):
        # Eight 3 MiB tensors, every other one freed, then 16 MiB: 28 MiB live at most, but the
        # modelled allocator holds two 20 MiB segments it cannot give back, then a 16 MiB one.
        keep = [torch.empty(3 * MiB, dtype=torch.uint8) for _ in range(8)]
        del keep[::2]
        big = torch.empty(16 * MiB, dtype=torch.uint8)
        return len(keep) + big.numel() // MiB

    out = run_with_fallback((Attempt.parse("cpu@48:cuda"), Attempt.parse("cpu@48")), job)
    assert out.history_text() == "cpu@48:cuda: oom in start -> cpu@48: ok" and out.status == "fallback"
    assert out.peak_mib == 28  # the live-bytes budget: the pattern fits



def test_a_cuda_budget_collects_garbage_before_its_peak_starts_and_names_the_card(monkeypatch):
    """On CUDA, max_memory_allocated counts every live block: garbage an earlier run left in
    reference cycles must be collected before the peak is reset (an H200 measured a rung 1 GB high
    without it), and set_per_process_memory_fraction needs the card's index ("cuda" has none)."""
    import gc

    from torch.cuda._utils import _get_device_index

    from workbench.core import common

    calls = []
    monkeypatch.setattr(common.platform, "uname", played_uname(LINUX_RELEASE))  # not WSL2
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("gc.collect") or 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: calls.append("reset_peak"))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: type("P", (), {"total_memory": 1024 * 2**20})())

    def fraction(f, device):  # torch's own check: raises for a device without an index
        calls.append(f"fraction {f:g} on {_get_device_index(device, optional=False)}")

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", fraction)
    # a notebook capped the process itself before (as torchtune emulates a smaller card): it comes back after
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.5)
    budget = device_budget("cuda", budget_mib=256)
    assert budget.device == torch.device("cuda", 0)
    budget.__enter__()
    assert calls[:4] == ["gc.collect", "empty_cache", "reset_peak", "fraction 0.25 on 0"]
    budget.__exit__(None, None, None)
    assert calls[4:] == ["gc.collect", "fraction 0.5 on 0", "empty_cache"]
    # without a budget the card is the limit: no fraction is set
    calls.clear()
    with device_budget("cuda"):
        pass
    assert not any(c.startswith("fraction") for c in calls)
    # under WSL2 the driver spills past the card into system memory instead of running out: a run is
    # capped at the card's room now (free, plus what this process holds), a budget at the smaller
    monkeypatch.setattr(common.platform, "uname",
                        played_uname(WSL2_RELEASE))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (600 * 2**20, 1024 * 2**20))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 40 * 2**20)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.75)
    for mib, expected in ((None, 0.625), (256, 0.25), (900, 0.625)):
        calls.clear()
        with device_budget("cuda", budget_mib=mib):
            pass
        assert [c for c in calls if c.startswith("fraction")] == [f"fraction {expected:g} on 0", "fraction 0.75 on 0"]
    # without a budget, a notebook's own smaller fraction (playing a smaller card) is not widened
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.5)
    calls.clear()
    with device_budget("cuda"):
        pass
    assert [c for c in calls if c.startswith("fraction")] == ["fraction 0.5 on 0", "fraction 0.5 on 0"]


def test_an_interrupted_run_leaves_nothing_alive_through_the_traceback_a_notebook_keeps():
    """^C in a notebook is a KeyboardInterrupt (not an Exception): no row, the study ends, and IPython
    keeps the traceback (sys.last_traceback), whose frames held the run's model on the card, in the
    next run's peak and against its budget. The frames are cleared; the memory is given back."""
    import weakref

    seen = []

    def job(attempt, budget, phase):
        model = torch.nn.Linear(64, 64)
        seen.append(weakref.ref(model))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as kept:  # held, as IPython holds it
        run_with_fallback((Attempt.parse("cpu@8"), Attempt.parse("cpu")), job)
    gc.collect()
    assert kept.value.__traceback__ is not None and seen[0]() is None
    assert len(seen) == 1  # and no next attempt: an interrupt is not an out-of-memory error
