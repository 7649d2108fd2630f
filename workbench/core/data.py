"""Which text do the studies train and evaluate on, and how does it become token blocks?

The embedded default needs no network: both domains are built deterministically from text that
ships with Python.

- Source domain (pretraining the embedded base): the standard library's own `.py` files, sorted
  by path (tests, site-packages, idlelib and pydoc_data left out: pydoc_data holds the target
  domain), the first `source_mib` Mi characters; every 20th file (interleaved through the sorted
  list) is held out.
- Target domain (fine-tuning in study 1): the language reference that `pydoc_data.topics` ships
  (79 topics in CPython 3.11). A topic goes to held-out when a stable hash of its name falls in
  the held-out share.

A user corpus (a text file or a folder of .txt/.md/.py/.rst files) can replace the target domain;
its files are split the same way, by file (keyed by the path inside the folder, so the folder's
own name does not change the split; a few files whose hashes hold out none get the lowest-hashed
share, `heldout_keys`); a single file is split by paragraph.

Held-out means unseen in content, not only in name. pydoc's topics repeat each other word for
word (`compound` holds the `if`, `while`, `for` and `try` topics), so a split by name alone left
about half of the held-out text's 50-character windows in the training text. Every corpus is
therefore split content-disjoint (`disjoint_split`): documents are cut into paragraphs, repeated
paragraphs are kept once, the documents are split, and a held-out paragraph that shares a
50-character window with the training text, verbatim or with whitespace collapsed (a re-wrapped or
re-indented copy: `compound` and `try` hold one paragraph wrapped differently), is left out of the
held-out text. What this removed, and the overlap left (`Overlap`: the share of held-out
50-character windows that occur in training text, whitespace collapsed on both sides), travel with
the corpus; a user corpus that needed it gets a warning naming the files. A user corpus fine-tuning
the embedded base is also held to the text the base was pretrained on (`pretrained`: the standard
library's source): a held-out paragraph that shares a window with it is not unseen by the model, and
is left out too (`Overlap.seen_by_model_paragraphs`).
"""

from __future__ import annotations

import hashlib
import re
import sysconfig
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

HELDOUT_SHARE = 0.2
SPLIT_VERSION = 3  # what `disjoint_split` keeps (in the base's cache key); 3: whitespace-collapsed windows too
WINDOW = 50  # characters (UTF-8 bytes) of a window that counts as shared text
MAX_OVERLAP = 0.005  # the most held-out windows that may occur in training text
_TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
_PARAGRAPH = re.compile(r"\n[ \t]*\n")


class CorpusError(ValueError):
    """A corpus that is missing or empty."""


@dataclass(frozen=True)
class Overlap:
    """How much held-out text occurs in training text (whitespace collapsed), before and after the clean-up."""

    share_by_name: float  # held-out windows in training text, split by document name alone
    share: float  # the same after deduplication and the content-disjoint split
    duplicate_paragraphs: int  # repeated paragraphs kept once
    dropped_paragraphs: int  # held-out paragraphs left out: repeats of, or sharing a window with, training text
    dropped_chars: int
    heldout_windows: int
    files: tuple[str, ...] = ()  # held-out documents that lost text, worst first
    seen_by_model_paragraphs: int = 0  # of those dropped: sharing a window with the model's pretraining text

    def row(self) -> dict:
        d = asdict(self)
        d["files"] = ", ".join(self.files)
        return d


@dataclass(frozen=True)
class Corpus:
    """A domain's documents, already split into train and held-out (content-disjoint)."""

    name: str
    train: tuple[str, ...]
    heldout: tuple[str, ...]
    overlap: Overlap | None = field(default=None, compare=False)

    def describe(self) -> dict:
        d = {"corpus": self.name, "train_docs": len(self.train), "heldout_docs": len(self.heldout),
             "train_chars": sum(map(len, self.train)), "heldout_chars": sum(map(len, self.heldout))}
        if self.overlap is not None:
            d["heldout_overlap_share"] = self.overlap.share
            d["heldout_overlap_share_by_name"] = self.overlap.share_by_name
        return d

    def fingerprint(self) -> str:
        """A content key of the split: any change to either side's text changes it."""
        h = hashlib.sha256()
        for side in (self.train, self.heldout):
            for doc in side:
                h.update(hashlib.sha256(doc.encode("utf-8", "replace")).digest())
            h.update(b"|")
        return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------
# shared text: 50-character windows


_P = 1099511628211  # the 64-bit FNV prime: odd, so it has an inverse modulo 2**64
_P_INV = pow(_P, -1, 2**64)


def window_hashes(text: str, width: int = WINDOW) -> np.ndarray:
    """A 64-bit polynomial hash of every `width`-byte window of `text` (UTF-8): uint64 (n - width + 1,).

    Rolling, in O(n) memory: with H[i] = sum_{k<i} b[k] P^k (mod 2**64), the window at i hashes to
    (H[i + width] - H[i]) * P^-i. Integer overflow in numpy wraps, which is the modulo we want.
    """
    b = np.frombuffer(text.encode("utf-8", "replace"), dtype=np.uint8)
    n = len(b) - width + 1
    if n <= 0:
        return np.empty(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        pw = np.full(len(b), _P, dtype=np.uint64)
        pw[0] = 1
        pw = np.cumprod(pw, dtype=np.uint64)  # P^k
        prefix = np.concatenate([np.zeros(1, np.uint64), np.cumsum(b.astype(np.uint64) * pw, dtype=np.uint64)])
        inv = np.full(n, _P_INV, dtype=np.uint64)
        inv[0] = 1
        inv = np.cumprod(inv, dtype=np.uint64)  # P^-i
        return (prefix[width:width + n] - prefix[:n]) * inv


def collapse(text: str) -> str:
    """`text`, each run of whitespace one space, none at its ends: a re-wrapped paragraph is the same text."""
    return " ".join(text.split())


def text_windows(text: str) -> np.ndarray:
    """The windows shared text is looked for in: `text`'s verbatim (what a byte-level tokenizer sees,
    indentation included) and those of `collapse(text)`. Verbatim windows alone missed text repeated with
    other line breaks or indentation: 0.36% of the default target's held-out windows, reported as 0.00%."""
    return np.concatenate([window_hashes(text), window_hashes(collapse(text))])


def window_set(docs, *, collapsed_only: bool = False) -> np.ndarray:
    """Every window hash (`text_windows`; `collapsed_only`: of `collapse(d)` alone) of `docs`, sorted and
    unique (for `_contains`)."""
    parts = [window_hashes(collapse(d)) if collapsed_only else text_windows(d) for d in docs]
    return np.unique(np.concatenate(parts)) if parts else np.empty(0, np.uint64)


def _contains(sorted_set: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """Which of `hashes` are in `sorted_set` (binary search: O(m log n), unlike np.isin's sort of both)."""
    if not len(sorted_set):
        return np.zeros(len(hashes), dtype=bool)
    idx = np.minimum(np.searchsorted(sorted_set, hashes), len(sorted_set) - 1)
    return sorted_set[idx] == hashes


def overlap_share(train: tuple[str, ...] | list[str], heldout: tuple[str, ...] | list[str]) -> float:
    """The share of held-out `WINDOW`-character windows that occur in the training text, whitespace
    collapsed on both sides (`collapse`): a re-wrapped copy counts."""
    held = [window_hashes(collapse(d)) for d in heldout]
    held = np.concatenate(held) if held else np.empty(0, np.uint64)
    return float(_contains(window_set(train, collapsed_only=True), held).mean()) if len(held) else 0.0


def _paragraphs(text: str) -> list[str]:
    return [p.strip("\n") for p in _PARAGRAPH.split(text) if p.strip()]


def disjoint_split(items: list[tuple[str, str]], heldout_keys: set[str], name: str,
                   pretrained: np.ndarray | None = None) -> Corpus:
    """Split (key, text) documents into train and held-out so that held-out text is unseen.

    1. Each document is cut into paragraphs (blank-line separated); a paragraph seen before (same
       words, whitespace aside; training documents are read first) is dropped, so repeated text
       exists once.
    2. Documents whose key is in `heldout_keys` are held out.
    3. A held-out paragraph that shares a `WINDOW`-character window with the training text, verbatim
       or with whitespace collapsed (`text_windows`), or, if shorter than a window, occurs in it, is
       left out of the held-out text; so is one that shares a window with `pretrained` (the
       `window_set` of text the model was pretrained on), if given.
    """
    by_name = ([v for k, v in items if k not in heldout_keys], [v for k, v in items if k in heldout_keys])
    seen: set[str] = set()
    docs: list[tuple[str, list[str]]] = []
    duplicates = 0
    # Training documents first: a paragraph that both sides hold stays in training text and leaves
    # the held-out side (decontaminate the held-out text, keep the training text whole).
    lost: dict[str, int] = {}  # held-out document -> characters left out
    dropped = dropped_chars = 0
    for key, text in sorted(items, key=lambda kv: kv[0] in heldout_keys):
        kept = []
        for p in _paragraphs(text):
            norm = " ".join(p.split())
            if norm in seen:
                duplicates += 1
                if key in heldout_keys:
                    dropped, dropped_chars = dropped + 1, dropped_chars + len(p)
                    lost[key] = lost.get(key, 0) + len(p)
                continue
            seen.add(norm)
            kept.append(p)
        if kept:
            docs.append((key, kept))
    train = [(k, ps) for k, ps in docs if k not in heldout_keys]
    held = [(k, ps) for k, ps in docs if k in heldout_keys]
    train_text = ["\n\n".join(ps) for _, ps in train]
    train_windows = window_set(train_text)
    joined = collapse("\n\n".join(train_text))
    heldout, seen_dropped = [], 0
    for key, ps in held:
        kept = []
        for p in ps:
            w = text_windows(p)
            shared = _contains(train_windows, w).any() if len(w) else collapse(p) in joined
            if not shared and pretrained is not None and _contains(pretrained, w).any():
                shared, seen_dropped = True, seen_dropped + 1
            if shared:
                dropped += 1
                dropped_chars += len(p)
                lost[key] = lost.get(key, 0) + len(p)
            else:
                kept.append(p)
        if kept:
            heldout.append("\n\n".join(kept))
    files = tuple(sorted(lost, key=lambda k: -lost[k]))
    held_windows = sum(len(window_hashes(collapse(d))) for d in heldout)  # the windows `share` is of
    overlap = Overlap(overlap_share(*by_name), overlap_share(train_text, heldout), duplicates,
                      dropped, dropped_chars, held_windows, files, seen_dropped)
    return Corpus(name, tuple(train_text), tuple(heldout), overlap)


def _bucket(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 10_000


def _is_heldout(key: str, share: float = HELDOUT_SHARE) -> bool:
    return _bucket(key) < share * 10_000


def heldout_keys(keys: list[str], share: float = HELDOUT_SHARE) -> set[str]:
    """The documents to hold out: those whose stable hash falls in `share`. Where that holds out none
    (or every one) of a few documents, the `share` of them with the lowest hashes, at least one and
    at most all but one (a folder of three files held out none about half the time)."""
    held = {k for k in keys if _is_heldout(k, share)}
    if len(keys) >= 2 and (not held or len(held) == len(keys)):
        held = set(sorted(keys, key=lambda k: (_bucket(k), k))[:max(1, round(share * len(keys)))])
    return held


def source_corpus(source_mib: float = 8.0) -> Corpus:
    """The standard library's source: deterministic for a given Python version."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in lib.rglob("*.py")
        if "site-packages" not in p.parts
        and "test" not in p.parts
        and "tests" not in p.parts
        and "idlelib" not in p.parts
        and "pydoc_data" not in p.parts  # the target domain's text (topics.py): never pretraining text
    )
    docs, total, limit = [], 0, int(source_mib * 2**20)
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        docs.append((p, text))
        total += len(text)
        if total >= limit:
            break
    if not docs:
        raise CorpusError(f"no Python source found under {lib}")
    n_held = max(1, len(docs) // 20)
    # Interleave the held-out files through the sorted list so they span many packages.
    step = max(1, len(docs) // n_held)
    held_idx = set(range(step - 1, len(docs), step))
    items = [(str(p.relative_to(lib)), d) for p, d in docs]
    return disjoint_split(items, {items[i][0] for i in held_idx}, "python-stdlib-source")


_NO_TEXT = (f"corpus {{path!r}} holds no text: give a text file, or a folder of {'/'.join(_TEXT_SUFFIXES)} files "
            "that are not blank")
_TOO_SMALL = ("corpus {path!r} is too small to split into train and held-out text{after}: give it more text of its "
              "own, in more files or in more paragraphs (blank-line separated) of one file")


def _text_files(root: Path) -> list[Path]:
    return [root] if root.is_file() else sorted(
        p for p in root.rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES)


def utf8_text(path: Path, text: str) -> str:
    """`text` read from `path` (errors="replace"), if it is text: random bytes named .txt trained as U+FFFD."""
    if text and (text.count("\ufffd") + text.count("\0")) > 0.01 * len(text):
        raise CorpusError(f"corpus file {str(path)!r} is not UTF-8 text (over 1% of the {len(text):,} characters "
                          "read are not): convert it to UTF-8, or leave it out")
    return text


def check_has_text(path: str, head: int = 1 << 20) -> None:
    """A corpus that cannot be split, as far as the first `head` characters of its files tell (a CorpusError;
    settings are made often, a corpus may be one large file): no text, or one file of one paragraph."""
    root = Path(path).expanduser()
    texts = []
    for f in _text_files(root):
        with open(f, encoding="utf-8", errors="replace") as fh:
            text, whole = utf8_text(f, fh.read(head)), not fh.read(1)
        texts += [(text, whole)] if text.strip() or not whole else []  # a head of blanks, whole: no text
        if len(texts) == 2:
            return
    if not texts:
        raise CorpusError(_NO_TEXT.format(path=path))
    if texts[0][1] and sum(bool(p.strip()) for p in texts[0][0].split("\n\n")) < 2:  # one paragraph, whole
        raise CorpusError(_TOO_SMALL.format(path=str(root), after=" (one paragraph)"))


def target_corpus(path: str | None = None, pretrained: np.ndarray | None = None) -> Corpus:
    """The target domain: pydoc's language reference by default, or a user's text. `pretrained`: the window
    set of the model's pretraining text (models.seen_windows), held-out text sharing none of it."""
    if not path or path == "embedded":
        from pydoc_data import topics

        items = sorted(topics.topics.items())
        name = "python-language-reference"
    else:
        root = Path(path).expanduser()
        if not root.exists():
            raise CorpusError(f"corpus {path!r} does not exist")
        # keyed by the path inside the corpus: the split does not depend on the folder's own name
        items = [(root.name if p == root else str(p.relative_to(root)),
                  utf8_text(p, p.read_text(encoding="utf-8", errors="replace"))) for p in _text_files(root)]
        name = str(root)
    items = [(k, v) for k, v in items if v.strip()]
    if not items:
        raise CorpusError(_NO_TEXT.format(path=path or "embedded"))
    if len(items) == 1:
        # One document: split it by paragraphs instead, so held-out text still exists.
        key, text = items[0]
        items = [(f"{key}#{i}", p) for i, p in enumerate(text.split("\n\n")) if p.strip()]
    corpus = disjoint_split(items, heldout_keys([k for k, _ in items]), name, pretrained)
    if not corpus.train or not corpus.heldout:
        raise CorpusError(_TOO_SMALL.format(path=name,
                                            after=" (after repeated text was removed from the held-out side)"))
    ov = corpus.overlap
    if ov.seen_by_model_paragraphs:
        warnings.warn(f"corpus {name}: {ov.seen_by_model_paragraphs:,} held-out paragraphs share text with what the "
                      f"model was pretrained on and were left out of the held-out text", stacklevel=2)
    if path and path != "embedded" and ov.share_by_name > MAX_OVERLAP:
        shown = ", ".join(ov.files[:5]) + (f" and {len(ov.files) - 5} more" if len(ov.files) > 5 else "")
        kept = sum(map(len, corpus.heldout))
        warnings.warn(f"corpus {name}: split by file alone, {ov.share_by_name:.1%} of the held-out text's "
                      f"{WINDOW}-character windows would occur in the training text (files: {shown}); "
                      f"{ov.dropped_paragraphs:,} held-out paragraphs ({ov.dropped_chars:,} characters) that "
                      f"repeat training text were left out: the held-out text is {kept:,} characters in "
                      f"{len(corpus.heldout):,} documents, {ov.share:.2%} of its windows in the training text",
                      stacklevel=2)
    return corpus


def token_blocks(tokenizer, text: str, seq_len: int) -> torch.Tensor:
    """Tokenize `text` and cut it into non-overlapping blocks: LongTensor (n_blocks, seq_len).

    Documents are joined with the tokenizer's EOS so a block may span a boundary, as in
    pretraining; the tail shorter than a block is dropped.
    """
    if seq_len < 2:
        raise ValueError("seq_len must be at least 2")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = len(ids) // seq_len
    if n == 0:
        raise CorpusError(f"text of {len(ids):,} tokens is shorter than one block of seq_len {seq_len:,} tokens: "
                          "lower seq_len or give more text")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def corpus_blocks(tokenizer, corpus: Corpus, seq_len: int,
                  eval_blocks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(train_blocks, heldout_blocks) for a corpus; a warning when `eval_blocks` (the held-out
    blocks a study asks to score) is more than the held-out text holds (all of it is scored)."""
    sep = "\n\n" + (tokenizer.eos_token or "")
    train = token_blocks(tokenizer, sep.join(corpus.train), seq_len)
    held = token_blocks(tokenizer, sep.join(corpus.heldout), seq_len)
    if eval_blocks is not None and eval_blocks > len(held):
        warnings.warn(f"eval_blocks {eval_blocks:,} is more than the held-out text of {corpus.name} holds: "
                      f"all of it is scored, {len(held):,} blocks of {seq_len:,} tokens", stacklevel=2)
    return train, held


def unigram_perplexity(train: torch.Tensor, heldout: torch.Tensor, vocab_size: int) -> float:
    """Held-out perplexity of an add-one unigram model fitted on `train`: the floor any LM must beat.
    Scored on the tokens a causal LM is scored on (`evaluate_perplexity`): every token of a block but
    the first, which has no context to be predicted from."""
    counts = torch.bincount(train.flatten(), minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(torch.exp(-logp[heldout[:, 1:].flatten()].mean()))
