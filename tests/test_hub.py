"""A hub that cannot be reached is answered at once: from the local cache, or with the fix in one line.

Offline, huggingface_hub retries each file for ~30 s before it looks in its cache. Here the hub's
host does not resolve (socket.getaddrinfo fails, as it does on a machine with no network), and
every name look-up after the workbench's one probe fails the test: the models load, or fail,
without asking the network.
"""

import os
import shutil
import socket
from pathlib import Path

import pytest
from huggingface_hub import constants as hub_constants
from huggingface_hub.utils import _detect_agent

from workbench.core import hub
from workbench.core.hub import hub_options, shipped_config
from workbench.core.models import ModelNotFoundError, load_config, load_model

ROOT = Path(__file__).resolve().parent.parent
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _no_dns(*a, **k):
    raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No name resolves, no proxy is set, HF_HUB_OFFLINE is not set, and an empty hub cache; a name
    look-up after the probe's first fails the test. Returns (the cache folder, the hosts looked up)."""
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    for v in hub.PROXY_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    lookups = []

    def lookup(host, *a, **k):
        lookups.append(host)
        if len(lookups) > 1:
            raise AssertionError(f"asked the network for {host} after the probe found no network")
        _no_dns()

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    # huggingface_hub's own best-effort fetch of its agent registry (once a process, one look-up,
    # errors swallowed) is not a model load: count only what loading a model asks
    monkeypatch.setattr(_detect_agent, "_registry", {}, raising=False)
    hub._probes.clear()
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(ROOT)
    yield cache, lookups
    hub._probes.clear()


def _cache(cache: Path, repo: str, source: Path) -> None:
    """Put `source`'s files into the hub cache as `repo` at one commit, the layout huggingface_hub writes."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    snapshot = folder / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        if f.is_file():
            shutil.copy(f, snapshot / f.name)


def test_a_cached_model_loads_offline_without_asking_the_hub(offline, tiny_base):
    cache, lookups = offline
    _cache(cache, "someone/cached-base", tiny_base)
    assert load_config("someone/cached-base").model_type == "qwen2"
    model, tokenizer = load_model("someone/cached-base")
    assert sum(p.numel() for p in model.parameters()) > 0 and tokenizer("def f():")["input_ids"]
    assert lookups == ["huggingface.co"]  # the probe, once


def test_an_uncached_model_fails_at_once_naming_why_and_the_shipped_config(offline):
    _, lookups = offline
    for load in (load_config, load_model):
        with pytest.raises(ModelNotFoundError, match="huggingface.co cannot be reached from here") as e:
            load("someone/not-cached")
        assert "\n" not in str(e.value) and "ships" not in str(e.value)
    with pytest.raises(ModelNotFoundError) as e:
        load_config("Qwen/Qwen2-0.5B")
    assert str(e.value).endswith("`workbench estimate` needs only its config, which ships: "
                                 "--model data/configs/qwen2-0.5b.json.")
    assert load_config("data/configs/qwen2-0.5b.json").hidden_size == 896  # and the hint is a path that loads
    assert lookups == ["huggingface.co"]


def test_the_hub_is_asked_as_usual_when_its_host_resolves_or_a_proxy_is_set(monkeypatch, tmp_path):
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    for v in hub.PROXY_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    hub._probes.clear()
    monkeypatch.setattr(hub.socket, "getaddrinfo", lambda *a, **k: [])
    assert hub_options("someone/model") == {}
    hub._probes.clear()
    monkeypatch.setattr(hub.socket, "getaddrinfo", _no_dns)
    assert hub_options("someone/model") == {"local_files_only": True}
    assert hub_options(str(tmp_path)) == {}  # a local folder is never the hub's business
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")  # the proxy resolves names for us
    assert hub_options("someone/model") == {}
    hub._probes.clear()


def test_a_kernel_that_goes_back_online_finds_the_hub_within_a_minute(monkeypatch):
    hub._probes.clear()
    clock = [1000.0]
    monkeypatch.setattr(hub.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(hub.socket, "getaddrinfo", _no_dns)
    assert hub._unresolvable("huggingface.co")
    monkeypatch.setattr(hub.socket, "getaddrinfo", lambda *a, **k: [])  # the network is back
    assert hub._unresolvable("huggingface.co")  # the answer of a moment ago, not asked again
    clock[0] += hub.PROBE_TTL_S
    assert not hub._unresolvable("huggingface.co")
    hub._probes.clear()


def test_shipped_configs_are_found_by_hub_id_or_bare_name(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    assert shipped_config("Qwen/Qwen2-0.5B") == os.path.join("data", "configs", "qwen2-0.5b.json")
    assert shipped_config("qwen2-7b") == os.path.join("data", "configs", "qwen2-7b.json")
    assert shipped_config("meta-llama/Llama-2-7b-hf") == os.path.join("data", "configs", "llama-2-7b.json")
    assert shipped_config("someone/not-shipped") is None
    monkeypatch.chdir(tmp_path)  # from elsewhere: a path that still opens
    assert Path(shipped_config("openai-community/gpt2")).is_file()
