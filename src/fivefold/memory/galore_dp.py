"""GaLore with data parallelism: averaged gradients, projected Adam states sharded (ZeRO-1/2).

GaLore pretrains beyond one device with data parallelism (arXiv 2403.03507, Sec. 5), and
GaLore 2 (arXiv 2504.20437, Sec. 3) makes it compose with sharded data parallelism (FSDP).
This is fivefold's data-parallel GaLore (`ParallelPlan.update == "galore-dp"`): every rank
holds the whole fp32 model, so every block matrix is whole where its subspace is taken,
and the ZeRO stage says what of the rest is divided over the n dp ranks:

  stage 0   gradients all-reduced; every rank holds every state and does every update
  stage 1   gradients reduce-scattered; each rank holds 1/n of the projected moments (and of
            the full-rank parameters' AdamW moments), computes 1/n of the low-rank step,
            and the steps (and the full-rank parameters' new values) are all-gathered
  stage 2   the same, and each micro-batch's gradient is reduce-scattered at once, so only a
            1/n shard of the gradient outlives a micro-batch's backward

Rows of a matrix shard everything. An m x n block matrix W is seen as T (b x a), a = min(m, n)
the side GaLore projects (T = W^T when m <= n: the left singular vectors P, m x r; T = W when
m > n: the right ones, n x r; r = a / 4, fivefold.memory.galore). The projected gradient is
then T_G P (b x r), row for row, Adam's moments are b x r, and so is its normalized step N:
the rank holding rows [k c, (k + 1) c) of T's gradient (b padded to n c) needs nothing else
but P to compute rows [k c, (k + 1) c) of N. Each rank's segment of a flat bucket
(fivefold.memory.row_bucket) holds its rows of every matrix, then its 1/n of the full-rank
parameters (the embedding, norms and head, AdamW's, flat and padded). A step sends one
reduce-scatter of the gradient bucket (4 bytes per padded parameter) and one all-gather of a
bucket of the same layout with r columns per matrix: every rank's rows of N, and the new
values of the full-rank parameters. Each rank then applies the whole update N P^T (b x a)
itself, so the all-gather moves r / a of a matrix's bytes (a quarter), at the price of every
rank computing every back-projection.

The subspace refresh (every `train.galore_update_gap` steps) takes the SVD of the whole
averaged gradient: that step all-reduces the bucket instead (twice the bytes of the
reduce-scatter) and, at stage 2, accumulates its micro-batches' gradients whole first. The
SVDs, the refresh's cost that GaLore 2 sets out to cut, are divided over the dp ranks: rank
i mod n takes matrix i's (with fivefold.memory.galore's `refresh_seed` under the randomized
refresh, so a run is deterministic and matches one process) and broadcasts its projection,
4 A r bytes per matrix on refresh steps only, so every rank holds the same P.

`train.galore_reduce = "projected"` reduces, on steps without refresh, each rank's projected
gradient T_G P instead (the projection is linear, so the sum of the ranks' projections is
the projection of their sum): the reduce-scatter then carries r / a of each matrix's bytes
too. The full gradient's global norm is then never formed, so clipping is refused with it
(validate.py) and the logged norm is that of the projected gradient and the full-rank
parameters' gradient; a refresh step reduces the whole gradient, takes the subspaces in
`after_backward` and projects this rank's rows itself.

Clipping sees this rank's segment (its rows and its shard of the rest), the squared norm
summed over the dp ranks (ParallelPlan.grad_norm_axes); on a refresh step it scales the whole
averaged bucket and counts only this rank's segment. The arithmetic is GaLoreAdamW's and
AdamW's (decoupled weight decay on matrices), so a run matches the one-process GaLore run up
to the order of the gradient sums (tests/test_galore_dp.py).

Not overlapped with backward: the bucket is reduced after the (micro-batch's) backward.
Autograd accumulates each parameter's local gradient in its own .grad, which is packed into
the bucket and dropped (the bucket interleaves every matrix's rows by rank, so .grad cannot
be a view of it, as the engine's are of its flat units): a full local gradient exists from
a micro-batch's backward until its packing, beside the bucket, and is not in the count below.
Every collective goes through fivefold.comm.collectives; the model-state bytes land in the
ledger: params (the whole fp32 model), grads (the bucket at stages 0-1, the shard at stage 2),
master (the fp32 shard of the full-rank parameters AdamW steps, at stages 1-2; at stage 0
the parameters are views of it) and optimizer (projections, projected moments, AdamW's
moments).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fivefold.comm import collectives as C
from fivefold.comm.ledger import Ledger
from fivefold.config import TrainConfig
from fivefold.memory.galore import adam_direction, galore_rank, refresh_seed, subspace
from fivefold.memory.row_bucket import RowBucket
from fivefold.optim import is_block_matrix
from fivefold.parallel.grad_reduce import all_reduce_grad, reduce_scatter_grad


@dataclass
class _Matrix:
    """One block matrix: W (m x n) seen as T (b x a), a the projected side, rank r."""

    name: str
    param: nn.Parameter
    left: bool  # m <= n: T = W^T
    r: int

    def t_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (m x n, W's shape) seen as T (b x a)."""
        return tensor.T if self.left else tensor

    def untransposed(self, t: torch.Tensor) -> torch.Tensor:
        """T-shaped `t` (b x a) seen in W's shape."""
        return t.T if self.left else t


class GaLoreDataParallel:
    """Owns gradients and optimizer state of a data-parallel GaLore run.

    Per optimizer step: `after_backward(last)` after each micro-batch's backward, clipping of
    `norm_grads()` (fivefold.parallel.grad_clip), then `step(lr)` and `zero_grad()`."""

    def __init__(self, model: nn.Module, train: TrainConfig, stage: int, axis: C.Axis,
                 ledger: Ledger):
        self.model, self.cfg, self.stage, self.ledger = model, train, stage, ledger
        self.axis = axis  # the data-parallel ranks: all-reduce at stage 0, shards at 1-2
        self.n = axis.size if stage >= 1 else 1
        self.k = axis.rank if stage >= 1 else 0
        named = [(name, q) for name, q in model.named_parameters() if q.requires_grad]
        self.matrices = [_Matrix(name, q, q.shape[0] <= q.shape[1], galore_rank(q.shape))
                         for name, q in named if is_block_matrix(name, q)]
        self.rest = [q for name, q in named if not is_block_matrix(name, q)]
        rest_numel = sum(q.numel() for q in self.rest)
        ta = [(max(w.param.shape), min(w.param.shape)) for w in self.matrices]  # (b, a)
        self.grads = RowBucket(self.n, ta, rest_numel)  # gradients: T's rows
        self.steps = RowBucket(self.n, [(b, w.r) for (b, _), w in zip(ta, self.matrices)],
                               rest_numel)  # the all-gather: rows of N, new full-rank values
        # what the ranks reduce on steps without refresh: the gradient, or its projection
        # (train.galore_reduce = "projected": rows of T_G P, the steps' layout)
        self.projected = train.galore_reduce == "projected"
        self.reduced = self.steps if self.projected else self.grads
        device = named[0][1].device
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.float32, device=device)
        # persistent gradient storage: the whole bucket (stages 0-1), or this rank's shard
        self.bucket = zeros(self.n * self.reduced.seg) if stage <= 1 else None
        self.shard = (self.bucket.view(self.n, -1)[self.k] if stage <= 1
                      else zeros(self.reduced.seg))
        self.full: torch.Tensor | None = None  # a refresh step's whole averaged bucket
        self.step_count = torch.zeros(())  # GaLore's step, the same for every matrix
        self.proj = [zeros(a, w.r) for (_, a), w in zip(ta, self.matrices)]
        self.exp_avg = [zeros(c, w.r) for c, w in zip(self.grads.chunks, self.matrices)]
        self.exp_avg_sq = [zeros(c, w.r) for c, w in zip(self.grads.chunks, self.matrices)]
        # the full-rank parameters: this rank's fp32 shard, stepped by torch's AdamW
        padded = zeros(self.n * self.grads.rest_chunk)
        if self.rest:
            torch.cat([q.detach().reshape(-1).float() for q in self.rest],
                      out=padded[:rest_numel])
        self.rest_master = nn.Parameter(padded.view(self.n, -1)[self.k].clone())
        if self.n == 1:  # the shard is all of it: the parameters become views of it
            start = 0
            for q in self.rest:
                q.data = self.rest_master.data[start:start + q.numel()].view_as(q)
                start += q.numel()
        self.rest_decay = self._rest_decay_mask(device, rest_numel)
        self.adamw = torch.optim.AdamW([self.rest_master], lr=train.lr, weight_decay=0.0,
                                       betas=(train.beta1, train.beta2), eps=train.eps)
        state = self.adamw.state[self.rest_master]  # created now, so a checkpoint load fills it
        state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(self.rest_master),
                     exp_avg_sq=torch.zeros_like(self.rest_master))
        self.record_model_state()

    def _rest_decay_mask(self, device: torch.device, rest_numel: int) -> torch.Tensor:
        """This rank's shard of the full-rank parameters: True where weight decay applies
        (matrices: the embedding and head; not the norm gains), as fivefold.optim's groups."""
        flags = torch.zeros(self.n * self.grads.rest_chunk, dtype=torch.bool, device=device)
        start = 0
        for q in self.rest:
            flags[start:start + q.numel()] = q.dim() >= 2
            start += q.numel()
        return flags.view(self.n, -1)[self.k].clone()

    # ------------------------------------------------------------------ gradients

    @property
    def refreshing(self) -> bool:
        """Whether this step takes new subspaces (from the whole averaged gradient)."""
        return int(self.step_count) % self.cfg.galore_update_gap == 0

    def _pack(self, out: torch.Tensor, layout: RowBucket) -> torch.Tensor:
        """Lay every parameter's gradient (each matrix's projected onto its subspace, in the
        steps' layout) into bucket `out`, then drop the .grad."""
        matrices = [w.t_view(w.param.grad) for w in self.matrices]
        if layout is self.steps:
            matrices = [t @ proj for t, proj in zip(matrices, self.proj)]
        layout.pack(out, matrices, [q.grad for q in self.rest])
        for q in self.model.parameters():
            q.grad = None
        return out

    def _refresh(self, full: torch.Tensor) -> None:
        """New subspaces from the whole averaged gradient bucket `full`: dp rank i mod n takes
        matrix i's SVD (the randomized refresh seeded per matrix and step), all of its own
        first, then each projection is broadcast from its rank, in order."""
        k, ranks, me = int(self.step_count), self.axis.size, self.axis.rank
        for i, w in enumerate(self.matrices):
            if i % ranks == me:
                g = w.untransposed(self.grads.whole(full, i))
                self.proj[i].copy_(subspace(g, w.r, w.left, refresh_seed(i, k),
                                            self.cfg.galore_svd))
        for i, proj in enumerate(self.proj):
            C.broadcast(proj, self.axis, i % ranks, "galore_subspace")

    def after_backward(self, last: bool) -> None:
        """After a micro-batch's backward (`last`: the step's last one): reduce what is due.
        Stage 2 reduce-scatters every micro-batch into its shard, except on refresh steps;
        otherwise the gradients accumulate in .grad until the last micro-batch."""
        per_micro = self.stage == 2 and not self.refreshing
        if not (last or per_micro):
            return
        device = self.shard.device
        if self.refreshing:
            full = self._pack(self.bucket if self.bucket is not None and not self.projected
                              else self.grads.empty(device), self.grads)
            all_reduce_grad(full, self.axis)
            if not self.projected:
                self.full = full  # clipped whole, then refreshed from, in `step`
                return
            self._refresh(full)  # and this rank's projected rows, from the whole gradient
            segment = full.view(self.n, -1)[self.k]
            for i, proj in enumerate(self.proj):
                self.steps.mine(self.shard, i).copy_(self.grads.mine(segment, i) @ proj)
            self.steps.rest_of(self.shard).copy_(self.grads.rest_of(segment))
        elif self.stage == 0:
            all_reduce_grad(self._pack(self.bucket, self.reduced), self.axis)
        elif self.stage == 1:
            reduce_scatter_grad(self.shard, self._pack(self.bucket, self.reduced), self.axis)
        else:
            part = torch.empty_like(self.shard)
            reduce_scatter_grad(part, self._pack(self.reduced.empty(device), self.reduced),
                                self.axis)
            self.shard += part

    def _segment(self) -> torch.Tensor:
        """This rank's segment of the averaged gradient (seg elements)."""
        return (self.full.view(self.n, -1)[self.k] if self.full is not None else self.shard)

    def norm_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None] | None]:
        """(gradients, counted masks) for clipping: this rank's segment, or on a refresh step
        the whole averaged bucket, of which this rank counts its own segment. Under
        "projected" always the segment: its matrices' rows are projected gradients."""
        if self.full is None:
            return [self.shard], None
        if self.n == 1:
            return [self.full], None
        mask = torch.zeros(self.n, self.grads.seg, dtype=torch.bool, device=self.full.device)
        mask[self.k] = True
        return [self.full], [mask.view(-1)]

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        """(name, gradient) of this rank's segment, for the non-finite guard's report."""
        segment = self._segment()
        out = [(w.name, self.reduced.mine(segment, i)) for i, w in enumerate(self.matrices)]
        return out + [("embedding, norms and head", self.reduced.rest_of(segment))]

    # ------------------------------------------------------------------ the update

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """GaLore's normalized step of this rank's rows of every matrix (new subspaces
        first on a refresh step) and AdamW on its shard of the rest; then every rank's
        rows and shard are all-gathered and applied (`_apply`)."""
        t = self.cfg
        k = int(self.step_count)
        segment = self._segment()
        send = torch.zeros(self.steps.seg, device=segment.device)
        if self.full is not None:
            self._refresh(self.full)
        for i in range(len(self.matrices)):
            low = self.reduced.mine(segment, i)
            if not self.projected:
                low = low @ self.proj[i]
            self.steps.mine(send, i).copy_(adam_direction(
                self.exp_avg[i], self.exp_avg_sq[i], low, k + 1, t.beta1, t.beta2, t.eps))
        self.step_count.fill_(k + 1)
        self.rest_master.grad = self.reduced.rest_of(segment)
        self.rest_master.mul_(torch.where(self.rest_decay, 1.0 - lr * t.weight_decay, 1.0))
        for group in self.adamw.param_groups:
            group["lr"] = lr
        self.adamw.step()
        self.rest_master.grad = None
        self.steps.rest_of(send).copy_(self.rest_master)
        gathered = send
        if self.n > 1:
            gathered = self.steps.empty(send.device)
            C.all_gather(gathered, send, self.axis, "params")
        self._apply(gathered, lr)

    def _apply(self, gathered: torch.Tensor, lr: float) -> None:
        """Every matrix: decoupled weight decay, then the projected-back update N P^T
        (GaLoreAdamW's order); the full-rank parameters take their gathered new values."""
        t = self.cfg
        for i, w in enumerate(self.matrices):
            update = self.steps.whole(gathered, i) @ self.proj[i].T  # b x a
            weights = w.t_view(w.param)
            weights.mul_(1 - lr * t.weight_decay)
            weights.add_(update, alpha=-lr * t.galore_scale)
        if self.n == 1:
            return  # the full-rank parameters are views of the stepped master
        flat, start = self.steps.rest_whole(gathered), 0
        for q in self.rest:
            q.view(-1).copy_(flat[start:start + q.numel()])
            start += q.numel()

    def zero_grad(self) -> None:
        """Forget this step's gradients (after the update, or when the guard skips it)."""
        self.full = None
        for q in self.model.parameters():
            q.grad = None
        self.shard.zero_()
        if self.bucket is not None:
            self.bucket.zero_()

    # ------------------------------------------------------------------ ledger, checkpoints

    def record_model_state(self) -> None:
        """Bytes of parameters, gradients, master shard and optimizer states on this rank."""
        params = sum(q.nbytes for q in self.model.parameters())
        grads = (self.bucket if self.bucket is not None else self.shard).nbytes
        master = self.rest_master.nbytes if self.n > 1 else 0  # stage 0: the parameters
        state = self.adamw.state[self.rest_master]
        optimizer = (sum(t.nbytes for t in (*self.proj, *self.exp_avg, *self.exp_avg_sq))
                     + state["exp_avg"].nbytes + state["exp_avg_sq"].nbytes)
        self.ledger.model_state_bytes = {"params": params, "grads": grads, "master": master,
                                         "optimizer": optimizer, "host": 0, "disk": 0,
                                         "total": params + grads + master + optimizer}

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Tensors to save and load in place: the model (parameters and buffers) and the
        projections (the same on every rank, one key each) and this rank's shards of the
        moments (`.shard{k}of{n}`)."""
        tag = f"shard{self.k}of{self.n}"
        state = self.adamw.state[self.rest_master]
        out = {f"model.{name}": t for name, t in self.model.state_dict().items()}
        out["galore.step"] = self.step_count
        for w, proj, m, v in zip(self.matrices, self.proj, self.exp_avg, self.exp_avg_sq):
            out[f"galore.proj.{w.name}"] = proj
            out[f"galore.exp_avg.{w.name}.{tag}"] = m
            out[f"galore.exp_avg_sq.{w.name}.{tag}"] = v
        out.update({f"rest.master.{tag}": self.rest_master.data,
                    f"rest.exp_avg.{tag}": state["exp_avg"],
                    f"rest.exp_avg_sq.{tag}": state["exp_avg_sq"],
                    f"rest.step.{tag}": state["step"]})
        return out
