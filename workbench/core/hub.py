"""Where a model name that is not the embedded base points: a local path, the Hugging Face hub (or
its local cache), or one of the config copies that ship in data/configs.

    from_pretrained(path, **hub_options(path))   # offline: the local cache only, at once
    names_a_path("nope.json")                     # True: no hub id looks like that
    shipped_config("Qwen/Qwen2-0.5B")             # 'data/configs/qwen2-0.5b.json'

Offline, huggingface_hub retries every file it is asked for (about 30 s each, a dozen warnings) before
it looks in its cache; a name that cannot be on the hub, or a hub whose host does not even resolve,
is answered here at once instead, with the fix in one line.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import constants as hub_constants
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import SafetensorError

from workbench.core.common import PROJECT_ROOT

SHIPPED_CONFIGS = PROJECT_ROOT / "data" / "configs"  # config.json copies of real models, for estimates
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
PROBE_TTL_S = 60.0  # a probe's answer is reused this long: a load asks up to three times, a kernel for hours
_probes: dict[str, tuple[float, bool]] = {}  # host -> (when probed, unresolvable)


def names_a_path(name: str) -> bool:
    """`name` can only be a local path (a *.json file, or what no hub id can look like: ./x, /x, ~/x,
    a/b/c), so when it does not exist there is nothing to ask the hub for."""
    if name.endswith(".json"):
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def hub_options(path: str, *, model: bool = False) -> dict:
    """from_pretrained's keywords for `path`: when it is no local file or folder and the hub's host
    cannot be looked up (no network), read the local Hugging Face cache only, so that a model that
    is not there fails at once, and one that is loads without a wait. `model`: for an AutoModel
    class, whose look-up of a PEFT adapter (transformers 5.23, auto_factory.from_pretrained) is not
    given `local_files_only` and would ask the hub for adapter_config.json."""
    if Path(path).expanduser().exists() or hub_constants.HF_HUB_OFFLINE or not hub_unreachable():
        return {}
    return {"local_files_only": True, **({"adapter_kwargs": {"local_files_only": True}} if model else {})}


def hub_unreachable() -> bool:
    """The hub's host name does not resolve here, and no proxy is set that would resolve it for us."""
    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return False
    return _unresolvable(urlparse(hub_constants.ENDPOINT).hostname or "")


def _unresolvable(host: str) -> bool:
    """Looked up at most once a minute, so a notebook kernel that goes back online finds the hub."""
    now = time.monotonic()
    if host in _probes and now - _probes[host][0] < PROBE_TTL_S:
        return _probes[host][1]
    try:
        socket.getaddrinfo(host, 443)
        down = False
    except OSError:  # socket.gaierror: no network, or no name server answers
        down = True
    _probes[host] = (now, down)
    return down


def shipped_config(name: str) -> str | None:
    """The shipped config.json copy for a hub id or a bare model name ('Qwen/Qwen2-0.5B',
    'qwen2-0.5b', 'meta-llama/Llama-2-7b-hf'), as a path from the working folder where that is
    short; None when none ships."""
    stem = name.rstrip("/").rpartition("/")[2].lower()
    for candidate in dict.fromkeys((stem, stem.removesuffix("-hf"))):
        path = SHIPPED_CONFIGS / f"{candidate}.json"
        if candidate and path.is_file():
            rel = os.path.relpath(path)
            return str(path) if rel.startswith("..") else rel
    return None


# What loading a model raises where a folder or an id holds no loadable model: a file missing (OSError), a
# config it cannot read (ValueError), weights whose safetensors header is none (a Git LFS pointer, a
# download cut short: SafetensorError, which ended a study with a traceback).
LOAD_ERRORS = (OSError, ValueError, SafetensorError)


def with_vocabulary(tokenizer):
    """`tokenizer`, if it has one: transformers 5 builds one with no vocabulary but its special tokens
    from a folder without tokenizer files, and study 1 then said its text was too short (8 tokens)."""
    if len(tokenizer) <= len(set(tokenizer.all_special_tokens)):
        raise NoTokenizer("no tokenizer files (the tokenizer made without them has no vocabulary)")
    return tokenizer


class NoTokenizer(FileNotFoundError):
    """A model found, config and all, without tokenizer files (with_vocabulary)."""


def not_found_message(name: str, err: Exception,
                      needs: str = "config.json, tokenizer files and *.safetensors weights") -> str:
    """One line: why `name` could not be loaded, and the fix. `needs`: what the caller needs of a
    local folder (a config alone, or a whole model)."""
    local = Path(name).expanduser()
    if local.is_file():
        if "safetensors" in needs and _is_config(local):  # a good config.json, where a whole model is needed
            return (f"model {name!r} is a config.json alone: this needs a folder holding {needs} (a config.json "
                    "serves `workbench ladder` and `workbench estimate`, which need no weights)")
        return (f"model {name!r} is a file but not a model's config.json; pass a config.json (a JSON object with "
                f"'model_type') or a folder holding {needs}")
    if local.exists():
        return f"model {name!r}: the folder exists but holds no loadable model (needs {needs}): {err}"
    if isinstance(err, (SafetensorError, NoTokenizer)):  # a hub model found, a part of it not loadable
        return f"model {name!r} was found but holds no loadable model (needs {needs}): {err}"
    if hub_constants.HF_HUB_OFFLINE:
        why = "HF_HUB_OFFLINE is set, and it is not in the local Hugging Face cache"
    elif hub_unreachable():
        host = urlparse(hub_constants.ENDPOINT).hostname
        why = f"{host} cannot be reached from here, and it is not in the local Hugging Face cache"
    else:
        why = "the hub has no such model, or this machine may be offline"
    shipped = shipped_config(name)
    hint = f" `workbench estimate` needs only its config, which ships: --model {shipped}." if shipped else ""
    return (
        f"model {name!r} is not a local directory and could not be loaded from the Hugging Face hub "
        f"({why}). Fix: pass a local directory that holds the model (config.json, tokenizer, "
        f"*.safetensors), run where the hub is reachable once so it is cached (HF_HOME), or use "
        f"the workbench's own base, 'embedded' (--model embedded; model='embedded' in Python).{hint}"
    )


def _is_config(path: Path) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "model_type" in data
