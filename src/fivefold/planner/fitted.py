"""The few constants fitted to published runs, and how they enter a prediction.

A hardware profile (fivefold.hardware) holds datasheet figures and microbenchmark rates; a
software stack (fivefold.planner.stack) the switches of the software. What neither states
is what a real training step sustains of those rates on a real cluster. That is `Fitted`:
four numbers, one set for every GPU profile and every stack (never per run, model, source
or profile), fitted to all rows of calibration_runs.json by `fivefold plan validate --cross`
(in-sample) and refitted in each of its leave-one-source-out folds
(fivefold.planner.validation). They are not the only choices the rows shaped: the stacks'
switches and release boundaries were chosen while reading the rows
(fivefold.planner.fitted_to.FITTED_TO), and the folds cannot see those choices. CPU profiles (`cores` > 0) are measured where they train and
take none of them: their semantics are `fivefold calibrate`'s.

- sustained: the share of a microbenchmark's GEMM and attention rate that kernels keep in
  a long training step (clocks under sustained power, caches shared with other kernels)
- overlap_eff: the share of a collective that hides behind concurrent compute
- comm_eff: the share of link bandwidth NCCL's collectives reach (intra- and inter-node)
- nic_aggregation: how many of a node's NICs one collective's ring uses together
  (fivefold.planner.comm: per_node^a NICs; 1 = all)

The FlashAttention-2-class kernel's rate over the measured SDPA was a fifth constant; it is
now the published kernel ratio fivefold.kernel_tables.FLASH2_RATE_H100 (arXiv 2407.08608),
which held the cross-validation better than any value fitted to the rows (docs/planner.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivefold.hardware import HardwareProfile


@dataclass(frozen=True)
class Fitted:
    sustained: float = 1.0
    overlap_eff: float = 0.85
    comm_eff: float = 0.8
    nic_aggregation: float = 1.0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


BOUNDS = {"sustained": (0.6, 1.0), "overlap_eff": (0.5, 1.0), "comm_eff": (0.4, 0.95),
          "nic_aggregation": (0.0, 1.0)}

# the in-sample fit of `fivefold plan validate --cross` to the 140 rows of
# calibration_runs.json (2026-12-07, 15:10-15:35 UTC, on 7f1f0be); none ends at a bound
FITTED = Fitted(sustained=0.8528, overlap_eff=0.8932, comm_eff=0.7325, nic_aggregation=0.3804)


_SUSTAINED: dict[tuple[int, Fitted], tuple[HardwareProfile, HardwareProfile]] = {}


def in_training(prof: HardwareProfile, fit: Fitted = FITTED) -> HardwareProfile:
    """`prof` as a training step sustains it: the fitted constants over its rates (GPU
    profiles only; a CPU profile is returned as measured). Built once per (profile, fit):
    the planner's search asks for it for every layout it scores."""
    if prof.cores:
        return prof
    hit = _SUSTAINED.get((id(prof), fit))
    if hit is not None and hit[0] is prof:
        return hit[1]
    if len(_SUSTAINED) >= 256:
        _SUSTAINED.clear()
    _SUSTAINED[(id(prof), fit)] = (prof, _sustained(prof, fit))
    return _SUSTAINED[(id(prof), fit)][1]


def _sustained(prof: HardwareProfile, fit: Fitted) -> HardwareProfile:
    e = prof.eff
    s = fit.sustained
    rowwise = None if e.gemm_fp8_rowwise_eff is None else e.gemm_fp8_rowwise_eff * s
    eff = dataclasses.replace(e, gemm_eff=e.gemm_eff * s, gemm_fp8_eff=e.gemm_fp8_eff * s,
                              gemm_fp8_rowwise_eff=rowwise,
                              attn_eff=e.attn_eff * s, overlap_eff=fit.overlap_eff,
                              comm_intra_eff=fit.comm_eff, comm_inter_eff=fit.comm_eff,
                              nic_aggregation=fit.nic_aggregation)
    return dataclasses.replace(prof, eff=eff)
