"""Which text do the studies train and evaluate on, and how does it become token blocks?

The embedded default needs no network: both domains are built deterministically from text that
ships with Python.

- Source domain (pretraining the embedded base): the standard library's own `.py` files, sorted
  by path (tests and site-packages left out), the first `source_mib` MiB; the last 5% of files is
  held out.
- Target domain (fine-tuning in study 1): the language reference that `pydoc_data.topics` ships
  (79 topics in CPython 3.11). It is split *by topic*, so that held-out text is really unseen: a
  topic goes to held-out when a stable hash of its name falls in the held-out share.

A user corpus (a text file or a folder of .txt/.md/.py files) can replace the target domain;
its files are split the same way, by file.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

HELDOUT_SHARE = 0.2
_TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")


class CorpusError(ValueError):
    """A corpus that is missing or empty."""


@dataclass(frozen=True)
class Corpus:
    """A domain's documents, already split into train and held-out."""

    name: str
    train: tuple[str, ...]
    heldout: tuple[str, ...]

    def describe(self) -> dict:
        return {
            "corpus": self.name,
            "train_docs": len(self.train),
            "heldout_docs": len(self.heldout),
            "train_chars": sum(map(len, self.train)),
            "heldout_chars": sum(map(len, self.heldout)),
        }


def _is_heldout(key: str, share: float = HELDOUT_SHARE) -> bool:
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return (h % 10_000) < share * 10_000


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
    )
    docs, total, limit = [], 0, int(source_mib * 2**20)
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        docs.append(text)
        total += len(text)
        if total >= limit:
            break
    if not docs:
        raise CorpusError(f"no Python source found under {lib}")
    n_held = max(1, len(docs) // 20)
    # Interleave the held-out files through the sorted list so they span many packages.
    step = max(1, len(docs) // n_held)
    held_idx = set(range(step - 1, len(docs), step))
    return Corpus(
        "python-stdlib-source",
        tuple(d for i, d in enumerate(docs) if i not in held_idx),
        tuple(d for i, d in enumerate(docs) if i in held_idx),
    )


def target_corpus(path: str | None = None) -> Corpus:
    """The target domain: pydoc's language reference by default, or a user's text."""
    if not path or path == "embedded":
        from pydoc_data import topics

        items = sorted(topics.topics.items())
        name = "python-language-reference"
    else:
        root = Path(path).expanduser()
        if not root.exists():
            raise CorpusError(f"corpus {path!r} does not exist")
        files = [root] if root.is_file() else sorted(
            p for p in root.rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES
        )
        items = [(str(p.relative_to(root.parent)), p.read_text(encoding="utf-8", errors="replace")) for p in files]
        name = str(root)
    items = [(k, v) for k, v in items if v.strip()]
    if not items:
        raise CorpusError(f"corpus {path or 'embedded'!r} holds no text")
    if len(items) == 1:
        # One document: split it by paragraphs instead, so held-out text still exists.
        key, text = items[0]
        items = [(f"{key}#{i}", p) for i, p in enumerate(text.split("\n\n")) if p.strip()]
    train = tuple(v for k, v in items if not _is_heldout(k))
    held = tuple(v for k, v in items if _is_heldout(k))
    if not train or not held:
        raise CorpusError(f"corpus {name!r} is too small to split into train and held-out text")
    return Corpus(name, train, held)


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
        raise CorpusError(f"text of {len(ids)} tokens is shorter than one block of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def corpus_blocks(tokenizer, corpus: Corpus, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train_blocks, heldout_blocks) for a corpus."""
    sep = "\n\n" + (tokenizer.eos_token or "")
    train = token_blocks(tokenizer, sep.join(corpus.train), seq_len)
    held = token_blocks(tokenizer, sep.join(corpus.heldout), seq_len)
    return train, held


def unigram_perplexity(train: torch.Tensor, heldout: torch.Tensor, vocab_size: int) -> float:
    """Held-out perplexity of an add-one unigram model fitted on `train`: the floor any LM must beat."""
    counts = torch.bincount(train.flatten(), minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(torch.exp(-logp[heldout.flatten()].mean()))
