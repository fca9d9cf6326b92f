"""The `[data]` section of a config and its `[[data.sources]]` tables: the corpus (one source
or a weighted mixture, docs/data.md) and the tokenizer. fivefold.config assembles the
sections; fivefold.validate and fivefold.data_sources check these values.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config_fields import doc_field as _doc


@dataclass
class SourceConfig:
    path: str = _doc('"stdlib" or a file or folder, as data.source', "stdlib")
    weight: float = _doc("share of the sequences drawn from this source, relative to the "
                         "other sources' weights", 1.0)
    format: str = _doc('"auto" | "text" | "jsonl" | "tokens", as data.format', "auto")
    text_field: str = _doc("JSONL field holding the text", "text")
    token_dtype: str = _doc('"uint16" | "uint32" for format "tokens"', "uint16")


@dataclass
class DataConfig:
    source: str = _doc('"stdlib" (built-in corpus) or a path to a file or folder', "stdlib")
    sources: list[SourceConfig] | None = _doc("a weighted mixture instead of data.source: "
                                              "[[data.sources]] tables (docs/data.md)", None)
    format: str = _doc('"auto" | "text" | "jsonl" | "tokens" (raw little-endian token ids)',
                       "auto")
    text_field: str = _doc("JSONL field holding the text", "text")
    token_dtype: str = _doc('"uint16" | "uint32" for format "tokens"', "uint16")
    tokenizer: str | None = _doc("tokenizer.json (HF `tokenizers`) to use instead of training one",
                                 None)
    eos_token: str | None = _doc("the token that ends each document; default: from "
                                 "tokenizer_config.json / config.json beside the tokenizer, "
                                 "else <|endoftext|>, </s>, <|end_of_text|> or <eos>", None)
    val_fraction: float = _doc("share of documents held out for validation", 0.02)
    tokenizer_sample_mib: float = _doc("MiB of training text the BPE tokenizer learns from", 5.0)
    cache_dir: str | None = _doc("tokenizer and token cache; default ~/.cache/fivefold", None)
