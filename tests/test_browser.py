"""A person's view: JupyterLab in a real (headless) browser, and the Voila dashboard.

JupyterLab is started on 127.0.0.1 with a token; Debian's chromium is driven by Playwright for
Python (no `playwright install`: no browser download here). The test opens study 1's notebook on tiny
parameters, runs it, checks that the knobs and a chart with data rendered, moves a knob (a bad
value shows the config error; a good one runs the study again) and saves a screenshot under
results/browser/. Voila serves a study app the same way (screenshot), the report opens offline with
"What we found" first (screenshot), and no server's token appears on any process's command line. Skipped with the reason when chromium or playwright is missing; `make test`
installs both where it can (root, Debian).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest
from conftest import connection_info_notebook

from workbench.front.dashboard import port_in_use, private_config, start_voila, stop_voila, voila_command
from workbench.front.live import LiveChart
from workbench.front.notebooks import available
from workbench.front.report import write_report
from workbench.studies.ladder.config import LadderConfig
from workbench.studies.ladder.runner import run_ladder

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOTS = ROOT / "results" / "browser"
TINY = {"base_size": "tiny", "seq_len": 64, "token_budget": 2000, "seeds": [0], "strategies": ["bitfit", "full"],
        "budget_mib": 11.0, "eval_blocks": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc=None, timeout: float = 90) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before answering")
        try:
            return urllib.request.urlopen(url, timeout=5).status
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer in {timeout} s")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # report the redirect (to a login page) instead of following it


def status_of(url: str) -> int:
    try:
        return urllib.request.build_opener(_NoRedirect).open(url, timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def server_env(tiny_base, results_dir):
    return {**os.environ, "WORKBENCH_RESULTS": str(results_dir)}


def start(cmd, env, log: Path):
    f = open(log, "w")
    return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def token_on_a_command_line(token: str) -> list[str]:
    """Every process whose command line shows `token` (what `ps` shows every user of the machine)."""
    hits = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if token in text:
            hits.append(text)
    return hits


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.mark.skipif(not CHROMIUM, reason="Debian's chromium is not installed (make test installs it as root)")
def test_jupyterlab_runs_study_1_with_knobs_and_a_chart(tmp_path, server_env):
    pw = pytest.importorskip("playwright.sync_api", reason="playwright (Python) is not installed")
    import papermill as pm

    work = tmp_path / "lab"
    work.mkdir()
    nb = work / "study1.ipynb"
    pm.execute_notebook(str(ROOT / "notebooks" / "01_strategies.ipynb"), str(nb), parameters=TINY,
                        prepare_only=True, kernel_name="python3", progress_bar=False)
    port, token = free_port(), "test-token-0123"
    lab = start([sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
                 f"--ServerApp.port={port}", f"--ServerApp.root_dir={work}", "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                 *(["--allow-root"] if os.geteuid() == 0 else [])],
                {**server_env, "JUPYTER_TOKEN": token}, tmp_path / "lab.log")  # the token: not on a command line
    try:
        assert wait_http(f"http://127.0.0.1:{port}/api/status?token={token}", lab) == 200
        assert token_on_a_command_line(token) == []
        assert status_of(f"http://127.0.0.1:{port}/api/contents") == 403  # no token, no access
        SHOTS.mkdir(parents=True, exist_ok=True)
        with pw.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            try:
                drive_study_1(page, port, token)
            except Exception:
                page.screenshot(path=str(SHOTS / "jupyterlab_failure.png"))
                raise
            finally:
                browser.close()
    finally:
        stop(lab)


def shown_chart_traces(page, timeout_ms: int = 120_000):
    """The traces of the first plotly chart in a widget Output (the knobs panel's live chart), drawn.
    plotly's renderer shows its own PNG of a graph once an output's data carries one (it saves it
    there after drawing; the widget's state brings it back, with the Output's content set as state in
    Voila every time) and draws the graph again when a viewer's pointer enters it: pointed at, as a
    viewer would. A chart drawn empty has no trace either way."""
    chart = page.locator(".widget-output .jp-RenderedPlotly").first
    chart.wait_for(timeout=timeout_ms)
    image, traces = chart.locator("img.plot-img"), chart.locator(".scatterlayer .trace")
    deadline = time.time() + timeout_ms / 1000
    while time.time() < deadline:  # the PNG can replace the graph after it is drawn: look until it is the graph
        if image.is_visible():
            image.dispatch_event("mouseenter")  # (a hover retries once the graph, drawn over it, hides it)
        elif traces.count() and traces.first.is_visible():
            return traces
        time.sleep(0.5)
    raise TimeoutError(f"no trace of the chart was drawn in {timeout_ms / 1000:.0f} s")


def drive_study_1(page, port: int, token: str) -> None:
    page.goto(f"http://127.0.0.1:{port}/lab/tree/study1.ipynb?token={token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
    page.locator(".jp-StatusBar-TextItem", has_text="Idle").first.wait_for(timeout=90_000)  # kernel connected
    for _ in range(3):  # a click before the session is fully wired can be dropped: check that cells started
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        try:
            page.locator(".jp-InputPrompt", has_text="[1]").first.wait_for(timeout=20_000)
            break
        except Exception:
            page.keyboard.press("Escape")
    # the knobs panel is the last output: when it renders, every cell has run
    run_button = page.locator("button.widget-button", has_text="Run")
    run_button.wait_for(timeout=300_000)
    assert page.locator(".jp-RenderedText", has_text="Traceback").count() == 0, "a cell raised"
    chart = page.locator(".js-plotly-plot .scatterlayer .trace").first
    chart.wait_for(timeout=60_000)
    assert page.locator(".js-plotly-plot").count() >= 3
    # move a knob: a bad value is refused with the config's own message ...
    budget = page.locator(".widget-inline-hbox", has_text="token_budget").locator("input")
    budget.fill("0")
    budget.press("Enter")
    run_button.click()
    page.locator(".widget-html", has_text="token_budget must be positive").wait_for(timeout=30_000)
    # ... a good one runs the study again, with its live chart inside the panel
    budget.fill("1500")
    budget.press("Enter")
    run_button.click()
    page.locator(".widget-html", has_text="done").wait_for(timeout=300_000)
    assert shown_chart_traces(page).count() >= 1  # the live chart, with data
    assert page.locator(".widget-output .jp-RenderedPlotly").count() == 2  # it, redrawn in place, and the summary
    page.screenshot(path=str(SHOTS / "jupyterlab_study1.png"), full_page=False)


def test_dashboard_prepares_every_study_app(server_env):
    prep = subprocess.run([sys.executable, "-m", "workbench.cli", "dashboard", "--quick", "--prepare-only"],
                          env=server_env, capture_output=True, text=True, timeout=120)
    assert prep.returncode == 0, prep.stderr
    folder = Path(server_env["WORKBENCH_RESULTS"]) / "dashboard"

    assert sorted(p.name for p in folder.glob("*.ipynb")) == sorted(nb.path.name for nb in available())
    nb = nbformat.read(folder / "01_strategies.ipynb", 4)
    injected = [c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert injected and "base_size = \"tiny\"" in injected[0].source
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code")  # prepared, not run


@pytest.mark.skipif(not CHROMIUM, reason="Debian's chromium is not installed (make test installs it as root)")
def test_voila_app_renders_knobs_and_live_chart_on_localhost_with_a_token(tmp_path, server_env):
    pw = pytest.importorskip("playwright.sync_api", reason="playwright (Python) is not installed")
    import papermill as pm

    folder = tmp_path / "apps"
    folder.mkdir()
    pm.execute_notebook(str(ROOT / "notebooks" / "01_strategies.ipynb"), str(folder / "study1.ipynb"),
                        parameters=TINY, prepare_only=True, kernel_name="python3", progress_bar=False)
    # the ladder's app alone (nothing runs until Run): its field names are the longest; Run on one
    # tiny rung, a few seconds
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from workbench.front.apps import app\nfrom workbench.studies.ladder.config import LadderConfig\n"
        "app(LadderConfig(base_size='tiny', rungs=('fp32',), breakdown_rung='fp32', steps=2, micro_batch=2, "
        "seq_len=32, autofit=False, reference_model='', budget_mib=64.0))")],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}),
        folder / "knobs.ipynb")
    port, token = free_port(), "dash-token-0123"
    log = open(tmp_path / "voila.log", "w")
    voila = start_voila(folder, port, token, env=server_env, stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True)
    try:
        assert wait_http(f"http://127.0.0.1:{port}/?token={token}", voila) == 200
        assert status_of(f"http://127.0.0.1:{port}/voila/render/study1.ipynb") in (302, 403)  # no token
        assert token_on_a_command_line(token) == []  # it reached Voila through a private voila.json
        SHOTS.mkdir(parents=True, exist_ok=True)
        with pw.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            said = []  # the browser's console: a widget manager's error shows there
            page.on("console", lambda m: said.append(f"{m.type}: {m.text}"))
            asked = []  # every address the pages ask for: the server's alone (an offline classroom)
            page.on("request", lambda r: asked.append(r.url))
            try:
                # A page is a fresh kernel. Twice in CI, with the other worker busy, a first page failed
                # where a person would load it again: on 2026-11-27 its kernel started and the page never
                # loaded; on 2026-12-01 it loaded, its kernel's websocket closed ("Starting buffering" in
                # Voila's log) and its widgets never drew (alone the whole test takes 48 s). Causes not
                # found: a second page, a kernel of its own, is tried once; what the first showed is kept.
                for attempt in (1, 2):
                    try:
                        page.goto(f"http://127.0.0.1:{port}/voila/render/study1.ipynb?token={token}", timeout=150_000)
                        page.locator("button.widget-button", has_text="Run").wait_for(
                            timeout=(150_000, 300_000)[attempt - 1])
                        break
                    except pw.TimeoutError:
                        if attempt == 2:
                            raise
                        page.screenshot(path=str(tmp_path / "first_page.png"))
                        (tmp_path / "first_page_console.txt").write_text("\n".join(said))
                        log.flush()
                        errors = [m for m in said if m.startswith("error")]
                        print(f"the first page's widgets did not draw (screenshot, console and voila.log in {tmp_path});"
                              f" its console's errors: {errors[-10:]}", file=sys.stderr)
                page.locator(".js-plotly-plot .scatterlayer .trace").first.wait_for(timeout=60_000)
                assert page.locator(".js-plotly-plot").count() >= 3
                assert page.get_by_text("from_namespace").count() == 0  # an app shows outputs, not code
                page.screenshot(path=str(SHOTS / "voila_study1.png"))
                # the tables show every text whole: pandas' display cut each cell at 50 characters
                assert page.locator("table.wb-table").count() >= 3
                assert page.evaluate("[...document.querySelectorAll('td')].filter(td => /\\.\\.\\.$/"
                                     ".test(td.textContent)).length") == 0
                page.goto(f"http://127.0.0.1:{port}/voila/render/knobs.ipynb?token={token}", timeout=120_000)
                page.locator("button.widget-button", has_text="Run").wait_for(timeout=120_000)
                labels = page.locator(".widget-label")
                assert labels.count() >= 20
                cut = page.evaluate("[...document.querySelectorAll('.widget-label')]"
                                    ".filter(l => l.scrollWidth > l.clientWidth).map(l => l.textContent)")
                assert cut == []  # "reference_budget_mib" read "reference_budget_..."
                # Run: the live chart inside the panel is drawn (a display id is not updated inside
                # the panel's Output: the ladder's and the split's apps showed an empty chart)
                page.locator("button.widget-button", has_text="Run").click()
                page.get_by_text("done", exact=True).wait_for(timeout=180_000)
                # 120 s: beside the other test worker, 30 s once ran out after "done" (2026-11-30); a
                # fresh clone's run of 2026-12-02 found no trace in 120 s: plotly's PNG of the chart
                # was shown, it is likely (shown_chart_traces)
                shown_chart_traces(page)
                assert page.locator("table.wb-table").count() >= 1
                page.screenshot(path=str(SHOTS / "voila_ladder_run.png"), full_page=True)
                # the Run button's icon draws from Voila's own Font Awesome (its lab page linked a CDN's too)
                assert page.evaluate("document.fonts.check('900 14px \"Font Awesome 5 Free\"')")
                assert page.evaluate("getComputedStyle(document.querySelector('button.widget-button i.fa-play'),"
                                     " '::before').content") == '"\uf04b"'
                page.goto(f"http://127.0.0.1:{port}/?token={token}")  # the address the dashboard prints
                page.get_by_text("knobs.ipynb").wait_for(timeout=60_000)
                page.goto(f"http://127.0.0.1:{port}/voila/render/absent.ipynb?token={token}")
                page.get_by_text("404").first.wait_for(timeout=60_000)
                assert [u for u in asked if not u.startswith((f"http://127.0.0.1:{port}/", f"ws://127.0.0.1:{port}/",
                                                                "data:", "blob:"))] == []
            finally:
                browser.close()
    finally:
        stop_voila(voila)
    assert "0.0.0.0" not in (tmp_path / "voila.log").read_text()
    assert not voila.config_dir.exists()  # the token's private folder went with the server


def test_the_dashboards_kernels_talk_over_private_unix_sockets(tmp_path):
    """Voila's kernels listened on TCP ports of 127.0.0.1, where any user of a shared teaching machine
    could read their output stream, and its log carried ipykernel's "running over TCP without
    encryption" for every page opened. They use Unix sockets in Voila's private folder now."""
    folder = tmp_path / "apps"
    folder.mkdir()
    connection_info_notebook(folder / "who.ipynb")
    port, token = free_port(), "ipc-token-0123"
    with open(tmp_path / "voila.log", "w") as log:
        voila = start_voila(folder, port, token, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            assert wait_http(f"http://127.0.0.1:{port}/?token={token}", voila) == 200
            url = f"http://127.0.0.1:{port}/voila/render/who.ipynb?token={token}"
            with urllib.request.urlopen(url, timeout=120) as page:
                page.read()  # Voila streams the page as the notebook runs: read it to the end
        finally:
            stop_voila(voila)
    info = json.loads((folder / "who.json").read_text())
    assert info["transport"] == "ipc" and info.get("mode") == "0o700", info
    assert "without encryption" not in (tmp_path / "voila.log").read_text()


def test_the_dashboard_command_line_carries_no_token(tmp_path):
    cmd = voila_command(tmp_path, 8866)
    assert not [a for a in cmd if "token" in a.lower()]
    folder = private_config("secret-0123")
    try:
        assert (folder.stat().st_mode & 0o777) == 0o700 and ((folder / "voila.json").stat().st_mode & 0o777) == 0o600
        assert "secret-0123" in (folder / "voila.json").read_text()
    finally:
        shutil.rmtree(folder)


def test_the_dashboards_apps_write_apart_and_its_address_carries_any_token(tmp_path, monkeypatch, capsys):
    """The apps' studies wrote into the studies' own results/<study>/, where a demo's run became what the report
    read as the study's latest; a $WORKBENCH_TOKEN with '&', '#' or a space was printed unquoted, an address
    that asked for the token again. Played: no server starts."""
    import argparse

    from workbench.front import dashboard

    seen = {}

    class Server:
        returncode = 0

        def __init__(self, cmd, **kw):
            seen.update(kw)

        def wait(self, timeout=None):
            return 0

        def poll(self):
            return 0

    monkeypatch.setattr(dashboard.subprocess, "Popen", Server)
    proc = start_voila(tmp_path / "apps", 8866, "t-0123", env={"PATH": "/bin"})
    shutil.rmtree(proc.config_dir)
    # JUPYTER_PATH: where Voila finds the apps' template (its lab page less the CDN's links), before any of yours
    assert seen["env"] == {"PATH": "/bin", "WORKBENCH_RESULTS": str(tmp_path / "apps" / "results"),
                           "JUPYTER_PATH": str(dashboard.TEMPLATES)}
    proc = start_voila(tmp_path / "apps", 8866, "t-0123", env={"PATH": "/bin", "JUPYTER_PATH": "/mine"})
    shutil.rmtree(proc.config_dir)
    assert seen["env"]["JUPYTER_PATH"] == f"{dashboard.TEMPLATES}{os.pathsep}/mine"
    monkeypatch.setattr(dashboard, "prepare", lambda quick: tmp_path / "apps")
    monkeypatch.setenv("WORKBENCH_TOKEN", "my tok&en#1")
    assert dashboard.main(argparse.Namespace(port=free_port(), prepare_only=False, quick=True)) == 0
    out = capsys.readouterr().out
    assert "/?token=my%20tok%26en%231  (Ctrl-C stops the server)" in out, out


def test_voila_refuses_a_taken_port_instead_of_moving_to_another(tmp_path, server_env):
    """Voila's own default moves to the next free port; the printed address (and the token a
    browser sends there) would then reach whatever holds the first one."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # the command refuses it in one line, before preparing anything
        cmd = subprocess.run([sys.executable, "-m", "workbench.cli", "dashboard", "--quick", "--port", str(port)],
                             env=server_env, capture_output=True, text=True, timeout=120)
        assert cmd.returncode == 2 and cmd.stdout == ""
        assert cmd.stderr.count("\n") == 1 and f"port {port} on 127.0.0.1 is in use" in cmd.stderr
        assert "pass --port " in cmd.stderr
        assert not (Path(server_env["WORKBENCH_RESULTS"]) / "dashboard").exists()
        # and Voila itself, given the taken port (as when another server takes it meanwhile), exits
        (tmp_path / "apps").mkdir()
        log = tmp_path / "voila.log"
        with open(log, "w") as f:
            voila = start_voila(tmp_path / "apps", port, "t-0123", env=server_env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
            try:
                assert voila.wait(timeout=90) != 0
            finally:
                stop_voila(voila)
    text = log.read_text()
    assert "could not be started" in text and "is running at" not in text, text
    assert not voila.config_dir.exists()


def test_the_dashboards_server_listens_on_localhost_alone_and_asks_for_its_token(tmp_path, server_env):
    """No browser needed. Voila logs the host's name, not 0.0.0.0, when it listens everywhere, so the log
    could not show it: the listening sockets are read from the server's process. A page asked for without
    the token is refused; with it, served."""
    import psutil

    folder = tmp_path / "apps"
    folder.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")],
                                            metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                     "language": "python"}}), folder / "page.ipynb")
    port, token = free_port(), "listen-token-0123"
    with open(tmp_path / "voila.log", "w") as log:
        voila = start_voila(folder, port, token, env=server_env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
        try:
            assert wait_http(f"http://127.0.0.1:{port}/?token={token}", voila) == 200
            assert status_of(f"http://127.0.0.1:{port}/voila/render/page.ipynb") in (302, 403)  # no token
            assert status_of(f"http://127.0.0.1:{port}/?token=not-{token}") in (302, 403)  # another token
            assert status_of(f"http://127.0.0.1:{port}/voila/render/missing.ipynb?token={token}") == 404
            procs = [psutil.Process(voila.pid), *psutil.Process(voila.pid).children(recursive=True)]
            listening = {c.laddr.ip for p in procs for c in p.net_connections(kind="inet")
                         if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
            assert listening and listening <= {"127.0.0.1"}, listening
        finally:
            stop_voila(voila)
    # a refused or missing page is logged without its token (tornado's own log wrote `?token=...`)
    text = (tmp_path / "voila.log").read_text()
    assert text.count("GET /voila/render/missing.ipynb?token=[secret]") == 2 and token not in text, text


def test_a_stopped_dashboard_takes_its_server_and_token_with_it(tmp_path, server_env):
    """`kill` (SIGTERM) of `workbench dashboard` stops Voila and removes the folder holding the token."""
    port = free_port()
    env = {**server_env, "TMPDIR": str(tmp_path)}  # where the private folder is made
    log = tmp_path / "dashboard.log"
    cli = start([sys.executable, "-m", "workbench.cli", "dashboard", "--quick", "--port", str(port)], env, log)
    try:
        assert wait_http(f"http://127.0.0.1:{port}/", cli, timeout=180) in (200, 302, 403)
        assert len(list(tmp_path.glob("workbench-voila-*"))) == 1
        cli.terminate()
        assert cli.wait(timeout=30) == 143
    finally:
        if cli.poll() is None or port_in_use(port):
            os.killpg(cli.pid, signal.SIGKILL)  # leave no server behind when this fails
    assert not list(tmp_path.glob("workbench-voila-*")), log.read_text()
    assert "workbench dashboard: stopped (the server, its kernels and its token's folder are gone)" in log.read_text()
    deadline = time.time() + 10
    while port_in_use(port) and time.time() < deadline:
        time.sleep(0.2)
    assert not port_in_use(port)  # Voila went with it


@pytest.mark.parametrize("port", ["0", "70000"])
def test_a_port_out_of_range_is_a_one_line_error(port, server_env):
    cmd = subprocess.run([sys.executable, "-m", "workbench.cli", "dashboard", "--port", port],
                         env=server_env, capture_output=True, text=True, timeout=120)
    assert cmd.returncode == 2 and cmd.stderr == f"workbench dashboard: --port must be between 1 and 65535, got {port}\n"


@pytest.mark.skipif(not CHROMIUM, reason="Debian's chromium is not installed (make test installs it as root)")
def test_the_report_opens_in_a_browser_with_what_we_found_first(results_dir, tiny_base):
    pw = pytest.importorskip("playwright.sync_api", reason="playwright (Python) is not installed")

    run_ladder(LadderConfig(base_size="tiny", rungs=("fp32", "bf16_ckpt"), breakdown_rung="fp32", micro_batch=2,
                            seq_len=32, steps=2, autofit=False, reference_model=""))
    page_path = write_report()
    SHOTS.mkdir(parents=True, exist_ok=True)
    with pw.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(page_path.resolve().as_uri())
            headings = page.locator("h2").all_inner_texts()
            assert headings[0] == "What we found" and "Study 2: the memory ladder" in headings
            assert page.get_by_text("Predicted peaks of 2 rung(s) measured here").count() == 1
            page.locator(".js-plotly-plot .trace").first.wait_for(timeout=30_000)  # plotly.js inlined: offline
            page.screenshot(path=str(SHOTS / "report.png"), full_page=True)
            # where it was written, and where its measured figures were (each run's row): not one for the other
            assert page.get_by_text("on this machine (no GPU; CPU").count() == 1
            assert page.get_by_text("were measured where their study ran").count() == 1
            # narrower than the ladder's table: it scrolls in its own box, the page does not spill over
            page.set_viewport_size({"width": 700, "height": 1000})
            page.wait_for_timeout(1500)  # plotly's charts follow a resize after a short delay
            assert page.evaluate("document.documentElement.scrollWidth") <= 700
            assert page.evaluate("Math.max(...[...document.querySelectorAll('.wide')].map(d => d.scrollWidth))") > 700
        finally:
            browser.close()
    assert (SHOTS / "report.png").stat().st_size > 10_000


@pytest.mark.skipif(not CHROMIUM, reason="Debian's chromium is not installed (make test installs it as root)")
@pytest.mark.parametrize("runs", [2, 21])
def test_the_live_chart_legend_never_covers_the_axis_titles(tmp_path, runs):
    """Study 1's 21 runs (7 strategies x 3 seeds) filled four legend rows, placed at a fixed share
    of the plot's height: the first row covered the panels' "tokens" and "step" titles, and the
    panels shrank as the legend grew. Drawn by plotly.js in chromium, at a notebook's width and a
    narrow one."""
    pw = pytest.importorskip("playwright.sync_api", reason="playwright (Python) is not installed")
    live = LiveChart(title="Study 1: loss, device memory against the budget, speed (live)", display=False)
    names = ["adapter", "freeze_lower", "freeze_embeddings", "full", "lora", "bitfit", "qlora"]
    for i in range(runs):
        for step in (1, 2):
            live({"strategy": names[i % 7], "seed": i // 7, "device": "cpu@160", "step": step, "tokens": 64 * step,
                  "loss": 5.0 - step * 0.1, "mem_mib": 100.0 + i, "tokens_per_s": 1000.0, "budget_mib": 160.0})
    page_path = tmp_path / "live.html"
    live.close().write_html(page_path, include_plotlyjs=True)
    boxes = """() => ({legend: document.querySelector('.legend').getBoundingClientRect().toJSON(),
                      titles: [...document.querySelectorAll('.xtitle, .x2title, .x3title')].map(e => e.getBoundingClientRect().toJSON()),
                      panels: [...document.querySelectorAll('.nsewdrag')].map(e => e.getBoundingClientRect().toJSON())})"""
    with pw.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            for width in (900, 1400):
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.goto(page_path.resolve().as_uri())
                page.locator(".js-plotly-plot .legend").first.wait_for(timeout=30_000)
                seen = page.evaluate(boxes)
                assert len(seen["titles"]) == 3 and len(seen["panels"]) == 3
                assert seen["legend"]["top"] >= max(t["bottom"] for t in seen["titles"]), (width, seen)
                assert min(p["height"] for p in seen["panels"]) >= 200, (width, seen)  # the legend took no room from them
                assert page.locator(".legend .traces").count() == runs
                page.close()
        finally:
            browser.close()
