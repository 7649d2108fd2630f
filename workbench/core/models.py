"""Which model does a study start from, and where do its weights come from?

    model, tokenizer = load_model("embedded")            # the built-in base (built once, cached)
    model, tokenizer = load_model("Qwen/Qwen2-0.5B")      # any hub id (needs network or a local HF cache)
    model, tokenizer = load_model("/path/to/model_dir")   # a local directory with config.json + safetensors

Real models load through transformers' Auto classes from safetensors only, without remote code
unless asked. The embedded base is a small Qwen2-architecture model (tied embeddings, like
Qwen2-0.5B) with a byte-level BPE tokenizer, trained here: the tokenizer on both domains' training
text, the model on the standard library's source (see workbench.core.data). It is pretrained once,
with a progress bar, and cached in `$WORKBENCH_CACHE` (default: `.cache/` in the project). The cache
holds a manifest with every file's SHA-256; a partial or corrupt cache is rebuilt, never loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import StrictDataclassError

from workbench.core.common import PROJECT_ROOT
from workbench.core.config import ConfigError
from workbench.core.files import atomic_write_bytes
from workbench.core.data import (SPLIT_VERSION, corpus_blocks, source_corpus, target_corpus, unigram_perplexity,
                                 window_set)
from workbench.core.hub import LOAD_ERRORS, hub_options, names_a_path, not_found_message, with_vocabulary
from workbench.core.training import TrainSettings, evaluate_perplexity, train

EMBEDDED = "embedded"
MANIFEST = "manifest.json"
EOS = "<|endoftext|>"


class ModelNotFoundError(ValueError):
    """A model id or path that cannot be loaded here."""


class NotACausalLMError(ModelNotFoundError):
    """A model whose config transformers cannot build as a causal language model."""


def check_causal_lm(config, name: str) -> None:
    """Refuse, in one line, a config that is not a causal LM (a ViT, BERT, Whisper, ...)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    kind = getattr(config, "model_type", None)
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        arch = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
        what = ("a causal LM whose architecture is its repository's own code: the workbench builds models (its memory "
                "prediction too) from transformers' own classes"  # auto_map: trust_remote_code loaded its config
                if "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
                else "not a causal language model: the workbench trains causal LMs")
        raise NotACausalLMError(f"model {name!r} is a {kind!r} model ({arch}), {what} (e.g. Qwen2, Llama, GPT-2, OPT, "
                                "GPT-NeoX); pass one of those")
    for attr in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        v = getattr(config, attr, None)  # GPT-2's n_embd and n_layer are read through these names too
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise ModelNotFoundError(f"model {name!r}: its config's {attr} must be a positive integer, got {v!r}")


def max_positions(config) -> int | None:
    """The longest sequence the model's position embeddings allow, if the config states one."""
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        v = getattr(config, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def check_seq_len(config, seq_len: int, name: str = "the model") -> None:
    """Refuse a sequence longer than the model's positions (GPT-2: 1024), naming the limit."""
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        # a rotary model has no position table: past its trained context is context extension, which
        # raises the config's limit (with rope scaling); a learned table (GPT-2, OPT) ends there
        rotary = getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None)
        raise ConfigError(f"sequence length {seq_len} is longer than {name} allows ({limit} positions); "
                          f"use a sequence length of at most {limit}"
                          + (", or raise max_position_embeddings in its config (with rope scaling) to predict a "
                             "context extension" if rotary else ""))


@dataclass(frozen=True)
class EmbeddedSpec:
    """How the embedded base is built. Changing any field makes a new cache entry."""

    vocab_size: int = 4096
    hidden_size: int = 192
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    seq_len: int = 128
    batch: int = 16
    steps: int = 400
    lr: float = 2e-3
    source_mib: float = 6.0
    seed: int = 0

    def key(self) -> str:
        # v3: corpora split content-disjoint (tokenizer and pretraining text changed), the report holds the source's
        # held-out overlap; v4: the report's unigram floor is scored on the model's tokens (not each block's first)
        blob = json.dumps({**asdict(self), "python": sys.version.split()[0], "v": 4, "split": SPLIT_VERSION},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


# A spec small enough for tests: it builds in seconds.
TINY_SPEC = EmbeddedSpec(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                         intermediate_size=128, seq_len=64, batch=8, steps=150, lr=3e-3, source_mib=0.5)


def cache_root() -> Path:
    env = os.environ.get("WORKBENCH_CACHE")
    return Path(env) if env else PROJECT_ROOT / ".cache"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_is_valid(path: Path) -> bool:
    """True when every file the manifest lists exists with its recorded hash."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        return bool(files) and all(_sha256(path / name) == digest for name, digest in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def seen_windows(model: str, corpus: str | None, spec: EmbeddedSpec = EmbeddedSpec(), *, source=None):
    """For a corpus fine-tuning the embedded base (the default one too: until 2026-12-02 only a user's),
    the window set (data.window_set) of the base's pretraining text, cached beside it: written by the
    base's build (`source`: its corpus), else made once (~45 s). None for a hub model (text not known)."""
    if model != EMBEDDED:
        return None
    path = cache_root() / f"pretraining-windows-{spec.key()}.npy"
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        pass
    windows = window_set((source or source_corpus(spec.source_mib)).train)
    buffer = io.BytesIO()  # through atomic_write_bytes, whose temporaries a later writer clears (a killed
    np.save(buffer, windows)  # writer's .<pid>.pretraining-windows-*.npy had stayed in the cache for good)
    atomic_write_bytes(path, buffer.getvalue())
    return windows


def corpus_for(model: str, corpus: str | None, spec: EmbeddedSpec = EmbeddedSpec()):
    """A study's target corpus for `model`: held-out text unseen by the embedded base too (`seen_windows`)."""
    return target_corpus(corpus, seen_windows(model, corpus, spec))


def embedded_path(spec: EmbeddedSpec = EmbeddedSpec()) -> Path:
    return cache_root() / f"embedded-{spec.key()}"


def _remove_orphaned_builds(root: Path) -> None:
    """Remove the temporary folders of builds whose process is gone (killed: no `finally` ran).
    A build's folder is `.embedded-KEY.PID.RANDOM`; a live process's folder is left alone."""
    for tmp in root.glob(".embedded-*.*.*"):
        pid = tmp.name.split(".")[2]
        if not (tmp.is_dir() and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError:  # alive, under another user
            pass


def ensure_embedded_base(spec: EmbeddedSpec = EmbeddedSpec(), *, progress: bool = True) -> Path:
    """Return the cached embedded base, building it first if the cache is missing or invalid."""
    path = embedded_path(spec)
    if cache_is_valid(path):
        return path
    if path.exists():
        print(f"workbench: cached base at {path} is partial or corrupt; rebuilding it", file=sys.stderr)
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphaned_builds(path.parent)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}."))
    try:
        _build_embedded(spec, tmp, progress=progress)
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.name != MANIFEST}
        metrics = json.loads((tmp / "pretrain.json").read_text())
        (tmp / MANIFEST).write_text(json.dumps({"spec": asdict(spec), "files": files, **metrics}, indent=2))
        try:
            os.replace(tmp, path)
        except OSError:  # another process built it first
            if not cache_is_valid(path):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def model_fingerprint(name: str, spec: EmbeddedSpec = EmbeddedSpec()) -> str:
    """A key of the weights a run starts from: the embedded base's manifest (every file's SHA-256),
    a local directory's files (names, sizes, modification times), a config.json's content (a model
    initialised at random from it), or a hub id with its cached snapshot's commit (else the id alone)."""
    h = hashlib.sha256()
    if name == EMBEDDED:
        manifest = json.loads((ensure_embedded_base(spec, progress=False) / MANIFEST).read_text())
        h.update(json.dumps(manifest["files"], sort_keys=True).encode())
    elif Path(name).expanduser().is_dir():
        for p in sorted(Path(name).expanduser().rglob("*")):
            if p.is_file():
                st = p.stat()
                h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    elif Path(name).expanduser().is_file():
        h.update(Path(name).expanduser().read_bytes())
    else:  # a hub id, with its cached snapshot's commit (none cached, or an id the hub refuses: the id alone)
        try:
            name += "@" + Path(try_to_load_from_cache(name, "config.json")).parent.name  # snapshots/<commit>/
        except (TypeError, ValueError):
            pass
        h.update(name.encode())
    return h.hexdigest()[:16]


def embedded_metrics(spec: EmbeddedSpec = EmbeddedSpec()) -> dict:
    """The pretraining report of the embedded base (held-out and unigram perplexity, time)."""
    return json.loads((ensure_embedded_base(spec) / "pretrain.json").read_text())


def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE tokenizer trained with `tokenizers`, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=EOS)


def embedded_config(spec: EmbeddedSpec = EmbeddedSpec(), vocab_size: int | None = None, eos_id: int = 0):
    """The embedded base's config as its build writes it, without building it (an estimate needs no
    weights): the vocabulary is the trained tokenizer's (`vocab_size`; before it is trained, the spec's,
    which the build reaches on its corpus), EOS its one special token (id 0)."""
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=vocab_size or spec.vocab_size, hidden_size=spec.hidden_size,
                       intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                       num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                       max_position_embeddings=max(2048, spec.seq_len), tie_word_embeddings=True,
                       bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)


def _build_embedded(spec: EmbeddedSpec, out: Path, *, progress: bool) -> None:
    from tqdm.auto import tqdm
    from transformers import Qwen2ForCausalLM

    t0 = time.perf_counter()
    source = source_corpus(spec.source_mib)
    target = target_corpus()  # its training text (the tokenizer's): not changed by the check below
    seen_windows(EMBEDDED, None, spec, source=source)  # what study 1's held-out text is checked against
    # The tokenizer sees both domains' training text (never held-out text).
    tokenizer = train_tokenizer(list(source.train) + list(target.train), spec.vocab_size)
    train_blocks, held_blocks = corpus_blocks(tokenizer, source, spec.seq_len)
    config = embedded_config(spec, len(tokenizer), tokenizer.eos_token_id)
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    settings = TrainSettings(steps=spec.steps, micro_batch=spec.batch, lr=spec.lr,
                             warmup_steps=max(1, spec.steps // 20), seed=spec.seed)
    bar = tqdm(total=spec.steps, desc="pretraining the embedded base", unit="step", disable=not progress)

    def show(row):
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")

    result = train(model, train_blocks, settings, device="cpu", sinks=[show])
    bar.close()
    held_ppl = evaluate_perplexity(model, held_blocks, max_blocks=256)
    unigram = unigram_perplexity(train_blocks, held_blocks[:256], len(tokenizer))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    metrics = {
        "params": sum(p.numel() for p in model.parameters()),
        "source_train_tokens": int(train_blocks.numel()),
        "pretrain_tokens": result.tokens, "pretrain_seconds": round(result.seconds, 1),
        "build_seconds": round(time.perf_counter() - t0, 1),
        "final_train_loss": result.final_loss,
        "heldout_perplexity": held_ppl,
        "unigram_perplexity": unigram,
        # held-out source text seen in training (50-character windows): see workbench.core.data
        "source_corpus": source.name,
        "source_train_chars": sum(map(len, source.train)), "source_heldout_chars": sum(map(len, source.heldout)),
        "source_overlap_share": source.overlap.share,
        "source_overlap_share_by_name": source.overlap.share_by_name,
        "source_heldout_paragraphs_left_out": source.overlap.dropped_paragraphs,
    }
    (out / "pretrain.json").write_text(json.dumps(metrics, indent=2))
    if progress:
        print(f"workbench: embedded base ready: held-out perplexity {held_ppl:.1f} "
              f"(unigram {unigram:.1f}), {metrics['build_seconds']} s", file=sys.stderr)


def resolve_model_path(name: str, spec: EmbeddedSpec = EmbeddedSpec()) -> str:
    """The id or folder that transformers should load for `name`."""
    if not isinstance(name, str) or not name.strip():
        raise ModelNotFoundError("model must be 'embedded', a Hugging Face model id or a local directory")
    if name == EMBEDDED:
        return str(ensure_embedded_base(spec))
    if (local := Path(name).expanduser()).exists():  # transformers does not expand "~" (--model=~/x, a notebook's)
        return str(local)
    if names_a_path(name):
        raise ModelNotFoundError(
            f"model {name!r}: no such file or directory, and not a Hugging Face model id. Fix: check the "
            f"path (a config.json, or a folder with config.json and *.safetensors), or pass a hub id such "
            f"as 'Qwen/Qwen2-0.5B', or the workbench's own base, 'embedded' (--model embedded, model='embedded').")
    return name


def load_model(
    name: str = EMBEDDED,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
    spec: EmbeddedSpec = EmbeddedSpec(),
):
    """(model, tokenizer) for the embedded base, a hub id or a local directory; safetensors only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per load is noise in a study of many loads
    path = resolve_model_path(name, spec)
    local = Path(path).expanduser()
    if local.is_dir() and not (local / "config.json").is_file():
        raise ModelNotFoundError(not_found_message(name, FileNotFoundError(f"no config.json in {local}")))
    check_causal_lm(load_config(name, trust_remote_code=trust_remote_code, spec=spec), name)
    try:
        tokenizer = with_vocabulary(AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                                  **hub_options(path)))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, use_safetensors=True,
                                                     trust_remote_code=trust_remote_code, **hub_options(path, model=True))
    except LOAD_ERRORS as e:
        raise ModelNotFoundError(not_found_message(name, e)) from e
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device), tokenizer


def load_config(name: str, *, trust_remote_code: bool = False, spec: EmbeddedSpec = EmbeddedSpec()):
    """A model's config without its weights: an id, a model dir, a config.json, the embedded base (unbuilt too)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if name.endswith(".json") and Path(name).expanduser().is_file():
        try:
            data = json.loads(Path(name).expanduser().read_text())
        except ValueError as e:
            raise ModelNotFoundError(f"{name} is not valid JSON: {e}") from e
        if not isinstance(data, dict) or "model_type" not in data:
            raise ModelNotFoundError(f"{name} is not a model config (it has no 'model_type')")
        if data["model_type"] not in CONFIG_MAPPING:
            raise ModelNotFoundError(f"{name}: unknown model_type {data['model_type']!r}")
        try:  # transformers 5 validates each field's type (num_hidden_layers 1.5: a TypeError inside)
            config = CONFIG_MAPPING[data["model_type"]].from_dict(data)
        except (StrictDataclassError, TypeError, ValueError) as e:
            raise ModelNotFoundError(f"{name} is not a valid {data['model_type']} config: "
                                     f"{' '.join(str(e).split())}") from e
    elif name == EMBEDDED and not cache_is_valid(embedded_path(spec)):
        config = embedded_config(spec)
    else:
        path = resolve_model_path(name, spec)
        try:  # a folder without config.json: transformers said "Unrecognized model ... no `model_type`"
            if Path(path).expanduser().is_dir() and not (Path(path).expanduser() / "config.json").is_file():
                raise FileNotFoundError(f"no config.json in {path}")
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **hub_options(path))
        except (OSError, ValueError) as e:
            raise ModelNotFoundError(not_found_message(name, e, needs="a config.json")) from e
    check_causal_lm(config, name)
    return config
