"""Study 3's part of `workbench gpu-check`: its rows, comparisons and verdict on fabricated
measurements and on a real CPU engine run (the CUDA layer itself needs a GPU).

    .venv/bin/python -m pytest tests/test_offload_gpu_check.py -q
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from workbench.front import gpu_check
from workbench.front.gpu_check import Options
from workbench.studies.split import gpu_check as sg, zero_baseline
from workbench.studies.split.adam import AdamHP
from workbench.studies.split.engine import SplitEngine

LIMIT = 64 * 2**20


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU is shared
    yield
    torch.set_num_threads(n)


def _row(i, k=0.0, ms=100.0, tokens=1000, **kw):
    r = {"iteration": i, "loss": 5.0 - i * 0.1, "k_actual": k, "iteration_ms": ms, "tokens": tokens,
         "backward_ms": 40.0, "accel_idle_share": 0.3, "host_done_before_bwd_end_share": 0.5,
         "to_host_ms": 10.0, "to_accel_ms": 20.0, "to_host_bytes": 2e8, "to_accel_bytes": 2e8,
         "alpha": 0.05, "k_next": 0.2, "pinned_bytes": 2**25, "staging_bytes": 2**25}
    r.update(kw)
    return r


def _events(i, bwd_end=50.0, host_start=30.0):
    return [{"iteration": i, "activity": "backward", "what": "backward", "start_ms": 10.0, "end_ms": bwd_end},
            {"iteration": i, "activity": "host update", "what": "w", "start_ms": host_start, "end_ms": host_start + 5}]


def test_run_row_means_after_warmup_and_rates():
    rows = [_row(0, ms=1000.0, accel_idle_share=0.9)] + [_row(i) for i in range(1, 4)]
    events = [e for i in range(4) for e in _events(i, host_start=30.0 if i != 3 else 60.0)]
    r = sg.run_row("k=0", rows, events, warmup=1, k_target=0.0)
    assert r["tokens_per_s"] == pytest.approx(3000 / 0.3)  # warm-up iteration 0 left out
    assert r["accel_idle_share"] == pytest.approx(0.3) and r["measured_iterations"] == 3
    assert r["overlapped_iterations"] == 2  # iteration 3's host update started after backward ended
    assert r["d2h_gb_per_s"] == pytest.approx(3 * 2e8 / (30.0 * 1e6))  # bytes / ms / 1e6 = GB/s
    assert r["h2d_gb_per_s"] == pytest.approx(3 * 2e8 / (60.0 * 1e6))
    assert r["pinned_bytes"] == 2**25 and r["alpha"] == 0.05 and r["k_target"] == 0.0
    assert r["timeline_problems"] == []


def test_timeline_problems_catch_two_clocks():
    bad = [{"iteration": 2, "activity": "to host", "what": "w", "start_ms": 50.0, "end_ms": 10.0}]
    assert len(sg.timeline_problems(bad)) == 1 and "40.000 ms before" in sg.timeline_problems(bad)[0]
    assert sg.timeline_problems(_events(0)) == []


def test_parity_row():
    ref = {"a": torch.zeros(3), "b": torch.ones(2)}
    good = sg.parity_row("fp32", ref, {"a": torch.full((3,), 1e-6), "b": torch.ones(2)}, lr=1e-3)
    assert good["passed"] and good["worst_param"] == "a" and good["max_abs_diff"] == pytest.approx(1e-6)
    bad = sg.parity_row("fp32", ref, {"a": torch.zeros(3), "b": torch.ones(2) + 1e-4}, lr=1e-3)
    assert not bad["passed"] and bad["worst_param"] == "b"
    nan = sg.parity_row("fp32", ref, {"a": torch.zeros(3), "b": torch.tensor([1.0, float("nan")])}, lr=1e-3)
    assert not nan["passed"]


def test_a_deepspeed_not_installed_is_recorded_as_torchaos_is_not_failed(monkeypatch):
    """Its ImportError had read "unavailable" and failed study 3's check, where the verdict passes over a
    library baseline not installed (torchao's already was)."""
    from workbench.studies.split.zero_baseline import run_zero_offload

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` raises ImportError
    rows, reason = run_zero_offload(torch.nn.Linear(2, 2), [torch.zeros(1, 2)], 1e-3, 0.0)
    assert (rows, reason) == ([], sg.NOT_INSTALLED)
    assert sg.baseline_row("DeepSpeed ZeRO-Offload", rows, reason)["status"] == sg.NOT_INSTALLED


def test_baseline_rows():
    assert sg.baseline_row("torchao", [], sg.NOT_INSTALLED)["status"] == sg.NOT_INSTALLED
    un = sg.baseline_row("ZeRO", [], "DeepSpeed ZeRO-Offload unavailable: ImportError")
    assert un["status"] == "unavailable" and un["tokens_per_s"] is None
    ok = sg.baseline_row("ZeRO", [_row(0, ms=500.0), _row(1, ms=200.0), _row(2, ms=200.0)], None, warmup=1)
    assert ok["status"] == "ok" and ok["tokens_per_s"] == pytest.approx(2000 / 0.4)


def _good_runs():
    events = [e for i in range(4) for e in _events(i)]
    return [sg.run_row(f"k={k:g}", [_row(i, k=k, ms=100.0 - 10 * k) for i in range(4)], events, warmup=1, k_target=k)
            for k in (0.0, 0.5, 1.0)]


def test_verdict_passes_and_compares_with_baselines():
    parity = [{"run": "fp32", "max_abs_diff": 0.0, "worst_param": "a", "atol": 1e-5, "passed": True}]
    base = [sg.baseline_row("ZeRO", [_row(i, ms=200.0) for i in range(4)], None, warmup=1),
            sg.baseline_row("torchao", [], sg.NOT_INSTALLED)]
    v = sg.split_verdict(parity, _good_runs(), base, LIMIT)
    assert v["status"] == "pass", v["failures"]
    zero, ao = v["comparisons"]
    # like for like: the baselines update every fp32 weight on the host, as the engine does at k=0
    assert zero["same_offload_run"] == "k=0" and zero["same_offload_speedup"] == pytest.approx(200.0 / 100.0)
    assert zero["best_engine_run"] == "k=1" and zero["speedup"] == pytest.approx(200.0 / 90.0)
    assert ao["speedup"] is None and ao["status"] == sg.NOT_INSTALLED  # recorded, not a failure
    md = sg.split_markdown({**v, "model": "m", "pinned_bytes": 1})
    assert ("vs ZeRO (tokens/s, fp32): k=0 (every update on the host, as the baseline) 2.00x; the fastest, k=1 "
            "(k 1 of the weights updated on the card), 2.22x") in md
    assert "torchao: not installed" in md and "| k=0.5 | ok |" in md
    # a faster run in another precision is not set against the fp32 baselines (bf16 halves what moves)
    half = sg.run_row("bf16 k=0", [_row(i, k=0.0, ms=20.0) for i in range(4)],
                      [e for i in range(4) for e in _events(i)], warmup=1, k_target=0.0, precision="bf16")
    (zero, _) = sg.split_verdict(parity, _good_runs() + [half], base, LIMIT)["comparisons"]
    assert zero["best_engine_run"] == "k=1" and zero["same_offload_run"] == "k=0"
    assert zero["same_offload_speedup"] == pytest.approx(2.0)
    # a baseline installed but failing on the card (NCCL, out of memory) fails the check with its
    # reason: "unavailable" had passed, the comparison the check exists for silently missing
    broken = [sg.baseline_row("ZeRO", [], "DistBackendError: NCCL error"), base[1]]
    v = sg.split_verdict(parity, _good_runs(), broken, LIMIT)
    assert v["status"] == "fail" and v["failures"] == ["baseline ZeRO: unavailable: DistBackendError: NCCL error"]


def test_settled_times_the_iterations_after_the_last_move_of_k():
    """On an H200 the adaptive run's k went 0, 0.777, 0, 0.223, 1, 1: its tokens/s over the measured
    iterations mixed the search with the k it chose. The iterations after its last move are timed
    apart; a run whose k still moved at the end has no settled figure."""
    ks = [0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0]
    ms = [100.0, 90.0, 90.0, 70.0, 40.0, 40.0, 50.0, 50.0]
    rows = [_row(i, k=k, ms=m) for i, (k, m) in enumerate(zip(ks, ms))]
    st = sg.settled(rows, warmup=2)
    assert st["settled_k"] == 1.0 and st["settled_from"] == 4
    assert st["settled_tokens_per_s"] == pytest.approx(4000 / 0.18)  # 4 iterations of 1000 tokens in 180 ms
    # the last move inside the warm-up: only the measured iterations count
    st = sg.settled([_row(i, k=1.0 if i else 0.0) for i in range(4)], warmup=2)
    assert st["settled_from"] == 1 and st["settled_tokens_per_s"] == pytest.approx(2000 / 0.2)
    assert sg.settled([_row(0), _row(1), _row(2), _row(3, k=1.0)], warmup=1)["settled_k"] is None  # moved last
    run = sg.run_row("adaptive", rows, [e for i in range(8) for e in _events(i)], warmup=2, k_target=None,
                     **sg.settled(rows, warmup=2))
    fixed = sg.run_row("k=1", [_row(i, k=1.0, ms=40.0) for i in range(4)], [e for i in range(4) for e in _events(i)],
                       warmup=1, k_target=1.0)
    md = sg.split_markdown({**sg.split_verdict([], [fixed, run], [], LIMIT), "model": "m", "pinned_bytes": 1})
    assert ("adaptive after its last move (k=1 from iteration 4): 22,222 tokens/s; "
            "the fastest fixed k: k=1, 25,000") in md
    unsettled = sg.run_row("adaptive", rows[:4], [], warmup=2, k_target=None, **sg.settled(rows[:4], warmup=2))
    md = sg.split_markdown({**sg.split_verdict([], [unsettled], [], LIMIT), "model": "m", "pinned_bytes": 1})
    assert "not settled within the run" in md


def test_verdict_failures():
    parity = [{"run": "fp32", "max_abs_diff": 1.0, "worst_param": "a", "atol": 1e-5, "passed": False}]
    runs = _good_runs()
    runs[0] = sg.run_row("k=0", [_row(i) for i in range(4)], [e for i in range(4) for e in _events(i, host_start=60.0)],
                         warmup=1, k_target=0.0)  # never overlapped
    runs[1]["pinned_bytes"] = 10 * LIMIT
    runs[2]["accel_idle_share"] = 1.5
    runs.append({"run": "adaptive", "status": "error", "reason": "RuntimeError: boom", "k_target": None})
    v = sg.split_verdict(parity, runs, [], LIMIT)
    text = "\n".join(v["failures"])
    assert v["status"] == "fail" and len(v["failures"]) == 5
    assert "parity fp32" in text and "no host update started" in text and "bytes pinned" in text
    assert "outside [0, 1]" in text and "adaptive: error: RuntimeError: boom" in text


def test_run_row_on_a_real_cpu_engine_run():
    """The rows check_split reads are the engine's own: a CPU run goes through run_row and the
    verdict (the 'accelerator' is the CPU here; on CUDA the same code reads the card's rows)."""

    base = sg._model(sg.QUICK)
    g = torch.Generator().manual_seed(2)
    data = [torch.randint(0, 2048, (8, 64), generator=g) for _ in range(4)]
    eng = SplitEngine(copy.deepcopy(base), hp=AdamHP(lr=sg.LR), k=0.0)
    for b in data:
        eng.step(b)
    eng.finish()
    r = sg.run_row("k=0", eng.rows, eng.events, warmup=1, k_target=0.0)
    eng.close()
    assert r["tokens_per_s"] > 0 and r["d2h_gb_per_s"] > 0 and r["h2d_gb_per_s"] > 0 and r["alpha"] > 0
    assert r["pinned_bytes"] == 0 and r["staging_bytes"] > 0 and r["timeline_problems"] == []
    # the balance's inputs, iteration by iteration, as the engine's rows had them (ms)
    assert [p["host_busy_ms"] for p in r["balance_path"]] == [round(x["host_busy_ms"], 3) for x in eng.rows]
    assert r["host_busy_ms"] > 0 and r["balance_path"][-1]["t_host_side_ms"] == round(
        eng.rows[-1]["t_host_side_s"] * 1e3, 3)
    v = sg.split_verdict([], [r], [], LIMIT)
    assert v["status"] == "pass", v["failures"]


def test_the_workbench_check_finds_the_split_check():
    found = gpu_check.checks()
    assert found["split"] is sg.check_split and sg.gpu_checks() == {"split": sg.check_split}


def test_check_split_dry_run_on_the_cpu(monkeypatch, tmp_path):
    """The CUDA layer's own code with the CPU as the device (shortened): every run, the parity
    rows, both baseline rows (ZeRO-Offload stubbed: its op build takes minutes here) and the
    report. On a card the same code measures the card."""

    monkeypatch.setattr(sg, "ITERATIONS", 3)
    monkeypatch.setattr(sg, "ADAPTIVE_ITERATIONS", 5)
    monkeypatch.setattr(sg, "WARMUP", 1)
    monkeypatch.setattr(sg, "K_SWEEP", (0.0, 1.0))
    monkeypatch.setattr(sg, "QUICK", {**sg.QUICK, "batch": 8})
    calls = []
    stub = lambda *a, **kw: calls.append(a) or ([_row(i, ms=200.0) for i in range(3)], None)  # noqa: E731
    monkeypatch.setattr(zero_baseline, "run_zero_offload", stub)
    monkeypatch.setattr(sg, "run_zero_offload", stub)  # the name the check imported
    r = sg.check_split(Options(out=tmp_path, tiny=True, device="cpu"))
    assert r["status"] == "pass", r["failures"]
    assert [p["max_abs_diff"] for p in r["parity"]] == [0.0, 0.0]  # the CPU: same kernels, bit for bit
    assert [x["run"] for x in r["runs"]] == ["k=0", "k=1", "adaptive", "bf16 k=0", "fp16 k=0"]
    assert all(x["status"] == "ok" and x["tokens_per_s"] > 0 for x in r["runs"])
    assert r["pinned_bytes"] == 0 and len(calls) == 1 and next(calls[0][0].parameters()).device.type == "cpu"
    assert {b["run"]: b["status"] for b in r["baselines"]}["DeepSpeed ZeRO-Offload"] == "ok"
    assert "### Study 3 split engine on the card: pass" in r["report"]
    adaptive = next(x for x in r["runs"] if x["run"] == "adaptive")
    assert len(adaptive["k_path"]) == 5 and "- adaptive: k by iteration" in r["report"]
    assert [p["k"] for p in adaptive["balance_path"]] == adaptive["k_path"] and "| host_busy_ms |" in r["report"]
    assert "settled_k" in adaptive and all(len(x["k_path"]) == 3 for x in r["runs"] if x["run"] != "adaptive")
    # the study's reference at 16 bits (study 3 compares a bf16/fp16 engine with it): bf16 trains here, fp16
    # needs CUDA's autocast (unavailable, not failed); on a card both must train
    bf16, fp16 = r["references"]
    assert bf16["run"] == "AdamW all on cpu, bf16 mixed (the reference)" and bf16["status"] == "ok"
    assert bf16["iterations"] == 3 and bf16["tokens_per_s"] > 0 and bf16["k_actual"] == 1.0
    assert fp16["status"] == "unavailable" and "fp16 autocast needs a CUDA device" in fp16["reason"]
    assert "| AdamW all on cpu, bf16 mixed (the reference) | ok |" in r["report"]
    broken = {**bf16, "status": "error", "reason": "CUDA out of memory"}
    assert sg.split_verdict([], [], [], LIMIT, [broken])["failures"] == [
        "AdamW all on cpu, bf16 mixed (the reference): error: CUDA out of memory"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the split check measures the card")
def test_check_split_on_the_card(tmp_path):
    r = sg.check_split(Options(out=tmp_path, tiny=True))
    assert r["status"] == "pass", r["failures"]
    assert {b["run"] for b in r["baselines"]} == {"DeepSpeed ZeRO-Offload", "torchao CPUOffloadOptimizer"}
    assert [x["status"] for x in r["references"]] == ["ok", "ok"]  # bf16 and fp16 (a GradScaler) on the card
