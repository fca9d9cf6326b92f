"""Token streams and the deterministic, resumable, rank-aware batch sampler.

`prepare_data` turns the configured source into two flat token arrays (train, validation),
each document ended by the tokenizer's end-of-document token (and begun by its bos where
the model family does that: fivefold.train.special_tokens), cached on disk as .npy files
keyed by a hash of the corpus, the tokenizer (with its bos/eos) and the vocabulary size: the
built-in corpus is tokenized once (about 10 s) and memory-mapped after that. Cache files are
written to a temporary name and renamed, so concurrent ranks or an interrupted run never see a
partial file. A run keeps its tokenizer in RUN_DIR/tokenizer (`write_run_tokenizer`).

Several `[[data.sources]]` give a `Mixture` of streams instead (`prepare_mixture`). Every
source is read as `data.source` would be: text and JSONL sources hold out `val_fraction` of
their documents, a token file the last `val_fraction` of its ids, so validation draws from
each source's own held-out part with the training weights. One tokenizer serves every
source: `data.tokenizer`, or a BPE trained on a weighted sample of the text sources' training
documents (each source gives about its weight's share of `data.tokenizer_sample_mib`), cached
under a key of every source, weight and setting.

`BatchSampler` draws the global batch of step `s` from a generator seeded by (seed, split, s)
alone. The data position is therefore just the step number (resuming is exact), and the
global batch is the same whatever the layout: data-parallel rank r of dp takes rows
[r*G/dp, (r+1)*G/dp) of it, or its `parallel.dp_batch_shares` part (fivefold.batch_shares),
and cuts them into micro-batches. From a mixture, each sequence
of the global batch draws its source by weight from that same generator
(fivefold.train.mixture), so all of this holds for mixtures too.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from fivefold.batch_shares import replica_slice
from fivefold.config import Config, ConfigError, DataConfig
from fivefold.data_sources import source_configs
from fivefold.train.corpus import Document, detect_format, load_documents, split_documents
from fivefold.train.mixture import Mixture
from fivefold.train.special_tokens import SpecialTokens, special_tokens, write_tokenizer_folder
from fivefold.train.tokenizer import sample_texts, train_tokenizer

CACHE_VERSION = "1"
RUN_TOKENIZER = "tokenizer"  # RUN_DIR/tokenizer: the run's tokenizer files


@dataclass
class TokenData:
    train: np.ndarray | Mixture
    val: np.ndarray | Mixture
    tokenizer: Tokenizer | None
    special: SpecialTokens | None = None  # its bos/eos, when there is a tokenizer


def cache_dir(cfg: DataConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fivefold"


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _save_npy(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object: np.save would append ".npy" to a name
        np.save(f, array)


def _token_dtype(vocab: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)


def _encode(tok: Tokenizer, special: SpecialTokens, texts: list[str],
            dtype: np.dtype) -> np.ndarray:
    parts = [np.asarray(special.document(enc.ids), dtype=dtype)
             for enc in tok.encode_batch(texts, add_special_tokens=False)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def run_special_tokens(cfg: DataConfig, tok: Tokenizer) -> SpecialTokens:
    """bos/eos of the run's tokenizer: a given one's from its folder's files, the built-in
    BPE's `<|endoftext|>` (fivefold.train.special_tokens)."""
    folder = Path(cfg.tokenizer).parent if cfg.tokenizer else None
    return special_tokens(tok, folder, cfg.eos_token)


def load_tokens_file(cfg: Config) -> TokenData:
    """Pre-tokenized ids: the last val_fraction of the stream is held out."""
    path = Path(cfg.data.source)
    dtype = np.dtype(cfg.data.token_dtype).newbyteorder("<")
    size = path.stat().st_size
    if size == 0:
        raise ConfigError("data.source", f"token file {str(path)!r} is empty")
    if size % dtype.itemsize:
        raise ConfigError("data.token_dtype", f"{path} holds {size} bytes, not a whole number of "
                                              f"{cfg.data.token_dtype} ids; check "
                                              "data.token_dtype")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    split = int(len(tokens) * (1 - cfg.data.val_fraction))
    tok = Tokenizer.from_file(cfg.data.tokenizer) if cfg.data.tokenizer else None
    special = run_special_tokens(cfg.data, tok) if tok else None
    return TokenData(tokens[:split], tokens[split:], tok, special)


def prepare_data(cfg: Config, log=print) -> TokenData:
    """Load or build the tokenizer and the train/validation token streams: of `data.source`
    (or one `[[data.sources]]` table), or a `Mixture` of several (fivefold.train.mixture)."""
    if cfg.data.sources and len(cfg.data.sources) > 1:
        return prepare_mixture(cfg, log)
    key = "data.sources[0].path" if cfg.data.sources else "data.source"
    cfg = replace(cfg, data=source_configs(cfg.data)[0][0])
    if detect_format(cfg.data) == "tokens":
        data = load_tokens_file(cfg)
    else:
        data = _prepare_text(cfg, log)
    check_data(cfg, data, key)
    return data


def _prepare_text(cfg: Config, log) -> TokenData:
    d, vocab = cfg.data, cfg.model.vocab
    docs = load_documents(d)
    hasher = hashlib.sha256(f"{CACHE_VERSION}|{vocab}|{d.val_fraction}|{d.tokenizer_sample_mib}"
                            .encode())
    for doc in docs:
        hasher.update(doc.name.encode() + b"\0" + doc.text.encode() + b"\0")
    if d.tokenizer:
        hasher.update(Path(d.tokenizer).read_bytes())
        tok = Tokenizer.from_file(d.tokenizer)
        special = run_special_tokens(d, tok)
        hasher.update(repr(special).encode())  # the files beside it and data.eos_token
    key = hasher.hexdigest()[:16]
    root = cache_dir(d)
    tok_path = Path(d.tokenizer) if d.tokenizer else root / f"tokenizer-{key}.json"
    train_docs, val_docs = split_documents(docs, d.val_fraction)
    tok = load_or_train_tokenizer(tok_path, train_docs, vocab, d.tokenizer_sample_mib, log)
    special = run_special_tokens(d, tok)
    train, val = tokenized_splits(tok, special, train_docs, val_docs, root / f"tokens-{key}",
                                  vocab, log)
    return TokenData(train, val, tok, special)


def load_or_train_tokenizer(tok_path: Path, train_docs: list[Document], vocab: int,
                            sample_mib: float, log) -> Tokenizer:
    """The tokenizer at `tok_path`, trained on `train_docs` and saved there first if absent."""
    if not tok_path.exists():
        log(f"training a {vocab}-token BPE tokenizer on {len(train_docs)} documents ...")
        tok = train_tokenizer(train_docs, vocab, sample_mib)
        _atomic_write(tok_path, tok.save)
    tok = Tokenizer.from_file(str(tok_path))
    if tok.get_vocab_size() > vocab:
        raise ConfigError("model.vocab", f"{vocab} is smaller than the tokenizer's "
                                         f"{tok.get_vocab_size()} tokens; raise model.vocab")
    return tok


def tokenized_splits(tok: Tokenizer, special: SpecialTokens, train_docs: list[Document],
                     val_docs: list[Document], stem: Path, vocab: int, log
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The (train, validation) token streams, each document framed by `special`'s bos/eos,
    cached as `{stem}-train.npy` / `-val.npy`."""
    train_path, val_path = Path(f"{stem}-train.npy"), Path(f"{stem}-val.npy")
    if not (train_path.exists() and val_path.exists()):
        log(f"tokenizing {len(train_docs)} + {len(val_docs)} documents "
            f"({sum(len(x.text) for x in train_docs + val_docs) / 2**20:.1f} MiB) ...")
        dtype = _token_dtype(vocab)
        for path, split in ((train_path, train_docs), (val_path, val_docs)):
            ids = _encode(tok, special, [x.text for x in split], dtype)
            _atomic_write(path, lambda tmp, ids=ids: _save_npy(tmp, ids))
    return np.load(train_path, mmap_mode="r"), np.load(val_path, mmap_mode="r")


def write_run_tokenizer(run_dir: Path, cfg: Config, data: TokenData) -> None:
    """RUN_DIR/tokenizer: the run's tokenizer with its bos/eos, as transformers reads it, for
    `fivefold convert` and `fivefold generate` of the run's checkpoints."""
    if data.tokenizer is not None and data.special is not None:
        source = Path(cfg.data.tokenizer).parent if cfg.data.tokenizer else None
        write_tokenizer_folder(Path(run_dir) / RUN_TOKENIZER, data.tokenizer, data.special,
                               cfg.model.seq_len, source)


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
    if "tokens" in formats and set(formats) != {"tokens"} and d.tokenizer is None:
        raise ConfigError("data.tokenizer", "the mixture holds token files and text: give "
                                            "the tokenizer.json the token files were made "
                                            "with, which then tokenizes the text too")
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
        hasher.update(repr(run_special_tokens(d, Tokenizer.from_file(d.tokenizer))).encode())
    key, root = hasher.hexdigest()[:16], cache_dir(d)
    tok = special = None
    if splits or d.tokenizer:
        tok_path = Path(d.tokenizer) if d.tokenizer else root / f"tokenizer-{key}.json"
        sample = weighted_sample([(splits[i][0], sources[i][1]) for i in splits],
                                 d.tokenizer_sample_mib)
        tok = load_or_train_tokenizer(tok_path, sample, vocab, math.inf, log)  # all of it
        special = run_special_tokens(d, tok)
    trains, vals = [], []
    for i, (one, _) in enumerate(sources):
        if i in splits:
            train, val = tokenized_splits(tok, special, *splits[i], root / f"tokens-{key}-{i}",
                                          vocab, log)
        else:
            tokens = load_tokens_file(replace(cfg, data=one))
            train, val = tokens.train, tokens.val
        check_data(cfg, TokenData(train, val, tok), f"data.sources[{i}].path")
        trains.append(train)
        vals.append(val)
    weights = tuple(weight for _, weight in sources)
    return TokenData(Mixture(tuple(trains), weights), Mixture(tuple(vals), weights), tok,
                     special)


def check_data(cfg: Config, data: TokenData, source_key: str = "data.source") -> None:
    """Both splits (of the source `source_key` names) must hold at least one sequence, and
    ids must fit the vocabulary."""
    need = cfg.model.seq_len + 1
    for name, tokens in (("train", data.train), ("validation", data.val)):
        if len(tokens) < need:
            raise ConfigError("data.val_fraction" if name == "validation" else source_key,
                              f"the {name} split of {source_key} holds {len(tokens)} tokens, fewer than one "
                              f"sequence of model.seq_len + 1 = {need}; give more data or a "
                              "shorter model.seq_len")
    top = int(data.train[: 1 << 20].max())
    if top >= cfg.model.vocab:
        raise ConfigError("model.vocab", f"token id {top} does not fit a vocabulary of "
                                         f"{cfg.model.vocab}; raise model.vocab")


class BatchSampler:
    """Sequences of `seq_len + 1` tokens at random offsets, fixed by (seed, split, step).

    With context parallelism a rank holds some positions of every sequence (`positions`,
    fivefold.parallel.context.layout): its inputs and targets are those columns of the
    unsplit sequences, so each token's label is the next token of the whole sequence, also
    at the boundaries between the ranks' chunks."""

    def __init__(self, tokens: np.ndarray | Mixture, seq_len: int, global_batch: int,
                 seed: int, split: int = 0, dp_rank: int = 0, dp_size: int = 1,
                 positions: torch.Tensor | None = None,
                 shares: tuple[int, ...] | None = None):
        self.mixture = tokens if isinstance(tokens, Mixture) else Mixture((tokens,), (1.0,))
        self.seq_len, self.global_batch = seq_len, global_batch
        self.seed, self.split = seed, split
        self.first_row, self.per_rank = replica_slice(global_batch, dp_size, shares, dp_rank)
        self.positions = None if positions is None else positions.cpu()

    def global_draw(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, offset) of every sequence of the global batch of `step`."""
        rng = np.random.default_rng([self.seed, self.split, step])
        return self.mixture.draw(rng, self.global_batch, self.seq_len)

    def global_offsets(self, step: int) -> np.ndarray:
        return self.global_draw(step)[1]

    def rank_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the global batch of `step`: inputs and targets, (G/dp, T),
        or (G/dp, T/cp) at this rank's `positions`."""
        mine = slice(self.first_row, self.first_row + self.per_rank)
        sources, offsets = (drawn[mine] for drawn in self.global_draw(step))
        streams = self.mixture.streams
        rows = np.stack([np.asarray(streams[i][o:o + self.seq_len + 1], dtype=np.int64)
                         for i, o in zip(sources, offsets)])
        rows_BT = torch.from_numpy(rows)
        inputs_BT, targets_BT = rows_BT[:, :-1], rows_BT[:, 1:]
        if self.positions is None:
            return inputs_BT, targets_BT
        return inputs_BT[:, self.positions], targets_BT[:, self.positions]
