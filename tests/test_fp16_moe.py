"""fp16 loss scaling with MoE: the auxiliary losses' gradients are scaled as the token loss's.

The load-balancing and z-losses reach backward through `AttachAuxLoss` (fivefold.models.moe)
with the coefficient `aux_grad_scale`, not through the loss that fp16's dynamic loss scale
(fivefold.train.loss_scale) multiplies; the trainer sets that coefficient each step to the
loss scale over the global batch's tokens, so the unscale divides the scale out of the
auxiliary part too.

Tolerances:
- One process: the router's gradient of one fp16 step, the scale divided out, against the
  fp32 run's, relative 1e-2 in norm (fp16 activations; measured at most 7.7e-4 on 2 shared CPU
  cores). Without the auxiliary losses' scaling it is off by their share of the gradient
  (measured 0.55 here), so the check can fail.
- ep 2 and tp 2 on 2 ranks against the one-process fp16 MoE run: tests/test_fp16_layouts.py's
  (losses rel 2e-5, gradient norms rel 1e-3, each parameter off by at most a tenth of the
  reference's own change), after 5 steps; every rank's ledger as `predict_ledger` says, the
  routed all-to-alls exact summed over the ranks (balanced routing is the prediction).
"""

from __future__ import annotations

import pytest
import torch
from parity import CPU, STEPS, assert_ledgers_predicted, full_parameters

from fivefold.config import load_config
from fivefold.models.llama import build_model
from fivefold.parallel.expert import gather_experts
from fivefold.parallel.plan import plan_from_config
from fivefold.planner.ledger_model import predict_ledger
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer

FP16 = ["parallel.precision=fp16"]
MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32",
       "model.moe.aux_loss_weight=0.01", "model.moe.z_loss_weight=0.001",
       "parallel.micro_batch=2", f"train.steps={STEPS}"]
LAYOUTS = {"ep 2": ["parallel.ep=2"], "tp 2": ["parallel.tp=2"]}
ROUTED = ("moe_dispatch", "moe_combine", "moe_dispatch_backward", "moe_combine_backward")
LOSS_REL, NORM_REL, CHANGE_FRACTION = 2e-5, 1e-3, 0.1


def _router_grads(sets, run_dir):
    """The routers' gradients of step 0, the loss scale divided out."""
    trainer = Trainer(load_config(None, sets), CPU, run_dir)
    got = {}
    for name, p in trainer.model.named_parameters():
        if "router" in name:
            p.register_hook(lambda g, name=name: got.__setitem__(name, got.get(name, 0) + g))
    scale = trainer.updater.loss_scale.scale if trainer.updater.loss_scale else 1.0
    trainer.train_step(0)
    return {name: g.float() / scale for name, g in got.items()}


def test_fp16_router_gradient_carries_the_scaled_aux_losses(parity_overrides, tmp_path):
    """Module docstring: the fp16 router gradient within 1e-2 of the fp32 one."""
    sets = parity_overrides + MOE
    fp32 = _router_grads(sets, tmp_path / "fp32")
    fp16 = _router_grads(sets + FP16, tmp_path / "fp16")
    assert fp32.keys() == fp16.keys() and fp32
    for name, g in fp32.items():
        assert (fp16[name] - g).norm() <= 1e-2 * g.norm(), name


def _run(rt, sets, run_dir):
    """(losses, gradient norms, whole parameters, ledger totals, predicted ledger)."""
    cfg = load_config(None, sets)
    trainer = Trainer(cfg, rt, run_dir)
    results = [trainer.train_step(s) for s in range(STEPS)]
    recorded = (trainer.ledger.totals("bytes"), trainer.ledger.totals("wire_bytes"),
                trainer.ledger.model_state_bytes)
    predicted = predict_ledger(cfg, plan_from_config(cfg, rt.world_size, "fp32"), rt.rank)
    params = full_parameters(trainer)
    if trainer.expert_axes:
        params = gather_experts(params, trainer.expert_axes)
    return ([r.loss for r in results], [r.grad_norm for r in results], params, recorded,
            predicted)


def _layouts(rt, sets, run_dir):
    return {name: _run(rt, sets + layout, f"{run_dir}/{name}")
            for name, layout in LAYOUTS.items()}


@pytest.mark.slow
def test_fp16_moe_layouts_match_one_process(parity_overrides, tmp_path):
    """ep 2 and tp 2 against the one-process fp16 MoE run at the module docstring's bounds."""
    sets = parity_overrides + MOE + FP16
    runs = run_on_ranks(_layouts, 2, sets, str(tmp_path / "ranks"), timeout_s=900)
    ref_losses, ref_norms, ref_params, _, _ = _run(CPU, sets, tmp_path / "reference")
    cfg = load_config(None, sets)
    initial = dict(build_model(cfg.model, cfg.train.seed, torch.device("cpu")).named_parameters())
    for name in LAYOUTS:
        losses, norms, params, _, _ = runs[0][name]
        assert losses == pytest.approx(ref_losses, rel=LOSS_REL), name
        assert norms == pytest.approx(ref_norms, rel=NORM_REL), name
        assert params.keys() == ref_params.keys(), name
        for key, ref in ref_params.items():
            moved = (ref - initial[key]).norm()
            assert (params[key] - ref).norm() <= CHANGE_FRACTION * moved, (name, key)
        assert_ledgers_predicted([r[name][4] for r in runs], [r[name][3] for r in runs],
                                 ROUTED, name)
