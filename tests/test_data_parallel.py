"""Data parallelism: each stage reproduces the single-process run (parity), holds the memory
the ZeRO paper promises (model-state bytes per rank, exactly) and moves the bytes it promises
(communication ledger, exactly).

Parity tolerance: fp32 on CPU at lr 1e-3 (each step moves a parameter by up to 1e-3), after
5 optimizer steps losses agree to 2e-5 relative and parameters (scale 0.02) to 1e-5 absolute
+ 1e-4 relative. The layouts sum gradients in a different order than one process, and Adam
divides by the root of the second moment, so an element with a near-zero gradient turns a
rounding difference of 1e-12 into a parameter difference of about 2e-6 (measured, 8 ranks).
"""

from __future__ import annotations

import pytest
from parity import CPU, STEPS, assert_params_close, train_steps

from fivefold.config import load_config
from fivefold.testing import run_on_ranks
from fivefold.train.trainer import Trainer

LAYOUTS_2 = [  # (zero_stage, zero_group, micro_batch)
    (0, None, None), (0, None, 1), (1, None, None), (1, None, 1), (2, None, None),
    (2, None, 1), (3, None, None), (3, None, 1)]
LAYOUTS_4 = [(0, None, None), (1, None, 1), (2, None, None), (3, None, 1), (1, 2, None),
             (2, 2, 1), (3, 2, None), (3, None, 1, ["parallel.hpz=true", "cluster.gpus_per_node=2"])]
LAYOUTS_8 = [(0, None, None), (1, None, None), (3, None, None), (3, 4, None), (2, 2, None)]


def _config(overrides, stage, group, micro, extra=()):
    sets = overrides + [f"parallel.zero_stage={stage}", f"train.steps={STEPS}", *extra]
    if group:
        sets.append(f"parallel.zero_group={group}")
    if micro:
        sets.append(f"parallel.micro_batch={micro}")
    return load_config(None, sets)


MUON = ["train.optimizer=muon"]
MUON_LAYOUTS = {2: [(0, None, 1, MUON), (0, None, None, MUON + ["parallel.pp=2"])],
                4: [(0, None, None, MUON + ["parallel.pp=2"])]}
RESUME_LAYOUTS = [(0, None, None), (1, None, None), (3, None, 1), (2, 1, None),
                  (0, None, None, MUON)]  # on 2 ranks
FOUR_BLOCKS = ["model.layers=4"]


TP_EPS = "train.eps=1e-6"  # tensor parallelism's eps (test_recompute_matches_one_process)


def _recompute_layouts(mode: str) -> dict[int, list]:
    """DDP with micro-batches, ZeRO-2, ZeRO-3, pipelines (1F1B, GPipe, interleaved on 4
    blocks) and tp 2 with and without sequence parallelism (at eps 1e-6) on 2 ranks; pp 2 x
    ZeRO-3 on 4."""
    rec = [f"parallel.recompute={mode}"]
    tp = [TP_EPS, "parallel.tp=2"]
    tp_sp = tp + ["parallel.sequence_parallel=true"]
    return {2: [(0, None, 1, rec), (2, None, None, rec), (3, None, 1, rec),
                (0, None, 1, rec + ["parallel.pp=2"]),
                (0, None, 2, rec + ["parallel.pp=2", "parallel.schedule=gpipe"]),
                (0, None, 2, rec + FOUR_BLOCKS + ["parallel.pp=2", "parallel.schedule=interleaved",
                                                  "parallel.vpp=2"]),
                (0, None, None, rec + tp), (0, None, 1, rec + tp_sp)],
            4: [(3, None, 1, rec + ["parallel.pp=2"])]}


def _groups(world: int) -> dict[str, list]:
    """The layouts each test checks on `world` ranks, by test."""
    groups = {"parity": dict(WORLDS)[world]}
    if world in MUON_LAYOUTS:
        groups["muon"] = MUON_LAYOUTS[world]
        for mode in ("full", "selective"):
            groups[mode] = _recompute_layouts(mode)[world]
    return groups


def _world(rt, overrides, groups: dict[str, list], tmp):
    """Every group's layouts in turn on these ranks (each rank's runs, parameters
    gathered), and on 2 ranks the interrupted and straight runs of RESUME_LAYOUTS."""
    runs = {name: [train_steps(rt, _config(overrides, *layout), f"{tmp}/{i}/{k}")
                   for k, layout in enumerate(layouts)]
            for i, (name, layouts) in enumerate(groups.items())}
    resumed = (_interrupted_and_straight(rt, overrides, RESUME_LAYOUTS, f"{tmp}/resume")
               if rt.world_size == 2 else None)
    return runs, resumed


class _RunsByWorld(dict):
    """Each world's ranks started once, for every test's layouts, when a test first asks
    for that world (so a run without `-m slow` never starts the 8 ranks)."""

    def __init__(self, overrides, tmp_path_factory):
        super().__init__()
        self.overrides, self.tmp = overrides, tmp_path_factory

    def __missing__(self, world):
        self[world] = run_on_ranks(_world, world, self.overrides, _groups(world),
                                   str(self.tmp.mktemp(f"w{world}")), timeout_s=1800)
        return self[world]


@pytest.fixture(scope="module")
def ranks(parity_overrides, tmp_path_factory):
    return _RunsByWorld(parity_overrides, tmp_path_factory)


def _stages_params(runs: list, group: str, k: int) -> dict:
    """Layout k of `group`'s parameters over all ranks: a pipeline's stages, each once."""
    params = {}
    for rank_runs, _ in runs:
        params.update(rank_runs[group][k].params)
    return params


@pytest.fixture(scope="module")
def reference(parity_overrides, tmp_path_factory):
    """The single-process Trainer, with and without micro-batches of 1 sequence."""
    return {micro: train_steps(CPU, _config(parity_overrides, 0, None, micro),
                               tmp_path_factory.mktemp("r"))
            for micro in (None, 1)}


WORLDS = [(2, LAYOUTS_2), (4, LAYOUTS_4), (8, LAYOUTS_8)]


@pytest.mark.parametrize("world, layouts", [
    (2, LAYOUTS_2), (4, LAYOUTS_4), pytest.param(8, LAYOUTS_8, marks=pytest.mark.slow)])
def test_parity_with_one_process(world, layouts, ranks, reference):
    """Losses rel 2e-5; parameters atol 1e-5 + rtol 1e-4 (module docstring)."""
    for layout, run in zip(layouts, ranks[world][0][0]["parity"]):
        ref, label = reference[layout[2]], f"world {world} layout {layout}"
        assert run.losses == pytest.approx(ref.losses, rel=2e-5), label
        assert_params_close(run.params, ref.params, label, atol=1e-5, rtol=1e-4)


class _Crash(Exception):
    pass


def _interrupted_and_straight(rt, overrides, layouts, tmp):
    """Per layout: metrics of an uninterrupted run and of one that crashed after step 3 and
    resumed from its step-2 checkpoint (read on rank 0)."""
    import json
    from pathlib import Path

    out = []
    for k, layout in enumerate(layouts):
        cfg = _config(overrides + ["train.checkpoint_every=2", "train.eval_every=100"], *layout)
        root = Path(tmp) / str(k)
        Trainer(cfg, rt, root / "straight").run()
        crashing = Trainer(cfg, rt, root / "resumed")
        real_step = crashing.train_step

        def crash_at_3(step, real_step=real_step):
            if step == 3:
                raise _Crash
            return real_step(step)

        crashing.train_step = crash_at_3
        try:
            crashing.run()
        except _Crash:
            pass
        Trainer(cfg, rt, root / "resumed").run()
        if rt.is_main:
            out.append(tuple([json.loads(line) for line in
                              (root / run / "metrics.jsonl").read_text().splitlines()]
                             for run in ("straight", "resumed")))
    return out


def test_sharded_checkpoint_resume_is_bit_identical(ranks):
    """The engine's DCP checkpoint (master shards + Adam moments; with Muon its momentum
    and AdamW's moments per parameter) restores a run exactly (2 ranks)."""
    for layout, (straight, resumed) in zip(RESUME_LAYOUTS, ranks[2][0][1]):
        assert [r["step"] for r in resumed] == list(range(1, STEPS + 1)), layout
        for a, b in zip(straight, resumed):
            assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (layout, a["step"])


def test_muon_matches_one_process(parity_overrides, ranks, tmp_path):
    """Muon through the engine (DDP on 2 ranks, with micro-batches of 1; a synchronous
    pipeline, pp 2 x 1F1B; DDP x pp, 4 ranks) against the one-process Trainer with Muon:
    losses rel 2e-5, parameters atol 1e-4 + rtol 1e-4 (torch's Muon orthogonalizes in bf16,
    which turns the layouts' float-sum order into up to ~3e-5 after 5 steps: see
    tests/test_pipeline_parity.py)."""
    ref = train_steps(CPU, _config(parity_overrides, 0, None, None, MUON), tmp_path / "ref")
    for world, layouts in MUON_LAYOUTS.items():
        for k, layout in enumerate(layouts):
            label = f"world {world} {layout}"
            assert ranks[world][0][0]["muon"][k].losses == pytest.approx(ref.losses,
                                                                         rel=2e-5), label
            assert_params_close(_stages_params(ranks[world], "muon", k), ref.params, label,
                                atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_matches_one_process(mode, parity_overrides, ranks, tmp_path):
    """parallel.recompute = 'full' and 'selective' under DDP with micro-batches, ZeRO-2,
    ZeRO-3 (its backward gather, started by the block output's gradient hook, precedes the
    recomputation, which so finds the block's weights gathered), tp 2 with and without
    sequence parallelism (the recomputed forward repeats their collectives) and pipelines
    (1F1B, GPipe, interleaved on 4 blocks) on 2 ranks, and pp 2 x ZeRO-3 on 4: the module
    docstring's tolerances against the one-process run of the layout's micro-batches, model
    keys and eps (recomputation itself changes nothing, tests/test_train.py).

    Why those: the module docstring's tolerances assume a reference that accumulates the
    same micro-batches (gradients 1e-12 apart). Against the whole batch, micro-batches of 1
    move layers.1.mlp.w2.weight[61, 42]'s first gradient from 7.2e-9 to 6.7e-9 (one process,
    measured), and for an element below Adam's eps 1e-8, where lr g / (|g| + eps) is
    steepest, that ends 7e-6 apart after 5 steps. Tensor parallelism's half-width GEMMs move
    that gradient by 2-3e-10 more (6.5e-9 with tp 2 + sequence parallelism, micro-batches of
    1), which at eps 1e-8 left that layout 1.24e-5 off the whole-batch run on an AMD EPYC
    (1.13e-5 allowed). So the tp layouts run at eps 1e-6, as tests/test_tensor_parallel.py
    does for the reason its docstring derives: a step then moves by at most lr |dg| / eps,
    1e-6 for |dg| up to 1e-9."""
    refs: dict[tuple, object] = {}
    for world, layouts in _recompute_layouts(mode).items():
        for k, layout in enumerate(layouts):
            same = [s for s in layout[3] if s.startswith(("model.", "train.eps"))]
            key = (layout[2], *same)
            if key not in refs:
                refs[key] = train_steps(CPU, _config(parity_overrides, 0, None, layout[2], same),
                                        tmp_path / f"ref{len(refs)}")
            ref, label = refs[key], f"world {world} layout {layout}"
            assert ranks[world][0][0][mode][k].losses == pytest.approx(ref.losses,
                                                                       rel=2e-5), label
            assert_params_close(_stages_params(ranks[world], mode, k), ref.params, label,
                                atol=1e-5, rtol=1e-4)
