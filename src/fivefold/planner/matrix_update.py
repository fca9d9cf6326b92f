"""Seconds of the per-matrix work of Muon's and GaLore's updates on one rank, for the
step simulation (fivefold.planner.simulate) and the search (fivefold.planner.search).

Muon: the Newton-Schulz orthogonalization of each block matrix
(fivefold.planner.compute.newton_schulz_time). GaLore (arXiv 2403.03507, Algorithm 2;
fivefold.memory.galore_dp and galore_units): per step and block matrix, this rank's block
of the gradient T (B x A, A the projected side) times P (A x r) and the back-projection
N P^T, two fp32 GEMMs of B x A x r; and every `train.galore_update_gap` steps the subspace
refresh, priced amortized over the gap: the exact SVD of the whole matrix at Golub and Van
Loan's flop count for the R-SVD with both singular-vector sets (6 B A^2 + 20 A^3, Matrix
Computations) at the fp32 GEMM rate, the randomized one (GaLore 2, arXiv 2504.20437, Sec.
3.1; torch.svd_lowrank with 8 extra columns and 2 power iterations) as 6 GEMMs of B x A x
(r + 8). The exact SVD's price is a lower bound (an SVD runs below the GEMM rate; no
measured rate is fitted), so on small matrices, where the randomized one's kernel launches
dominate, exact reads cheaper. Every rank is charged every SVD of its matrices, as
galore_units takes them (galore_dp divides them over the dp ranks: there this is an upper
bound). Communication is not here: the ledger model predicts GaLore's collectives
(fivefold.planner.ledger_galore, ledger_update).
"""

from __future__ import annotations

from fivefold.config import ModelConfig, TrainConfig
from fivefold.hardware import HardwareProfile
from fivefold.planner.compute import Gemm, gemm_time, newton_schulz_time
from fivefold.planner.params import block_matrix_shapes

OVERSAMPLE, POWER_ITERS = 8, 2  # fivefold.memory.galore.subspace's defaults


def galore_time(model: ModelConfig, layer: int, tp: int, train: TrainConfig,
                prof: HardwareProfile) -> float:
    """GaLore's projections and amortized refresh of block `layer`'s matrices, one rank."""
    rate = prof.peak_flops("fp32") * prof.eff.gemm_eff
    total = 0.0
    for local, whole in zip(block_matrix_shapes(model, layer, tp),
                            block_matrix_shapes(model, layer)):
        a, b = sorted(whole)
        r = max(1, a // 4)
        rows, cols = local if whole[0] > whole[1] else local[::-1]  # T's block on this rank
        total += 2 * gemm_time(Gemm("galore_project", rows, cols, r), prof, False, 4)
        if train.galore_svd == "exact":
            refresh = (6 * b * a * a + 20 * a ** 3) / rate
        else:
            refresh = (2 + 2 * POWER_ITERS) * gemm_time(
                Gemm("galore_range", b, a, min(a, r + OVERSAMPLE)), prof, False, 4)
        total += refresh / train.galore_update_gap
    return total


def matrix_update_time(model: ModelConfig, layer: int, tp: int, train: TrainConfig,
                       prof: HardwareProfile) -> float:
    """Muon's orthogonalization or GaLore's projections and refresh of block `layer`'s
    matrices on one rank; 0 for the other optimizers."""
    if train.optimizer == "muon":
        return newton_schulz_time(block_matrix_shapes(model, layer, tp), prof)
    if train.optimizer == "galore":
        return galore_time(model, layer, tp, train, prof)
    return 0.0
