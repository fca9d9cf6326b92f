"""fp8 training (fivefold.parallel.fp8): the rounding, the scales, the linear, the layouts.

Tolerances, and why:

- Rounding and scaling are bit for bit: the emulation's own rounding (formats.round_to_format)
  against torch's float8 casts, over every fp8 value, every tie, subnormals and signed zeros.
- The emulated linear against the same GEMMs written with torch's casts: rel 1e-6 (identical
  operand values; only where 1/s is applied differs). The real path (torch._scaled_mm, whose
  CPU kernel torch 2.13 has) against the emulation: rel 1e-5 (fp32 accumulation order).
- Layouts against the one-process fp8 run on the same micro-batches. dp 2, dp 2 ZeRO-3 and
  pp 2 reorder no sum that fp8 rounds (data parallelism sums whole micro-batch gradients as
  the one-process run accumulates them): losses rel 2e-5, parameters atol 1e-5 + rtol 1e-4
  after 5 steps, the fp32 parity tolerances of tests/test_tensor_parallel.py. tp 2 computes
  every scale as the one process does (the ranks agree on amax over the ledger), so its
  first loss equals the one-process loss to rel 1e-6; but its row-parallel partial sums and
  input-gradient all-reduce reorder fp32 sums (rel ~1e-7), and where that moves a value
  across a rounding boundary, fp8 changes that element by a whole step (e5m2: 1/8 to 1/4 of
  it). Rounding is discontinuous, so no fp32-sized tolerance holds: measured over 5 steps,
  losses within rel 4e-5 and parameters within 1e-2 of each tensor's norm (AdamW turns small
  gradient differences into update differences of up to lr); asserted at rel 1e-4 and 2e-2.
- The planner (fivefold.planner.compute, activations): the recipe's switches move time and
  memory the way the runtime's recipe does: exact byte counts and orderings.
- Convergence: over the default 200-step schedule (warm-up 20, cosine to 0.1 of lr 1e-3) on
  the tiny test model, the fp8-emulated run's training loss stays within LOSS_BAND of the
  fp32 run at every step and its final validation loss within VAL_BAND; on the default
  `fivefold train` model (under `-m slow`) the final validation loss and the mean of the
  last 20 training losses within DEFAULT_BAND.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import load_config
from fivefold.hardware import PROFILES
from fivefold.memory.activation_count import SavedActivations
from fivefold.parallel.fp8.formats import BF16, E4M3, E5M2, round_to_format
from fivefold.parallel.fp8.linear import Fp8Linear
from fivefold.parallel.fp8.recipe import Fp8Recipe, fp8_gemms
from fivefold.parallel.fp8.scaling import agreed_amax, quantize, scale_of
from fivefold.parallel.plan import plan_from_config, training_plan
from fivefold.planner.activations import block_saved_bytes
from fivefold.planner.compute import Gemm, Shard, block_times, fp8_cast_bytes
from fivefold.planner.ledger_model import predict_ledger
from fivefold.planner.simulate import simulate
from fivefold.planner.spec import spec_config
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer
from parity import CPU, assert_params_close, train_steps

FP8 = ["parallel.precision=fp8"]
LOSS_BAND = 0.05  # |fp8 - fp32| training loss at any of the 200 steps (measured max 0.026)
VAL_BAND = 0.02  # |fp8 - fp32| final validation loss (measured 0.001)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def torch_cast(x: torch.Tensor, fmt) -> torch.Tensor:
    return x.to(fmt.dtype).float()


# ---------------------------------------------------------------- rounding and scales

@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_rounding_matches_torch_float8_bit_for_bit(fmt):
    """Every finite value of the format, the midpoint of every pair of neighbours (the ties,
    to even), values around and below the subnormals, signed zeros, random values over the
    whole range: round_to_format equals x.to(float8).float() in every bit."""
    grid = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    grid = grid[grid.isfinite()].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    smallest = 2.0 ** (fmt.min_normal_exp - fmt.mantissa_bits)
    torch.manual_seed(0)
    x = torch.cat([grid, ties, -ties, torch.tensor([0.0, -0.0, smallest / 2, -smallest / 2,
                                                    smallest / 3, -smallest * 0.75, 1e-30]),
                   torch.randn(20000) * smallest * 8,
                   torch.randn(20000) * torch.exp2(torch.randint(-20, 16, (20000,)).float())])
    x = x.clamp(-fmt.max, fmt.max)
    assert torch.equal(bits(round_to_format(x, fmt)), bits(torch_cast(x, fmt)))
    assert round_to_format(x, fmt).isfinite().all()


def test_bf16_rounding_matches_torch_bit_for_bit():
    torch.manual_seed(0)
    x = torch.randn(50000) * torch.exp2(torch.randint(-130, 100, (50000,)).float())
    assert torch.equal(bits(round_to_format(x, BF16)), bits(x.to(torch.bfloat16).float()))


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("dim", [None, 0, 1], ids=["tensorwise", "rowwise0", "rowwise1"])
def test_scaled_quantization_matches_torch_float8(fmt, dim):
    """scale = fmt.max / amax (tensorwise or per row); the amax element lands on +-fmt.max;
    the emulated values are torch's cast of the clamped scaled tensor, divided by the scale,
    bit for bit; the real path returns torch's float8 tensor and 1/scale; an all-zero row
    keeps a finite scale and stays zero."""
    torch.manual_seed(1)
    t = torch.randn(24, 40) * torch.exp2(torch.randint(-8, 8, (24, 1)).float())
    t[3] = 0.0
    amax = agreed_amax(t, dim, None, None)
    scale = scale_of(amax, fmt)
    expected_amax = t.abs().amax() if dim is None else t.abs().amax(dim, keepdim=True)
    assert torch.equal(amax, expected_amax)
    assert torch.equal(scale, fmt.max / expected_amax.clamp(min=1e-12))
    assert scale.isfinite().all()
    emulated, none = quantize(t, fmt, scale, emulate=True)
    reference = torch_cast((t * scale).clamp(-fmt.max, fmt.max), fmt) / scale
    assert none is None and torch.equal(bits(emulated), bits(reference))
    assert torch.equal(emulated[3], torch.zeros(40))
    peak = (t * scale).abs().amax()
    assert peak == pytest.approx(fmt.max, rel=1e-6)
    real, inverse = quantize(t, fmt, scale, emulate=False)
    assert real.dtype == fmt.dtype and torch.equal(real, (t * scale).clamp(
        -fmt.max, fmt.max).to(fmt.dtype))
    assert torch.equal(inverse, scale.reciprocal())


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_saturation_clamps_to_the_format_max(fmt):
    """A scale larger than max / amax (another tensor's, say) saturates instead of producing
    NaN (e4m3 has no infinity) or infinity: the outliers become +-max / scale."""
    t = torch.tensor([1.0, -3.0, 1000.0, -1e6, 0.25])
    scale = torch.tensor(fmt.max / 2.0)
    emulated, _ = quantize(t, fmt, scale, emulate=True)
    assert emulated.isfinite().all()
    assert emulated[2] == fmt.max / scale and emulated[3] == -fmt.max / scale
    assert torch.equal(bits(emulated), bits(torch_cast((t * scale).clamp(-fmt.max, fmt.max),
                                                       fmt) / scale))


# ---------------------------------------------------------------- the linear

def _linear_run(recipe: Fp8Recipe, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    weight, inp = nn.Parameter(w.clone()), x.clone().requires_grad_()
    y = Fp8Linear(weight, None, recipe, None, None)(inp)
    y.backward(dy)
    return y.detach(), inp.grad, weight.grad


def _by_casts(t: torch.Tensor, fmt, dim: int | None) -> torch.Tensor:
    """`t` quantized with torch's cast, scaled over `dim` (None: the whole tensor)."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim, keepdim=True)
    scale = fmt.max / amax.clamp(min=1e-12)
    return torch_cast((t * scale).clamp(-fmt.max, fmt.max), fmt) / scale


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_emulated_linear_is_the_three_gemms_of_quantized_operands(scaling):
    """y = q(x) q(W)^T, dx = q(dy) q(W), dW = q(dy)^T q(x), each operand scaled along the
    GEMM's contracted dim (rowwise) or as a whole (tensorwise), written with torch's casts;
    with grad_output off the gradients' dy stays fp32 (rel 1e-6)."""
    torch.manual_seed(2)
    x, w, dy = torch.randn(3, 16, 32), torch.randn(48, 32) * 0.1, torch.randn(3, 16, 48)
    x2, dy2 = x.flatten(0, 1), dy.flatten(0, 1)

    def dims(d):
        return None if scaling == "tensorwise" else d

    y, dx, dw = _linear_run(Fp8Recipe(scaling), x, w, dy)
    close = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y.flatten(0, 1), _by_casts(x2, E4M3, dims(1))
                               @ _by_casts(w, E4M3, dims(1)).t(), **close)
    torch.testing.assert_close(dx.flatten(0, 1), _by_casts(dy2, E5M2, dims(1))
                               @ _by_casts(w, E4M3, dims(0)), **close)
    torch.testing.assert_close(dw, _by_casts(dy2, E5M2, dims(0)).t()
                               @ _by_casts(x2, E4M3, dims(0)), **close)
    _, dx, dw = _linear_run(Fp8Recipe(scaling, ("input", "weight")), x, w, dy)
    torch.testing.assert_close(dx.flatten(0, 1), dy2 @ _by_casts(w, E4M3, dims(0)), **close)
    torch.testing.assert_close(dw, dy2.t() @ _by_casts(x2, E4M3, dims(0)), **close)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("tensors", [("input", "weight", "grad_output"), ("weight",)])
def test_real_scaled_mm_matches_the_emulation(scaling, tensors):
    """The real path (fp8 tensors into torch._scaled_mm, or a dequantized operand where one
    class is off) against the emulation: output and both gradients rel 1e-5."""
    torch.manual_seed(3)
    x, w, dy = torch.randn(2, 16, 32), torch.randn(64, 32) * 0.1, torch.randn(2, 16, 64)
    emulated = _linear_run(Fp8Recipe(scaling, tensors, emulate=True), x, w, dy)
    real = _linear_run(Fp8Recipe(scaling, tensors, emulate=False), x, w, dy)
    for e, r in zip(emulated, real):
        torch.testing.assert_close(r, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())


def test_fp8_gemms_need_both_operands():
    assert fp8_gemms(("input", "weight", "grad_output")) == ("forward", "grad_input",
                                                             "grad_weight")
    assert fp8_gemms(("weight", "grad_output")) == ("grad_input",)
    assert fp8_gemms(("input",)) == ()


# ---------------------------------------------------------------- the trainer

def _tiny(tiny_overrides, *sets):
    return load_config(None, tiny_overrides + ["train.sample_tokens=0", *sets])


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_model_saves_what_the_plain_model_saves(tiny_overrides, scaling):
    """The fp8 linear keeps its high-precision input (shared by wq, wk, wv) and weight, as a
    plain linear does: per block the same bytes as the fp32 model, and the planner's count
    (fivefold.planner.activations, fp32 here) of both."""
    batch = {}
    for precision in ("fp32", "fp8"):
        cfg = _tiny(tiny_overrides, f"parallel.precision={precision}",
                    f"parallel.fp8_recipe={scaling}")
        trainer = Trainer(cfg, CPU, "unused", plan=training_plan(cfg, 1, "cpu"))
        model = trainer.model
        inputs, targets = trainer.train_sampler.rank_batch(0)
        labels = {f"layers.{i}": b for i, b in enumerate(model.layers)}
        with SavedActivations(model, labels) as acts:
            F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        batch[precision] = dict(acts.bytes_by_label)
    assert any(isinstance(m, Fp8Linear) for m in trainer.model.modules())
    assert batch["fp8"] == batch["fp32"]
    tokens = cfg.parallel.global_batch * cfg.model.seq_len
    assert batch["fp8"]["layers.0"] == block_saved_bytes(cfg.model, tokens, 4)


def _losses_over_default_schedule(cfg):
    trainer = Trainer(cfg, CPU, "unused", plan=training_plan(cfg, 1, "cpu"))
    losses = [trainer.train_step(s).loss for s in range(cfg.train.steps)]
    return losses, trainer.evaluate()


def test_fp8_loss_stays_in_band_over_the_default_200_steps(tiny_overrides):
    """The tiny test model over `fivefold train`'s default schedule (200 steps, warm-up 20,
    lr 1e-3): fp8-emulated (tensorwise) training loss within LOSS_BAND of fp32 at every
    step, final validation loss within VAL_BAND; and fp8 is not fp32 (the test can fail)."""
    defaults = ["train.lr=1e-3", "train.warmup_steps=20", "train.steps=200"]
    fp32, fp32_val = _losses_over_default_schedule(_tiny(tiny_overrides, *defaults))
    fp8, fp8_val = _losses_over_default_schedule(_tiny(tiny_overrides, *defaults, *FP8))
    gaps = [abs(a - b) for a, b in zip(fp8, fp32)]
    assert max(gaps) < LOSS_BAND, max(gaps)
    assert abs(fp8_val - fp32_val) < VAL_BAND, (fp8_val, fp32_val)
    assert fp8 != fp32 and fp32[-1] < fp32[0] - 1.0


DEFAULT_BAND = 0.05  # the default run: final val loss, and train loss averaged over its last
# 20 steps (measured -0.023 and -0.016 by bench/fp8_study.py, the same run). Single steps
# are not compared: the trajectories part (fp8 perturbs them), and single-batch losses
# differ by up to 0.39, as another seed's would


@pytest.mark.slow
def test_fp8_loss_stays_in_band_on_the_default_run():
    """The default `fivefold train` config (tiny preset, built-in corpus, 200 steps), fp8
    tensorwise against fp32, within DEFAULT_BAND: about 12 minutes with OMP_NUM_THREADS=1."""
    base = ["train.tensorboard=false", "train.sample_tokens=0", "train.device=cpu"]
    fp32, fp32_val = _losses_over_default_schedule(load_config(None, base))
    fp8, fp8_val = _losses_over_default_schedule(load_config(None, base + FP8))
    assert abs(sum(fp8[-20:]) - sum(fp32[-20:])) / 20 < DEFAULT_BAND
    assert abs(fp8_val - fp32_val) < DEFAULT_BAND


# ---------------------------------------------------------------- layouts

# (name, overrides of the layout, overrides of its one-process reference)
LAYOUTS = [
    ("dp2", ["parallel.micro_batch=4"], ["parallel.micro_batch=4"]),
    ("dp2-zero3", ["parallel.zero_stage=3", "parallel.micro_batch=2"],
     ["parallel.micro_batch=2"]),
    ("pp2", ["parallel.pp=2", "parallel.micro_batch=2"], ["parallel.micro_batch=2"]),
    ("tp2", ["parallel.tp=2"], []),
    ("tp2-rowwise", ["parallel.tp=2", "parallel.fp8_recipe=rowwise"],
     ["parallel.fp8_recipe=rowwise"]),
]


def _on_ranks(rt, sets, tmp):
    out = {}
    for name, layout, _ in LAYOUTS:
        run = train_steps(rt, load_config(None, sets + layout), f"{tmp}/{name}")
        amax = [r for r in run.records if r["purpose"] == "fp8_amax"]
        out[name] = (run.losses, run.params, len(amax), {r["mesh_dim"] for r in amax},
                     sum(r["bytes"] for r in amax))
    return out


@pytest.fixture(scope="module")
def fp8_sets(parity_overrides):
    return parity_overrides + FP8 + ["train.eps=1e-6"]


@pytest.fixture(scope="module")
def layouts(fp8_sets, tmp_path_factory):
    return run_on_ranks(_on_ranks, 2, fp8_sets, str(tmp_path_factory.mktemp("fp8")),
                        timeout_s=900)


def test_fp8_layouts_match_the_one_process_fp8_run(layouts, fp8_sets, tmp_path):
    """dp 2, dp 2 ZeRO-3, pp 2 at the fp32 parity tolerances; tp 2 (tensorwise, rowwise)
    with its first loss at rel 1e-6 and the bounds of rounding flips after it (module
    docstring). Pipeline stages' parameters are joined over the two ranks."""
    for name, _, reference in LAYOUTS:
        ref = train_steps(CPU, load_config(None, fp8_sets + reference), tmp_path / name)
        losses, params = layouts[0][name][0], dict(layouts[0][name][1])
        if name == "pp2":
            params.update(layouts[1][name][1])
        if not name.startswith("tp"):
            assert losses == pytest.approx(ref.losses, rel=2e-5), name
            assert_params_close(params, ref.params, name, atol=1e-5, rtol=1e-4)
            continue
        assert losses[0] == pytest.approx(ref.losses[0], rel=1e-6), name
        assert losses == pytest.approx(ref.losses, rel=1e-4), name
        assert params.keys() == ref.params.keys()
        for key, value in ref.params.items():
            assert (params[key] - value).norm() <= 2e-2 * value.norm(), (name, key)


def test_tp_ranks_agree_on_scales_over_the_ledger(layouts, fp8_sets):
    """tp 2: each linear whose amax spans the split dim all-gathers it on the "tp" axis
    (purpose fp8_amax): tensorwise, per block and micro-batch, the weights of all 7 linears
    and the inputs of wo and w2 forward and the output gradients of the 5 column-parallel
    linears backward (14); rowwise, the inputs and weights of wo and w2 forward and the output
    gradients and weights of the 5 column-parallel ones backward (14); one micro-batch, one
    step (the ledger keeps the last). No other layout
    exchanges scales. The planner's ledger model predicts the same bytes."""
    layers = load_config(None, fp8_sets).model.layers
    for name, layout, _ in LAYOUTS[3:]:
        count, axes, nbytes = layouts[0][name][2:]
        assert (count, axes) == (14 * layers, {"tp"}), name
        cfg = load_config(None, fp8_sets + layout)
        predicted = predict_ledger(cfg, plan_from_config(cfg, 2, "fp32")).totals()
        assert predicted[("all_gather", "tp", "fp8_amax")] == nbytes, name
    for name in ("dp2", "dp2-zero3", "pp2"):
        assert layouts[0][name][2] == 0, name


# ---------------------------------------------------------------- the planner

def _fp8_spec(stack: str, **fp8) -> dict:
    return {"model": {"preset": "8B"}, "cluster": {"gpu": "H100-SXM", "gpus": 64},
            "parallel": {"global_batch": 128, "tp": 2, "sequence_parallel": True,
                         "zero_stage": 1, "micro_batch": 2, "precision": "fp8", **fp8},
            "train": {"stack": stack}}


def test_planner_cast_bytes_follow_the_recipe():
    """Per class and per scaling: tensorwise with every class is the old count; rowwise casts
    x and W again from high precision and dy twice instead of transposing fp8 copies."""
    g = Gemm("w1", 4096, 1024, 2048)
    x, w, dy, cast = g.m * g.k, g.k * g.n, g.m * g.n, 2 * 2 + 1
    assert fp8_cast_bytes(g, 2) == (cast * (x + w), cast * dy + 2 * (x + w + dy))
    assert fp8_cast_bytes(g, 2, scaling="rowwise") == (cast * (x + w), cast * (x + w + 2 * dy))
    assert fp8_cast_bytes(g, 2, tensors=("weight",)) == (cast * w, 2 * w)
    assert fp8_cast_bytes(g, 2, True, tensors=("weight", "grad_output")) == (0.0, dy)


def test_planner_time_follows_the_recipe_switches():
    """grad_output off: both backward GEMMs leave fp8 (slower backward, same forward); input
    off: the forward and weight-gradient GEMMs; rowwise: the H100's rowwise GEMM rate
    (measured below the tensorwise one) forward and backward, and more backward cast
    traffic; every class off costs more than fp8 and less than nothing at all."""
    m = load_config(None, ["model.preset='8B'"]).model
    prof = PROFILES["H100-SXM"]

    def times(**kw):
        return block_times(m, Shard(2, 8192, 2, 1, False, 1, "fp8", "none", **kw), prof, False)

    full = times()
    no_grad = times(fp8_tensors=("input", "weight"))
    no_input = times(fp8_tensors=("weight", "grad_output"))
    rowwise = times(fp8_recipe="rowwise")
    bf16 = block_times(m, Shard(2, 8192, 2, 1, False, 1, "bf16", "none"), prof, False)
    assert no_grad.fwd == pytest.approx(full.fwd) and no_grad.bwd > full.bwd
    assert no_input.fwd > full.fwd and no_input.wgrad > full.wgrad
    assert rowwise.fwd > full.fwd and rowwise.bwd > full.bwd
    assert full.fwd < bf16.fwd and full.bwd < bf16.bwd
    none_on = times(fp8_tensors=())
    assert none_on.fwd == pytest.approx(bf16.fwd) and none_on.bwd == pytest.approx(bf16.bwd)


def test_planner_fp8_memory_follows_the_recipe():
    """A stack that saves fp8 linear inputs (megatron) does so only with tensorwise scales and
    the input class in fp8; fivefold's runtime saves its high-precision inputs either way."""
    acts = {(stack, key): simulate(spec_config(_fp8_spec(stack, **fp8))
                                   ).memory_per_gpu_bytes["activations"]
            for stack in ("megatron", "fivefold")
            for key, fp8 in (("tensorwise", {}), ("rowwise", {"fp8_recipe": "rowwise"}),
                             ("no-input", {"fp8_tensors": ["weight", "grad_output"]}))}
    assert acts["megatron", "tensorwise"] < acts["megatron", "rowwise"]
    assert acts["megatron", "rowwise"] == acts["megatron", "no-input"]
    assert (acts["fivefold", "tensorwise"] == acts["fivefold", "rowwise"]
            == acts["fivefold", "no-input"])
