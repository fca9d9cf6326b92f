"""The byte-level BPE tokenizer: its vocabulary and end-of-text token, exact round trips of
any text, deterministic training."""

from __future__ import annotations

import pytest

from fivefold.train.corpus import Document
from fivefold.train.tokenizer import EOS, eos_id, train_tokenizer

from text_samples import SAMPLES


@pytest.fixture(scope="module")
def tokenizer():
    docs = [Document(name, text) for name, text in SAMPLES.items()] * 4
    return train_tokenizer(docs, vocab_size=400, sample_mib=1.0)


def test_tokenizer_vocab_size_and_eos(tokenizer):
    assert 257 <= tokenizer.get_vocab_size() <= 400  # 256 bytes + EOS, then merges
    eos = eos_id(tokenizer)
    assert tokenizer.encode(EOS).ids == [eos]
    ids = tokenizer.encode("abc" + EOS + "def").ids
    assert ids.count(eos) == 1
    assert tokenizer.decode(ids, skip_special_tokens=False) == "abc" + EOS + "def"


@pytest.mark.parametrize("text", list(SAMPLES.values()) + [
    "", " ", "\n", "  a\tb\n\n c   ", "unseen: Ωμέγα ✓ ☃ 🦀 ﷽ \x00\x01 control",
    "x" * 1000, "mixed日本😀code();\r\n\r\n"])
def test_tokenizer_round_trip_exact(tokenizer, text):
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    assert eos_id(tokenizer) not in ids


def test_tokenizer_training_is_deterministic():
    docs = [Document(name, text) for name, text in SAMPLES.items()] * 4
    a = train_tokenizer(docs, 350, 1.0)
    b = train_tokenizer(docs, 350, 1.0)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() > 257  # it learned merges
    text = SAMPLES["code.py"]
    assert len(a.encode(text).ids) < len(text.encode())  # and they compress


def test_eos_id_requires_the_token():
    from tokenizers import Tokenizer, models
    with pytest.raises(ValueError, match="endoftext"):
        eos_id(Tokenizer(models.BPE()))
