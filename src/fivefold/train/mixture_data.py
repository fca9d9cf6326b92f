"""The token streams of a `[[data.sources]]` mixture, each source split and cached on its own.

Every source is read as `data.source` would be (fivefold.train.data): text and JSONL sources
hold out `val_fraction` of their documents, a token file the last `val_fraction` of its ids,
so validation draws from each source's own held-out part with the training weights. One
tokenizer serves every source: `data.tokenizer`, or a BPE trained on a weighted sample of
the text sources' training documents (each source contributes about its weight's share of
`data.tokenizer_sample_mib`), cached under a key of every source, weight and setting.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace
from pathlib import Path

from fivefold.config import Config
from fivefold.data_sources import source_configs
from fivefold.train.corpus import Document, detect_format, load_documents, split_documents
from fivefold.train.data import (CACHE_VERSION, TokenData, _load_tokens_file, cache_dir,
                                 check_data, load_or_train_tokenizer, tokenized_splits)
from fivefold.train.mixture import Mixture
from fivefold.train.tokenizer import sample_texts


def weighted_sample(sources: list[tuple[list[Document], float]], sample_mib: float
                    ) -> list[Document]:
    """About `sample_mib` MiB of documents, each source's share in proportion to its weight
    (every k-th document of it, as fivefold.train.tokenizer samples one source)."""
    total = sum(weight for _, weight in sources)
    return [Document(str(i), text) for i, (docs, weight) in enumerate(sources)
            for text in sample_texts(docs, sample_mib * weight / total)]


def prepare_mixture(cfg: Config, log=print) -> TokenData:
    """The tokenizer and a `Mixture` of every source's train and validation streams."""
    d, vocab = cfg.data, cfg.model.vocab
    sources = source_configs(d)
    formats = [detect_format(one) for one, _ in sources]
    splits = {i: split_documents(load_documents(one), d.val_fraction)
              for i, ((one, _), fmt) in enumerate(zip(sources, formats)) if fmt != "tokens"}
    hasher = hashlib.sha256(f"{CACHE_VERSION}|mixture|{vocab}|{d.val_fraction}|"
                            f"{d.tokenizer_sample_mib}".encode())
    for i, (train_docs, val_docs) in splits.items():
        hasher.update(f"|source {i} weight {sources[i][1]!r}|".encode())
        for doc in train_docs + val_docs:
            hasher.update(doc.name.encode() + b"\0" + doc.text.encode() + b"\0")
    if d.tokenizer:
        hasher.update(Path(d.tokenizer).read_bytes())
    key, root = hasher.hexdigest()[:16], cache_dir(d)
    tok = None
    if splits or d.tokenizer:
        tok_path = Path(d.tokenizer) if d.tokenizer else root / f"tokenizer-{key}.json"
        sample = weighted_sample([(splits[i][0], sources[i][1]) for i in splits],
                                 d.tokenizer_sample_mib)
        tok = load_or_train_tokenizer(tok_path, sample, vocab, math.inf, log)  # all of it
    trains, vals = [], []
    for i, (one, _) in enumerate(sources):
        if i in splits:
            train, val = tokenized_splits(tok, *splits[i], root / f"tokens-{key}-{i}", vocab,
                                          log)
        else:
            tokens = _load_tokens_file(replace(cfg, data=one))
            train, val = tokens.train, tokens.val
        check_data(cfg, TokenData(train, val, tok), f"data.sources[{i}].path")
        trains.append(train)
        vals.append(val)
    weights = tuple(weight for _, weight in sources)
    names = tuple(one.source for one, _ in sources)
    return TokenData(Mixture(tuple(trains), weights, names), Mixture(tuple(vals), weights, names),
                     tok)
