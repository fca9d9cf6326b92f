"""`fivefold generate`: text from a model, greedy or sampled.

    fivefold generate SOURCE --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K]
                      [--seed S] [--device auto|cpu|cuda]

SOURCE is anything `fivefold convert` reads (fivefold.train.model_source): a run directory
(its latest checkpoint), one checkpoint step folder, a fivefold weights folder or a Hugging
Face folder. Its tokenizer is the one beside the weights, or the run's RUN_DIR/tokenizer.
The prompt is encoded as a training document starts (bos first where the model family adds
it, fivefold.train.special_tokens), and generation ends after the end-of-document token or
N new tokens. Temperature 0, the default, is greedy (what transformers' `generate` does with
`do_sample=False`); above 0 the next token is drawn from the top-k softmax of logits /
temperature, seeded by --seed. The model runs in fp32 (fivefold.train.sample).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fivefold.config import ConfigError


def add_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text from a run, checkpoint, weights "
                                          "folder or Hugging Face folder")
    gen.add_argument("source", help="run directory (latest checkpoint), checkpoint step "
                                    "folder, fivefold weights folder or Hugging Face folder")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                     help="most tokens to add (default 64); ends early at end-of-document")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T",
                     help="0 (default): greedy; above 0: sample from softmax(logits / T)")
    gen.add_argument("--top-k", type=int, metavar="K",
                     help="sample among the K most likely tokens (default: all)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    gen.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                     help="auto (default): the GPU when there is one")


def generate(source: Path, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, device: str = "auto"
             ) -> tuple[list[int], list[int], object]:
    """(prompt ids, prompt + generated ids, tokenizer) of the model at `source`."""
    import torch

    from fivefold.models.llama import Transformer
    from fivefold.train.dist import pick_device
    from fivefold.train.model_source import load_pretrained, load_tokenizer
    from fivefold.train.sample import generate_ids

    if max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", f"must be 1 or more, got {max_new_tokens}")
    if not 0 <= temperature < float("inf"):
        raise ConfigError("--temperature", f"must be 0 (greedy) or more, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ConfigError("--top-k", f"must be 1 or more, got {top_k}")
    tokens = load_tokenizer(source)
    if tokens is None:
        raise ConfigError("source", f"{source} has no tokenizer.json beside its weights (nor a "
                                    "run's RUN_DIR/tokenizer); put the model's tokenizer.json "
                                    "there")
    tok, special, _ = tokens
    prompt_ids = special.prompt(tok.encode(prompt, add_special_tokens=False).ids)
    if not prompt_ids:
        raise ConfigError("--prompt", "encodes to no tokens; give some text")
    try:
        dev = pick_device(device, 0)
    except RuntimeError as err:
        raise ConfigError("--device", str(err)) from None
    pre = load_pretrained(source)
    model = Transformer(pre.cfg)
    model.load_state_dict(pre.state, strict=True)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = generate_ids(model.float().to(dev), prompt_ids, max_new_tokens, dev, temperature,
                       top_k, gen, special.eos_id)
    return prompt_ids, ids, tok


def run(args: argparse.Namespace) -> int:
    _, ids, tok = generate(Path(args.source), args.prompt, args.max_new_tokens,
                           args.temperature, args.top_k, args.seed, args.device)
    print(tok.decode(ids))
    return 0
