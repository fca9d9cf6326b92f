"""Text from a model: greedy or top-k sampling, seeded, no KV cache.

`generate_ids` is what `fivefold generate` runs and `sample_text` the short sample a person
reads at the end of a run. Neither is an inference engine: each new token reruns the model
over the last `seq_len` tokens. Greedy decoding (temperature 0) takes the first largest
logit, as `torch.argmax` and transformers' greedy search do.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from fivefold.models.llama import Transformer


@torch.no_grad()
def generate_ids(model: Transformer, ids: list[int], new_tokens: int, device: torch.device,
                 temperature: float = 0.0, top_k: int | None = None,
                 generator: torch.Generator | None = None,
                 stop_id: int | None = None) -> list[int]:
    """`ids` followed by up to `new_tokens` more: the most likely one each time when
    `temperature` is 0, else one drawn from the softmax of logits / temperature over the
    `top_k` largest (all when None), with `generator`; ends after `stop_id`."""
    model.eval()
    ids = list(ids)
    for _ in range(new_tokens):
        window = torch.tensor([ids[-model.cfg.seq_len:]], device=device)
        logits_V = model(window)[0, -1].float().cpu()
        if temperature == 0:
            ids.append(int(torch.argmax(logits_V)))
        else:
            top = torch.topk(logits_V / temperature, min(top_k or len(logits_V), len(logits_V)))
            probs = torch.softmax(top.values, dim=-1)
            ids.append(int(top.indices[torch.multinomial(probs, 1, generator=generator)]))
        if ids[-1] == stop_id:
            break
    return ids


def sample_text(model: Transformer, tok: Tokenizer, prompt: str, new_tokens: int, seed: int,
                device: torch.device, temperature: float = 0.8, top_k: int = 40) -> str:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = generate_ids(model, tok.encode(prompt).ids, new_tokens, device, temperature, top_k,
                       gen)
    return tok.decode(ids)
