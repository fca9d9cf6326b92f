"""The end-of-document and beginning-of-document tokens of any HF `tokenizers` tokenizer.

fivefold joins documents into one token stream, each one laid out as

    [bos] + the document's tokens + [eos]          (bos only where the family adds it)

and prompts at generation time as `[bos] + the prompt's tokens`.

The end-of-document token (eos) is the first of:

1. `data.eos_token`, when set;
2. `eos_token` of the tokenizer_config.json next to the tokenizer.json (Hugging Face folders);
3. `eos_token_id` of the config.json next to it (the first, when it lists several);
4. the first token the tokenizer has of COMMON_EOS (GPT-2's and fivefold's `<|endoftext|>`,
   Llama 1/2's and Mistral's `</s>`, Llama 3's `<|end_of_text|>`, Gemma's `<eos>`).

The beginning-of-document token (bos) is prepended when the model family's own tokenizer
prepends it, so that fine-tuning documents and prompts start the way the model's
pre-training sequences did: `add_bos_token` of tokenizer_config.json when it says (Llama 1/2
and Mistral set it true; transformers then prepends bos to every encoding), else when the
tokenizer.json's post-processor puts a token before every encoding (Llama 3's
TemplateProcessing adds `<|begin_of_text|>`). GPT-2-style tokenizers and the built-in BPE
add nothing. Documents are encoded with `add_special_tokens=False` and bos/eos are added here,
so nothing is added twice; the built-in BPE has no post-processor, so its streams are the
same ids as before this module existed.

`write_tokenizer_folder` writes what transformers' `AutoTokenizer.from_pretrained` reads:
tokenizer.json (its post-processor made to prepend bos exactly when fivefold does),
tokenizer_config.json and special_tokens_map.json naming bos and eos.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, processors

from fivefold.config import ConfigError

COMMON_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"


@dataclass(frozen=True)
class SpecialTokens:
    eos: str
    eos_id: int
    bos: str | None = None
    bos_id: int | None = None
    add_bos: bool = False  # prepend bos to every document and prompt

    def prompt(self, ids: list[int]) -> list[int]:
        return [self.bos_id, *ids] if self.add_bos else list(ids)

    def document(self, ids: list[int]) -> list[int]:
        return [*self.prompt(ids), self.eos_id]

    def config_ids(self) -> dict:
        """config.json's token ids (what transformers' `generate` stops at)."""
        return {"bos_token_id": self.bos_id, "eos_token_id": self.eos_id}


def read_json(path: Path) -> dict:
    """A JSON object file, or {} when absent."""
    if not path.is_file():
        return {}
    try:
        out = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError("data.tokenizer", f"{path} does not parse as JSON: {err}") from None
    return out if isinstance(out, dict) else {}


def _name(value) -> str | None:
    """A token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(tok: Tokenizer, folder: Path | None,
                   eos_token: str | None = None) -> SpecialTokens:
    """bos/eos of `tok`, read as the module docstring says; `folder` holds the tokenizer.json
    and maybe tokenizer_config.json and config.json (None: the built-in BPE's cache)."""
    tok_cfg = read_json(folder / TOKENIZER_CONFIG) if folder else {}
    model_cfg = read_json(folder / "config.json") if folder else {}
    eos = _eos(tok, tok_cfg, model_cfg, eos_token, folder)
    bos, add_bos = _bos(tok, tok_cfg, model_cfg)
    return SpecialTokens(eos, tok.token_to_id(eos), bos,
                         None if bos is None else tok.token_to_id(bos), add_bos)


def _eos(tok: Tokenizer, tok_cfg: dict, model_cfg: dict, eos_token: str | None,
         folder: Path | None) -> str:
    if eos_token is not None:
        if tok.token_to_id(eos_token) is None:
            raise ConfigError("data.eos_token", f"{eos_token!r} is not a token of the tokenizer;"
                                                " name the token that ends its documents")
        return eos_token
    named = _name(tok_cfg.get("eos_token"))
    if named is not None:
        if tok.token_to_id(named) is None:
            raise ConfigError("data.eos_token", f"{folder / TOKENIZER_CONFIG} names eos_token "
                                                f"{named!r}, which the tokenizer does not have;"
                                                " set data.eos_token to the token that ends a "
                                                "document")
        return named
    ids = model_cfg.get("eos_token_id")
    ids = ids[0] if isinstance(ids, list) and ids else ids
    if isinstance(ids, int):
        name = tok.id_to_token(ids)
        if name is None:
            raise ConfigError("data.eos_token", f"{folder / 'config.json'} has eos_token_id = "
                                                f"{ids}, which the tokenizer does not have; set "
                                                "data.eos_token to the token that ends a "
                                                "document")
        return name
    for name in COMMON_EOS:
        if tok.token_to_id(name) is not None:
            return name
    raise ConfigError("data.eos_token", "the tokenizer has no end-of-document token that "
                                        f"fivefold recognises ({', '.join(COMMON_EOS)}), and "
                                        "no tokenizer_config.json (eos_token) or config.json "
                                        "(eos_token_id) beside it names one; name it, e.g. "
                                        "--set data.eos_token='</s>'")


def prepended_token(tok: Tokenizer) -> int | None:
    """The id the tokenizer's post-processor puts before every encoding, if any."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a").ids
    if len(full) > len(plain) and full[1:len(plain) + 1] == plain:
        return full[0]
    return None


def _bos(tok: Tokenizer, tok_cfg: dict, model_cfg: dict) -> tuple[str | None, bool]:
    """(bos token or None, whether to prepend it)."""
    first = prepended_token(tok)
    bos = _name(tok_cfg.get("bos_token"))
    if bos is None and isinstance(model_cfg.get("bos_token_id"), int):
        bos = tok.id_to_token(model_cfg["bos_token_id"])
    if bos is None and first is not None:
        bos = tok.id_to_token(first)
    if bos is not None and tok.token_to_id(bos) is None:
        bos = None
    add = tok_cfg.get("add_bos_token")
    if add is None:
        add = first is not None and tok.id_to_token(first) == bos
    if add and bos is None:
        raise ConfigError("data.tokenizer", "its tokenizer_config.json sets add_bos_token but "
                                            "names no bos_token the tokenizer has; set "
                                            "bos_token there or add_bos_token to false")
    return bos, bool(add)


def write_tokenizer_folder(folder: Path, tok: Tokenizer, special: SpecialTokens,
                           max_length: int, source: Path | None = None) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json in `folder`, as
    transformers reads them; `source` is the folder the tokenizer came from, whose
    tokenizer_config.json keys (its class, chat template) and other special tokens (pad,
    unk) are kept."""
    folder.mkdir(parents=True, exist_ok=True)
    out = Tokenizer.from_str(tok.to_str())
    first = prepended_token(out)
    if special.add_bos and first != special.bos_id:
        out.post_processor = processors.TemplateProcessing(
            single=f"{special.bos}:0 $A:0", pair=f"{special.bos}:0 $A:0 {special.bos}:1 $B:1",
            special_tokens=[(special.bos, special.bos_id)])
    elif not special.add_bos and first is not None:
        out.post_processor = None
    out.save(str(folder / "tokenizer.json"))
    names = {"bos_token": special.bos, "eos_token": special.eos}
    config = read_json(source / TOKENIZER_CONFIG) if source else {}
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config.update(names, add_bos_token=special.add_bos, add_eos_token=False,
                  model_max_length=max_length)
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    tokens_map = read_json(source / SPECIAL_TOKENS_MAP) if source else {}
    tokens_map.update({k: v for k, v in names.items() if v is not None})
    (folder / SPECIAL_TOKENS_MAP).write_text(json.dumps(tokens_map, indent=2) + "\n")
