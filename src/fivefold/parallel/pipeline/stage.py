"""One pp rank's share of the plain Transformer: its virtual stages' blocks, plus the
embedding (first stage) and the final norm and output head (last stage).

The stage is built from the plain model's own modules (fivefold.models.llama: Block,
RMSNorm), and every parameter keeps the plain model's name (`tok_embeddings.weight`,
`layers.5.attention.wq.weight`, `norm.weight`, `output.weight`), so deterministic
initialization (fivefold.models.init) gives each stage exactly the slice of the
single-process model, and checkpoints and parity tests compare by name. `layers` is keyed by
the global block index and iterates over its blocks like the plain model's ModuleList, so
code written for `model.layers` (data-parallel units) works on a stage.

Tied embeddings: the first stage owns `tok_embeddings.weight`. A last stage on another rank
computes the head with `tied_head_weight`, a non-persistent buffer that receives the owner's
current matrix at the start of each step and whose gradient is returned to the owner (the
schedule's tied-embedding actions). It is not a parameter, so no optimizer, no data-parallel
unit and no checkpoint sees it twice.

Tensor parallelism inside a stage (fivefold.parallel.pipeline.tensor_stage) swaps two
attributes: `token_loss_sum`, the last stage's loss (the vocabulary-parallel cross-entropy
over a sharded head), and `sequence_shards`, the number of sequence shards of the hidden
states a stage receives and sends (tp with sequence parallelism, else 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import ModelConfig
from fivefold.models.init import init_model_, init_tensor
from fivefold.models.llama import Block, RMSNorm, rotary_rows, rotary_tables


def cross_entropy_sum(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32 over full-vocabulary logits."""
    return F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten(),
                           reduction="sum")


class StageLayers(nn.ModuleDict):
    """Blocks keyed by their index in the whole model; iterating yields the blocks."""

    def __iter__(self):
        return iter(self.values())


class PipelineStage(nn.Module):
    """The virtual stages `stage_ids` (this rank's chunks) of a `stages`-stage pipeline.
    `borrow_head`: with tied embeddings the last stage borrows the matrix even on the rank
    that owns it (a V schedule's first rank, fivefold.parallel.pipeline.schedules_v), so the
    head's and the embedding's gradients stay in their own stages' passes."""

    def __init__(self, cfg: ModelConfig, stage_ids: list[int], layer_ranges: list[range],
                 borrow_head: bool = False):
        super().__init__()
        self.cfg, self.stage_ids = cfg, list(stage_ids)
        self.stages = len(layer_ranges)
        self.layer_ranges = {s: layer_ranges[s] for s in self.stage_ids}
        self.has_first, self.has_last = 0 in self.stage_ids, self.stages - 1 in self.stage_ids
        if self.has_first:
            self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = StageLayers({str(i): Block(cfg, i) for s in self.stage_ids
                                   for i in self.layer_ranges[s]})
        if self.has_last:
            self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
            self.output = None if cfg.tied_embeddings else nn.Linear(cfg.hidden, cfg.vocab,
                                                                     bias=False)
            if cfg.tied_embeddings and (borrow_head or not self.has_first):
                self.register_buffer("tied_head_weight", torch.zeros(cfg.vocab, cfg.hidden),
                                     persistent=False)
        cos, sin = rotary_tables(cfg.seq_len, cfg.d_head, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.token_positions: torch.Tensor | None = None  # cp: this rank's tokens (llama.py)
        self.capture: list | None = None  # (output, params, module) while capturing (ZB)
        self.token_loss_sum = cross_entropy_sum
        self.sequence_shards = 1

    @property
    def borrows_embedding(self) -> bool:
        """True on a last stage that computes the head with the first stage's matrix."""
        return hasattr(self, "tied_head_weight")

    @torch.no_grad()
    def load_plain_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take this stage's parameters, by their plain names, from a whole model's state
        (pretrained weights); the borrowed tied head takes the embedding."""
        for name, param in self.named_parameters():
            param.copy_(state[name])
        if self.borrows_embedding:
            self.tied_head_weight.copy_(state["tok_embeddings.weight"])

    def output_weight(self) -> torch.Tensor:
        if self.output is not None:
            return self.output.weight
        return self.tied_head_weight if self.borrows_embedding else self.tok_embeddings.weight

    def forward(self, stage: int, x: torch.Tensor, targets_BT: torch.Tensor | None = None,
                start: int = 0, block_fn=None) -> torch.Tensor:
        """Run virtual stage `stage` on tokens (B, T) (first stage) or hidden states (B, T, D)
        at positions [start, start + T). Returns hidden states (B, T, D); the last stage returns
        the summed token cross-entropy (fp32) against `targets_BT`, or the logits without them.
        `block_fn(i, block, x, cos, sin)` replaces block i's plain call (TeraPipe's KV cache).
        Hidden states received from another stage may be sequence shards (B, T/n, D)."""
        T = x.shape[1] if stage == 0 else x.shape[1] * self.sequence_shards
        cos, sin = rotary_rows(self.rope_cos, self.rope_sin, T, start, self.token_positions)
        if stage == 0:
            x = self.tok_embeddings(x)
        for i in self.layer_ranges[stage]:
            block = self.layers[str(i)]
            x = block(x, cos, sin) if block_fn is None else block_fn(i, block, x, cos, sin)
        if stage != self.stages - 1:
            return x
        weight = self.output_weight()
        logits_BTV = F.linear(self.norm(x), weight)
        if self.capture is not None and isinstance(weight, nn.Parameter):
            self.capture.append((logits_BTV, [weight], None))  # no module: not recomputed
        if targets_BT is None:
            return logits_BTV
        return self.token_loss_sum(logits_BTV, targets_BT)


@torch.no_grad()
def build_stage(cfg: ModelConfig, seed: int, stage_ids: list[int], layer_ranges: list[range],
                device: str | torch.device = "cpu", borrow_head: bool = False) -> PipelineStage:
    """A deterministically initialized fp32 stage: each parameter equals the plain model's."""
    stage = init_model_(PipelineStage(cfg, stage_ids, layer_ranges, borrow_head), seed,
                        cfg.layers)
    if stage.borrows_embedding:
        stage.tied_head_weight.copy_(init_tensor("tok_embeddings.weight",
                                                 (cfg.vocab, cfg.hidden), seed, cfg.layers))
    return stage.to(device)
