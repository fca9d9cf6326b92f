"""TeraPipe: token-level pipelining of a causal model (Li et al., arXiv 2102.07988).

A causal transformer's position t depends only on positions < t, so a sequence can be cut
into slices that flow through the pipeline one after another (Sec. 3.1): while stage 2 works
on slice 0, stage 1 already runs slice 1, whose attention reads the keys and values that
slice 0 left in stage 1's cache. The schedule (fivefold.parallel.pipeline.schedules,
`terapipe_order`) runs every (micro-batch, slice) forward in order and the backwards in
reverse, so a slice's backward runs after every later slice has added the gradient it sends
back to this slice's keys and values.

The attention with a key/value prefix lives here, not in the model: `block_with_prefix`
computes exactly what fivefold.models.llama.Block computes (the same modules, rotary tables,
grouped-query sharing and SDPA), with the slice's queries also attending to the cached keys
and values of the earlier slices (a bottom-right-aligned causal mask), and returns the slice's
own keys and values for the cache. tests/test_pipeline_parity.py checks it reproduces the
plain block. The cache detaches the prefix at the slice boundary: the earlier slices' keys and
values enter a later slice as leaves, their gradients are collected after that slice's
backward and added to the earlier slice's own backward as extra roots, so autograd never walks
a slice's graph twice. Slices are near-equal in length (`slice_bounds` of
fivefold.parallel.pipeline.partition); the paper's dynamic programming over slice lengths,
which favours shorter late slices, is not done.

Tensor names: B batch, T tokens of the slice, P tokens before it, D width, H heads,
K kv heads, E head width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fivefold.models.llama import Attention, Block, apply_rotary


def attention_with_prefix(attn: Attention, x_BTD: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, prefix: tuple[torch.Tensor, torch.Tensor] | None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, this slice's rotated keys, its values) of causal attention over prefix + slice."""
    B, T, _ = x_BTD.shape
    q_BHTE = attn.wq(x_BTD).view(B, T, -1, attn.head_dim).transpose(1, 2)
    k_BKTE = attn.wk(x_BTD).view(B, T, -1, attn.head_dim).transpose(1, 2)
    v_BKTE = attn.wv(x_BTD).view(B, T, -1, attn.head_dim).transpose(1, 2)
    q_BHTE, k_BKTE = apply_rotary(q_BHTE, cos, sin), apply_rotary(k_BKTE, cos, sin)
    keys, values = k_BKTE, v_BKTE
    if prefix is not None:
        keys, values = torch.cat((prefix[0], k_BKTE), dim=2), torch.cat((prefix[1], v_BKTE), dim=2)
    groups = q_BHTE.shape[1] // keys.shape[1]
    gqa_in_kernel = groups > 1 and x_BTD.is_cuda
    if groups > 1 and not gqa_in_kernel:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    if prefix is None:
        out_BHTE = F.scaled_dot_product_attention(q_BHTE, keys, values, is_causal=True,
                                                  enable_gqa=gqa_in_kernel)
    else:  # query i (position P + i) sees keys 0 .. P + i
        P = prefix[0].shape[2]
        mask_TS = torch.ones(T, P + T, dtype=torch.bool, device=x_BTD.device).tril(diagonal=P)
        out_BHTE = F.scaled_dot_product_attention(q_BHTE, keys, values, attn_mask=mask_TS,
                                                  enable_gqa=gqa_in_kernel)
    return attn.wo(out_BHTE.transpose(1, 2).reshape(B, T, -1)), k_BKTE, v_BKTE


def block_with_prefix(block: Block, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      prefix: tuple[torch.Tensor, torch.Tensor] | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block.forward for one slice after `prefix`; also returns the slice's keys and values."""
    attended, k_BKTE, v_BKTE = attention_with_prefix(block.attention, block.attention_norm(x_BTD),
                                                     cos, sin, prefix)
    x_BTD = x_BTD + attended
    return x_BTD + block.mlp(block.mlp_norm(x_BTD)), k_BKTE, v_BKTE


class TokenSliceCache:
    """Keys and values of the slices seen so far, per (micro-batch, block), for one step."""

    def __init__(self):
        self.kv: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.prefixes: dict[tuple, list[tuple[int, torch.Tensor, torch.Tensor, list[int]]]] = {}
        self.kv_grads: dict[tuple[int, int, int], list[torch.Tensor]] = {}

    def block_fn(self, unit: tuple[int, int, int]):
        """The block call for (stage, micro-batch, slice): attend to the cache, then extend it."""
        _, mb, _ = unit

        def run(i: int, block: Block, x_BTD, cos, sin):
            cached = self.kv.setdefault((mb, i), [])
            prefix = None
            if cached:
                grad = torch.is_grad_enabled()
                k = torch.cat([k for k, _ in cached], dim=2).detach().requires_grad_(grad)
                v = torch.cat([v for _, v in cached], dim=2).detach().requires_grad_(grad)
                lengths = [k.shape[2] for k, _ in cached]
                self.prefixes.setdefault(unit, []).append((i, k, v, lengths))
                prefix = (k, v)
            x_BTD, k_BKTE, v_BKTE = block_with_prefix(block, x_BTD, cos, sin, prefix)
            cached.append((k_BKTE, v_BKTE))
            return x_BTD

        return run

    def backward_extras(self, unit: tuple[int, int, int]) -> tuple[list, list]:
        """Extra backward roots of a slice: its keys and values, with the gradients that the
        later slices sent back to them."""
        _, mb, slc = unit
        outs, grads = [], []
        for (m, i), cached in self.kv.items():
            g = self.kv_grads.pop((mb, i, slc), None) if m == mb else None
            if g is not None:
                outs += list(cached[slc])
                grads += g
        return outs, grads

    def after_backward(self, unit: tuple[int, int, int]) -> None:
        """Hand the gradients of this slice's prefix leaves to the slices they came from."""
        _, mb, _ = unit
        for i, k, v, lengths in self.prefixes.pop(unit, []):
            for j, (gk, gv) in enumerate(zip(k.grad.split(lengths, dim=2),
                                             v.grad.split(lengths, dim=2))):
                acc = self.kv_grads.get((mb, i, j))
                self.kv_grads[(mb, i, j)] = [gk, gv] if acc is None else [acc[0] + gk,
                                                                         acc[1] + gv]
