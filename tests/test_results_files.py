"""What core/results.py promises about files on a crash: a write is whole or not at all, a torn last line
of steps.jsonl is left out, and runs.csv keeps every row a new one does not replace."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from workbench.core import files, results
from workbench.core.results import ResultsWriter, StudyResult, atomic_write_json, latest, read_steps, read_table


def test_a_write_that_fails_leaves_the_old_file_whole_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    atomic_write_json(path, {"status": "ok", "n": 1})

    def crash(src, dst):
        raise OSError("disk gone (played)")

    monkeypatch.setattr(results.os, "replace", crash)
    with pytest.raises(OSError, match="played"):
        atomic_write_json(path, {"status": "error", "n": 2})
    assert json.loads(path.read_text()) == {"status": "ok", "n": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no .summary.json.*.tmp left behind
    # what open() would have made (0666 less the umask), not mkstemp's 0600 (nor anything wider)
    umask = os.umask(0)
    os.umask(umask)
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~umask)


def test_a_temporary_left_by_a_killed_writer_is_removed_by_the_next_write(tmp_path):
    """SIGKILL runs no `except`: the writer's hidden temporary stays. The next write of that file removes
    it once its process is gone, and leaves a live writer's, another file's and another host's."""
    path = tmp_path / "summary.json"
    code = ("import os, sys, signal; from workbench.core import files; "
            "files.os.replace = lambda a, b: os.kill(os.getpid(), signal.SIGKILL); "
            "files.atomic_write_json(sys.argv[1], {'n': 1})")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], cwd=Path(__file__).resolve().parent.parent)
    assert proc.wait(timeout=120) == -signal.SIGKILL
    (left,) = tmp_path.glob(".summary.json.*.tmp")
    host = files._host()
    live = tmp_path / f".summary.json.{host}-{os.getppid()}.abc.tmp"  # a live process's (pytest's parent)
    other_host = tmp_path / f".summary.json.elsewhere-{proc.pid}.abc.tmp"
    other_file = tmp_path / f".steps.json.{host}-{proc.pid}.abc.tmp"
    for p in (live, other_host, other_file):
        p.write_text("{}")
    atomic_write_json(path, {"n": 2})
    assert not left.exists() and json.loads(path.read_text()) == {"n": 2}
    assert live.exists() and other_host.exists() and other_file.exists()


def test_a_torn_last_line_of_steps_is_left_out(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 2.5}) + "\n" + json.dumps({"step": 2, "loss": 2.4}) + "\n"
                    + '{"step": 3, "lo')  # the process killed mid-line
    steps = read_steps(path)
    assert steps["step"].tolist() == [1, 2] and steps["loss"].tolist() == [2.5, 2.4]


@pytest.mark.parametrize("killed_at", range(3))  # each os.replace write_summary makes: 2 partial files, the summary's
def test_a_run_killed_while_its_summary_is_written_is_one_try_or_unfinished(tmp_path, killed_at, monkeypatch):
    """A second try of a finished run puts its config and steps in place and then writes its summary: a kill
    at any point between leaves the finished try whole, or a run without a summary (it runs again), never the
    old summary (finished) beside the new try's steps."""
    run = results.RunDir("study", "r1", root=tmp_path)
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) > killed_at:
            raise KeyboardInterrupt
        return real(src, dst)

    for n in (1, 2):
        run.write_config({"try": n})
        sink = run.steps_sink()
        sink({"step": 1, "try": n})
        sink.close()
        if n == 2:
            monkeypatch.setattr(results.os, "replace", replace)
        with pytest.raises(KeyboardInterrupt) if n == 2 else contextlib.nullcontext():
            run.write_summary({"status": "ok", "try": n})
    # the old summary went first, the new one was not written: unfinished, whichever files had moved
    assert run.summary() is None, (run.summary(), calls)


@pytest.mark.parametrize("key", ["012345678901", "1e3456789012", "123456789012"])
def test_a_key_of_digits_is_text_and_its_row_is_replaced(tmp_path, monkeypatch, key):
    """Study 3's key is a bare 12-hex-digit hash: one of digits, or of digits around one 'e', was read
    back as a number (12345678901, inf), so the same settings run again added a second row and
    latest() returned both."""
    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path))
    writer = ResultsWriter("split")
    writer.update_runs([{"study_key": key, "x": 1}], key="study_key")
    writer.update_runs([{"study_key": key, "x": 2}], key="study_key")
    runs = read_table(tmp_path / "split" / "runs.csv")
    assert list(runs["study_key"]) == [key] and list(runs["x"]) == [2]
    assert list(latest(runs, "study_key")["x"]) == [2]


def test_hashes_commits_and_versions_are_read_back_as_written(tmp_path, monkeypatch):
    """A row's commit, code fingerprint, config hash and trainable-set hash look like numbers one time
    in fifty or so (1e23456 is inf, 0123 is 123); runs.csv is read and written back at every update,
    so the first update after such a row had corrupted it for good."""
    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path))
    writer = ResultsWriter("split")
    row = {"study_key": "a", "env_git_commit": "1e23456", "env_workbench_code": "012345678901",
           "config_hash": "123456e78901", "trainable_set": "0000ff", "env_python": "3.10", "x": 1,
           # study 1's rows carry its inputs' fingerprints too (job.inputs)
           "workbench_code": "012345678901", "corpus_fingerprint": "1234567e89012345", "model_fingerprint": "0000000000001234"}
    writer.update_runs([row], key="study_key")
    writer.update_runs([{"study_key": "b", "x": 2}], key="study_key")  # read back, written again
    runs = read_table(tmp_path / "split" / "runs.csv")
    first = runs[runs["study_key"] == "a"].iloc[0]
    assert {k: first[k] for k in row if k not in ("study_key", "x")} == {k: v for k, v in row.items()
                                                                         if k not in ("study_key", "x")}
    assert runs["x"].tolist() == [1, 2] and runs["env_cpu_count"].dtype.kind == "i"  # numbers stay numbers


@pytest.mark.parametrize("same_second", [False, True])
def test_latest_is_the_most_recent_calls_rows(tmp_path, monkeypatch, same_second):
    """The report shows study 3's latest settings (`latest`): every test had written one key only."""
    from workbench.core import files, results

    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path))
    stamps = iter(["2026-11-29T10:00:00+00:00"] * 3 if same_second else
                  ["2026-11-29T10:00:01+00:00", "2026-11-29T10:00:02+00:00", "2026-11-29T10:00:03+00:00"])
    monkeypatch.setattr(results, "now", lambda: next(stamps))
    writer = ResultsWriter("split")
    writer.update_runs([{"study_key": "a", "x": 1}, {"study_key": "a", "x": 2}], key="study_key")  # as study 3 writes
    writer.update_runs([{"study_key": "b", "x": 3}], key="study_key")
    runs = read_table(tmp_path / "split" / "runs.csv", ["study_key"])
    assert list(latest(runs, "study_key")["x"]) == [3] and len(runs) == 3
    writer.update_runs([{"study_key": "a", "x": 4}], key="study_key")  # a's settings again, later
    runs = read_table(tmp_path / "split" / "runs.csv", ["study_key"])
    assert list(latest(runs, "study_key")["x"]) == [4]


def test_a_result_with_no_steps_leaves_no_earlier_steps_to_be_read_back(tmp_path, monkeypatch):
    """Study 3 with no measured steps (every run skipped for memory, or none asked for) left the earlier
    settings' steps.csv in place, and load_result showed its loss curves beside the new runs, as measured."""
    from workbench.core.results import StudyResult

    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path))
    writer = ResultsWriter("split")
    writer.write(StudyResult("split", runs=pd.DataFrame([{"study_key": "a"}]),
                             steps=pd.DataFrame([{"run": "k=0", "loss": 5.0}])), runs_key="study_key")
    writer.write(StudyResult("split", runs=pd.DataFrame([{"study_key": "b"}]), steps=pd.DataFrame()),
                 runs_key="study_key")
    assert read_table(tmp_path / "split" / "steps.csv").empty


def test_runs_csv_replaces_rows_with_the_same_key_and_keeps_every_other(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path))
    writer = ResultsWriter("study")
    writer.update_runs([{"run_id": "a", "x": 1}, {"run_id": "b", "x": 2}])
    df = writer.update_runs([{"run_id": "b", "x": 20}, {"run_id": "c", "x": 3}])
    on_disk = pd.read_csv(tmp_path / "study" / "runs.csv")
    assert sorted(zip(on_disk["run_id"], on_disk["x"])) == [("a", 1), ("b", 20), ("c", 3)]
    assert len(df) == 3 and {"recorded", "env_torch"} <= set(on_disk.columns)
    # a key of several columns: a row is replaced only where all of them match
    other = ResultsWriter("keyed")
    other.update_runs([{"run_id": "a", "seed": 0, "x": 5}, {"run_id": "a", "seed": 1, "x": 6}], key=("run_id", "seed"))
    other.update_runs([{"run_id": "a", "seed": 0, "x": 50}], key=("run_id", "seed"))
    keyed = pd.read_csv(tmp_path / "keyed" / "runs.csv")
    assert sorted(zip(keyed["seed"], keyed["x"])) == [(0, 50), (1, 6)]
    assert not [p for p in (tmp_path / "study").iterdir() if p.name.endswith(".tmp")] and os.path.exists(
        tmp_path / "study" / "runs.csv")


def _add_rows(root: str, name: str, start) -> None:
    """One of two processes adding 40 rows to one runs.csv, one call each, both at once."""
    writer = ResultsWriter("study", root=root)
    start.wait()
    for i in range(40):
        writer.update_runs([{"run_id": f"{name}{i}", "x": i}])


def test_two_processes_adding_rows_at_once_lose_none(tmp_path):
    """update_runs reads, extends and rewrites runs.csv: two studies finishing at once (a sweep's points
    writing one results folder) would each write the table without the other's new rows, but for its lock."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or torch state forked
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_add_rows, args=(str(tmp_path), name, start)) for name in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    runs = read_table(tmp_path / "study" / "runs.csv")
    assert len(runs) == 80 and sorted(runs.run_id) == sorted(f"{n}{i}" for n in "ab" for i in range(40))


def test_runs_csv_is_written_after_the_tables_it_lists(tmp_path, monkeypatch):
    """A study's result killed while written: runs.csv had been written first, so its new rows stood beside
    the earlier call's steps and side tables. The tables go first; runs.csv, which lists the runs, last."""
    writer = ResultsWriter("split", root=tmp_path)

    def result(key: str, loss: float) -> StudyResult:
        return StudyResult("split", runs=pd.DataFrame([{"study_key": key}]), steps=pd.DataFrame([{"loss": loss}]),
                           tables={"side": pd.DataFrame([{"key": key}])}, facts={"host": {"key": key}})

    writer.write(result("a", 1.0), runs_key="study_key")
    real = results.atomic_write_text

    def killed_at_the_fact(path, text):
        if Path(path).name == "host.json":
            raise KeyboardInterrupt("killed (played)")
        return real(path, text)

    for module in (results, files):  # csv tables write through results' name, json facts through files'
        monkeypatch.setattr(module, "atomic_write_text", killed_at_the_fact)
    with pytest.raises(KeyboardInterrupt):
        writer.write(result("b", 2.0), runs_key="study_key")
    assert list(read_table(tmp_path / "split" / "runs.csv")["study_key"]) == ["a"]  # b's tables are not all there


def test_a_benchmark_row_keeps_its_own_environment_columns(tmp_path, monkeypatch):
    """This process's env_* overwrote a row's own (cpu_adam.py records env_deepspeed; a row of another
    machine's measurement would have carried this one's), the other way round from update_runs (a fault audit)."""
    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path))
    results.append_benchmark_row({"benchmark": "b", "value": 1.0, "env_torch": "2.11.0+cu130"})
    row = pd.read_csv(tmp_path / "benchmarks.csv").iloc[0]
    assert row["env_torch"] == "2.11.0+cu130" and row["benchmark"] == "b" and row["env_cpu_count"] > 0
    # the file is read and written again at each row: a hash that looks like a number stays as written
    (tmp_path / "benchmarks.csv").unlink()
    monkeypatch.setattr(results, "environment", lambda: {"git_commit": "0012e45", "workbench_code": "000123456789"})
    results.append_benchmark_row({"benchmark": "c", "value": 2.0})
    results.append_benchmark_row({"benchmark": "d", "value": 3.0})
    again = read_table(tmp_path / "benchmarks.csv")
    assert again["env_git_commit"].tolist() == ["0012e45"] * 2 and again["value"].tolist() == [2.0, 3.0]
    assert again["env_workbench_code"].tolist() == ["000123456789"] * 2


def test_a_snapshot_that_cannot_be_written_leaves_the_last_one_whole(tmp_path):
    """The memory snapshot (a pickle) was written in place: a failure or a kill part-way left a torn file
    where the last good one had been (a crash-safety review)."""
    import pickle

    from workbench.core.memory.snapshot import dump

    path = tmp_path / "snapshot.pickle"
    dump({"segments": [1, 2]}, path)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        dump({"segments": [lambda: 0]}, path)  # fails part-way through
    assert pickle.loads(path.read_bytes()) == {"segments": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["snapshot.pickle"]  # no temporary left beside it
