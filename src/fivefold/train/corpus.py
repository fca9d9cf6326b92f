"""Documents to train on: the built-in corpus and the user's text and JSONL files.

The built-in corpus is the Python standard library of the running interpreter (its `.py`
files, found through `sysconfig`, site-packages excluded), so `fivefold train` needs no
download. Files that are not valid UTF-8 are skipped. Every document has a stable name, and
the validation split holds out the documents whose name hashes below `val_fraction`, so the
split does not depend on file order or on how many documents there are.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from fivefold.config import ConfigError, DataConfig

TEXT_CHUNK_CHARS = 1 << 16  # a single large text file is cut into documents of about this size


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def stdlib_documents() -> list[Document]:
    """The `.py` sources of this interpreter's standard library, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if "site-packages" in rel.parts:
            continue
        try:
            docs.append(Document(str(rel), path.read_bytes().decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return docs


def _chunks(name: str, text: str) -> list[Document]:
    """Cut a long text at line boundaries into documents of about TEXT_CHUNK_CHARS."""
    docs, start = [], 0
    while start < len(text):
        end = text.find("\n", start + TEXT_CHUNK_CHARS)
        end = len(text) if end < 0 else end + 1
        docs.append(Document(f"{name}#{len(docs)}", text[start:end]))
        start = end
    return docs


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError("data.source", f"{path} is not UTF-8 text ({err.reason} at byte "
                                         f"{err.start}); convert it or use format 'tokens'") from None


def text_documents(path: Path) -> list[Document]:
    """A text file (cut into chunks) or every file in a folder, one document each."""
    if path.is_file():
        return _chunks(path.name, _read_text(path))
    files = sorted(p for p in path.rglob("*") if p.is_file())
    return [Document(str(p.relative_to(path)), _read_text(p)) for p in files]


def jsonl_documents(path: Path, field: str) -> list[Document]:
    """One document per line of a JSONL file (or of every .jsonl file in a folder)."""
    files = [path] if path.is_file() else sorted(path.rglob("*.jsonl"))
    docs = []
    for file in files:
        label = file.name if file == path else str(file.relative_to(path))
        for lineno, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError("data.source", f"{file}:{lineno} is not JSON ({err.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ConfigError("data.text_field", f"{file}:{lineno} has no string field "
                                                     f"{field!r}; set data.text_field")
            docs.append(Document(f"{label}:{lineno}", record[field]))
    return docs


def detect_format(cfg: DataConfig) -> str:
    """`cfg.format`, or for "auto" the format implied by the source."""
    if cfg.format != "auto":
        return cfg.format
    if cfg.source == "stdlib":
        return "stdlib"
    path = Path(cfg.source)
    if path.suffix in (".bin", ".tokens"):
        return "tokens"
    if path.suffix == ".jsonl" or (path.is_dir() and any(path.rglob("*.jsonl"))):
        return "jsonl"
    return "text"


def load_documents(cfg: DataConfig) -> list[Document]:
    """Every document of a text-like source."""
    fmt = detect_format(cfg)
    if fmt == "stdlib":
        docs = stdlib_documents()
    elif fmt == "jsonl":
        docs = jsonl_documents(Path(cfg.source), cfg.text_field)
    else:
        docs = text_documents(Path(cfg.source))
    if not docs:
        raise ConfigError("data.source", f"no documents found in {cfg.source!r}")
    return docs


def is_validation(doc: Document, val_fraction: float) -> bool:
    """Whether a document belongs to the held-out split (a hash of its name)."""
    digest = hashlib.sha256(doc.name.encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < val_fraction


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document],
                                                                         list[Document]]:
    """(train, validation) documents; at least one of each when there are two or more."""
    train = [d for d in docs if not is_validation(d, val_fraction)]
    val = [d for d in docs if is_validation(d, val_fraction)]
    if not val and len(train) > 1:
        val.append(train.pop())
    if not train and len(val) > 1:
        train.append(val.pop(0))
    return train, val
