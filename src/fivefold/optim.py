"""Optimizer construction (the learning-rate schedule is fivefold.lr_schedule).

AdamW (Loshchilov & Hutter, arXiv 1711.05101) with decoupled weight decay on matrices only
(norm gains and other vectors are not decayed), fused on GPU.

Muon (`train.optimizer = "muon"`; Jordan et al. 2024, at scale Liu et al., arXiv 2502.16982)
replaces each weight matrix's update by the orthogonalized momentum (Newton-Schulz), with
torch.optim.Muon. It applies to the blocks' matrices; the embedding, the head and the norm
gains keep AdamW (rows of a lookup table and vectors have no matrix structure to
orthogonalize); a mixture-of-experts layer's stacked experts (E, A, B) are E matrices, each
orthogonalized on its own (fivefold.muon.StackedMuon). Muon's step is scaled to AdamW's
update RMS (0.2 sqrt(max(A, B)), Liu et al. Sec. 2.2), so both take `train.lr` and
`train.weight_decay`. Why fivefold has it: under one step of gradient staleness
(PipeDream-2BW) AdamW loses ~12% on the default run and Muon under 1% (docs/pipeline.md;
Zmushko et al., arXiv 2606.30634, find the same).

GaLore (`train.optimizer = "galore"`, fivefold.memory.galore) takes the same split: low-rank
Adam on the blocks' matrices, AdamW on the rest.

Why at the top level: the trainer builds these optimizers over a module's parameters and the
data-parallel engine (fivefold.parallel.data_parallel) builds the same ones over views of its
flat master weights, so both layers import this module. It sits beside config.py, below
parallel/ and train/, and imports only config and memory/.
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.config import TrainConfig
from fivefold.memory.galore import GaLoreAdamW
from fivefold.muon import StackedMuon


def param_groups(params: list[torch.Tensor], weight_decay: float) -> list[dict]:
    """Matrices decay, vectors (norm gains, biases) do not; empty groups are left out
    (DCP's state dicts refuse them)."""
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class OptimizerPair:
    """Muon or GaLore on the blocks' matrices and AdamW on the other parameters, stepped
    together.

    Iterating it gives the torch optimizers (one where a pipeline stage holds only one
    kind), which is the form DCP's get_state_dict and set_state_dict take several optimizers
    in; `param_groups` lists all their groups (the trainer sets every group's learning
    rate)."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    def __iter__(self):
        return iter(self.optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def is_block_matrix(name: str, param: torch.Tensor) -> bool:
    """A weight matrix inside a transformer block (models and pipeline stages alike)."""
    return name.startswith("layers.") and param.dim() == 2


def is_muon_matrix(name: str, param: torch.Tensor) -> bool:
    """What Muon updates: a block's weight matrix, or a block's stacked expert matrices
    (E, A, B), E matrices of A x B."""
    return name.startswith("layers.") and param.dim() in (2, 3)


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device):
    """torch's AdamW or SGD, or an `OptimizerPair` (Muon or GaLore, and AdamW), over the
    model's trainable parameters."""
    return optimizer_for([(n, q) for n, q in model.named_parameters() if q.requires_grad],
                         cfg, device)


def optimizer_for(named: list[tuple[str, torch.Tensor]], cfg: TrainConfig,
                  device: torch.device):
    """The optimizer `cfg.optimizer` names over (name, tensor) pairs: a module's parameters,
    or views of the data-parallel engine's flat master weights."""
    adamw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                 fused=device.type == "cuda")
    if cfg.optimizer in ("muon", "galore"):
        chosen = is_muon_matrix if cfg.optimizer == "muon" else is_block_matrix
        matrices = [q for n, q in named if chosen(n, q)]
        rest = param_groups([q for n, q in named if not chosen(n, q)], cfg.weight_decay)
        optimizers = []
        if matrices and cfg.optimizer == "muon":
            muon = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum)
            if flat := [q for q in matrices if q.dim() == 2]:
                optimizers.append(torch.optim.Muon(flat, adjust_lr_fn="match_rms_adamw", **muon))
            if stacked := [q for q in matrices if q.dim() == 3]:
                optimizers.append(StackedMuon(stacked, **muon))
        elif matrices:
            optimizers.append(GaLoreAdamW(matrices, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                          eps=cfg.eps, weight_decay=cfg.weight_decay,
                                          update_gap=cfg.galore_update_gap,
                                          scale=cfg.galore_scale, svd=cfg.galore_svd))
        if rest:
            optimizers.append(torch.optim.AdamW(rest, **adamw))
        return OptimizerPair(*optimizers)
    groups = param_groups([q for _, q in named], cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.beta1)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, **adamw)
    raise ValueError(f"train.optimizer = {cfg.optimizer!r} has no optimizer object (LOMO "
                     "updates inside backward: fivefold.memory.lomo)")


def optimizer_state_bytes(optimizers) -> int:
    """Bytes of every tensor in the optimizers' state but the step counters."""
    return sum(t.nbytes for opt in optimizers for state in opt.state.values()
               for key, t in state.items() if key != "step" and isinstance(t, torch.Tensor))
