"""GaLore: Adam in a low-rank subspace of each weight matrix's gradient.

GaLore (Zhao et al., arXiv 2403.03507, Sec. 4, Algorithm 2) keeps full-parameter training
but shrinks the optimizer state: for an m x n weight matrix (m <= n) it takes the top-r
left singular vectors P (m x r) of the gradient G every `update_gap` steps, runs Adam on the
projected gradient R = P^T G (r x n), and applies the projected-back update scale * P N,
N Adam's normalized step. For m > n it projects from the right (R = G Q, Q n x r). The
moments then take 2 r n instead of 2 m n values, plus the projection; with the paper's
rank of a quarter of the smaller side (r = D/4 in its runs) that is 2 bytes per parameter
for the moments in fp32 (fivefold.planner.memory counts the same, projection included).

The subspace refresh is an exact SVD (`svd = "exact"`, the first paper) or, as GaLore 2 does
to make refreshes cheap at scale (arXiv 2504.20437, Sec. 3.1), a randomized SVD
(`svd = "randomized"`: Halko et al.'s range finder with `oversample` extra columns and
`power_iters` power iterations, torch.svd_lowrank, which costs O(m n (r + p)) instead of
O(m n min(m, n))). Its random test matrix is drawn from a generator seeded by the matrix's
index and step, inside a forked RNG, so a run is deterministic, resumes exactly and leaves
the global RNG untouched.

`GaLoreAdamW` handles the blocks' weight matrices; fivefold.optim pairs it with AdamW
for the embedding, head and norm gains, as for Muon. Weight decay is decoupled and
full-rank, as AdamW's. The moments carry over when the projection is refreshed (they are
not reset); the projection is kept in fp32.
"""

from __future__ import annotations

import torch


def galore_rank(shape: torch.Size | tuple[int, int]) -> int:
    """The projection rank of a matrix: a quarter of its smaller side (at least 1)."""
    return max(1, min(shape) // 4)


class GaLoreAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, update_gap: int, scale: float, svd: str = "exact",
                 oversample: int = 8, power_iters: int = 2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      update_gap=update_gap, scale=scale))
        self.svd, self.oversample, self.power_iters = svd, oversample, power_iters

    def init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero state of matrix `p` (also what a checkpoint load fills)."""
        state = self.state[p]
        if not state:
            m, n = p.shape
            r = galore_rank(p.shape)
            low = (r, n) if m <= n else (m, r)
            state.update(step=torch.zeros(()),
                         proj=torch.zeros((m, r) if m <= n else (n, r), dtype=torch.float32,
                                          device=p.device),
                         exp_avg=torch.zeros(low, dtype=torch.float32, device=p.device),
                         exp_avg_sq=torch.zeros(low, dtype=torch.float32, device=p.device))
        return state

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """One update of every matrix with a gradient (torch's state-dict loader passes
        `closure=None`; a closure is not supported)."""
        if closure is not None:
            raise ValueError("GaLoreAdamW.step takes no closure")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for index, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self.init_state(p)
                grad, left = p.grad.float(), p.shape[0] <= p.shape[1]
                k = int(state["step"])
                if k % group["update_gap"] == 0:  # a new subspace from this gradient
                    state["proj"].copy_(self.subspace(grad, state["proj"].shape[1], left,
                                                      seed=refresh_seed(index, k)))
                proj = state["proj"]
                low = proj.T @ grad if left else grad @ proj
                k += 1
                state["step"].fill_(k)
                normalized = adam_direction(state["exp_avg"], state["exp_avg_sq"], low, k,
                                            beta1, beta2, group["eps"])
                update = proj @ normalized if left else normalized @ proj.T
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-group["lr"] * group["scale"])

    def subspace(self, grad: torch.Tensor, r: int, left: bool, seed: int) -> torch.Tensor:
        """The top-r left (or right) singular vectors of `grad`, exact or randomized."""
        return subspace(grad, r, left, seed, self.svd, self.oversample, self.power_iters)


def refresh_seed(index: int, step: int) -> int:
    """The randomized refresh's seed of matrix `index` (its place among the optimizer's
    matrices) at step `step`: the same on every rank of a data-parallel run."""
    return index * 1_000_003 + step


def adam_direction(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, low: torch.Tensor, k: int,
                   beta1: float, beta2: float, eps: float) -> torch.Tensor:
    """Adam's normalized step of the projected gradient `low` at step `k` (1-based), the
    moments updated in place (Algorithm 2's Adam in the subspace)."""
    exp_avg.lerp_(low, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(low, low, value=1 - beta2)
    m_hat = exp_avg / (1 - beta1 ** k)
    v_hat = exp_avg_sq / (1 - beta2 ** k)
    return m_hat / (v_hat.sqrt() + eps)


def subspace(grad: torch.Tensor, r: int, left: bool, seed: int, svd: str = "exact",
             oversample: int = 8, power_iters: int = 2) -> torch.Tensor:
    """The top-r left (or right) singular vectors of `grad` (m x n), m x r (or n x r), by
    exact or randomized SVD (module docstring)."""
    if svd == "exact":
        u, _, vh = torch.linalg.svd(grad, full_matrices=False)
        return u[:, :r] if left else vh[:r].T
    q = min(r + oversample, *grad.shape)
    devices = [grad.device.index or 0] if grad.is_cuda else []
    with torch.random.fork_rng(devices=devices, device_type=grad.device.type):
        torch.manual_seed(seed)
        u, _, v = torch.svd_lowrank(grad, q=q, niter=power_iters)
    return u[:, :r] if left else v[:, :r]
