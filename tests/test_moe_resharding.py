"""Expert-parallel checkpoints resume under other layouts and export to transformers
(fivefold.train.expert_checkpoint, fivefold.train.reshard, fivefold.train.checkpoint_export).

The tiny MoE of tests/test_expert_parallel.py with 4 experts (top-2, both blocks MoE, the
balancing loss on). On 4 gloo ranks, one process start:

  ep 2 x edp 2, ZeRO-1, routing biases on -> ep 4, ZeRO-1
                                          -> dp 4 without ep, ZeRO-1
                                          -> pp 2 x ep 2, 1F1B
  dp 4 without ep, ZeRO-1                 -> ep 2 x edp 2, ZeRO-3

Each old layout trains steps 1-3 and saves; each new layout resumes from a copy of that
checkpoint, saves what it loaded, and trains step 4. The ep 2 checkpoint also resumes in
one process (the plain Trainer and torch's AdamW).

Tolerances. Resharding is a copy of rows: every weight, AdamW moment and step count, and every
routing bias, read back whole from the checkpoint the new layout saves right after loading,
equals the old checkpoint's bit for bit. The resumed loss of step 4 equals the
one-process run's within rel 2e-5, the parity tolerance of tests/test_resharding.py (fp32 on
CPU, lr 1e-3; the layouts' sums in steps 1-3 run in another float order).

Export: `fivefold convert` of the ep 2 x edp 2 ZeRO-3 checkpoint writes a Mixtral folder that
transformers loads; its logits equal fivefold's on the checkpoint's weights within rtol 1e-4,
atol 1e-5 (tests/test_hf.py's tolerance: the same function in another rounding order; the
logits here, 3 steps from initialization, are of magnitude 0.1-1).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fivefold.config import ConfigError, load_config
from fivefold.parallel.plan import plan_from_config
from fivefold.testing import run_on_ranks
from fivefold.train.checkpoint import check_layout, layout_record, step_dir
from fivefold.train.checkpoint_export import read_expert_biases, read_training_state
from fivefold.train.trainer import Trainer

from parity import CPU, assert_hf_export_matches, assert_state_equal

STEPS, SAVE_AT = 4, 3  # at step 3 the routing biases are not zero (at 2 they happen to be)
LOSS_REL = 2e-5  # module docstring
MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32",
       "model.moe.aux_loss_weight=0.01", "parallel.micro_batch=2", "train.eps=1e-6",
       f"train.steps={STEPS}"]
BIAS = ["model.moe.bias_update_rate=0.01"]
EP2 = ["parallel.ep=2", "parallel.zero_stage=1"]
DP4 = ["parallel.zero_stage=1"]
OLD = {"ep2": BIAS + EP2, "dp4": DP4}  # old layouts: model keys and layout
CHANGES = {  # name: (old layout, new layout)
    "ep2 -> ep4": ("ep2", ["parallel.ep=4", "parallel.zero_stage=1"]),
    "ep2 -> dp4 (no ep)": ("ep2", DP4),
    "ep2 -> pp2 x ep2": ("ep2", ["parallel.ep=2", "parallel.pp=2", "parallel.schedule='1f1b'"]),
    "dp4 (no ep) -> ep2 ZeRO-3": ("dp4", ["parallel.ep=2", "parallel.zero_stage=3"]),
}


@pytest.fixture(scope="module")
def moe_sets(parity_overrides):
    return parity_overrides + MOE


def model_keys(old: str) -> list[str]:
    return BIAS if old == "ep2" else []


def _on_ranks(rt, sets, tmp):
    """Old layouts: 3 steps and a checkpoint each; then per change the resumed layout's saved
    state and its loss of step 4."""
    for old, layout in OLD.items():
        trainer = Trainer(load_config(None, sets + layout), rt, f"{tmp}/{old}")
        for s in range(SAVE_AT):
            trainer.train_step(s)
        trainer._save(SAVE_AT)
    out = {}
    for k, (name, (old, new)) in enumerate(CHANGES.items()):
        if rt.rank == 0:
            shutil.copytree(step_dir(f"{tmp}/{old}", SAVE_AT), step_dir(f"{tmp}/{k}", SAVE_AT))
        dist.barrier()
        resumed = Trainer(load_config(None, sets + model_keys(old) + new), rt, f"{tmp}/{k}")
        start = resumed._resume()
        resumed.run_dir = resumed.run_dir.with_name(f"{k}.loaded")
        resumed._save(start)
        out[name] = (start, [resumed.train_step(s).loss for s in range(start, STEPS)])
    return out


@pytest.fixture(scope="module")
def resharded(moe_sets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_reshard")
    return tmp, run_on_ranks(_on_ranks, 4, moe_sets, str(tmp), timeout_s=900)


@pytest.fixture(scope="module")
def one_process(moe_sets, tmp_path_factory):
    """The one-process Trainer's losses of 4 straight steps, with and without routing biases."""
    out = {}
    for old in OLD:
        trainer = Trainer(load_config(None, moe_sets + model_keys(old)), CPU,
                          tmp_path_factory.mktemp("plain"))
        out[old] = [trainer.train_step(s).loss for s in range(STEPS)]
    return out



@pytest.mark.slow
def test_an_ep_checkpoint_reshards_exactly(resharded, moe_sets):
    """Every change of layout holds, right after resuming, the old checkpoint's whole experts
    (joined over its ep ranks and edp shards), dense weights, AdamW moments and step counts and
    routing biases, bit for bit; the experts' moments are not empty and the biases not zero."""
    tmp, _ = resharded
    cfg = load_config(None, moe_sets).model
    for k, (name, (old, _)) in enumerate(CHANGES.items()):
        saved, loaded = step_dir(tmp / old, SAVE_AT), step_dir(tmp / f"{k}.loaded", SAVE_AT)
        want = read_training_state(saved, cfg)
        assert_state_equal(read_training_state(loaded, cfg), want, name)
        assert want[0]["layers.0.mlp.w1"].shape == (4, 32, 64), name  # whole, all 4 experts
        assert all(want[1][f"layers.{i}.mlp.w{j}"]["exp_avg"].abs().flatten(1).sum(1).min() > 0
                   for i in range(2) for j in (1, 2, 3)), name  # every expert was trained
        biases, loaded_biases = read_expert_biases(saved), read_expert_biases(loaded)
        assert biases.keys() == loaded_biases.keys() == ({"layers.0", "layers.1"}
                                                         if old == "ep2" else set()), name
        for block, bias in biases.items():
            assert bias.abs().sum() > 0 and torch.equal(loaded_biases[block], bias), name


@pytest.mark.slow
def test_resumed_losses_follow_one_process(resharded, one_process):
    """Each new layout resumes at step 3 and its loss of step 4 is the one-process run's
    within rel 2e-5; every rank logs the same losses."""
    _, results = resharded
    for name, (old, _) in CHANGES.items():
        start, after = results[0][name]
        assert start == SAVE_AT, name
        assert after == pytest.approx(one_process[old][SAVE_AT:], rel=LOSS_REL), name
    assert all(r == results[0] for r in results[1:])


@pytest.mark.slow
def test_an_ep_checkpoint_resumes_in_one_process(resharded, moe_sets, one_process, tmp_path):
    """ep 2 x edp 2 ZeRO-1 -> one process: the plain model, its routing biases and torch's
    AdamW hold exactly the checkpoint's tensors; step 4 is the one-process run's."""
    tmp, _ = resharded
    assert_resumes_in_one_process(step_dir(tmp / "ep2", SAVE_AT), moe_sets, tmp_path,
                                  one_process["ep2"], "one process")


def assert_resumes_in_one_process(saved: Path, sets: list[str], run_dir: Path,
                                  want_losses: list[float], label: str) -> None:
    """The expert-parallel checkpoint folder `saved` resumed by one process in `run_dir`:
    the plain model, its routing biases and torch's AdamW hold exactly its tensors, and the
    steps after SAVE_AT are `want_losses`' (rel LOSS_REL)."""
    shutil.copytree(saved, step_dir(run_dir, SAVE_AT))
    cfg = load_config(None, sets + BIAS)
    trainer = Trainer(cfg, CPU, run_dir)
    assert trainer._resume() == SAVE_AT
    names = {id(q): n for n, q in trainer.model.named_parameters()}
    got = ({n: q.detach() for n, q in trainer.model.named_parameters()},
           {names[id(q)]: state for q, state in trainer.optimizer.state.items()})
    assert_state_equal(got, read_training_state(saved, cfg.model), label)
    for block, bias in read_expert_biases(saved).items():
        assert torch.equal(trainer.model.get_submodule(block).mlp.expert_bias, bias), block
    losses = [trainer.train_step(s).loss for s in range(SAVE_AT, STEPS)]
    assert losses == pytest.approx(want_losses[SAVE_AT:], rel=LOSS_REL), label


@pytest.mark.slow
def test_convert_of_an_ep_checkpoint_loads_in_transformers(resharded, tmp_path):
    """`fivefold convert` of the ep 2 x edp 2 ZeRO-3 checkpoint: a Mixtral folder whose
    per-expert tensors are the checkpoint's rows, and whose logits in transformers equal
    fivefold's on the checkpoint's weights (rtol 1e-4, atol 1e-5)."""
    tmp, _ = resharded
    k = list(CHANGES).index("dp4 (no ep) -> ep2 ZeRO-3")
    pre, tensors = assert_hf_export_matches(step_dir(tmp / f"{k}.loaded", SAVE_AT),
                                            tmp_path / "hf")
    for e in range(4):  # expert 3 lives on ep rank 1, in its edp shards
        assert torch.equal(tensors[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"],
                           pre.state["layers.1.mlp.w2"][e])


def test_an_ep_change_of_layout_is_resharded_not_refused(moe_sets):
    """check_layout names ep, etp and tp (which the experts fold into) as changes to reshard,
    either way; Muon's states of experts split over etp ranks it refuses, naming the key."""
    def meta(*sets):
        cfg = load_config(None, moe_sets + list(sets))
        return layout_record(plan_from_config(cfg, 4, "fp32"))

    def plan(*sets):
        return plan_from_config(load_config(None, moe_sets + list(sets)), 4, "fp32")

    path = Path("ckpt")
    assert check_layout(path, meta("parallel.ep=2"), plan("parallel.ep=2")) == []
    assert check_layout(path, meta("parallel.ep=2"), plan("parallel.ep=4")) == ["parallel.ep"]
    assert check_layout(path, meta("parallel.ep=2"), plan()) == ["parallel.ep"]
    assert "parallel.tp" in check_layout(path, meta("parallel.ep=2"),
                                         plan("parallel.ep=2", "parallel.tp=2"))
    assert check_layout(path, meta("parallel.ep=2"), plan("parallel.etp=2")) == [
        "parallel.ep", "parallel.etp"]
    assert {"parallel.tp", "parallel.ep", "parallel.etp"} <= set(check_layout(
        path, meta("parallel.etp=2", "parallel.ep=2"), plan("parallel.tp=2")))
    muon = "train.optimizer='muon'"
    with pytest.raises(ConfigError, match="split over etp ranks") as err:
        check_layout(path, meta(muon, "parallel.ep=2"), plan(muon, "parallel.etp=2"))
    assert err.value.key == "parallel.ep"


def test_a_model_mixtral_does_not_compute_is_not_exported():
    """Export refuses, naming the key, an MoE that Mixtral's config cannot express exactly."""
    from fivefold.config import ModelConfig, MoEConfig
    from fivefold.models.hf import CheckpointError, hf_config_from_model

    base = dict(layers=2, hidden=32, heads=4, ffn_hidden=48, vocab=96, seq_len=16)
    assert hf_config_from_model(ModelConfig(**base, moe=MoEConfig(experts=4)),
                                torch.float32)["model_type"] == "mixtral"
    for key, value in (("shared_experts", 1), ("score", "sigmoid"), ("bias_update_rate", 0.01),
                       ("capacity_factor", 1.25), ("dense_layers", 1)):
        cfg = ModelConfig(**base, moe=MoEConfig(experts=4, **{key: value}))
        with pytest.raises(CheckpointError) as err:
            hf_config_from_model(cfg, torch.float32)
        assert err.value.key == f"model.moe.{key}"


@pytest.mark.parametrize("ep,etp,tp", [(2, 1, 1), (4, 1, 1), (2, 2, 1), (1, 2, 1), (1, 1, 2),
                                       (2, 2, 2)])
def test_expert_units_are_joined_into_whole_experts(ep, etp, tp, tmp_path):
    """One process, no ranks: each grid rank's units of a model (its expert rows and etp
    columns apart, as the engine builds them), cut into 2 edp shards with padding, read back
    as the whole model bit for bit; `expert_part` then gives each (ep, etp) rank exactly the
    part its unit held. With tp 2 (which leaves the experts whole) each expert unit's shards
    sit under different tp ranks' tags, as the edp ranks holding them have."""
    import copy

    from fivefold.comm.collectives import Axis
    from fivefold.config import ModelConfig, MoEConfig
    from fivefold.models.llama import build_model
    from fivefold.parallel.tensor import apply_tensor_parallel
    from fivefold.train.checkpoint_export import _join_flat_units
    from fivefold.train.expert_checkpoint import ExpertGrid, expert_part, rank_units

    cfg = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=40, vocab=67,
                      seq_len=8, moe=MoEConfig(experts=4, top_k=2, expert_ffn_hidden=24))
    model = build_model(cfg, seed=5)
    grid = ExpertGrid(ep, etp, True)
    flat, held = {}, {}
    for t in range(tp):
        tp_model = copy.deepcopy(model)
        tag = f".tp{t}of{tp}" if tp > 1 else ""
        if tp > 1:
            apply_tensor_parallel(tp_model, Axis("tp", None, tp, t, None), False)
        for place in grid.ranks():
            for unit, params, expert in rank_units(copy.deepcopy(tp_model), grid, *place):
                if expert and t:
                    continue
                buffer = torch.cat([p.detach().reshape(-1) for _, p in params])
                buffer = torch.cat([buffer, torch.zeros(buffer.numel() % 2)])  # 2 shards
                for r, piece in enumerate(buffer.chunk(2)):
                    where = f".tp{r}of{tp}" if expert and tp > 1 else tag  # edp r's tp rank
                    flat[f"master.{unit}.shard{r}of2{where}"] = piece
                held.update({(place, name): p.detach() for name, p in params if expert})
    assert any(f".experts{ep - 1}of{ep}" in key for key in flat)
    state = _join_flat_units(flat, cfg, tmp_path)
    assert state.keys() == {name for name, _ in model.named_parameters()}
    for name, value in model.named_parameters():
        assert torch.equal(state[name], value.detach()), name
        for place in grid.ranks():
            part = expert_part(name, state[name], ep, place[0], etp, place[1])
            assert torch.equal(part, held.get((place, name), value.detach())), (name, place)
