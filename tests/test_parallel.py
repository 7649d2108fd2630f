"""run_many: independent runs in this process, on a LocalCluster, or on an existing scheduler.

    OMP_NUM_THREADS=1 python -m pytest tests/test_parallel.py -q      # about half a minute on 2 cores

Results must come back in the order of the items whatever order the runs finish in, a run's
exception must reach the caller with its own type, each worker process must get its share of the
cores, and no worker process may outlive the call.
"""

import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings

import psutil
import pytest
from distributed import Client, LocalCluster

from workbench.core import parallel
from workbench.core.parallel import cluster, cores, run_many, visible_cards

RAN = []  # the sequential path runs here: what ran, in order


class Boom(Exception):
    pass


def probe(x):
    """Where and how it ran; on a cluster item 0 finishes last (the other worker does the rest)."""
    import torch

    time.sleep(3.0 if x == 0 else 0.2)
    RAN.append(x)
    return {"x": x, "squared": x * x, "pid": os.getpid(), "omp": os.environ.get("OMP_NUM_THREADS"),
            "torch_threads": torch.get_num_threads(), "finished": time.monotonic()}


def explode_at_2(x):
    RAN.append(x)
    if x == 2:
        raise Boom(f"run {x} failed on purpose")
    return x


def workers() -> list[int]:
    """Live (not zombie) worker processes started by this test process (multiprocessing's
    resource tracker, which lives as long as its parent, is not one)."""
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(c.cmdline()):
                out.append(c.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(autouse=True)
def fresh():
    RAN.clear()


def test_sequential_in_this_process():
    rows = run_many(probe, [3, 1, 2], progress=False)
    assert [r["squared"] for r in rows] == [9, 1, 4] and RAN == [3, 1, 2]
    assert {r["pid"] for r in rows} == {os.getpid()}  # no Dask, no process: today's behaviour
    with pytest.raises(Boom, match="run 2 failed on purpose"):
        run_many(explode_at_2, [1, 2, 3], workers=1, progress=False)
    assert RAN[-2:] == [1, 2]  # it stopped at the failure: 3 never ran
    assert run_many(probe, [], workers=2) == []


def test_the_bar_counts_the_runs_finished_before_among_its_total(capsys):
    """A study that reads 3 finished runs back and runs 2: the bar reads 3/5 to 5/5 (it read 0/2 to 2/2)."""
    run_many(probe, [1, 2], progress=True, done=3, desc="runs")
    shown = capsys.readouterr().err
    assert "3/5" in shown and "5/5" in shown and "/2 " not in shown, shown


def test_local_cluster_order_threads_and_errors(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # inherited by the workers unless their share replaces it
    before = set(workers())
    rows = run_many(probe, [0, 1, 2, 3], workers=2, progress=False)
    assert [r["x"] for r in rows] == [0, 1, 2, 3] and [r["squared"] for r in rows] == [0, 1, 4, 9]
    finished = [r["finished"] for r in rows]
    assert finished != sorted(finished)  # they did not finish in that order
    pids = {r["pid"] for r in rows}
    assert len(pids) == 2 and os.getpid() not in pids and not RAN  # two worker processes ran them
    share = max(1, cores() // 2)  # each of two workers half the cores (not the function under test's answer)
    assert {r["omp"] for r in rows} == {str(share)} and {r["torch_threads"] for r in rows} == {share}
    # the run's own exception type and message, raised here; the cluster is closed behind it
    with pytest.raises(Boom, match="run 2 failed on purpose"):
        run_many(explode_at_2, [1, 2, 3, 4], workers=2, progress=False)
    assert set(workers()) <= before, "a worker process outlived run_many"


def test_more_workers_than_cores_is_said(monkeypatch):
    """workers=100 on this 2-core machine was taken without a word: a hundred processes, each with its torch."""
    class Started(Exception):
        pass

    def started(**kw):
        raise Started(kw["n_workers"])  # (no cluster is started: what matters is said before)

    monkeypatch.setattr(parallel, "LocalCluster", started)
    monkeypatch.setattr(parallel, "cores", lambda: 2)
    with pytest.warns(UserWarning, match=r"^3 workers on 2 cores: they share the cores, no faster than 2 side by "
                                         r"side, .* workers=2 at most$"), pytest.raises(Started):
        with cluster(3):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n, cards in ((2, []), (4, ["0", "1", "2", "3"])):  # as many as the cores, or one worker per card
            monkeypatch.setattr(parallel, "visible_cards", lambda cards=cards: cards)
            with pytest.raises(Started):
                with cluster(n):
                    pass


def test_a_workers_share_of_the_cores(monkeypatch):
    """On this 2-core machine half the cores is 1, which a share of always 1 also gives: the
    arithmetic on a larger machine, played."""
    monkeypatch.setattr(parallel, "cores", lambda: 16)
    assert [parallel.threads_per_worker(n) for n in (1, 2, 3, 16, 32, 0)] == [16, 8, 5, 1, 1, 16]
    assert parallel.threads_here() == 16  # outside a Dask worker: every core
    # inside one: the cores over the tasks that can run at once on its host, counted from the scheduler's
    # workers (two of one thread and one of four here, one elsewhere); capped by tasks_per_worker
    import types

    workers = {"tls://10.0.0.1:4001": {"nthreads": 1}, "tls://10.0.0.1:4002": {"nthreads": 1},
               "tls://10.0.0.1:4003": {"nthreads": 4}, "tls://10.0.0.2:4001": {"nthreads": 8}}
    client = types.SimpleNamespace(scheduler_info=lambda n_workers: {"workers": workers})
    monkeypatch.setattr(parallel, "current_worker", lambda: types.SimpleNamespace(address="tls://10.0.0.1:4002"))
    monkeypatch.setattr(parallel, "get_client", lambda: client)
    assert (parallel.threads_here(), parallel.threads_here(tasks_per_worker=1)) == (16 // 6, 16 // 3)


def test_local_cluster_listens_on_localhost_only(tmp_path):
    with cluster(2) as client:
        info = client.scheduler_info()
        assert len(info["workers"]) == 2 and all(w["nthreads"] == 1 for w in info["workers"].values())
        me = psutil.Process()
        listening = [c.laddr for p in [me, *me.children(recursive=True)]
                     for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert len(listening) >= 3 and {a.ip for a in listening} == {"127.0.0.1"}, listening
        # no dashboard, and no HTTP route of the scheduler's or the workers' (logs, call stacks and metrics
        # had been served without a token to every user here)
        assert info["services"]["dashboard"] in {a.port for a in listening}
        for a in listening:
            for path in ("/status", "/info/main/workers.html", "/metrics", "/health"):
                with pytest.raises(OSError):  # 404 (an HTTPError), or not HTTP at all: the TLS ports
                    urllib.request.urlopen(f"http://127.0.0.1:{a.port}{path}", timeout=5)
        # 127.0.0.1 is every user's of this machine: only a holder of this cluster's certificate may
        # connect (plain TCP let any local process run code as this user through the scheduler)
        address = client.scheduler.address
        assert address.startswith("tls://")
        for a in (address, address.replace("tls://", "tcp://")):  # another process
            stranger = subprocess.run([sys.executable, "-c", STRANGER, a], capture_output=True, text=True, timeout=120)
            assert stranger.stdout.count("refused") == 2, (a, stranger.stdout, stranger.stderr[-2000:])
        # ... and the refusal is the scheduler's: a stranger that trusts this cluster's authority but has
        # no certificate of its own completes no handshake (the two above fail on their own side too)
        ca = tmp_path / "ca.pem"
        ca.write_text(client.security.tls_ca_file)
        stranger = subprocess.run([sys.executable, "-c", NO_CERTIFICATE, address, str(ca)], capture_output=True,
                                  text=True, timeout=120)
        # the scheduler's alert, or its closing the connection before the alert is read (a race seen in CI);
        # a scheduler that let it in would keep the connection open and say nothing: "timed out"
        assert re.search(r"refused \(SSL\w*Error: .*(CERTIFICATE_REQUIRED|EOF)", stranger.stdout), (
            stranger.stdout, stranger.stderr[-2000:])


NO_CERTIFICATE = """import socket, ssl, sys
host, port = sys.argv[1].removeprefix("tls://").rsplit(":", 1)
trusts = ssl.create_default_context(cafile=sys.argv[2])
trusts.check_hostname = False
try:
    with socket.create_connection((host, int(port)), timeout=5) as raw, trusts.wrap_socket(raw) as tls:
        tls.settimeout(5)
        print("connected", tls.recv(16))  # TLS 1.3: the server's verdict on the client comes with the first read
except Exception as e:
    print(f"refused ({type(e).__name__}: {e})")
"""


STRANGER = """import sys
from distributed import Client
from distributed.security import Security
said = []
for security in (None, Security.temporary()):  # none, and a certificate of its own
    try:
        Client(sys.argv[1], timeout=5, set_as_default=False, security=security).submit(sum, [1]).result(timeout=20)
        said.append("connected")
    except Exception as e:
        said.append(f"refused ({type(e).__name__})")
print("; ".join(said))
"""


def _card_seen():  # in the worker (os.environ.get itself would be pickled with this process's environment)
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_local_workers_take_a_card_each_on_a_machine_with_several(monkeypatch):
    """Kaggle's two T4s: both workers' runs went to the first card (each process's "cuda" is its
    current card, 0), the second idle. Played: torch counts two cards (the workers start no CUDA)."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_cards() == ["0", "1"]
    with cluster(2) as client:
        assert sorted(client.run(_card_seen).values()) == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,3,bogus")  # CUDA stops at the first it cannot use
    assert visible_cards() == ["5", "3"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with cluster(2) as client:  # one card: both workers see what this process sees
        assert set(client.run(_card_seen).values()) == {"5,3,bogus"}


def test_existing_scheduler():
    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, host="127.0.0.1",
                      dashboard_address=None, memory_limit=0) as cluster, \
            Client(cluster, set_as_default=False) as client:
        # plain TCP is said: whoever reaches the scheduler can run code on its workers
        with pytest.warns(UserWarning, match=r"^the Dask scheduler tcp://127\.0\.0\.1:\d+ speaks plain TCP: "
                                             r".*use tls:// with Dask's distributed.comm.tls settings$"):
            rows = run_many(probe, [2, 0, 1], scheduler=cluster.scheduler_address, progress=False)
        assert [r["x"] for r in rows] == [2, 0, 1]
        worker_pids = set(client.run(os.getpid).values())
        assert {r["pid"] for r in rows} == worker_pids
        # two tasks at once on this host (two one-thread workers): each half the cores (with one worker
        # this read all of them, as a share that ignored the scheduler's workers would)
        assert {r["torch_threads"] for r in rows} == {max(1, cores() // 2)} and cores() >= 2
        with pytest.raises(Boom), pytest.warns(UserWarning, match="plain TCP"):
            run_many(explode_at_2, [2], scheduler=cluster.scheduler_address, progress=False)
        assert set(client.run(os.getpid).values()) == worker_pids  # the scheduler's worker lives on
