"""The benchmark scripts' own behaviour (their figures are not asserted here: targets live in the
scripts, which print them and write them to results/benchmarks.csv): bad arguments are one line on
stderr and exit 2, before anything is timed; the short real runs write the row their last line states."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _run(args, results_dir, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "WORKBENCH_RESULTS": str(results_dir)})


@pytest.mark.parametrize("args, said", [
    (["benchmarks/cpu_adam.py", "--numel", "10"], "cpu_adam: --numel must be at least 50"),  # was a ZeroDivisionError
    (["benchmarks/cpu_adam.py", "--rounds", "0"], "cpu_adam: --numel must be at least 50 (50 tensors), --reps"),
    (["benchmarks/loop_overhead.py", "--rounds", "0"], "loop_overhead: --steps, --rounds, --batch and --threads"),
    (["benchmarks/monitor_overhead.py", "--rounds", "0"], "monitor_overhead: --rounds, --steps and --threads"),
    (["benchmarks/predict_ladder.py", "--rungs"], "predict_ladder: --rungs needs at least one rung"),
    (["benchmarks/predict_ladder.py", "--rungs", "fp32", "nosuch"], "predict_ladder: unknown rung(s) nosuch; known: fp32"),
    (["benchmarks/sweep_overhead.py", "--runs", "0"], "sweep_overhead: --runs and --workers must be at least 1"),
    (["benchmarks/model_copy.py", "--rounds", "0"], "model_copy: --rounds and --threads must be at least 1"),
    (["benchmarks/model_copy.py", "--model", "embedded"], "model_copy: --model must be a model config file (.json)"),
    # a device this machine lacks, or none at all, was a traceback from torch after the model was made
    (["benchmarks/monitor_overhead.py", "--device", "gpu"], "monitor_overhead: --device gpu: 'gpu' is not cpu, cuda"),
    (["benchmarks/split_adaptive.py", "--device", "gpu"], "split_adaptive: --device gpu: 'gpu' is not cpu, cuda"),
    (["benchmarks/split_adaptive.py", "--warmup", "-1"], "split_adaptive: --iterations must exceed --warmup, --warmup"),
]
    + ([(["benchmarks/monitor_overhead.py", "--device", "cuda"], "monitor_overhead: --device cuda: no CUDA device"),
        (["benchmarks/split_adaptive.py", "--device", "cuda"], "split_adaptive: --device cuda: no CUDA device")]
       if not torch.cuda.is_available() else []))
def test_a_bad_argument_is_one_line_and_exit_2(args, said, tmp_path):
    out = _run(args, tmp_path, timeout=120)
    lines = out.stderr.splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(said), out.stderr[-2000:]
    assert not (tmp_path / "benchmarks.csv").exists()


def test_cpu_adam_measures_its_headline_pair_in_alternating_rounds_and_writes_its_row(tmp_path):
    out = _run(["benchmarks/cpu_adam.py", "--numel", "200000", "--reps", "1", "--rounds", "3", "--threads", "1"],
               tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    row = pd.read_csv(tmp_path / "benchmarks.csv").iloc[-1]
    assert last == f"cpu_adam: {row['value']:.3f}" and row["version"] == 4 and row["rounds"] == 3
    probe_line = next(line for line in out.stdout.splitlines() if "Adam-pattern probe" in line)
    rounds = probe_line.split("(rounds: ")[1].split(";")[0].split(", ")
    fused = probe_line.split("torch_fused's: ")[1].split(";")[0].split(", ")
    assert len(rounds) == len(fused) == 3  # each side measured once a round, the order reversed every round
    assert "  measured in the order: probe, fused, fused, probe, probe, fused" in out.stdout.splitlines()
    assert float(row["memory_bytes_per_s"]) / 1e9 == pytest.approx(max(map(float, rounds)), abs=0.051)
    assert json.loads(row["details"])["torch_fused"]["bytes_per_s"] / 1e9 == pytest.approx(max(map(float, fused)),
                                                                                           abs=0.051)


def test_model_copy_times_fresh_loads_and_copies_in_alternating_rounds_and_writes_its_row(tmp_path):
    from conftest import tiny_config

    config = tmp_path / "config.json"
    tiny_config("qwen2").to_json_file(config)
    out = _run(["benchmarks/model_copy.py", "--model", str(config), "--rounds", "2", "--threads", "1"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    row = pd.read_csv(tmp_path / "benchmarks.csv").iloc[-1]
    assert last == f"model_copy: {row['value']:.3f}" and row["version"] == 1 and row["rounds"] == 2
    assert row["value"] == pytest.approx(row["copy_s"] / row["fresh_s"])
    assert row["copies"] == 2 + 1  # the copy side was timed once a round (the kept model counts its own copies)
    assert any(line.startswith("  measured in the order: fresh, copy, copy, fresh;") for line in out.stdout.splitlines())
    fresh = next(line for line in out.stdout.splitlines() if line.startswith("  fresh loads (s): "))
    assert len(fresh.split(": ")[1].split(";")[0].split(", ")) == 2  # each side once a round
