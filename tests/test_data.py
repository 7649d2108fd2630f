import pytest
import torch

from workbench.data import CorpusError, corpus_blocks, target_corpus, token_blocks, unigram_perplexity


def test_target_corpus_is_split_by_topic_and_deterministic():
    a, b = target_corpus(), target_corpus()
    assert a == b
    assert a.train and a.heldout
    assert not set(a.train) & set(a.heldout)  # held-out topics are unseen in training
    assert 0.05 < len(a.heldout) / (len(a.train) + len(a.heldout)) < 0.4


def test_user_corpus_folder(tmp_path):
    for i in range(12):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i} " * 50)
    c = target_corpus(str(tmp_path))
    assert len(c.train) + len(c.heldout) == 12 and c.heldout


@pytest.mark.parametrize("make", ["missing", "empty_dir", "blank_file"])
def test_missing_or_empty_corpus_is_a_clear_error(tmp_path, make):
    path = tmp_path / "corpus"
    if make == "empty_dir":
        path.mkdir()
    elif make == "blank_file":
        path.write_text("   \n")
    with pytest.raises(CorpusError, match="does not exist|no text"):
        target_corpus(str(path))


def test_blocks_and_unigram(tiny_base):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_base)
    train, held = corpus_blocks(tok, target_corpus(), 32)
    assert train.shape[1] == held.shape[1] == 32 and train.dtype == torch.long
    assert int(train.max()) < len(tok)
    ppl = unigram_perplexity(train, held, len(tok))
    assert 1 < ppl < len(tok)
    with pytest.raises(CorpusError):
        token_blocks(tok, "tiny", 4096)
