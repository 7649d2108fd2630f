"""The main job and notebook 01 run headless through papermill, as the README's command does."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import connection_info_notebook

from workbench.cli import main
from workbench.core.config import ConfigError
from workbench.front.notebooks import STUDIES, run_notebook

BIN = Path(sys.executable).parent


def test_cli_help_lists_the_main_job():
    out = subprocess.run([BIN / "workbench", "--help"], capture_output=True, text=True, check=True).stdout
    assert "reproduce" in out
    out = subprocess.run([BIN / "workbench", "reproduce", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--quick" in out


def test_a_failing_notebook_is_reported_and_the_others_still_run(tiny_base, results_dir, monkeypatch, capsys):
    """The first notebook's cell raises, the third's kernel dies (both played): the second still runs,
    reproduce.json has all three, and the exit code says two failed. A cell's error is one line on
    stderr, its traceback (without colour codes) in the log; anything else prints its traceback."""
    from papermill.exceptions import PapermillExecutionError

    from workbench.front import reproduce

    ran, ran_before = [], ("01_strategies", "02_ladder", "03_split")

    said_before = {}  # each notebook's row while it runs

    def run(path, params, out, progress=None, kernel_log=None):
        ran.append(Path(path).stem)
        rows = json.loads((results_dir / "reproduce.json").read_text())["notebooks"]
        said_before[ran[-1]] = next(r for r in rows if r["name"] == ran[-1])
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        if len(ran) == 1:
            Path(out).write_text("half")  # papermill writes the notebook as it goes
            raise PapermillExecutionError(4, 4, "train()", "ValueError", "a cell raised (played)",
                                          ["\x1b[0;31mTraceback\x1b[0m", "  File cell 4, in train",
                                           "ValueError: a cell raised (played)"])
        if len(ran) == 3:
            raise RuntimeError("Kernel died before replying (played)")
        Path(out).write_text("{}")

    monkeypatch.setattr(reproduce, "run_notebook", run)
    stamps = iter(f"2026-11-29T10:{i // 60:02d}:{i % 60:02d}+00:00" for i in range(3600))  # each call a later one
    monkeypatch.setattr(reproduce, "now", lambda: next(stamps))
    executed = results_dir / "notebooks"
    executed.mkdir(parents=True)
    for name in ran_before:  # the last good executed notebooks: a failed run must not replace them
        (executed / f"{name}.ipynb").write_text("good")
    (executed / "02_ladder.failed.ipynb").write_text("an earlier failure")
    assert main(["reproduce", "--quick", "--no-report"]) == 1
    assert ran == ["01_strategies", "02_ladder", "03_split"]
    assert (executed / "01_strategies.ipynb").read_text() == "good"
    assert (executed / "01_strategies.failed.ipynb").read_text() == "half"
    assert (executed / "02_ladder.ipynb").read_text() == "{}" and not (executed / "02_ladder.failed.ipynb").exists()
    assert (executed / "03_split.ipynb").read_text() == "good" and not list(executed.glob(".*"))
    log = json.loads((results_dir / "reproduce.json").read_text())
    assert [(n["name"], n["status"]) for n in log["notebooks"]] == [
        ("01_strategies", "error"), ("02_ladder", "ok"), ("03_split", "error")]
    first, _, third = log["notebooks"]
    for row in log["notebooks"]:  # 'not finished' while it ran; its end keeps when it started
        assert said_before[row["name"]]["status"] == "not finished", said_before
        assert row["started"] == said_before[row["name"]]["started"], (row, said_before)
    assert first["error"] == "ValueError: a cell raised (played)" and log["quick"] is True
    assert first["traceback"] == "Traceback\n  File cell 4, in train\nValueError: a cell raised (played)"
    assert third["error"] == "RuntimeError: Kernel died before replying (played)" and third["traceback"] is None
    assert first["output"] == str(executed / "01_strategies.failed.ipynb") and third["output"] is None
    err = capsys.readouterr().err
    assert "[01_strategies] ValueError: a cell raised (played)\n" in err
    assert "File cell 4" not in err and "Exception encountered" not in err  # not the cell's traceback
    assert "Traceback (most recent call last)" in err and "Kernel died" in err  # the kernel's: in full
    assert "workbench reproduce: 2 notebook(s) failed" in err
    # a call of some (--only) keeps the others' rows, and a notebook killed part-way is 'not finished' (the
    # log had listed the latest call's notebooks alone, each written when it ended: a killed one was nowhere)

    def killed(path, params, out, progress=None, kernel_log=None):
        Path(out).write_text("half")  # papermill writes as it goes
        raise KeyboardInterrupt

    monkeypatch.setattr(reproduce, "run_notebook", killed)
    assert main(["reproduce", "--quick", "--only", "02_ladder", "--no-report"]) == 130  # Ctrl-C, said in a line
    assert not list(executed.glob(".*partial*"))  # the half-run notebook is not left hidden (a fault audit)
    monkeypatch.setattr(reproduce, "run_notebook", run)
    assert main(["reproduce", "--quick", "--only", "01_strategies", "--no-report"]) == 0
    log = json.loads((results_dir / "reproduce.json").read_text())
    assert [(n["name"], n["status"]) for n in log["notebooks"]] == [
        ("01_strategies", "ok"), ("02_ladder", "not finished"), ("03_split", "error")]
    assert log["notebooks"][2] == third


def test_two_calls_at_once_keep_each_others_rows(tiny_base, results_dir, monkeypatch):
    """Two `reproduce --only` calls at once: each call had read reproduce.json once at its start and rewritten
    it whole, so the one that ended last wiped the other's row (03 ran, the log listed 01 and 02). Played:
    02's notebook runs until the 03 call, started while it runs, has ended."""
    import threading

    from workbench.front import reproduce

    results_dir.mkdir(parents=True)
    (results_dir / "reproduce.json").write_text(json.dumps({"notebooks": [{"name": "01_strategies", "status": "ok"}]}))
    running, other_done = threading.Event(), threading.Event()

    def run(path, params, out, progress=None, kernel_log=None):
        if Path(path).stem == "02_ladder":
            running.set()
            assert other_done.wait(60), "the 03 call did not end"
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text("{}")

    monkeypatch.setattr(reproduce, "run_notebook", run)
    codes = {}
    first = threading.Thread(target=lambda: codes.update(first=main(["reproduce", "--quick", "--only", "02_ladder",
                                                                     "--no-report"])))
    first.start()
    assert running.wait(60)
    codes["second"] = main(["reproduce", "--quick", "--only", "03_split", "--no-report"])
    other_done.set()
    first.join(60)
    assert codes == {"first": 0, "second": 0}
    log = json.loads((results_dir / "reproduce.json").read_text())
    assert [(n["name"], n["status"]) for n in log["notebooks"]] == [
        ("01_strategies", "ok"), ("02_ladder", "ok"), ("03_split", "ok")]


def test_a_notebook_whose_every_run_was_skipped_is_an_error_not_ok(tiny_base, results_dir, monkeypatch, capsys):
    """A study notebook runs to its end where every run is skipped or fails (each a row saying why):
    reproduce had called it ok and exited 0, where `workbench strategies` exits 1. Played: the notebook's
    cell is the study run in process, first on a device this machine lacks (every run skipped), then here."""
    from workbench.front import reproduce
    from workbench.studies.strategies.config import StrategiesConfig
    from workbench.studies.strategies.runner import run_strategies

    devices = ["cuda"]

    def run(path, params, out, progress=None, kernel_log=None):
        run_strategies(StrategiesConfig(base_size="tiny", strategies=("bitfit",), seeds=(0,), seq_len=32,
                                        token_budget=512, eval_blocks=2, devices=tuple(devices)))
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text("{}")

    monkeypatch.setattr(reproduce, "run_notebook", run)
    assert main(["reproduce", "--quick", "--only", "01_strategies", "--no-report"]) == 1
    (row,) = json.loads((results_dir / "reproduce.json").read_text())["notebooks"]
    assert row["status"] == "error" and row["error"].startswith("no run finished: every run was skipped or failed")
    assert row["output"] == str(results_dir / "notebooks" / "01_strategies.ipynb")  # kept: its table says why
    assert "[01_strategies] no run finished" in capsys.readouterr().err
    devices[:] = ["cpu"]
    assert main(["reproduce", "--quick", "--only", "01_strategies", "--no-report"]) == 0
    (row,) = json.loads((results_dir / "reproduce.json").read_text())["notebooks"]
    assert row["status"] == "ok" and row["error"] is None


def test_quick_runs_each_notebook_on_its_quick_parameters(results_dir, monkeypatch):
    """Nothing but the slow headless run held --quick to the notebooks' quick parameters (a fault audit:
    with them ignored, `reproduce --quick` would run the full study, about 25 minutes)."""
    from workbench.front import reproduce

    seen = {}

    def run(path, params, out, progress=None, kernel_log=None):
        seen[Path(path).stem] = params
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text("{}")

    monkeypatch.setattr(reproduce, "run_notebook", run)
    assert main(["reproduce", "--quick", "--no-report"]) == 0
    assert set(seen) == {nb.name for nb in STUDIES.values()}
    for nb in STUDIES.values():
        assert nb.quick and {k: seen[nb.name].get(k) for k in nb.quick} == dict(nb.quick), nb.name


def test_an_unknown_notebook_is_one_line_naming_the_known_ones(results_dir, capsys):
    assert main(["reproduce", "--quick", "--only", "01_strategies", "04_nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("workbench reproduce: no study notebook '04_nope'; known: 01_strategies, 02_ladder, 03_split")
    assert not (results_dir / "notebooks").exists()  # nothing ran: the names are checked first


def test_report_only_writes_the_report_and_runs_nothing(results_dir, capsys, monkeypatch):
    """There was no command that rewrote results/index.html alone (only `reproduce` wrote it)."""
    from workbench.front import reproduce

    def must_not(*a, **k):
        raise AssertionError("--report-only ran something")

    monkeypatch.setattr(reproduce, "ensure_embedded_base", must_not)
    monkeypatch.setattr(reproduce, "run_notebook", must_not)
    assert main(["reproduce", "--report-only"]) == 0
    assert capsys.readouterr().out.strip() == f"report: {results_dir / 'index.html'}"
    page = (results_dir / "index.html").read_text()
    assert page.count("no results yet: run its notebook") == len(STUDIES)
    assert main(["reproduce", "--report-only", "--quick"]) == 2
    assert capsys.readouterr().err.strip() == "workbench reproduce: --report-only runs nothing and takes no --quick"


def test_reproduce_quick_runs_notebook_01_and_writes_results(tiny_base, results_dir):
    env = {**os.environ, "WORKBENCH_RESULTS": str(results_dir)}
    proc = subprocess.run([BIN / "workbench", "reproduce", "--quick", "--only", "01_strategies"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[01_strategies] cells: 100%" in proc.stderr  # headless, the cells executed are shown as they go
    runs = pd.read_csv(results_dir / "strategies" / "runs.csv")
    quick = STUDIES["01_strategies"].quick
    assert len(runs) == len(quick["strategies"]) * len(quick["seeds"])
    assert runs["ppl_before"].notna().all() and runs["ppl_after"].notna().all()
    # the quick budget makes at least one strategy fall back and lets at least one fit
    assert "fallback" in set(runs["status"]) and "ok" in set(runs["status"])
    assert (results_dir / "strategies" / "claims.csv").exists()
    executed = results_dir / "notebooks" / "01_strategies.ipynb"
    nb = json.loads(executed.read_text())
    assert executed.stat().st_size < 3 * 2**20
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("application/vnd.plotly.v1+json" in o.get("data", {}) for o in outputs)
    report = (results_dir / "index.html").read_text()
    assert "Study 1" in report and "measured" in report and "freeze_lower" in report


def test_ctrl_c_is_one_line_and_the_kernels_output_goes_to_its_log(tiny_base, results_dir):
    """^C while a notebook's study runs (SIGINT to the process group, as a terminal sends it): the kernel,
    which wrote to this terminal's stderr, printed a 15-line `ZMQError: Socket operation on non-socket`
    traceback above the command's one line. Its output goes to results/notebooks/<notebook>.kernel.log."""
    import re
    import signal
    import threading
    import time

    env = {**os.environ, "WORKBENCH_RESULTS": str(results_dir)}
    # SIGINT as a terminal's process has it: a background job of a non-interactive shell (CI's runner, say)
    # ignores it, its children too, and the command then ran to its end (exit 0)
    proc = subprocess.Popen([BIN / "workbench", "reproduce", "--quick", "--only", "02_ladder", "--no-report"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read().decode()), daemon=True)
    reader.start()
    try:
        def a_rung_done():  # the study's cell has begun and measured its first of 8 rungs (seconds of work left)
            return any(f.read_text().strip() for f in (results_dir / "ladder").glob("*/rungs.jsonl"))

        deadline = time.monotonic() + 300
        while not a_rung_done() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # (its results folder and 2 s more: in CI the notebook had ended by then)
        assert proc.poll() is None, "the notebook ended before it could be interrupted"
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(120) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(30)
    lines = [line for line in re.split(r"[\r\n]+", err[0]) if line and not line.startswith("[02_ladder] cells:")]
    assert lines == ["workbench reproduce: interrupted; finished runs are kept"], err[0][-3000:]
    executed = results_dir / "notebooks"
    assert not list(executed.glob(".*partial*"))
    for log in executed.glob("*.kernel.log"):  # kept where the kernel said something; never empty
        assert log.name == "02_ladder.kernel.log" and log.stat().st_size


def test_a_headless_kernel_talks_over_private_unix_sockets(tmp_path, capfd, monkeypatch):
    """Every notebook run printed ipykernel's "Kernel is running over TCP without encryption" warning:
    the kernel now listens on Unix sockets in a folder of this user's (0700), removed afterwards."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp puts the sockets' folder
    connection_info_notebook(tmp_path / "who.ipynb")
    run_notebook(tmp_path / "who.ipynb", {"out": str(tmp_path / "info.json")}, tmp_path / "ran.ipynb")
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["transport"] == "ipc" and info.get("mode") == "0o700", info
    assert info["ip"].startswith(str(tmp_path / "wb-kernel-")), info
    assert "without encryption" not in capfd.readouterr().err
    assert not list(tmp_path.glob("wb-kernel-*"))  # removed after the run


def test_unknown_parameter_is_an_error_before_and_inside_the_notebook(tmp_path):
    with pytest.raises(ConfigError, match="unknown parameter.*token_budgt"):
        run_notebook("01_strategies", {"token_budgt": 10}, tmp_path / "out.ipynb")
    import papermill as pm

    with pytest.raises(pm.PapermillExecutionError, match="unknown parameter"):
        pm.execute_notebook(str(STUDIES["01_strategies"].path), str(tmp_path / "out2.ipynb"),
                            parameters={"token_budgt": 10}, kernel_name="python3", progress_bar=False)


def test_the_report_names_a_study_on_its_first_finding_inlines_plotly_once_and_lists_the_notebooks(results_dir,
                                                                                                   monkeypatch):
    """Three things of index.html no test held (a fault audit): the study's name beside its first finding
    (not its second), plotly.js inlined once (4.8 MB a chart otherwise), and the table of notebooks run."""
    from types import SimpleNamespace

    import plotly.graph_objects as go

    from workbench.front import report

    fig = go.Figure()
    figures = SimpleNamespace(findings=lambda r: [("first finding", "claim one"), ("second finding", "")],
                              report_section=lambda r: [("figure", "a chart", fig), ("figure", "another", fig)])
    fake = {k: SimpleNamespace(study=k, title=f"Study {k}", load=lambda: object(), figures=figures) for k in "ab"}
    monkeypatch.setattr(report, "STUDIES", fake)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "reproduce.json").write_text(json.dumps({"notebooks": [
        {"name": "01_strategies", "status": "ok", "quick": True, "started": "2026-11-30T10:00:00+00:00", "seconds": 3.0}]}))
    page = report.write_report().read_text()
    assert "<tr><td>Study a</td><td>first finding</td><td>claim one</td></tr>" in page
    assert "<tr><td></td><td>second finding</td><td></td></tr>" in page
    assert page.count("* plotly.js v") == 1 and page.count('class="plotly-graph-div"') == 4
    notebooks = page[page.index("<h3>Notebooks executed</h3>"):]
    assert "01_strategies" in notebooks[:2000] and "ok" in notebooks[:2000]
    assert ">quick</th>" in notebooks[:2000]  # a run on the tiny parameters says so


def test_the_kernels_own_output_reaches_its_log(tmp_path, capfd):
    """What the kernel process writes to its own stderr (fd 2: its log lines, a crash's last words) goes to
    `kernel_log`, not this process's stderr; the cells' output stays in the notebook."""
    import nbformat

    nb = tmp_path / "say.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os\nos.write(2, b'the kernel itself\\n')\nprint('a cell')")],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}), nb)
    log = tmp_path / "say.kernel.log"
    ran = run_notebook(nb, {}, tmp_path / "ran.ipynb", kernel_log=log)
    assert "the kernel itself" in log.read_text() and "the kernel itself" not in capfd.readouterr().err
    assert "a cell" in json.dumps(json.loads(Path(ran).read_text())["cells"][0]["outputs"])
