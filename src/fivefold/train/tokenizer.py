"""A byte-level BPE tokenizer trained locally with HF `tokenizers`.

Byte-level BPE (GPT-2, Radford et al. 2019) never meets an unknown character, so any UTF-8
text round-trips exactly. The tokenizer learns from a deterministic sample of the training
documents (every k-th document until `sample_mib` MiB), which takes about a second for the
built-in corpus; `<|endoftext|>` separates documents.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from fivefold.train.corpus import Document

EOS = "<|endoftext|>"


def sample_texts(docs: list[Document], sample_mib: float) -> list[str]:
    """Every k-th document, k chosen so that the sample is about `sample_mib` MiB."""
    total = sum(len(d.text) for d in docs)
    stride = max(1, int(total / (sample_mib * 2**20)))
    return [d.text for d in docs[::stride]]


def train_tokenizer(docs: list[Document], vocab_size: int, sample_mib: float) -> Tokenizer:
    """Learn a byte-level BPE of at most `vocab_size` tokens (EOS included)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(sample_texts(docs, sample_mib), trainer)
    return tok


def eos_id(tok: Tokenizer) -> int:
    token_id = tok.token_to_id(EOS)
    if token_id is None:
        raise ValueError(f"tokenizer has no {EOS} token")
    return token_id
