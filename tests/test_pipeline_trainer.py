"""The Trainer with pipeline parallelism (parallel.pp > 1) reproduces the single-process
Trainer, alone and composed with data and tensor parallelism (3D: pp 2 x dp 2 x tp 2 on 8
ranks), resumes from its checkpoints exactly, exports them (`fivefold convert`,
`--init-from`), and runs from `fivefold train`.

Each layout trains 5 optimizer steps of a tiny model (4 blocks, hidden 64, 32 tokens, global
batch 8) through `Trainer.train_step`, then `Trainer.evaluate`; the reference is the
single-process Trainer on the same config. Tolerances are those of tests/test_data_parallel.py
and tests/test_tensor_parallel.py (fp32 on CPU, lr 1e-3): losses and the validation loss rel
2e-5, gradient norms rel 1e-4, parameters atol 1e-5 + rtol 1e-4. The stages' backward and the
tensor-parallel sums only change the order of float additions; as in the tensor-parallel tests
Adam's eps is 1e-6, which bounds how much Adam can amplify such a rounding difference on an
element whose gradient is nearly zero (lr |dg| / eps per step).

Ranks start once per world size (2, 4, 8) and run every layout of that size in turn. ZeRO-3
(pp 2 x dp 2: 1F1B tied, GPipe, interleaved, ZB; and pp 2 x dp 2 x tp 2) gathers and frees
each stage's blocks around every pass and reduce-scatters per micro-batch, as the
non-pipeline engine does: same tolerances.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fivefold.config import ConfigError, load_config
from fivefold.models.llama import build_model
from fivefold.models.pretrained import WEIGHTS_FILE
from fivefold.parallel.pipeline.build import build_pipeline_stage
from fivefold.parallel.plan import plan_from_config
from fivefold.parallel.tensor import gather_full_state
from fivefold.testing import run_on_ranks
from fivefold.train.data import prepare_data
from fivefold.train.dist import Runtime
from fivefold.train.model_source import convert, load_weights_into
from fivefold.train.trainer import Trainer
from fivefold.validate import validate_for_training

STEPS = 5
CPU = Runtime(0, 1, 0, torch.device("cpu"))
# (schedule, vpp, micro_batch, tied, tp, sequence_parallel, zero_stage); dp = world / pp / tp
LAYOUTS = {
    2: [("1f1b", 1, 1, True, 1, False, 0),  # 8 micro-batches, tied embeddings
        ("interleaved", 2, 2, False, 1, False, 0),  # 4 micro-batches x 2 chunks of 1 block
        ("zb", 1, 2, True, 1, False, 0)],
    4: [("1f1b", 1, 1, True, 1, False, 1),  # pp 2 x dp 2, ZeRO-1
        ("zb", 1, 2, True, 2, False, 0),  # pp 2 x tp 2: vocabulary-parallel tied head
        ("gpipe", 1, 2, False, 2, True, 0),  # pp 2 x tp 2, sequence parallel
        ("1f1b", 1, 1, True, 1, False, 3),  # pp 2 x dp 2, ZeRO-3, tied
        ("gpipe", 1, 2, False, 1, False, 3),  # pp 2 x dp 2, ZeRO-3
        ("interleaved", 2, 2, False, 1, False, 3),  # ZeRO-3, 2 chunks of 1 block
        ("zb", 1, 1, True, 1, False, 3)],  # ZeRO-3: W passes on freed blocks
    8: [("1f1b", 1, 1, True, 2, True, 1),  # pp 2 x dp 2 x tp 2, SP, ZeRO-1
        ("1f1b", 1, 1, True, 2, True, 3)],  # pp 2 x dp 2 x tp 2, SP, ZeRO-3
}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _sets(base, layout):
    schedule, vpp, micro, tied, tp, sp, zero = layout
    return base + [f"model.tied_embeddings={str(tied).lower()}", "parallel.pp=2",
                   f"parallel.schedule={schedule}", f"parallel.vpp={vpp}",
                   f"parallel.micro_batch={micro}", f"parallel.tp={tp}",
                   f"parallel.sequence_parallel={str(sp).lower()}",
                   f"parallel.zero_stage={zero}"]


def _train(rt, cfg, tmp):
    """5 steps and validation: (losses, grad norms, val loss, full params, last step's ledger).
    The run ends with a checkpoint in `tmp`."""
    trainer = Trainer(cfg, rt, tmp)
    results = [trainer.train_step(s) for s in range(STEPS)]
    records = trainer.ledger.as_dicts()
    val = trainer.evaluate()
    if trainer.engine:
        params = gather_full_state(trainer.engine.full_state_dict(), cfg.model.vocab,
                                   trainer.tp_axis)
    else:
        params = {n: q.detach().clone() for n, q in trainer.model.named_parameters()}
    trainer._save(STEPS)
    return [r.loss for r in results], [r.grad_norm for r in results], val, params, records


def _resume(rt, base, tmp):
    """Losses of 4 straight steps, and of 2 steps, a checkpoint, a new Trainer resuming from
    it and 2 more steps (pp 2, 1F1B, tied embeddings)."""
    cfg = load_config(None, _sets(base, LAYOUTS[2][0]))
    straight_trainer = Trainer(cfg, rt, f"{tmp}/straight")
    straight = [straight_trainer.train_step(s).loss for s in range(4)]
    first = Trainer(cfg, rt, f"{tmp}/resumed")
    losses = [first.train_step(s).loss for s in range(2)]
    first._save(2)
    second = Trainer(cfg, rt, f"{tmp}/resumed")
    start = second._resume()
    losses += [second.train_step(s).loss for s in range(start, 4)]
    keys = sorted(second._checkpoint_state())
    return straight, losses, start, keys


def _two_bw(rt, base, tmp):
    """PipeDream-2BW through the Trainer: 3 steps' losses (the first computed with the initial
    weights) and the 3 losses with weight prediction."""
    sets = base + ["parallel.pp=2", "parallel.schedule=pipedream-2bw", "parallel.micro_batch=2",
                   "train.steps=3"]
    trainer = Trainer(load_config(None, sets), rt, f"{tmp}/2bw")
    losses = [trainer.train_step(s).loss for s in range(3)]
    predicting = Trainer(load_config(None, sets + ["parallel.weight_prediction=true"]), rt,
                         f"{tmp}/2bw-predict")
    predicted = [predicting.train_step(s).loss for s in range(3)]
    return losses, predicted


TWO_BW_RESUME = {"adamw": [], "prediction": ["parallel.weight_prediction=true"],
                 "muon": ["train.optimizer=muon"]}


def _two_bw_resume(rt, base, tmp):
    """PipeDream-2BW (tied, 2 micro-batches of 2 sequences, so pp 2's first rank has step
    t+1's first forward in flight at every UPDATE t) with AdamW, AdamW and weight prediction,
    and Muon: a 5-step run that writes a checkpoint after step 2 and goes on, and a new
    Trainer that resumes from that checkpoint and runs steps 2-4. Per mode: both runs'
    losses of steps 2-4 and their final stage parameters (the run directory holds the last
    checkpoint). A third Trainer on the finished directory finds the run complete."""
    out = {}
    for mode, sets in TWO_BW_RESUME.items():
        cfg = load_config(None, base + [
            "parallel.pp=2", "parallel.schedule=pipedream-2bw", "parallel.micro_batch=2",
            "parallel.global_batch=4", "model.tied_embeddings=true"] + sets)
        straight = Trainer(cfg, rt, f"{tmp}/2bw-resume-{mode}")
        losses = [straight.train_step(s).loss for s in range(2)]
        straight._save(2)
        losses = [straight.train_step(s).loss for s in range(2, STEPS)]
        resumed = Trainer(cfg, rt, f"{tmp}/2bw-resume-{mode}")
        start = resumed._resume()
        again = [resumed.train_step(s).loss for s in range(start, STEPS)]
        resumed._save(STEPS)
        complete = Trainer(cfg, rt, f"{tmp}/2bw-resume-{mode}").run()  # nothing left to run
        assert complete == {"steps": STEPS, "complete": True}
        out[mode] = [(losses, dict(straight.model.named_parameters())),
                        (again, dict(resumed.model.named_parameters()))]
    return out


def _on_ranks(rt, base, layouts, tmp):
    trained = [_train(rt, load_config(None, _sets(base, layout)), f"{tmp}/{i}")
               for i, layout in enumerate(layouts)]
    extra = {}
    if rt.world_size == 2:
        extra = {"resume": _resume(rt, base, tmp), "2bw": _two_bw(rt, base, tmp),
                 "2bw-resume": _two_bw_resume(rt, base, tmp)}
    return trained, extra


@pytest.fixture(scope="module")
def base(tiny_overrides):
    sets = tiny_overrides + ["model.layers=4", "parallel.global_batch=8", "train.lr=1e-3",
                             "train.eps=1e-6", "train.sample_tokens=0", f"train.steps={STEPS}"]
    prepare_data(load_config(None, sets))  # tokenize once, before the ranks start
    return sets


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory):
    """The single-process Trainer, tied and untied."""
    return {tied: _train(CPU, load_config(None, base + [
        f"model.tied_embeddings={str(tied).lower()}"]), tmp_path_factory.mktemp("ref"))
        for tied in (True, False)}


@pytest.fixture(scope="module")
def run_root(tmp_path_factory) -> Path:
    """Layout i of world size w trains in run_root / f"w{w}" / str(i)."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def ranks(base, run_root):
    for world in LAYOUTS:
        (run_root / f"w{world}").mkdir()
    return {world: run_on_ranks(_on_ranks, world, base, layouts, str(run_root / f"w{world}"),
                                timeout_s=900)
            for world, layouts in LAYOUTS.items()}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_trainer_matches_one_process(world, ranks, reference):
    """Every rank reports the reference losses, gradient norms and validation loss; the
    stages' parameters (gathered over dp shards and tp) are the reference's, by name."""
    for i, layout in enumerate(LAYOUTS[world]):
        ref_losses, ref_norms, ref_val, ref_params, _ = reference[layout[3]]
        label = f"world {world} {layout}"
        params = {}
        for trained, _ in ranks[world]:
            losses, norms, val, rank_params, _ = trained[i]
            assert losses == pytest.approx(ref_losses, rel=2e-5), label
            assert norms == pytest.approx(ref_norms, rel=1e-4), label
            assert val == pytest.approx(ref_val, rel=2e-5), label
            params.update(rank_params)
        assert params.keys() == ref_params.keys(), label
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-4, atol=1e-5,
                                       msg=f"{label} {name}")


def _pp_bytes(records, op, purpose):
    return sum(r["bytes"] for r in records
               if (r["op"], r["mesh_dim"], r["purpose"]) == (op, "pp", purpose))


def test_trainer_ledger_records_pipeline_messages(ranks):
    """1F1B, pp 2, 8 micro-batches of one sequence, tied embeddings: the first stage sends 8
    activations (1 x 32 x 64 fp32) and the embedding (512 x 64), and receives 8 input
    gradients and the head's gradient share. With tp 2 and sequence parallelism (pp 2 x dp 2
    x tp 2) each tp rank sends its sequence shard (1 x 16 x 64) and its vocabulary rows
    (256 x 64): half each."""
    act, table = 1 * 32 * 64 * 4, 512 * 64 * 4
    first = ranks[2][0][0][0][4]
    assert _pp_bytes(first, "send", "pp_activations") == 8 * act
    assert _pp_bytes(first, "recv", "pp_grads") == 8 * act
    assert _pp_bytes(first, "send", "pp_tied_weight") == table
    assert _pp_bytes(first, "recv", "pp_tied_grads") == table
    last = ranks[2][1][0][0][4]
    assert _pp_bytes(last, "send", "pp_grads") == 8 * act
    first_3d = ranks[8][0][0][0][4]  # rank 0: pp 0, dp 0, tp 0
    per_dp_rank = 4  # 8 sequences over dp 2, micro-batches of 1
    assert _pp_bytes(first_3d, "send", "pp_activations") == per_dp_rank * act // 2
    assert _pp_bytes(first_3d, "send", "pp_tied_weight") == table // 2


def test_zero_bubble_weight_pass_repeats_no_collective(ranks):
    """pp 2 x tp 2 ZB (4 micro-batches of 2 sequences): per micro-batch each stage's 2 blocks
    enter and leave 2 tensor-parallel regions (one all-reduce forward, one backward each),
    plus the first stage's embedding (forward) or the last stage's final norm (backward): 9,
    so 36 per step on every rank, exactly as many as a full backward issues. The W passes add
    none (before they recorded the final norm's output after Megatron's f and ran its
    all-reduce again: 40 on the last stage)."""
    for rank, (trained, _) in enumerate(ranks[4]):
        records = trained[1][4]  # LAYOUTS[4][1]: zb, tp 2
        tp_sums = sum(r["op"] == "all_reduce" and r["mesh_dim"] == "tp" and
                      r["purpose"] == "tp_activations" for r in records)
        assert tp_sums == 4 * 9, rank


def test_checkpoint_resumes_exactly(ranks):
    """pp 2: keys carry the pp rank (both stages have a "root" unit); resuming at step 2
    gives the straight run's losses bit for bit."""
    straight, resumed, start, keys = ranks[2][0][1]["resume"]
    assert start == 2
    assert resumed == straight
    assert "master.root.shard0of1.pp0of2" in keys


def test_pipedream_2bw_runs_in_the_trainer(ranks, reference):
    """PipeDream-2BW's first step computes with the initial weights, so its loss is the
    synchronous one (rel 2e-5); later steps use one-step-stale weights (their update rule is
    checked exactly in tests/test_pipeline_parity.py). With `parallel.weight_prediction`
    steps 0 and 1 still compute with W(0) (nothing to extrapolate yet: the same losses,
    rel 1e-6), step 2 with W(1) + (W(1) - W(0)) instead of W(1)."""
    losses, predicted = ranks[2][0][1]["2bw"]
    assert losses[0] == pytest.approx(reference[False][0][0], rel=2e-5)
    assert all(x == x for x in losses) and losses[2] < losses[0]  # finite, and it learns
    assert predicted[:2] == pytest.approx(losses[:2], rel=1e-6)
    assert predicted[2] != pytest.approx(losses[2], rel=1e-4) and predicted[2] < predicted[0]


@pytest.mark.parametrize("mode", TWO_BW_RESUME)
def test_pipedream_2bw_resumes_exactly(ranks, run_root, tmp_path, mode):
    """A 2BW run resumed from its checkpoint after step 2 recomputes the forwards that were in
    flight with the saved older version (the tied matrix sent to the last stage again) and
    continues as the run that never stopped: the same losses and parameters, bit for bit."""
    whole = {}
    for _, extra in ranks[2]:
        (losses, params), (again, resumed) = extra["2bw-resume"][mode]
        assert again == losses
        assert params.keys() == resumed.keys()
        for name, q in params.items():
            assert torch.equal(q, resumed[name]), name
        whole.update(params)
    # the stages' checkpoints export as the whole model (`fivefold convert`, `--init-from`)
    convert(run_root / "w2" / f"2bw-resume-{mode}", tmp_path, to="fivefold")
    exported = load_file(tmp_path / WEIGHTS_FILE)
    assert exported.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(exported[name], value), name


def test_stage_takes_pretrained_weights_by_name(base):
    """`load_plain_state`: each stage's parameters, and the borrowed tied head, from a
    whole model's state (another seed, so nothing equals the stage's own init)."""
    cfg = load_config(None, base + ["parallel.pp=2", "model.tied_embeddings=true"])
    plain = build_model(cfg.model, seed=123).state_dict()
    for rank in range(2):
        stage = build_pipeline_stage(cfg, plan_from_config(cfg, 2), rank, torch.device("cpu"))
        stage.load_plain_state(plain)
        for name, q in stage.named_parameters():
            assert torch.equal(q, plain[name]), name
        if stage.borrows_embedding:
            assert torch.equal(stage.tied_head_weight, plain["tok_embeddings.weight"])


@pytest.mark.parametrize("sets, key", [
    (["parallel.zero_stage=3", "parallel.schedule='terapipe'"], "parallel.schedule"),
    (["parallel.precision='fp16'", "parallel.schedule='pipedream-2bw'",
      "parallel.micro_batch=1"], "parallel.precision"),
    (["parallel.tp=2", "parallel.schedule='terapipe'"], "parallel.schedule"),
    (["parallel.tp=2", "parallel.schedule='pipedream-2bw'", "parallel.micro_batch=1"],
     "parallel.schedule"),
])
def test_unsupported_compositions_fail_at_config_time(sets, key, base):
    cfg = load_config(None, base + ["parallel.pp=2"] + sets)
    with pytest.raises(ConfigError) as err:
        validate_for_training(cfg, 8)
    assert err.value.key == key


def test_cli_trains_with_pp2(tiny_overrides, tmp_path):
    """`fivefold train --nproc 2 --set parallel.pp=2`: 3 steps with the single-process losses
    (rel 1e-5), metrics whose ledger summary holds the stage messages (rank 0, the first
    stage, of 1 micro-batch of 4 x 32 tokens x 64 wide fp32: one activation out, one
    gradient in), a checkpoint per stage, and no text sample."""
    sets = tiny_overrides + ["train.eval_every=3", "train.checkpoint_every=3"]
    args = [a for s in sets + ["parallel.pp=2"] for a in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "fivefold", "train", *args, "--steps", "3",
                           "--nproc", "2", "--run-dir", str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no text sample" in proc.stdout
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3] and "val_loss" in records[-1]
    trainer = Trainer(load_config(None, sets + ["train.steps=3"]), CPU, tmp_path / "one")
    ref = [trainer.train_step(s).loss for s in range(3)]
    assert [r["loss"] for r in records] == pytest.approx(ref, rel=1e-5)
    act = 4 * 32 * 64 * 4
    comm = records[-1]["ledger"]["comm"]
    assert comm["send@pp"] == {"calls": 1, "bytes": act, "wire_bytes": act}
    assert comm["recv@pp"]["bytes"] == act
    meta = json.loads((tmp_path / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert meta["step"] == 3


def test_pipeline_checkpoints_export(ranks, run_root, base, tmp_path):
    """`fivefold convert` (and `--init-from`, the same reader) joins every layout's last
    checkpoint: per-stage keys (pp 2, vpp 2 chunks), data-parallel shards (ZeRO-1, ZeRO-3) and
    tensor-parallel shards with the padded vocabulary dropped (pp 2 x tp 2, and pp 2 x dp 2 x
    tp 2). The weights equal, bit for bit, the full parameters gathered from the ranks."""
    exported = {}
    for world, layouts in LAYOUTS.items():
        for i, layout in enumerate(layouts):
            label = f"world {world} {layout}"
            params = {}
            for trained, _ in ranks[world]:
                params.update(trained[i][3])
            out = tmp_path / f"w{world}-{i}"
            convert(run_root / f"w{world}" / str(i), out, to="fivefold")
            state = exported[world, i] = load_file(out / WEIGHTS_FILE)
            assert state.keys() == params.keys(), label
            for name, value in params.items():
                assert torch.equal(state[name], value), f"{label} {name}"
    cfg = load_config(None, _sets(base, LAYOUTS[8][0]))
    model = build_model(cfg.model, seed=123)
    load_weights_into(model, cfg.model, run_root / "w8" / "0")
    for name, value in model.state_dict().items():
        assert torch.equal(value, exported[8, 0][name]), name
