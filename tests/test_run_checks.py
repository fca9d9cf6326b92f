"""What a run says and checks about itself: the start-up line's layout
(fivefold.train.run_header), which profile MFU is measured against (fivefold.train.mfu), and
the resume check of the keys the data position depends on (fivefold.train.resume_data)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from fivefold.config import ConfigError, load_config
from fivefold.hardware import PROFILES
from fivefold.parallel.plan import plan_from_config
from fivefold.train.checkpoint import check_resume
from fivefold.train.data import BatchSampler
from fivefold.train.dist import Runtime
from fivefold.train.mfu import mfu_peak
from fivefold.train.run_header import balance_note, pipeline_note, start_line
from fivefold.train.trainer import Trainer

CPU = Runtime(0, 1, 0, torch.device("cpu"))
MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32"]


@pytest.mark.parametrize("sets, ranks, layout", [
    (["parallel.cp=2", "parallel.micro_batch=2"], 2, "dp 1, tp 1, pp 1, cp 2, ep 1, ZeRO 0, 4 micro-batches of 2"),
    (MOE + ["parallel.ep=2", "parallel.zero_stage=1"], 4,
     "dp 4, tp 1, pp 1, cp 1, ep 2, ZeRO 1, 1 micro-batch of 2"),
    (["parallel.pp=2", "parallel.micro_batch=1", "parallel.schedule=1f1b"], 2,
     "dp 1, tp 1, pp 2 (1f1b, vpp 1), cp 1, ep 1, ZeRO 0, 8 micro-batches of 1"),
])
def test_start_line_names_every_degree(tiny_overrides, sets, ranks, layout):
    """Built from the plan alone: the whole layout, where "(pp 1, tp 1, dp 2)" hid cp and ep."""
    cfg = load_config(None, tiny_overrides + ["parallel.global_batch=8"] + sets)
    line = start_line(cfg, plan_from_config(cfg, ranks, "fp32"), "cpu")
    assert f"{ranks} rank(s) ({layout}) on cpu, fp32; global batch 8 x 32 tokens" in line, line


@pytest.mark.parametrize("sets, ranks, note", [
    (["parallel.pp=2"], 2, "pp 2 with one micro-batch per step does not pipeline: each stage "
                           "idles 1 of 2 turns; set parallel.micro_batch = 4 (2 micro-batches)"),
    (["parallel.pp=4", "parallel.global_batch=2"], 4,
     "idles 3 of 4 turns; raise parallel.global_batch to at least 4 and set"),
    (["parallel.pp=2", "parallel.micro_batch=4"], 2, None),
    (["parallel.pp=2", "parallel.schedule=terapipe"], 2, None),  # token slices pipeline
    ([], 1, None),
])
def test_pipeline_without_micro_batches_is_warned(tiny_overrides, sets, ranks, note):
    cfg = load_config(None, tiny_overrides + ["parallel.global_batch=8"] + sets)
    said = pipeline_note(plan_from_config(cfg, ranks, "fp32"))
    assert said == note if note is None else note in said, said


MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32"]


@pytest.mark.parametrize("sets, warned", [
    (MOE, True),
    (MOE + ["model.moe.aux_loss_weight=0.01"], False),
    (MOE + ["model.moe.bias_update_rate=0.001"], False),
    ([], False),  # dense
])
def test_moe_without_balancing_is_warned(tiny_overrides, sets, warned):
    said = balance_note(load_config(None, tiny_overrides + sets))
    assert (said is not None) == warned, said
    assert said is None or "model.moe.aux_loss_weight = 0.01" in said


def test_mfu_on_cpu_only_against_a_calibrated_profile(tmp_path):
    """CPU: no figure against the built-in (another machine's) profile; a profile file is
    used and named. GPU: that GPU's profile, by name."""
    cpu = torch.device("cpu")
    assert mfu_peak(cpu, None, "fp32", 2) is None
    assert mfu_peak(cpu, "cpu", "fp32", 2) is None
    profile = PROFILES["cpu"].to_dict()
    profile["peak_tflops"]["fp32"] = 0.05
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    peak = mfu_peak(cpu, str(path), "fp32", 2)
    assert peak.profile == f"cpu-calibrated: {path}"
    assert peak.flops == pytest.approx(0.05e12 * os.cpu_count(), rel=1e-12)
    gpu = mfu_peak(torch.device("cuda", 0), "H100-SXM", "bf16", 8)
    assert gpu.profile == "H100-SXM" and gpu.flops == pytest.approx(8 * 989e12, rel=1e-3)


def test_metrics_say_mfu_is_not_measured_on_cpu(tiny_overrides, tmp_path):
    """The metrics keep `mfu` (null) and add `mfu_profile` (null) without a calibrated file."""
    cfg = load_config(None, tiny_overrides + ["train.steps=1", "train.eval_batches=1",
                                              "train.sample_tokens=0"])
    Trainer(cfg, CPU, tmp_path).run()
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert record["mfu"] is None and record["mfu_profile"] is None


def test_resume_refuses_changed_data_unless_reset(tiny_overrides, tmp_path):
    """A checkpoint records what its data position depends on. A resume with another
    data.source (or seed, or tokenizer file) is refused naming the key and both fixes; under
    train.reset_data the weights resume and the data order restarts at the checkpoint's step,
    and a later resume (same data) keeps that start."""
    sets = tiny_overrides + ["train.steps=2", "train.eval_batches=1", "train.sample_tokens=0",
                             "train.checkpoint_every=2"]
    cfg = load_config(None, sets)
    Trainer(cfg, CPU, tmp_path).run()
    plan = plan_from_config(cfg, 1, "fp32")
    check_resume(tmp_path, load_config(None, sets + ["data.cache_dir='elsewhere'"]), plan)
    other = load_config(None, sets + ["data.source='other.txt'"])
    with pytest.raises(ConfigError) as err:
        check_resume(tmp_path, other, plan)
    assert err.value.key == "data.source"
    assert "other.txt" in str(err.value) and "train.reset_data=true" in str(err.value)
    with pytest.raises(ConfigError) as err:
        check_resume(tmp_path, load_config(None, sets + ["train.seed=1"]), plan)
    assert err.value.key == "train.seed"

    reset = sets + ["train.seed=1", "train.reset_data=true", "train.steps=4"]
    trainer = Trainer(load_config(None, reset), CPU, tmp_path)
    trainer.run()
    assert trainer.train_sampler.start == 2
    fresh = BatchSampler(trainer.data.train, 32, 4, seed=1)
    for got, want in zip(trainer.train_sampler.rank_batch(2), fresh.rank_batch(0)):
        assert torch.equal(got, want)
    meta = json.loads((Path(tmp_path) / "checkpoints/step_00000004/meta.json").read_text())
    assert (meta["data_start"], meta["data_position"]) == (2, 2)
    again = Trainer(load_config(None, reset[:-1] + ["train.steps=6"]), CPU, tmp_path)
    again.run()
    assert again.train_sampler.start == 2
