"""fp8 with MoE (fivefold.parallel.fp8.experts): experts in fp8, the router not.

Tolerances, and why:

- The fp8 expert product against each expert's rows through the dense fp8 linear
  (fivefold.parallel.fp8.linear) with that expert's weight: outputs and gradients rel 1e-6
  (the same quantized operands and fp32 GEMMs). It must differ from the fp32 product (the
  test can fail), and an expert without rows gets a zero weight gradient.
- One-process fp8 MoE against fp32 MoE: the dense bound of tests/test_fp8.py, training loss
  within LOSS_BAND = 0.05 at every step (here the tiny MoE's first STEPS_VS_FP32 steps of
  the parity schedule; measured max in the module's test docstring).
- Layouts against the one-process fp8 MoE run on the same micro-batches. ep 2 (folded onto
  dp 2): an expert's call holds both ranks' micro-batches, where the one-process run's holds
  one, so its rows' amax and the scales differ, and every rounding with them. tp 2 (folded
  into the experts' grid, with and without sp) and cp 2 (tensorwise, rowwise): the MoE
  layer runs on a rank's share of the tokens and every row-reducing amax of the experts and
  shared experts is agreed over those ranks (fivefold.parallel.fp8.experts), so the scales
  are the one-process run's; what is left is reordered fp32 sums that fp8 then rounds across
  boundaries (tests/test_fp8.py's tp bound). Their first loss (forward only, every scale
  equal) within rel 1e-6; without the agreed amax tp 2's is 1.0e-5 off. Measured after 5 steps on 2 shared CPU cores,
  losses / parameters relative to each tensor's norm: ep 2 3.3e-5 / 2.9e-2; tp 2 and tp 2
  + sp 2.7e-5 / 5.3e-3; cp 2 1.3e-5 / 1.5e-3; cp 2 rowwise 2.0e-5 / 1.1e-2 (tp 2 after 2 steps,
  the default suite's case: 7.6e-8 / 4.2e-4; before the amax was agreed, tp 2 missed the
  2e-2 parameter bound with 2.2e-2). Asserted at rel 1e-4 and 5e-2 (ep 2) / 2e-2 (the
  others, tests/test_fp8.py's). Every rank's ledger equals `predict_ledger` (the fp32
  config's plus the fp8 config's "fp8_amax" records; the routed all-to-alls exact summed
  over the ranks). The measured fp8-vs-fp32 gap over 20 steps: 0.002.
- tp 2 for 2 steps is the default suite's case (one start of 2 ranks, about 40 s on 2
  shared cores); every layout for 5 steps, and the fp32 comparison, are marked slow.
"""

from __future__ import annotations

import pytest
import torch

from fivefold.config import load_config
from fivefold.models.expert_matmul import expert_swiglu
from fivefold.models.moe import MoE
from fivefold.parallel.expert import gather_experts
from fivefold.parallel.fp8.experts import Fp8ExpertMatmul, apply_fp8_to_experts
from fivefold.parallel.fp8.linear import Fp8Linear
from fivefold.parallel.fp8.recipe import Fp8Recipe
from fivefold.parallel.fp8.scaling import agreed_amax
from fivefold.parallel.plan import plan_from_config
from fivefold.planner.ledger_model import predict_ledger
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer
from parity import CPU, assert_ledgers_predicted, full_parameters

FP8 = ["parallel.precision=fp8"]
MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32",
       "model.moe.shared_experts=1", "model.moe.aux_loss_weight=0.01",
       "parallel.micro_batch=2", "train.eps=1e-6"]
LOSS_BAND = 0.05  # tests/test_fp8.py's dense bound on |fp8 - fp32| training loss
STEPS = 5
FAST_STEPS = 2
STEPS_VS_FP32 = 20


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_expert_product_is_each_experts_fp8_linear(scaling):
    torch.manual_seed(0)
    counts = [5, 0, 3, 8]
    x = torch.randn(sum(counts), 16, requires_grad=True)
    w = torch.randn(4, 24, 16, requires_grad=True)
    recipe = Fp8Recipe(scaling)
    y = Fp8ExpertMatmul(recipe)(x, w, counts)
    gx, gw = torch.autograd.grad(y.square().sum(), (x, w))
    ref = torch.cat([Fp8Linear(w[e], None, recipe, None, None)(xe) if len(xe) else xe @ w[e].t()
                     for e, xe in enumerate(torch.split(x, counts))])
    rx, rw = torch.autograd.grad(ref.square().sum(), (x, w))
    for a, b in ((y, ref), (gx, rx), (gw, rw)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert gw[1].abs().max() == 0
    plain = torch.cat([xe @ w[e].t() for e, xe in enumerate(torch.split(x, counts))])
    assert (y - plain).abs().max() > 1e-3


def test_an_expert_without_rows_has_amax_zero():
    """A rank that routes no row to an expert still joins its amax exchange: amax 0, shaped
    as a row-holding rank's, so the maximum over the ranks is the others'."""
    empty = torch.empty(0, 16)
    assert agreed_amax(empty, None, None, None).shape == ()
    assert agreed_amax(empty, 0, None, None).shape == (1, 16)
    assert agreed_amax(empty, 1, None, None).shape == (0, 1)
    assert agreed_amax(empty, 0, None, None).abs().max() == 0


def test_apply_puts_experts_and_shared_experts_in_fp8_and_keeps_the_router(tiny_overrides):
    cfg = load_config(None, tiny_overrides + MOE)
    moe = MoE(cfg.model)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 6, cfg.model.hidden)
    plain_route = moe.route(x.view(-1, x.shape[-1]))
    apply_fp8_to_experts(moe, Fp8Recipe())
    assert isinstance(moe.expert_mm, Fp8ExpertMatmul)
    assert all(isinstance(c, Fp8Linear) for c in moe.shared.children())
    assert type(moe.router) is torch.nn.Linear
    for a, b in zip(moe.route(x.view(-1, x.shape[-1])), plain_route):
        assert torch.equal(a, b)
    counts = [3, 4, 0, 5]
    h = torch.randn(12, cfg.model.hidden)
    fp8 = moe.local_experts(h, counts)
    fp32 = expert_swiglu(h, counts, moe.w1, moe.w3, moe.w2, "loop")
    assert 0 < (fp8 - fp32).abs().max() < 0.1 * fp32.abs().max()


def _train(rt, sets, run_dir, steps=STEPS):
    """(losses, whole parameters, recorded ledger, predicted ledger) of `steps` steps."""
    cfg = load_config(None, sets)
    trainer = Trainer(cfg, rt, run_dir)
    losses = [trainer.train_step(s).loss for s in range(steps)]
    recorded = (trainer.ledger.totals("bytes"), trainer.ledger.totals("wire_bytes"),
                trainer.ledger.model_state_bytes)  # before the parameters' gathers
    params = full_parameters(trainer)
    if trainer.expert_axes:
        params = gather_experts(params, trainer.expert_axes)
    return losses, params, recorded, _predicted(cfg, sets, rt)


class _Fp8Prediction:
    """A step's ledger on the CPU, where fp8 training communicates in fp32 outside its
    linears: the fp32 config's predicted ledger plus the fp8 config's predicted "fp8_amax"
    all-gathers (tests/test_fp8_split_tokens.py composes it the same way)."""

    def __init__(self, plain, fp8):
        self.model_state_bytes = plain.model_state_bytes
        self._plain, self._fp8 = plain, fp8

    def totals(self, key):
        out = dict(self._plain.totals(key))
        out.update({k: v for k, v in self._fp8.totals(key).items() if k[2] == "fp8_amax"})
        return out


def _predicted(cfg, sets, rt):
    plain = load_config(None, [s for s in sets if not s.startswith("parallel.precision")])
    return _Fp8Prediction(
        predict_ledger(plain, plan_from_config(plain, rt.world_size, "fp32"), rt.rank),
        predict_ledger(cfg, plan_from_config(cfg, rt.world_size, "fp32"), rt.rank))


# name: (overrides, parameter bound relative to each tensor's norm; module docstring)
LAYOUTS = {"ep2": (["parallel.ep=2"], 5e-2), "tp2": (["parallel.tp=2"], 2e-2),
           "tp2-sp": (["parallel.tp=2", "parallel.sequence_parallel=true"], 2e-2),
           "cp2": (["parallel.cp=2"], 2e-2),
           "cp2-rowwise": (["parallel.cp=2", "parallel.fp8_recipe=rowwise"], 2e-2)}
FAST = ("tp2",)  # the default suite's case, FAST_STEPS steps; all, STEPS steps, under -m slow
ROUTED = ("moe_dispatch", "moe_combine", "moe_dispatch_backward", "moe_combine_backward")


def _layouts_on_ranks(rt, sets, names, run_dir, steps):
    return {name: _train(rt, sets + LAYOUTS[name][0], f"{run_dir}/{name}", steps)
            for name in names}


@pytest.mark.slow
def test_fp8_moe_one_process_stays_near_fp32(parity_overrides, tmp_path):
    """Training loss within LOSS_BAND of the fp32 MoE run at each of the first
    STEPS_VS_FP32 steps, and not equal to it."""
    fp32, _ = _train(CPU, parity_overrides + MOE, tmp_path / "fp32", STEPS_VS_FP32)
    fp8, _ = _train(CPU, parity_overrides + MOE + FP8, tmp_path / "fp8", STEPS_VS_FP32)
    gaps = [abs(a - b) for a, b in zip(fp8, fp32)]
    assert max(gaps) < LOSS_BAND and fp8 != fp32


@pytest.mark.parametrize("names,steps", [
    (FAST, FAST_STEPS),
    pytest.param(tuple(LAYOUTS), STEPS, marks=pytest.mark.slow)],
    ids=["tp2", "all"])
def test_fp8_moe_layouts_match_the_one_process_fp8_run(names, steps, parity_overrides,
                                                        tmp_path):
    """Layouts on 2 gloo ranks against the one-process fp8 MoE run of the same recipe, at
    the module docstring's bounds; every rank's ledger as predicted."""
    sets = parity_overrides + MOE + FP8
    runs = run_on_ranks(_layouts_on_ranks, 2, sets, names, str(tmp_path / "ranks"), steps,
                        timeout_s=900)
    references = {}
    for name in names:
        recipe = tuple(s for s in LAYOUTS[name][0] if "fp8_recipe" in s)
        if recipe not in references:
            references[recipe] = _train(CPU, sets + list(recipe),
                                        tmp_path / f"ref{len(references)}", steps)
        ref_losses, ref_params = references[recipe][:2]
        losses, params = runs[0][name][:2]
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        assert params.keys() == ref_params.keys(), name
        param_rel = max(((params[k] - v).norm() / v.norm()).item() for k, v in ref_params.items())
        if name != "ep2":  # every scale the one-process run's: the forward's loss equal
            assert losses[0] == pytest.approx(ref_losses[0], rel=1e-6), name
        assert loss_rel < 1e-4, (name, loss_rel)
        assert param_rel < LAYOUTS[name][1], (name, param_rel)
        assert_ledgers_predicted([r[name][3] for r in runs], [r[name][2] for r in runs],
                                 ROUTED, name)
        assert any(k[2] == "fp8_amax" for k in runs[0][name][2][0]) == (name != "ep2"), name
