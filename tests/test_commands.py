"""`workbench strategies|ladder|split NAME=VALUE ...`: one syntax for every study and for sweeps.

    .venv/bin/python -m pytest tests/test_commands.py -q        # about 30 s
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch

from workbench import cli
from workbench.cli import main
from workbench.core.charts import Table, rounded
from workbench.core.config import ConfigError
from workbench.front.commands import json_records, parse_assignments, split_long_text
from workbench.front.notebooks import STUDIES
from workbench.front.sweep_points import points_from_options
from workbench.studies.ladder.config import LadderConfig
from workbench.studies.strategies.config import StrategiesConfig
from tests.conftest import subprocess_env

ROOT = Path(__file__).resolve().parent.parent


def test_name_value_reads_as_a_sweep_reads_it():
    items = ["lr=1e-3", "seeds=[0, 1]", "base_size=tiny", "measure=false", "reference_model="]
    assert parse_assignments(items) == {"lr": 0.001, "seeds": [0, 1], "base_size": "tiny", "measure": False,
                                        "reference_model": None}
    assert points_from_options(items) == [parse_assignments(items)]


@pytest.mark.parametrize("argv, message", [
    (["ladder", "micro_batch"], "expected NAME=VALUE"),
    (["ladder", "micro-batch=2"], "expected NAME=VALUE"),
    (["ladder", "nosuch=1"], "unknown parameter for LadderConfig: nosuch"),
    (["strategies", "seeds=zero"], "seeds: expected a list"),
    # YAML reads an empty value as null: it said "got NoneType None"
    (["strategies", "lr="], "lr: expected a number, got nothing (an empty value, or null)"),
    (["ladder", "steps="], "steps: expected an integer, got nothing (an empty value, or null)"),
    (["strategies", "seeds="], "seeds: expected a list, got nothing (an empty value, or null)"),
    (["strategies", "preflight="], "preflight: expected true or false, got nothing (an empty value, or null)"),
])
def test_bad_assignments_are_one_line_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.parametrize("study", list(STUDIES))
def test_a_studys_help_lists_every_field_whole_under_its_column(study):
    """The fields' help was one line each, up to 325 characters, wrapped by the terminal under nothing."""
    text = cli.build_parser().commands[STUDIES[study].study].format_help()
    fields = text.split("fields (NAME=VALUE):\n")[1]
    assert max(len(line) for line in text.splitlines()) <= 102
    assert all(line.startswith("  ") and (line[2] != " " or line.startswith(" " * 25)) for line in fields.splitlines())
    flat = " ".join(fields.split())
    for name, help_ in STUDIES[study].config.help().items():
        assert f"{name} {' '.join(help_.split())}" in flat, name


def test_json_records_decode_the_json_text_of_csv_cells():
    table = pd.DataFrame({"history": ['[{"device": "cuda", "status": "oom"}]', None],
                          "note": ["[fp32] was skipped", "{not json"], "peak": [1.5, float("nan")]})
    assert json_records(table) == [
        {"history": [{"device": "cuda", "status": "oom"}], "note": "[fp32] was skipped", "peak": 1.5},
        {"history": None, "note": "{not json", "peak": None}]


def test_a_study_runs_from_the_shell_and_prints_its_findings(tiny_base, results_dir, capsys):
    # the rungs alone: the breakdown's default follows them
    code = main(["ladder", "--quick", "rungs=[fp32, cpu]", "reference_model=''", "autofit=false",
                 "steps=2", "micro_batch=2", "seq_len=32", "budget_mib=1000"])
    out = capsys.readouterr().out
    assert code == 0 and "fp32" in out and "predicted_peak (MiB)" in out
    fp32 = next(line for line in out.splitlines() if line.startswith("fp32 "))
    assert fp32.split()[-2:] == ["yes", "yes"] and "NaN" not in out  # fits, predicted and measured, read yes/no
    # fp32 compared; the cpu rung has no device peak to compare (it had counted, and alone read "within nan%")
    runs = pd.read_csv(results_dir / "ladder" / "runs.csv")
    assert f"- Predicted peaks of 1 rung(s) measured here are within {runs['max_prediction_error_pct'][0]:.1f}% " in out
    # the findings wrapped at 100 columns, a finding's later lines indented under its dash
    lines = out.splitlines()
    findings = lines[next(i for i, t in enumerate(lines) if t.startswith("- ")):]
    assert max(map(len, findings)) <= 100 and all(t.startswith(("- ", "  ")) for t in findings), findings
    assert len(findings) > sum(t.startswith("- ") for t in findings)  # some finding is longer than one line


def test_a_run_whose_loss_diverges_is_one_line_naming_the_fix(tiny_base, results_dir, capsys):
    """lr=1e9: the loss is NaN by the second step, and the study ended in FloatingPointError's traceback."""
    code = main(["ladder", "--quick", "rungs=[fp32]", "reference_model=''", "autofit=false", "steps=3", "lr=1e9"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and re.fullmatch(r"workbench ladder: the loss became nan at step \d \(peak learning rate "
                                      r"1e\+09\); lower the learning rate", err), err


def test_a_warning_of_the_workbench_is_one_line_naming_the_command(tiny_base, results_dir, tmp_path, capsys):
    """A user corpus whose files repeat each other: the warning was Python's (runner.py:255: UserWarning:
    ..., then the source line `corpus = target_corpus(cfg.corpus)`), and "leaving 0.03%" did not say of
    what. It is one line like the command's errors, with what was left out and what is left."""
    shared = "A paragraph that every chapter of this manual copies word for word, so it repeats."
    for i in range(20):
        own = " ".join(f"chapter{i}-word{j}" for j in range(40))
        (tmp_path / f"ch{i:02d}.md").write_text(f"{own}\n\n{shared} Variant {i % 2}.\n\n{own[::-1]}")
    code = main(["strategies", "base_size=tiny", f"corpus={tmp_path}", "strategies=[bitfit]", "seeds=[0]",
                 "seq_len=16", "token_budget=512", "eval_blocks=100000", "budget_mib=0", "--json"])
    out, err = capsys.readouterr()
    history = json.loads(out)[0]["history"]  # a list of attempts: it was the CSV cell's JSON text, a string
    # and what the peak counts, as the printed table says it (--json had no label: a user audit)
    assert json.loads(out)[0]["peak_is"].startswith("measured: "), json.loads(out)[0].get("peak_is")
    assert [a["result"] for a in history] == ["ok"], history
    err = [line for line in err.splitlines() if ": warning: " in line.lower()]
    assert code == 0 and len(err) == 2, err
    assert re.fullmatch(rf"workbench strategies: warning: eval_blocks 100,000 is more than the held-out text of "
                        rf"{tmp_path} holds: all of it is scored, [1-9]\d* blocks of 16 tokens", err[1]), err[1]
    assert err[0].startswith(f"workbench strategies: warning: corpus {tmp_path}: split by file alone, ")
    assert re.search(r"\(\d[\d,]* characters\) that repeat training text were left out: the held-out text is "
                     r"[\d,]+ characters in \d+ documents, [\d.]+% of its windows in the training text$", err[0])
    # a library's warning goes to the display it had (Python's: file, line, category)
    shown = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, filename, *rest: shown.append((str(message), filename))
        warnings.showwarning = cli._one_line_warnings("strategies")
        warnings.warn_explicit("a library's own", UserWarning, pd.__file__, 1)
    assert shown == [("a library's own", pd.__file__)] and not capsys.readouterr().err


@pytest.mark.parametrize("as_json", [True, False])
def test_json_is_all_that_reaches_stdout(tiny_base, results_dir, capfd, monkeypatch, as_json):
    """Whatever is printed while the study runs (here a line on descriptor 1, as a library's log
    handler or C code writes: DeepSpeed's accelerator warning) goes to stderr; stdout is the runs
    table alone (`--json`) or the table and its findings."""
    ladder = STUDIES["02_ladder"]
    real_run = ladder.run

    def noisy_run(*args, **kw):
        os.write(1, b"noise\n")
        return real_run(*args, **kw)

    monkeypatch.setitem(STUDIES, "02_ladder", dataclasses.replace(ladder, run=noisy_run))
    code = main(["ladder", "--quick", "rungs=[fp32, cpu]", "breakdown_rung=fp32", "reference_model=''", "autofit=false",
                 "steps=2", "micro_batch=2", "seq_len=32"] + ["--json"] * as_json)
    out, err = capfd.readouterr()
    assert "noise" in err and "noise" not in out and code == 0
    if as_json:
        assert sorted(r["rung"] for r in json.loads(out)) == ["cpu", "fp32"]
    else:
        assert out.splitlines()[0].startswith("rung ")


def test_the_cli_starts_without_the_notebook_stack_and_charts_still_render_as_plotly_json():
    """papermill and nbformat (with jsonschema's format grammars) took ~1.7 s of every command's
    start-up, `--help` included; only a command that runs or writes a notebook loads them now, and
    the chart default they were loaded for still holds at the first display."""
    probe = ("import sys, workbench.cli; print(sorted(m for m in ('nbformat', 'papermill', 'jsonschema') "
             "if m in sys.modules)); import plotly.io as pio; print(pio.renderers.default)")
    env = {k: v for k, v in subprocess_env(ROOT).items() if k != "PLOTLY_RENDERER"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300,
                         check=True).stdout.split("\n")
    assert out[:2] == ["[]", "plotly_mimetype"]
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True,
                         env={**env, "PLOTLY_RENDERER": "json"}).stdout.split("\n")
    assert out[1] == "json"  # a user's own choice wins
    # on Colab, which draws no plotly mimetype, plotly's own choice (its Colab renderer, in a kernel)
    colab = "import os, workbench.core.charts; print(os.environ.get('PLOTLY_RENDERER'))"
    out = subprocess.run([sys.executable, "-c", colab], capture_output=True, text=True, timeout=300, check=True,
                         env={**env, "COLAB_NOTEBOOK_ID": "1"}).stdout.split("\n")
    assert out[0] == "None"


def test_a_figure_column_with_gaps_is_rounded_under_its_unit():
    """Rows made with None where a run has no figure (a skipped run's peak) give an object column;
    it is shown in MiB, rounded, like a column without gaps."""
    df = pd.DataFrame({"strategy": ["full", "lora"], "peak_mem_mib": [None, 21.73099], "note": ["x", None],
                       "predicted_peak_mib": [None, None], "fits": [True, False],
                       "trainable_params": [None, 107_072], "device": [None, None]})
    out = rounded(df)
    assert list(out.columns) == ["strategy", "peak_mem (MiB)", "note", "predicted_peak (MiB)", "fits",
                                 "trainable_params", "device"]
    assert out["device"].tolist() == [None, None]  # text without a value stays text, not NaN
    assert out["trainable_params"].iloc[1] == 107_072  # a count is not rounded to 3 significant digits
    assert out["peak_mem (MiB)"].iloc[1] == 21.7 and pd.isna(out["peak_mem (MiB)"].iloc[0])
    assert out["predicted_peak (MiB)"].isna().all() and out["fits"].tolist() == [True, False]


def test_a_figure_in_a_sentence_is_rounded_to_what_it_says():
    """A 0.01 MiB budget read "nothing fits 0.0 MiB", where 0 means no budget."""
    from workbench.core.common import mib_text

    assert [mib_text(v) for v in (0.01, 0.0234, -0.01, 0.0, 0.05, 1.25, 99.94, 100.4, 12_345.6)] == [
        "0.01", "0.023", "-0.01", "0.0", "0.1", "1.2", "99.9", "100", "12,346"]


def test_a_small_figure_that_is_not_zero_is_not_shown_as_zero():
    """A tiny model's 0.023 TFLOP/s read "0.0" in the runs table, as if nothing was computed."""
    df = pd.DataFrame({"tflops": [0.0229811693, 46.73, 0.0534, None], "iteration_ms": [0.0423, 14.236, 0.0, 1.0],
                       "accel_idle_share": [0.751, 5.6e-16, -3e-16, 0.00002]})
    out = rounded(df)
    assert out["TFLOP/s"].iloc[:3].tolist() == [0.023, 46.7, 0.0534] and pd.isna(out["TFLOP/s"].iloc[3])
    assert out["iteration (ms)"].tolist() == [0.042, 14.2, 0.0, 1.0]
    # floating-point noise is 0, not 5.6e-14 %, which made the report print the whole column as 7.51e+01
    assert out["accel_idle (%)"].astype(str).tolist() == ["75.1", "0.0", "0.0", "0.002"]  # no "-0.0"
    # nor with one significant digit: BitFit's 0.07% of the parameters read 0.1% (README: 0.07%)
    share = rounded(pd.DataFrame({"trainable_share": [0.0007, 0.00734, 0.304]}))["trainable (%)"]
    assert share.tolist() == [0.07, 0.73, 30.4]


def test_a_figure_without_a_unit_is_not_shown_with_a_digit_it_does_not_have():
    """`workbench strategies` printed a perplexity of 120.4 as "120.0" (three significant digits,
    120, in a column of one decimal for the 85.9 beside it) while its summary line said 120.4."""
    df = pd.DataFrame({"ppl_after": [85.93, 120.42, 78.91, None], "ppl_before": [157.7, 157.7, 157.3, 157.7],
                       "lr": [1e-3, 3e-4, None, 5e-5]})
    out = rounded(df)
    assert out["ppl_after"].iloc[:3].tolist() == [85.9, 120.4, 78.9]
    assert out["ppl_before"].tolist() == [158, 158, 157, 158]
    assert out["lr"].iloc[[0, 1, 3]].tolist() == [0.001, 0.0003, 0.00005]  # each its own places
    row = repr(Table(df)).splitlines()[2].split()
    assert row[:2] == ["120.4", "158"] and "0.0003" in row


def test_a_table_in_a_notebook_shows_every_text_whole_and_its_figures_rounded_once():
    """pandas' own display cut each cell at 50 characters: the notebooks' and the Voila apps' findings
    and a skipped rung's reason read "Predicted peaks of 5 rung(s) measured here are...". A figures
    table is rounded already; shown again, 955.1 MiB must not become 955 (3 significant digits)."""
    why = "zero_offload moves tensors between a GPU and the host; this machine has no GPU, so it is predicted only"
    df = rounded(pd.DataFrame({"rung": ["fp32", "zero_offload"], "predicted_peak_mib": [8.1234, 955.14],
                               "tokens_per_s": [4987.2, None], "reason": ["", why], "fits": [True, False],
                               "fits_measured": [True, None]}))
    page = Table(df)._repr_html_()
    assert f">{why}</td>" in page and "..." not in page
    assert ">955.1</td>" in page and ">4,987</td>" in page  # thousands separated, one rounding
    sig = Table(pd.DataFrame({"tflops": [32.2, 0.0248, None]}))._repr_html_()
    assert ">32.2</td>" in sig and ">0.0248</td>" in sig  # 3 significant digits: not "32.2000"
    assert '<td style="text-align:right"></td>' in page  # no tok/s: an empty cell, not NaN
    assert page.count(">yes</td>") == 2 and "True" not in page  # a flag column with a gap reads the same
    assert '<td style="text-align:left">no</td>' in page and '<td style="text-align:left">zero_offload</td>' in page
    assert "<th" not in page.split("<tbody>")[1]  # no row index
    assert Table(df, caption="a <verdict>")._repr_html_().startswith("<p>a &lt;verdict&gt;</p><div")
    assert repr(Table(df, caption="a verdict")).startswith("a verdict\n\nrung ")
    text = repr(Table(df)).splitlines()
    assert text[0].split() == ["rung", "predicted_peak", "(MiB)", "tok/s", "reason", "fits", "fits_measured"]
    assert text[2].startswith("zero_offload") and text[2].endswith(f"{why}  no") and "NaN" not in text[2]
    assert text[1].split()[1:3] == ["8.1", "4,987"]  # numbers right-aligned under their header
    assert len(text[1].split("8.1")[0]) == len(text[2].split("955.1")[0]) + 2


def test_long_text_leaves_the_shell_table_and_follows_it_once_per_row_key():
    """A skipped rung's 150-character reason made every row of the printed ladder table that wide."""
    why = "zero_offload moves tensors between a GPU and the host; on a machine without a GPU both are the same memory"
    table = pd.DataFrame({"strategy": ["adapter", "full", "adapter", "full"], "seed": [0, 0, 1, 1],
                          "status": ["ok", "skipped", "ok", "skipped"], "reason": [None, why, None, why],
                          "notes": ["trains the last 2 decoder layers, the final norm and the head", ""] * 2})
    short, lines = split_long_text(table)
    assert list(short.columns) == ["strategy", "seed", "status"]
    assert lines == ["reason (by strategy):", f"  full: {why}", "notes (by strategy):",
                     "  adapter: trains the last 2 decoder layers, the final norm and the head"]
    assert split_long_text(short) == (short, [])  # nothing long: the table as it was
    # a first column whose rows differ in their texts (study 3's source): by row number, a # column
    runs = pd.DataFrame({"source": ["measured", "measured", "modelled"], "k": [0.0, 0.5, 0.2],
                         "reason": ["k still moving at the end of the run, so its figure is not settled", None,
                                    "modelled on H100-PCIe from the rates measured here and published specs"]})
    short, lines = split_long_text(runs)
    assert list(short.columns) == ["#", "source", "k"] and list(short["#"]) == [1, 2, 3]
    assert lines == ["reason (by #):", f"  1: {runs['reason'][0]}", f"  3: {runs['reason'][2]}"]


def test_library_messages_no_user_can_act_on_are_dropped_and_no_other():
    """bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community ... pip install
    kernels" and peft's use of a deprecated transformers name opened every `workbench estimate`;
    transformers' "`loss_type=None` was set in the config but it is unrecognized" every GPT-2 one;
    DeepSpeed's "Setting accelerator to CPU. If you have GPU ..." every command on a CPU machine."""
    probe = ("import logging, sys, warnings\n{first}"
             "import bitsandbytes, deepspeed, torch, transformers\n"
             "logging.getLogger('DeepSpeed').warning('another DeepSpeed message')\n"
             "gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2))\n"
             "ids = torch.zeros(1, 4, dtype=torch.long)\n"
             "gpt2(input_ids=ids, labels=ids)\n"
             "logging.getLogger('transformers.modeling_utils').warning('another transformers message')\n"
             "logging.getLogger('bitsandbytes.backends.cpu.ops').warning('another bitsandbytes message')\n"
             # the message as bitsandbytes logs it on an AVX512-BF16 CPU, said here on any CPU
             "logging.getLogger('bitsandbytes.backends.cpu.ops').warning('Failed to load CPU gemm_4bit_forward "
             "from kernels-community: %s. Please make sure you already `pip install kernels`', 'No module named x')\n"
             "warnings.warn('`is_gradient_checkpointing` is deprecated and will be removed in v6.', FutureWarning)\n"
             "warnings.warn('another deprecation', FutureWarning)\n")
    env = {**subprocess_env(ROOT), "PYTHONWARNINGS": "default"}
    run = [subprocess.run([sys.executable, "-c", probe.format(first=first)], capture_output=True, text=True,
                          timeout=300, env=env, check=True) for first in ("import workbench\n", "")]
    quiet, plain = run
    assert "another bitsandbytes message" in quiet.stderr and "another deprecation" in quiet.stderr
    assert "another transformers message" in quiet.stderr
    assert "kernels-community" not in quiet.stderr and "is_gradient_checkpointing" not in quiet.stderr
    assert "loss_type=None" not in quiet.stderr
    assert "is_gradient_checkpointing" in plain.stderr  # the probe would see them without the workbench
    assert "loss_type=None" in plain.stderr
    assert "kernels-community" in plain.stderr  # (bitsandbytes itself says it only on AVX512-BF16 CPUs)
    assert "another DeepSpeed message" in quiet.stdout and "Setting accelerator to CPU" not in quiet.stdout
    if not torch.cuda.is_available():  # (DeepSpeed logs to standard output, and says it only without CUDA)
        assert "Setting accelerator to CPU" in plain.stdout


def test_on_native_windows_the_package_says_in_one_line_to_use_wsl2():
    """Without it, `import workbench` on Windows ended in `ModuleNotFoundError: No module named
    'fcntl'` from deep in the results layer. Played: sys.platform before the import."""
    probe = "import sys; sys.platform = 'win32'\ntry:\n    import workbench\nexcept ImportError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=subprocess_env(ROOT),
                         timeout=120, cwd=ROOT)
    assert out.stdout.strip() == "workbench runs on Linux; on Windows, run it in WSL2 (see README.md, 'On Windows')"


def test_a_relative_results_folder_is_the_callers_for_every_process(tmp_path, monkeypatch, capsys):
    """WORKBENCH_RESULTS=out: the workbench process read it from the caller's folder and the study
    kernels, which run in notebooks/, from there: the studies wrote to notebooks/out/ (not git-ignored)
    and the report read ./out, where nothing was. The command makes it absolute before anything starts."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORKBENCH_RESULTS", "out")
    assert main(["gpu-check"]) == 0  # on this machine: one line, nothing run
    assert os.environ["WORKBENCH_RESULTS"] == str(tmp_path / "out")
    root = Path(cli.__file__).parents[1]
    kernel = subprocess.run([sys.executable, "-c", "from workbench.core.results import results_root; print(results_root())"],
                            cwd=root / "notebooks", env=subprocess_env(root), capture_output=True, text=True, check=True)
    assert kernel.stdout.strip() == str(tmp_path / "out")


def test_a_results_folder_that_cannot_be_written_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setenv("WORKBENCH_RESULTS", "/proc/no-such-results")
    assert main(["dashboard", "--prepare-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("workbench dashboard: cannot write the results folder /proc/no-such-results: No such file or "
                   "directory (set WORKBENCH_RESULTS to a folder you can write)")


def test_reproduce_checks_its_results_folder_before_building_the_base(tmp_path, monkeypatch, capsys):
    """A file where the results go was found after the base's build, as a traceback (NotADirectoryError)
    under a line blaming 'File exists'."""
    from workbench.front import reproduce

    monkeypatch.setattr(reproduce, "ensure_embedded_base", lambda *a, **k: pytest.fail("built before the check"))
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path / "afile"))
    assert main(["reproduce", "--quick", "--only", "03_split"]) == 2
    assert capsys.readouterr().err.strip() == (f"workbench reproduce: the results folder (WORKBENCH_RESULTS) "
                                               f"{tmp_path / 'afile'}: it is a file; name a folder you can write")


def test_a_results_folder_one_cannot_write_is_one_line(tmp_path, monkeypatch):
    """check_folder's other branch: a folder there that this user cannot write. These machines run as
    root, whom os.access lets write anywhere, so the permission is played; the deepest existing part
    is named (the folder itself would be made)."""
    from workbench.core import results

    (tmp_path / "ro").mkdir()
    real = os.access
    monkeypatch.setattr(results.os, "access", lambda p, mode: real(p, mode) and Path(p) != tmp_path / "ro")
    with pytest.raises(results.ConfigError, match=rf"^the results folder {re.escape(str(tmp_path / 'ro' / 'r'))}: "
                                                  rf"{re.escape(str(tmp_path / 'ro'))} is not writable by you; "
                                                  r"name a folder you can write$"):
        results.check_folder(tmp_path / "ro" / "r", "the results folder")
    results.check_folder(tmp_path / "rw" / "r", "the results folder")  # a folder to be made where one can write


def test_quick_with_devices_of_ones_own_leaves_the_quick_budget_out(monkeypatch):
    """Study 1's quick settings carry budget_mib 13, and a budget_mib beside devices is an error (it was
    dropped without a word): `strategies --quick devices=[cpu]` failed on a budget the user never set."""
    seen = []

    class Stop(Exception):
        pass

    def run(cfg, *a, **kw):
        seen.append(cfg)
        raise Stop

    from workbench.front import commands

    monkeypatch.setitem(commands.STUDIES, "01_strategies", dataclasses.replace(STUDIES["01_strategies"], run=run))
    with pytest.raises(Stop):
        main(["strategies", "--quick", "devices=[cpu]"])
    with pytest.raises(Stop):
        main(["strategies", "--quick"])
    mine, quick = seen
    assert mine.attempts_as_text() == ["cpu"] and mine.base_size == "tiny"
    assert quick.budget_mib == 13.0 and quick.attempts_as_text() != ["cpu"]
    assert main(["strategies", "--quick", "devices=[cpu]", "budget_mib=64"]) == 2  # given by the user: still an error


SEED_ERROR = ("is not a seed a run takes; use an integer from 0 to 2**63 - 1 (torch.manual_seed's range that a "
              "results table's int64 column holds), e.g. 0")


@pytest.mark.parametrize("seeds, said", [("[0, 18446744073709551616]", "seeds[1]: 18446744073709551616"),
                                         ("[9223372036854775808]", "seeds[0]: 9223372036854775808"),
                                         ("[-1]", "seeds[0]: -1")])
def test_a_seed_outside_what_a_run_takes_is_a_one_line_error_before_anything_runs(tiny_base, results_dir, capsys,
                                                                                   seeds, said):
    """seeds=[2**64] passed the settings and ended the job in a traceback from torch.manual_seed ("Overflow
    when unpacking long long"); 2**63, which torch takes, did not fit the runs table's int64 seed column."""
    code = main(["strategies", "base_size=tiny", "strategies=[bitfit]", f"seeds={seeds}", "seq_len=16",
                 "token_budget=512", "eval_blocks=2", "budget_mib=0"])
    err = capsys.readouterr().err.strip()
    assert (code, err) == (2, f"workbench strategies: {said} {SEED_ERROR}")
    assert not (results_dir / "strategies").exists()  # nothing ran
    assert StrategiesConfig.from_dict(seeds=[0, 2**63 - 1]).seeds == (0, 2**63 - 1)  # the range's ends are seeds
    with pytest.raises(ConfigError, match=rf"^seed: 18446744073709551616 {re.escape(SEED_ERROR)}$"):
        LadderConfig.from_dict(seed=2**64)  # the shared vocabulary's seed (studies 2 and 3) too


@pytest.mark.parametrize("command, argv, said", [
    ("estimate", ["estimate", "--model", "data/configs/gpt2.json"], "workbench estimate: interrupted"),
    ("gpu-check", ["gpu-check"], "workbench gpu-check: interrupted; the checks it finished are written"),
    ("strategies", ["strategies"], "workbench strategies: interrupted; finished runs are kept"),
    ("split", ["split"], "workbench split: interrupted; study 3 reuses no run: a rerun measures them again"),
])
def test_ctrl_c_says_what_is_kept_only_where_something_is(command, argv, said, monkeypatch, capsys):
    """Every command said 'finished runs are kept' on Ctrl-C, estimate too, which runs nothing."""
    def interrupted(args):
        raise KeyboardInterrupt

    real = cli.build_parser

    def parser():
        p = real()
        p.commands[command].set_defaults(func=interrupted)
        return p

    monkeypatch.setattr(cli, "build_parser", parser)
    assert cli.main(argv) == 130
    assert capsys.readouterr().err.strip() == said


def test_sigterm_ends_a_command_as_ctrl_c_does_and_says_so(monkeypatch, capsys):
    """SIGTERM (`kill`, `timeout`) ended a study without a word and without its `finally`s: a DeepSpeed
    build killed so left its lock, and every later build waited on it for good (a user audit)."""
    released, before = [], signal.getsignal(signal.SIGTERM)

    def terminated(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises in here
        finally:
            released.append(True)

    real = cli.build_parser

    def parser():
        p = real()
        p.commands["ladder"].set_defaults(func=terminated)
        return p

    monkeypatch.setattr(cli, "build_parser", parser)
    assert cli.main(["ladder"]) == 143
    assert released == [True]
    assert capsys.readouterr().err.strip() == "workbench ladder: terminated; finished runs are kept"
    assert signal.getsignal(signal.SIGTERM) == before  # the caller's handler is back


def test_a_study_that_finished_no_run_exits_1(tmp_path, monkeypatch, capsys):
    """`strategies devices=[cuda]` without a card skipped every run, said "No strategy finished a run" and
    exited 0 (a user audit). A ladder of predictions alone, and a reference's predicted rows, are not runs."""
    from workbench.front.commands import nothing_ran

    monkeypatch.setenv("WORKBENCH_RESULTS", str(tmp_path))
    assert main(["strategies", "--quick", "devices=[cuda]"]) == 1
    said = capsys.readouterr()
    assert said.out.rstrip().endswith("- No strategy finished a run.")
    # where the results are, as sweep says it (the study commands had not said it)
    assert said.err.rstrip().endswith(f"workbench strategies: results in {tmp_path / 'strategies'}"), said.err[-300:]
    rows = pd.DataFrame({"status": ["skipped", "fallback"]})
    assert not nothing_ran(rows) and nothing_ran(rows.iloc[:1]) and not nothing_ran(rows.iloc[:1], measure=False)
    ladder = pd.DataFrame({"role": ["at hand", "at hand", "reference"], "status": ["error", "error", "skipped"]})
    assert nothing_ran(ladder) and not nothing_ran(ladder.assign(status=["ok", "error", "skipped"]))
    assert not nothing_ran(ladder.assign(status=["skipped"] * 3))  # too big to measure here: predicted
    split = pd.DataFrame({"source": ["measured", "modelled"], "status": ["error", "ok"]})
    assert nothing_ran(split) and not nothing_ran(split.assign(status=["ok", "error"]))
