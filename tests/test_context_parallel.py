"""Context parallelism in training: parity with one process, and the ledger predicted exactly.

Each cp rank holds its part of every sequence (ring: the zigzag chunks c and 2cp-1-c;
Ulysses: chunk c), its tokens at their true positions (rotary rows and labels of the unsplit
sequence), and gradients are summed over the dp x cp ranks (ZeRO shards over them).

Parity tolerance (as tests/test_tensor_parallel.py, whose argument carries over): fp32 on CPU
at lr 1e-3, after 5 optimizer steps losses agree to 2e-5 relative, gradient norms to 1e-4
relative, parameters to 1e-5 absolute + 1e-4 relative; the blockwise online softmax and the
sums over cp ranks add in another order than one process, and Adam's eps is 1e-6 so that a
rounding-level gradient change moves no element by more than lr * |dg| / eps per step.

Models are tiny (2 layers, hidden 64, 32 tokens): grouped-query attention with 2 key/value
heads (fewer than Ulysses' 4 ranks at cp 4: replicated to fit) and with 1, tied and untied
embeddings. The hybrid runs Ulysses over pairs of neighbouring cp ranks and the ring across
the pairs (cp 4 = 2 x 2; cp 8: a ring of 4 across 2-rank Ulysses groups). Composed with
tensor (and sequence) parallelism and with pipelines, up to pp 2 x cp 2 x tp 2 on 8 ranks.
Ranks start once per world size (2, 4 and, with `-m slow`, 8).
"""

from __future__ import annotations

import pytest
import torch
from parity import CPU, STEPS, assert_params_close, full_parameters, resumed_losses, train_steps

from fivefold.config import load_config
from fivefold.memory.activation_count import SavedActivations
from fivefold.parallel.plan import training_plan
from fivefold.planner.activations import block_saved_bytes, ring_kv_heads
from fivefold.planner.ledger_model import predict_ledger
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer

MODELS = {
    "gqa-tied": ["model.heads=4", "model.kv_heads=2", "model.tied_embeddings=true"],
    "mqa-untied": ["model.heads=4", "model.kv_heads=1", "model.tied_embeddings=false"],
}
TP2 = ("parallel.tp=2",)
SP2 = ("parallel.tp=2", "parallel.sequence_parallel=true")
PP2 = ("parallel.pp=2",)
# (model, cp, cp_mode, zero_stage, micro_batch, other keys); dp = world / (cp tp pp)
RESUMED = ("gqa-tied", 2, "ring", 3, None, ())  # a LAYOUTS_4 layout, stopped and resumed
LAYOUTS_2 = [("gqa-tied", 2, "ring", 0, None, ()), ("gqa-tied", 2, "ulysses", 0, None, ()),
             ("mqa-untied", 2, "ring", 0, 2, ()), ("mqa-untied", 2, "ulysses", 0, None, ())]
LAYOUTS_4 = [("gqa-tied", 4, "ring", 0, None, ()), ("gqa-tied", 4, "ulysses", 0, None, ()),
             ("mqa-untied", 4, "ulysses", 0, None, ()),
             RESUMED, ("mqa-untied", 2, "ulysses", 1, None, ()),
             ("gqa-tied", 2, "ulysses", 2, 2, ()), ("mqa-untied", 2, "ring", 0, None, ()),
             ("gqa-tied", 2, "ring", 0, None, SP2), ("gqa-tied", 2, "ulysses", 1, None, TP2),
             ("gqa-tied", 2, "ring", 0, 2, PP2),
             ("mqa-untied", 2, "ulysses", 1, 2, (*PP2, "parallel.schedule=gpipe"))]
HYBRID = ("parallel.cp_ulysses=2",)
LAYOUTS_4 += [("gqa-tied", 4, "hybrid", 0, None, HYBRID),
              ("mqa-untied", 4, "hybrid", 2, 2, HYBRID)]
LAYOUTS_8 = [("gqa-tied", 2, "ring", 1, 2, (*PP2, *SP2)),
             ("gqa-tied", 8, "hybrid", 3, None, HYBRID),
             ("gqa-tied", 4, "hybrid", 0, None, (*HYBRID, *TP2))]


def _sets(overrides, model, cp=1, mode="ring", stage=0, micro=None, other=()):
    sets = overrides + MODELS[model] + [f"parallel.cp={cp}", f"parallel.cp_mode={mode}",
                                        f"parallel.zero_stage={stage}", f"train.steps={STEPS}",
                                        *other]
    return sets + ([f"parallel.micro_batch={micro}"] if micro else [])


def _on_ranks(rt, overrides, layouts, tmp):
    trained = [train_steps(rt, load_config(None, _sets(overrides, *layout)), tmp, evaluate=True)
               for layout in layouts]
    ledgers = [run.first_ledger for run in trained]
    saved = [_saved_bytes(rt, load_config(None, _sets(overrides, *layout)), tmp)
             for layout in _activation_layouts(layouts)]
    resume = None
    if rt.world_size == 4:  # cp 2 x dp 2 under ZeRO-3: stopped at step 2, resumed to step 4
        straight = trained[layouts.index(RESUMED)]  # the same config, run straight
        cfg = load_config(None, _sets(overrides, *RESUMED))
        losses, _, resumed = resumed_losses(rt, cfg, f"{tmp}/resumed", save_at=2, steps=4)
        resumed._save(4)
        resume = (straight.losses[:4], losses, full_parameters(resumed), f"{tmp}/resumed")
    return (trained if rt.rank == 0 else None), ledgers, resume, saved


def _activation_layouts(layouts):
    """The layouts whose blocks save only activations: cp alone (tp and pp change the
    count, and ZeRO-3's gathered weights are saved by the matmuls that use them)."""
    return [layout for layout in layouts if layout[5] in ((), HYBRID) and layout[3] < 3]


def _saved_bytes(rt, cfg, tmp) -> list[int]:
    """Bytes each block of this rank saves for backward over one micro-batch (saved-tensor
    hooks), and the tokens of that micro-batch on this rank."""
    trainer = Trainer(cfg, rt, tmp)
    x, y = trainer.train_sampler.rank_batch(0)
    x, y = x[:trainer.micro_batch], y[:trainer.micro_batch]
    labels = {f"layers.{i}": block for i, block in enumerate(trainer.model.layers)}
    with SavedActivations(trainer.model, labels) as acts:
        trainer.micro_batch_loss(x, y).backward()
    return [acts.bytes_by_label[name] for name in labels], x.numel()


@pytest.fixture(scope="module")
def overrides(parity_overrides):
    return parity_overrides + ["train.eps=1e-6"]


@pytest.fixture(scope="module")
def reference(overrides, tmp_path_factory):
    """The single-process Trainer, per model."""
    return {m: train_steps(CPU, load_config(None, _sets(overrides, m)),
                           tmp_path_factory.mktemp("r"), evaluate=True)
            for m in MODELS}


class _RunsByWorld(dict):
    """Each world's ranks started once, when a test first asks for that world, so a run
    without `-m slow` never starts the 8 ranks."""

    def __init__(self, overrides, tmp_path_factory):
        super().__init__()
        self.overrides, self.tmp = overrides, tmp_path_factory

    def __missing__(self, world):
        self[world] = run_on_ranks(_on_ranks, world, self.overrides, dict(WORLDS)[world],
                                   str(self.tmp.mktemp(f"w{world}")), timeout_s=900)
        return self[world]


@pytest.fixture(scope="module")
def ranks(overrides, tmp_path_factory):
    return _RunsByWorld(overrides, tmp_path_factory)


WORLDS = [(2, LAYOUTS_2), (4, LAYOUTS_4), (8, LAYOUTS_8)]
PARAMS = [(2, LAYOUTS_2), (4, LAYOUTS_4), pytest.param(8, LAYOUTS_8, marks=pytest.mark.slow)]


@pytest.mark.parametrize("world, layouts", PARAMS)
def test_parity_with_one_process(world, layouts, ranks, reference):
    """Losses and the validation loss rel 2e-5, gradient norms rel 1e-4, parameters atol
    1e-5 + rtol 1e-4 (module docstring): the validation loss is the unsplit sequence's, not
    a cp-fold sum. Under a pipeline rank 0 holds the first stage: its parameters are
    compared."""
    for layout, run in zip(layouts, ranks[world][0][0]):
        ref = reference[layout[0]]
        label = "model {} cp {} {} zero {} micro {} {}".format(*layout)
        assert run.losses == pytest.approx(ref.losses, rel=2e-5), label
        assert run.val_loss == pytest.approx(ref.val_loss, rel=2e-5), label
        assert run.grad_norms == pytest.approx(ref.grad_norms, rel=1e-4), label
        pipelined = any(key.startswith("parallel.pp=") for key in layout[5])
        ref_params = {n: ref.params[n] for n in run.params} if pipelined else ref.params
        assert_params_close(run.params, ref_params, label, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("world, layouts", PARAMS)
def test_ledger_prediction_equals_runtime(world, layouts, ranks, overrides):
    """Every rank's ledger of one step (the ring's sends and receives of key/value blocks and
    of their gradients, Ulysses' all-to-alls, the gradient sync over dp x cp) and its
    model-state bytes equal `predict_ledger` of the same plan, exactly."""
    for i, layout in enumerate(layouts):
        cfg = load_config(None, _sets(overrides, *layout))
        plan = training_plan(cfg, world, "cpu")
        for rank in range(world):
            got = ranks[world][rank][1][i]
            predicted = predict_ledger(cfg, plan, rank=rank)
            where = f"{layout}, rank {rank}"
            assert predicted.totals("bytes") == got[0], where
            assert predicted.totals("wire_bytes") == got[1], where
            assert predicted.model_state_bytes == got[2], where


def test_resume_is_exact(ranks):
    """cp 2 x dp 2, ZeRO-3, ring: a run stopped after 2 steps and resumed from its
    checkpoint gives the uninterrupted run's losses bit for bit."""
    straight, resumed, _, _ = ranks[4][0][2]
    assert resumed == straight


def test_checkpoint_exports_the_whole_model(ranks):
    """`fivefold convert`'s reader (fivefold.train.checkpoint_export) joins the ZeRO-3 shards
    that span dp x cp back into the whole model's tensors, equal to the trained ones."""
    from fivefold.train.checkpoint_export import read_checkpoint

    _, _, params, run_dir = ranks[4][0][2]
    exported = read_checkpoint(run_dir).state
    assert exported.keys() == params.keys()
    for name, value in params.items():
        assert torch.equal(exported[name], value), name


@pytest.mark.parametrize("world, layouts", WORLDS[:2])
def test_saved_activations_fall_as_one_over_cp(world, layouts, ranks, overrides):
    """On every rank each block saves about 1/cp of what one process saves for the same
    micro-batch (ring attention a little less: it keeps the key/value heads unrepeated), and
    the planner's count of it (fivefold.planner.activations) is within 5%, as for one
    process (tests/test_planner_ledger.py)."""
    for rank in range(world):
        for layout, (blocks, tokens) in zip(_activation_layouts(layouts),
                                            ranks[world][rank][3]):
            cfg = load_config(None, _sets(overrides, *layout))
            cp = layout[1]
            plan = training_plan(cfg, world, "cpu")
            whole = block_saved_bytes(cfg.model, tokens * cp, 4)  # one process, within 5%
            predicted = block_saved_bytes(cfg.model, tokens, 4,
                                          kv_heads=ring_kv_heads(cfg.model, plan))
            for saved in blocks:
                assert saved <= whole / cp * 1.05, (layout, rank)
                assert saved == pytest.approx(predicted, rel=0.05), (layout, rank)
