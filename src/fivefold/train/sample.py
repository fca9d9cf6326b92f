"""A short text sample from the trained model: top-k sampling, seeded, no KV cache.

This is a smoke check a person reads at the end of a run, not an inference engine: each new
token reruns the model over the last `seq_len` tokens.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from fivefold.models.llama import Transformer


@torch.no_grad()
def sample_text(model: Transformer, tok: Tokenizer, prompt: str, new_tokens: int, seed: int,
                device: torch.device, temperature: float = 0.8, top_k: int = 40) -> str:
    model.eval()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = tok.encode(prompt).ids
    for _ in range(new_tokens):
        window = torch.tensor([ids[-model.cfg.seq_len:]], device=device)
        logits_V = model(window)[0, -1].float().cpu() / temperature
        top = torch.topk(logits_V, top_k)
        probs = torch.softmax(top.values, dim=-1)
        ids.append(int(top.indices[torch.multinomial(probs, 1, generator=gen)]))
    return tok.decode(ids)
