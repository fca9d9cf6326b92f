"""Pipeline parallelism on gloo ranks reproduces the single-process trainer (parity), moves the
bytes it should (ledger), and TeraPipe's sliced attention equals the plain block.

Each layout runs 5 optimizer steps of the tiny test model through `PipelineEngine` with a step
loop that mirrors fivefold.train.trainer.Trainer: summed token cross-entropy divided by the
global batch's tokens, the global gradient norm clipped to train.grad_clip, AdamW with decay
on matrices, the same learning-rate schedule and data. The reference is the single-process
Trainer on the same config. Tolerances are those of tests/test_data_parallel.py (fp32 on CPU,
lr 1e-3: losses rel 2e-5, parameters atol 1e-5 + rtol 1e-4): micro-batching and the
stage-by-stage backward only change the order of float sums (measured: at most 2e-7 on any
parameter). TeraPipe also changes the attention kernel (a masked kernel over a key/value
prefix instead of one causal kernel); Adam turns the rounding difference into up to 1.1e-5
on elements with near-zero gradients (measured, pp 4), so its parameters get atol 3e-5.

Layouts cover every synchronous schedule with pp 2 and pp 4, uneven stages (7 blocks on 2
stages split 4 + 3 by cost, on 4 stages 2 + 2 + 2 + 1), micro-batch counts below, equal to and
above pp, tied and untied embeddings, and pp 2 x dp 2 with DDP, ZeRO-1 and ZeRO-2.

PipeDream-2BW changes the math on purpose (one step of weight staleness); its update rule,
W(t+1) = W(t) - lr * grad f(W(t-1)), is checked against a single-process implementation of
that rule (gradient clipping off: 2BW clips per stage), losses rel 2e-5, parameters atol 3e-5:
without clipping, elements whose gradient is near Adam's eps (1e-8) turn a gradient rounding
difference of 5e-10 (5e-7 relative, measured) into a first-step difference of 5e-6, and up to
2e-5 after 5 steps (measured, pp 2 x 8 micro-batches). The same with weight prediction.
With Muon (train.optimizer = "muon") parameters get atol 1e-4: torch's Muon orthogonalizes in
bf16, where a gradient rounding difference can move an element across a bf16 rounding step
(2^-8 relative) and Newton-Schulz spreads it over the matrix (measured: up to 3.4e-5 after 5
steps); the same run without staleness is 3.3e-3 away, so a wrong rule still fails.
The default model's validation loss under 2BW is tests/test_pipedream_2bw_default.py's (slow).
"""

from __future__ import annotations

import math

import pytest
import torch
from parity import CPU, STEPS, assert_params_close, train_steps

from fivefold.comm import collectives as C
from fivefold.comm.ledger import Ledger
from fivefold.config import load_config
from fivefold.lr_schedule import lr_at
from fivefold.models.llama import build_model
from fivefold.optim import build_optimizer
from fivefold.parallel.data_parallel import DataParallelEngine
from fivefold.parallel.grad_clip import clip_grad_norm_
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.pipeline.build import build_pipeline_stage, layer_ranges
from fivefold.parallel.pipeline.executor import PipelineEngine
from fivefold.parallel.pipeline.partition import slice_bounds
from fivefold.parallel.pipeline.pipedream_2bw import PipeDream2BWEngine
from fivefold.parallel.pipeline.schedules import build_schedule
from fivefold.parallel.pipeline.terapipe import TokenSliceCache
from fivefold.parallel.plan import plan_from_config
from fivefold.testing import run_on_ranks
from fivefold.train.data import BatchSampler, prepare_data

TEST_MODEL = ["model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=96",
              "model.vocab=512", "model.seq_len=32"]
# (schedule, vpp, micro_batch, layers, tied, zero_stage (None: no data-parallel engine), dp)
LAYOUTS_PP2 = [
    ("gpipe", 1, 8, 7, True, None, 1),  # 1 micro-batch: below pp
    ("gpipe", 1, 2, 7, False, None, 1),  # 4 micro-batches
    ("1f1b", 1, 1, 7, True, None, 1),  # 8
    ("1f1b", 1, 4, 7, False, None, 1),  # 2 = pp
    ("interleaved", 2, 2, 8, True, None, 1),  # 4 micro-batches x 2 chunks of 2 blocks
    ("interleaved", 2, 8, 8, False, None, 1),  # 1: below pp
    ("zb", 1, 1, 7, True, None, 1),
    ("zb", 1, 8, 7, False, None, 1),
    ("terapipe", 1, 4, 7, True, None, 1),  # 2 micro-batches x 2 token slices
]
LAYOUTS_4 = [  # 4 ranks: pp 4, then pp 2 x dp 2
    ("gpipe", 1, 1, 7, True, None, 1),
    ("1f1b", 1, 4, 7, True, None, 1),  # 2 micro-batches: below pp
    ("1f1b", 1, 1, 7, False, 0, 1),  # 8: above; the engine on 1 dp rank, as the trainer runs
    ("interleaved", 2, 2, 8, True, None, 1),  # 4 = pp
    ("zb", 1, 1, 7, True, None, 1),
    ("zb", 1, 4, 7, False, None, 1),
    ("terapipe", 1, 2, 7, True, None, 1),  # 4 micro-batches x 4 slices
    ("1f1b", 1, 1, 7, True, 0, 2),  # pp 2 x dp 2, DDP: 4 micro-batches per dp rank
    ("zb", 1, 2, 7, False, 1, 2),  # pp 2 x dp 2, ZeRO-1
    ("1f1b", 1, 2, 7, True, 2, 2),  # pp 2 x dp 2, ZeRO-2
    ("interleaved", 2, 2, 8, True, 0, 2),
]


def _overrides(base, layout):
    schedule, vpp, micro, layers, tied, _, _ = layout
    return base + [f"model.layers={layers}", f"model.tied_embeddings={str(tied).lower()}",
                   f"parallel.schedule={schedule}", f"parallel.vpp={vpp}",
                   f"parallel.micro_batch={micro}", f"train.steps={STEPS}"]


def pipeline_rank(rt, cfg, dp, ledger):
    """This rank's place in a pp x dp grid (pp = world / dp): the mesh, its pipeline stage, and
    the train and validation samplers of its dp rank."""
    mesh = Mesh({"pp": rt.world_size // dp, "dp_replicate": 1, "dp_shard": dp, "cp": 1, "tp": 1},
                "cpu", ledger)
    plan = plan_from_config(cfg, rt.world_size)
    stage = build_pipeline_stage(cfg, plan, mesh.axis("pp").rank, rt.device)
    data = prepare_data(cfg, log=lambda _: None)
    train, val = (BatchSampler(tokens, cfg.model.seq_len, cfg.parallel.global_batch,
                               cfg.train.seed, split, mesh.axis("dp_shard").rank, dp)
                  for split, tokens in enumerate((data.train, data.val)))
    return mesh, stage, train, val


def pipeline_run(rt, base, layout, tmp):
    """5 optimizer steps of one layout on this rank, then validation: (losses, this rank's
    params, the last step's ledger records, validation loss)."""
    zero, dp = layout[5], layout[6]
    cfg = load_config(None, _overrides(base, layout) + [f"parallel.pp={rt.world_size // dp}"])
    ledger = Ledger()
    mesh, stage, sampler, val_sampler = pipeline_rank(rt, cfg, dp, ledger)
    pp_axis, dp_axis = mesh.axis("pp"), mesh.axis("dp_shard")
    p, t = cfg.parallel, cfg.train
    engine = DataParallelEngine(stage, zero, mesh, t, rt.device) if zero is not None else None
    train, evaluation = plan_from_config(cfg, rt.world_size).pipeline_schedules(
        cfg.model.tied_embeddings)
    pipe = PipelineEngine(stage, train, pp_axis, evaluation, grad_sync=engine)
    optimizer = None if engine else build_optimizer(stage, t, rt.device)
    global_tokens = p.global_batch * cfg.model.seq_len
    losses = []
    for step in range(STEPS):
        ledger.start_step()
        lr = lr_at(step, t)
        inputs, targets = sampler.rank_batch(step)
        loss = pipe.train_step(inputs, targets, 1.0 / global_tokens)
        if engine:
            clip_grad_norm_([m.grad for m in engine.masters], t.grad_clip or math.inf,
                            [engine.shard_axis, pp_axis])
            engine.step(lr)
            engine.zero_grad()
        else:
            clip_grad_norm_([q.grad for q in stage.parameters()], t.grad_clip or math.inf,
                            [pp_axis])
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        C.all_reduce(loss, dp_axis, "loss")
        losses.append(loss.item() / global_tokens)
    records = ledger.as_dicts()
    val = sum(pipe.eval_step(*val_sampler.rank_batch(i)) for i in range(t.eval_batches))
    C.all_reduce(val, dp_axis, "val_loss")
    params = (engine.full_state_dict() if engine else
              {n: q.detach().clone() for n, q in stage.named_parameters()})
    return losses, params, records, val.item() / (t.eval_batches * global_tokens)


def _world(rt, base, layouts, two_bw_layouts, tmp):
    """One start of these ranks for every check on them: the synchronous schedules'
    layouts (pipeline_run), then PipeDream-2BW's (two_bw_run)."""
    return ([pipeline_run(rt, base, layout, tmp) for layout in layouts],
            two_bw_run(rt, base, two_bw_layouts))


@pytest.fixture(scope="module")
def ranks(parity_overrides, tmp_path_factory):
    """Every rank's results per world size (2 and 4)."""
    return {world: run_on_ranks(_world, world, parity_overrides, layouts,
                                [x for x in TWO_BW if x[0] * x[1] == world],
                                str(tmp_path_factory.mktemp(f"w{world}")), timeout_s=900)
            for world, layouts in ((2, LAYOUTS_PP2), (4, LAYOUTS_4))}


@pytest.fixture(scope="module")
def reference(parity_overrides, tmp_path_factory):
    """Single-process Trainer losses, parameters and validation loss per (layers, tied)."""
    out = {}
    for layers, tied in ((7, True), (7, False), (8, True), (8, False)):
        layout = ("1f1b", 1, 8, layers, tied, None, 1)
        cfg = load_config(None, _overrides(parity_overrides, layout))
        out[(layers, tied)] = train_steps(CPU, cfg, tmp_path_factory.mktemp("ref"),
                                          evaluate=True)
    return out


def _assert_parity(per_rank, ref, label, atol=1e-5):
    """Every rank's losses and validation loss rel 2e-5; the stages' parameters together
    are the reference's, atol `atol` + rtol 1e-4."""
    for losses, _, _, val in per_rank:
        assert losses == pytest.approx(ref.losses, rel=2e-5), label
        assert val == pytest.approx(ref.val_loss, rel=2e-5), label
    params = {}
    for _, rank_params, _, _ in per_rank:
        params.update(rank_params)
    assert_params_close(params, ref.params, label, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("world, layouts", [(2, LAYOUTS_PP2), (4, LAYOUTS_4)])
def test_parity_with_one_process(world, layouts, ranks, reference):
    for i, layout in enumerate(layouts):
        per_rank = [ranks[world][r][0][i] for r in range(world)]
        atol = 3e-5 if layout[0] == "terapipe" else 1e-5
        _assert_parity(per_rank, reference[(layout[3], layout[4])], f"world {world} {layout}",
                       atol)


def test_stages_hold_the_plain_models_parameters():
    """Every parameter of every stage, by name, equals the single-process model's (7 blocks
    on 4 stages by cost: 2 + 2 + 2 + 1); the borrowed tied head equals the embedding."""
    cfg = load_config(None, TEST_MODEL + ["model.layers=7", "model.tied_embeddings=true",
                                          "parallel.pp=4"])
    plain = dict(build_model(cfg.model, cfg.train.seed).named_parameters())
    plan = plan_from_config(cfg, 4)
    assert [len(r) for r in layer_ranges(cfg.model, plan)] == [2, 2, 2, 1]
    seen = {}
    for rank in range(4):
        stage = build_pipeline_stage(cfg, plan, rank, torch.device("cpu"))
        seen.update(dict(stage.named_parameters()))
        if rank == 3:
            assert torch.equal(stage.tied_head_weight, plain["tok_embeddings.weight"])
    assert set(seen) == set(plain)
    for name, value in plain.items():
        assert torch.equal(seen[name], value), name


def test_zero_bubble_split_equals_the_full_backward():
    """I then W (one rank, untied) accumulates the same gradients as B, to float rounding."""
    cfg = load_config(None, TEST_MODEL + ["model.layers=3", "parallel.micro_batch=2"])
    tokens = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
    grads = []
    for name in ("1f1b", "zb"):
        stage = build_pipeline_stage(cfg, plan_from_config(cfg, 1), 0, torch.device("cpu"))
        schedule = build_schedule(name, 1, 2)
        axis = C.Axis("pp", None, 1, 0, Ledger())
        PipelineEngine(stage, schedule, axis).train_step(tokens[:, :-1], tokens[:, 1:], 1e-2)
        grads.append({n: q.grad for n, q in stage.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-7, rtol=1e-5, msg=name)


def _pp_bytes(records, op, purpose):
    return sum(r["bytes"] for r in records
               if (r["op"], r["mesh_dim"], r["purpose"]) == (op, "pp", purpose))


def test_ledger_records_every_pipeline_message(ranks):
    """1F1B, pp 2, 8 micro-batches of one sequence, tied embeddings (a layout of the parity
    test's 2 ranks): each micro-batch sends one activation (1 x 32 tokens x 64 wide x 4
    bytes) down and one gradient up, and the 512 x 64 embedding matrix goes to the last
    stage and its gradient share comes back."""
    i = LAYOUTS_PP2.index(("1f1b", 1, 1, 7, True, None, 1))
    act, table = 1 * 32 * 64 * 4, 512 * 64 * 4
    first, last = ranks[2][0][0][i][2], ranks[2][1][0][i][2]
    assert _pp_bytes(first, "send", "pp_activations") == 8 * act
    assert _pp_bytes(last, "recv", "pp_activations") == 8 * act
    assert _pp_bytes(last, "send", "pp_grads") == 8 * act
    assert _pp_bytes(first, "recv", "pp_grads") == 8 * act
    assert _pp_bytes(first, "send", "pp_tied_weight") == _pp_bytes(last, "recv",
                                                                    "pp_tied_weight") == table
    assert _pp_bytes(last, "send", "pp_tied_grads") == _pp_bytes(first, "recv",
                                                                  "pp_tied_grads") == table
    for records in (first, last):
        sends = [r for r in records if r["op"] == "send"]
        assert all(r["wire_bytes"] == r["bytes"] and r["group_size"] == 2 for r in sends)
        assert all(r["wire_bytes"] == 0 for r in records if r["op"] == "recv")
        assert {(r["op"], r["purpose"]) for r in records if r["mesh_dim"] == "pp"
                and r["op"] == "all_reduce"} == {("all_reduce", "loss"),
                                                 ("all_reduce", "grad_norm")}


def test_sliced_attention_reproduces_the_plain_block():
    """TeraPipe's key/value cache: a block run on 3 uneven slices (11, 11, 10 tokens), with
    backwards in reverse slice order, gives the plain block's output and gradients (fp32,
    atol 1e-6, and rtol 1e-6 on the parameter gradients, sums over every token whose
    elements reach about 2, where one ulp is 2.4e-7: only the kernels' summation order
    differs, and on AMD EPYC cores one element of wo's gradient differed by 1.2e-6)."""
    cfg = load_config(None, TEST_MODEL + ["model.layers=1"]).model
    model = build_model(cfg, seed=3)
    block, cos, sin = model.layers[0], model.rope_cos, model.rope_sin
    x_BTD = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0))
    probe_BTD = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1))
    x_full = x_BTD.clone().requires_grad_()
    (block(x_full, cos, sin) * probe_BTD).sum().backward()
    full_grads = {n: q.grad.clone() for n, q in block.named_parameters()}
    block.zero_grad()
    cache, outs, xs = TokenSliceCache(), [], []
    bounds = slice_bounds(32, 3)
    assert bounds == [(0, 11), (11, 22), (22, 32)]
    for k, (lo, hi) in enumerate(bounds):
        xs.append(x_BTD[:, lo:hi].clone().requires_grad_())
        outs.append(cache.block_fn((0, 0, k))(0, block, xs[k], cos[lo:hi], sin[lo:hi]))
    torch.testing.assert_close(torch.cat(outs, dim=1), block(x_BTD, cos, sin), atol=1e-6,
                               rtol=0)
    for k in reversed(range(3)):
        lo, hi = bounds[k]
        extra_outs, extra_grads = cache.backward_extras((0, 0, k))
        torch.autograd.backward([(outs[k] * probe_BTD[:, lo:hi]).sum()] + extra_outs,
                                [None] + extra_grads)
        cache.after_backward((0, 0, k))
    torch.testing.assert_close(torch.cat([x.grad for x in xs], dim=1), x_full.grad, atol=1e-6,
                               rtol=0)
    for name, q in block.named_parameters():
        torch.testing.assert_close(q.grad, full_grads[name], atol=1e-6, rtol=1e-6, msg=name)


# ---------------------------------------------------------------- PipeDream-2BW

# (pp, dp, micro_batch, layers, tied, weight prediction, optimizer); micro-batches per step
# = 8 / dp / micro_batch
TWO_BW = [(2, 1, 2, 7, True, False, "adamw"), (2, 1, 1, 7, False, False, "adamw"),
          (4, 1, 2, 7, True, False, "adamw"), (2, 2, 1, 7, True, False, "adamw"),
          (2, 1, 2, 7, True, True, "adamw"), (4, 1, 2, 7, False, True, "adamw"),
          (2, 2, 1, 7, True, True, "adamw"), (2, 1, 2, 7, True, False, "muon"),
          (2, 2, 1, 7, False, False, "muon")]


def _two_bw_config(base, micro, layers, tied, optimizer, pp=1):
    return load_config(None, base + [
        f"model.layers={layers}", f"model.tied_embeddings={str(tied).lower()}",
        "parallel.schedule=pipedream-2bw", f"parallel.micro_batch={micro}", f"parallel.pp={pp}",
        f"train.steps={STEPS}", "train.grad_clip=0", f"train.optimizer={optimizer}"])


def two_bw_run(rt, base, layouts):
    out = []
    for pp, dp, micro, layers, tied, predict, optimizer in layouts:
        cfg = _two_bw_config(base, micro, layers, tied, optimizer, pp)
        mesh, stage, sampler, val_sampler = pipeline_rank(rt, cfg, dp, Ledger())
        pp_axis, dp_axis = mesh.axis("pp"), mesh.axis("dp_shard")
        p, t = cfg.parallel, cfg.train
        tokens = p.global_batch * cfg.model.seq_len
        engine = PipeDream2BWEngine(stage, pp_axis, p.global_batch // dp // micro, STEPS,
                                    build_optimizer(stage, t, rt.device),
                                    sampler.rank_batch, 1.0 / tokens, dp_axis=dp_axis,
                                    predict=predict)
        losses = []
        for step in range(STEPS):
            loss = engine.train_step(step, lr_at(step, t))
            C.all_reduce(loss, dp_axis, "loss")
            losses.append(loss.item() / tokens)
        val = engine.eval_step(*val_sampler.rank_batch(0))
        C.all_reduce(val, dp_axis, "val_loss")
        out.append((losses, {n: q.detach().clone() for n, q in stage.named_parameters()},
                    val.item() / tokens))
    return out


def stale_reference(cfg, predict):
    """One process, the 2BW rule: step t's gradient is taken at W(t-1), applied to W(t); with
    weight prediction (`predict`) taken at W(t-1) + (W(t-1) - W(t-2)) instead."""
    t, p = cfg.train, cfg.parallel
    data = prepare_data(cfg, log=lambda _: None)
    sampler = BatchSampler(data.train, cfg.model.seq_len, p.global_batch, t.seed)
    model, stale = build_model(cfg.model, t.seed), build_model(cfg.model, t.seed)
    optimizer = build_optimizer(model, t, torch.device("cpu"))
    versions, losses = [model.state_dict()], []
    versions[0] = {k: v.clone() for k, v in versions[0].items()}
    for step in range(STEPS):
        older, old = versions[max(step - 2, 0)], versions[max(step - 1, 0)]
        stale.load_state_dict({k: 2 * old[k] - older[k] for k in old} if predict else old)
        inputs, targets = sampler.rank_batch(step)
        ce = torch.nn.functional.cross_entropy(stale(inputs).flatten(0, 1), targets.flatten(),
                                               reduction="sum")
        (ce / (p.global_batch * cfg.model.seq_len)).backward()
        for q, q_stale in zip(model.parameters(), stale.parameters()):
            q.grad, q_stale.grad = q_stale.grad, None
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, t)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        versions.append({k: v.clone() for k, v in model.state_dict().items()})
        losses.append(ce.item() / (p.global_batch * cfg.model.seq_len))
    inputs, targets = BatchSampler(data.val, cfg.model.seq_len, p.global_batch, t.seed,
                                   1).rank_batch(0)
    with torch.no_grad():
        val = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(),
                                                reduction="sum").item()
    return (losses, {n: q.detach().clone() for n, q in model.named_parameters()},
            val / (p.global_batch * cfg.model.seq_len))


@pytest.mark.parametrize("world", [2, 4])
def test_pipedream_2bw_applies_stale_gradients(world, parity_overrides, ranks):
    """pp 2 and pp 4 (tied and untied), and pp 2 x dp 2 (gradients all-reduced at UPDATE),
    with AdamW and Muon; losses and validation loss rel 2e-5, parameters atol 3e-5 (Muon
    1e-4) + rtol 1e-4 (module docstring)."""
    layouts = [x for x in TWO_BW if x[0] * x[1] == world]
    results = [rank[1] for rank in ranks[world]]
    for i, (pp, dp, micro, layers, tied, predict, optimizer) in enumerate(layouts):
        ref_losses, ref_params, ref_val = stale_reference(
            _two_bw_config(parity_overrides, micro, layers, tied, optimizer), predict)
        layout = (pp, dp, micro, tied, predict, optimizer)
        first, last = results[0][i], results[(pp - 1) * dp][i]  # first, last stage; dp rank 0
        assert first[0] == pytest.approx(ref_losses, rel=2e-5), layout
        assert last[0] == pytest.approx(ref_losses, rel=2e-5), layout
        assert first[2] == pytest.approx(ref_val, rel=2e-5), layout
        params = {}
        for r in range(world):
            params.update(results[r][i][1])
        assert_params_close(params, ref_params, f"{layout}", rtol=1e-4,
                            atol=1e-4 if optimizer == "muon" else 3e-5)
