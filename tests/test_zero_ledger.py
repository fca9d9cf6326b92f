"""ZeRO's promises held against the ledger: model-state bytes per rank and communication bytes
per step, exactly; ZeRO++'s byte reductions and its loss tolerance.

Ψ is the parameter count, n the sharding degree, m the micro-batches per step. The test model's
units (root: embedding + final norm; each block) hold a multiple of 8 parameters, so the
unquantized flat buffers need no padding and the paper's formulas apply exactly; with ZeRO++
every shard is padded to whole 256-value quantization blocks and the formulas use the padded
unit sizes.
"""

from __future__ import annotations

import math

import pytest

from fivefold.comm.quantize import BLOCK
from fivefold.config import load_config
from fivefold.models.llama import Transformer
from fivefold.parallel.data_parallel import split_units
from fivefold.testing import run_on_ranks
from fivefold.train.data import prepare_data
from fivefold.train.trainer import Trainer


def unit_sizes(cfg) -> list[int]:
    return [sum(p.numel() for _, p in params) for _, params, _ in
            split_units(Transformer(cfg.model))]


def _two_steps(rt, overrides, layouts):
    """For each layout: the ledger of the second step (steady state) and model-state bytes."""
    out = []
    for sets in layouts:
        trainer = Trainer(load_config(None, overrides + sets), rt, "unused")
        trainer.train_step(0)
        trainer.train_step(1)
        ledger = trainer.ledger
        out.append((ledger.model_state_bytes, ledger.totals("bytes"), ledger.totals("wire_bytes")))
    return out


# (--set overrides, n = sharding degree, m = micro-batches per step)
LAYOUTS = [
    (["parallel.zero_stage=0"], 4, 1),
    (["parallel.zero_stage=1"], 4, 1),
    (["parallel.zero_stage=2", "parallel.micro_batch=1"], 4, 2),
    (["parallel.zero_stage=3"], 4, 1),
    (["parallel.zero_stage=3", "parallel.micro_batch=1"], 4, 2),
    (["parallel.zero_stage=2", "parallel.zero_group=2"], 2, 1),
    (["parallel.zero_stage=3", "parallel.zero_group=2"], 2, 1),
    (["parallel.zero_stage=0", "parallel.precision=bf16"], 4, 1),
    (["parallel.zero_stage=1", "parallel.precision=bf16"], 4, 1),
    (["parallel.zero_stage=3", "parallel.precision=bf16"], 4, 1),
]
WORLD = 4


@pytest.fixture(scope="module")
def on_ranks(parity_overrides):
    """Rank 0's results of every default check, from one start of the WORLD ranks: the
    ledgers of LAYOUTS and of ZPP, and the validation losses of ZeRO-3 with and without
    every ZeRO++ switch after 30 steps at lr 1e-2."""
    return run_on_ranks(_every_check, WORLD, parity_overrides, timeout_s=900)[0]


def _every_check(rt, overrides):
    loss_sets = overrides + ["train.lr=1e-2", "train.steps=30"]
    return (_two_steps(rt, overrides, [s for s, _, _ in LAYOUTS]),
            _two_steps(rt, overrides, ZPP),
            _loss_after_training(rt, loss_sets, [ZPP[0], ZPP[-1]], 30))


@pytest.fixture(scope="module")
def recorded(on_ranks):
    return on_ranks[0]


def expected_state(stage: int, psi: int, n: int, compute_bytes: int) -> dict:
    """ZeRO, Sec. 5.1: (p + g + K) Ψ with the sharded terms divided by n."""
    mixed = compute_bytes < 4
    master = 4 * psi if mixed else 0
    optimizer = 8 * psi
    params, grads = compute_bytes * psi, compute_bytes * psi
    if stage >= 1:
        master, optimizer = master // n, optimizer // n
    if stage >= 2:
        grads //= n
    if stage >= 3:
        params //= n
    return {"params": params, "grads": grads, "master": master, "optimizer": optimizer,
            "total": params + grads + master + optimizer, "host": 0, "disk": 0}  # no offload


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_model_state_bytes_match_the_zero_formula(index, parity_overrides, recorded):
    sets, n, _ = LAYOUTS[index]
    cfg = load_config(None, parity_overrides + sets)
    units = unit_sizes(cfg)
    assert all(u % 8 == 0 for u in units)
    compute = 2 if cfg.parallel.precision == "bf16" else 4
    state = recorded[index][0]
    assert state == expected_state(cfg.parallel.zero_stage, sum(units), n, compute)


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_communication_bytes_match_the_analytic_volume(index, parity_overrides, recorded):
    sets, n, m = LAYOUTS[index]
    cfg = load_config(None, parity_overrides + sets)
    units = unit_sizes(cfg)
    psi, root, blocks = sum(units), units[0], sum(units[1:])
    b = 2 if cfg.parallel.precision == "bf16" else 4
    stage, dp = cfg.parallel.zero_stage, WORLD
    expected = {("all_reduce", "dp_replicate+dp_shard", "loss"): 4}
    if stage == 0:
        expected[("all_reduce", "dp_replicate+dp_shard", "grads")] = b * psi
    else:
        expected[("all_reduce", "dp_shard", "grad_norm")] = 4
        rs_per_step = m if stage >= 2 else 1
        expected[("reduce_scatter", "dp_shard", "grads")] = rs_per_step * b * psi
        if stage in (1, 2):
            expected[("all_gather", "dp_shard", "params")] = b * psi
        else:  # forward gathers every unit, backward every block again (the root stays)
            expected[("all_gather", "dp_shard", "params")] = m * b * (root + 2 * blocks)
        if n < dp:  # hierarchical: second hop across the dp / n replicas
            expected[("all_reduce", "dp_replicate", "grads")] = b * psi // n
    assert recorded[index][1] == expected
    wire = recorded[index][2]
    for (op, dim, purpose), nbytes in expected.items():
        group = {"dp_shard": n, "dp_replicate": dp // n, "dp_replicate+dp_shard": dp}[dim]
        factor = 2 * (group - 1) if op == "all_reduce" else group - 1
        assert wire[(op, dim, purpose)] == nbytes * factor // group, (op, dim, purpose)


def test_zero_volume_per_rank_is_2_psi_for_ddp_and_stages_1_2_and_3_psi_for_stage_3(
        parity_overrides, recorded):
    """The paper's headline volumes (Sec. 7): wire bytes per rank per step over Ψ elements."""
    units = unit_sizes(load_config(None, parity_overrides))
    psi = sum(units)
    ratios = {}
    for index in (0, 1, 3):
        wire = recorded[index][2]
        grads_and_params = sum(v for (op, dim, purpose), v in wire.items()
                               if purpose in ("grads", "params"))
        ratios[index] = grads_and_params / (4 * psi) * WORLD / (WORLD - 1)
    assert ratios[0] == pytest.approx(2.0) and ratios[1] == pytest.approx(2.0)
    assert ratios[3] == pytest.approx(3.0 - units[0] / psi)  # 3Ψ less the root's backward
    assert 2.4 < ratios[3] < 3.0                               # gather (the root stays gathered)


# ------------------------------------------------------------------------------ ZeRO++

ZPP_BASE = ["parallel.zero_stage=3", "cluster.gpus_per_node=2"]
ZPP = [ZPP_BASE, ZPP_BASE + ["parallel.qwz=true"], ZPP_BASE + ["parallel.hpz=true"],
       ZPP_BASE + ["parallel.qgz=true"],
       ZPP_BASE + ["parallel.qwz=true", "parallel.hpz=true", "parallel.qgz=true"]]


@pytest.fixture(scope="module")
def zpp_recorded(on_ranks):
    return on_ranks[1]


def test_zeropp_bytes(parity_overrides, zpp_recorded):
    plain = unit_sizes(load_config(None, parity_overrides))
    units = [math.ceil(u / (WORLD * BLOCK)) * WORLD * BLOCK for u in plain]
    root, blocks = units[0], sum(units[1:])
    g, nodes = 2, WORLD // 2
    int8_and_scales = lambda n: n + 4 * n // BLOCK  # noqa: E731  (bytes of n quantized values)
    base, qwz, hpz, qgz, all3 = (r[1] for r in zpp_recorded)

    ag = ("all_gather", "dp_shard", "params")
    assert base[ag] == 4 * (plain[0] + 2 * sum(plain[1:]))  # unquantized: no block padding
    assert qwz[ag] == int8_and_scales(root + 2 * blocks)  # forward and backward, quantized
    assert hpz[ag] == 4 * sum(plain)  # hpZ alone quantizes nothing: no block padding
    assert hpz[("all_gather", "dp_shard.intra", "params")] == 4 * sum(plain[1:])  # backward

    rs = ("reduce_scatter", "dp_shard", "grads")
    assert base[rs] == 4 * sum(plain)
    assert rs not in qgz
    assert qgz[("all_to_all", "dp_shard.intra", "grads")] == int8_and_scales(root + blocks)
    assert qgz[("all_to_all", "dp_shard.inter", "grads")] == int8_and_scales(root + blocks) // g
    assert nodes == 2

    total = lambda t: sum(v for k, v in t.items() if k[2] in ("grads", "params"))  # noqa: E731
    assert total(all3) < 0.5 * total(base)


def _loss_after_training(rt, overrides, layouts, steps):
    out = []
    for sets in layouts:
        trainer = Trainer(load_config(None, overrides + sets), rt, "unused")
        for s in range(steps):
            trainer.train_step(s)
        out.append(trainer.evaluate())
    return out


def test_zeropp_validation_loss_within_2_percent(on_ranks):
    """ZeRO++ changes the math on purpose (int8 weights and gradients in flight): after the
    same 30 steps at lr 1e-2 its validation loss stays within 2% of the unquantized ZeRO-3
    run."""
    base, quantized = on_ranks[2]
    assert base < 5.5  # it learned something (the uniform-guess loss is ln 512 = 6.24)
    assert abs(quantized - base) / base < 0.02


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_zeropp_default_model_within_2_percent(tmp_path):
    """The issue's check on the default model (tiny preset, built-in corpus, default optimizer
    and 200-step schedule; 4 ranks, 2 per node so hpZ and qgZ have an intra- and an inter-node
    hop): every ZeRO++ switch on ends within 2% of ZeRO-3's validation loss. Measured 5.068
    vs 5.057 (-0.2%); about 10 minutes on 2 idle cores."""
    sets = [f"data.cache_dir='{tmp_path}'", "train.tensorboard=false", "train.sample_tokens=0"]
    cfg = load_config(None, sets)
    prepare_data(cfg)
    base, quantized = run_on_ranks(_loss_after_training, WORLD, sets, [ZPP[0], ZPP[-1]],
                                   cfg.train.steps, timeout_s=3000)[0]
    print(f"validation loss after {cfg.train.steps} steps: ZeRO-3 {base:.4f}, ZeRO++ "
          f"{quantized:.4f} ({100 * (quantized / base - 1):+.2f}%)")
    assert abs(quantized - base) / base < 0.02
