"""Resuming a run: the Trainer's state from RUN_DIR's latest complete checkpoint.

The checkpoint is loaded in place through the updater (fivefold.train.updaters: its
`checkpoint_state` and `after_load`) when it was written under this layout, or resharded
(fivefold.train.reshard) when under another; then the fp16 loss scale, the skipped-step
count, the data position (fivefold.train.resume_data) and the lr schedule's length
(fivefold.lr_schedule.resumed_length) are taken from it.
"""

from __future__ import annotations

from fivefold.lr_schedule import resumed_length
from fivefold.train.checkpoint import (check_resume, layout_record, load_checkpoint,
                                       remove_partials)
from fivefold.train.reshard import describe_change, load_resharded
from fivefold.train.resume_data import data_start


def resume_run(trainer) -> int:
    """Load `trainer`'s latest checkpoint into it; the step it resumes at (0: none)."""
    if trainer.rt.is_main:
        remove_partials(trainer.run_dir)
    found = check_resume(trainer.run_dir, trainer.cfg, trainer.plan)
    if found is None:
        return 0
    path, saved_meta, changed = found
    if changed:  # written under another layout (fivefold.train.reshard)
        meta = saved_meta
        extra = load_resharded(trainer.rt, path, trainer.cfg.model, trainer.model,
                               trainer.engine, trainer.optimizer, trainer.tp_axis,
                               trainer.expert_axes)
        change = describe_change(saved_meta["layout"], layout_record(trainer.plan)["layout"],
                                 changed)
        trainer.say(f"resharded {path} from {change}")
    else:
        state = trainer._checkpoint_state()
        meta, extra = load_checkpoint(trainer.rt, path, state)
        trainer.updater.after_load(state, trainer._shard_tag(), meta["step"])
    if trainer.updater.loss_scale and extra.get("scaler"):
        trainer.updater.loss_scale.load_state_dict(extra["scaler"])
    trainer.skipped_steps = meta.get("skipped_steps", 0)
    trainer.train_sampler.start, reset = data_start(meta, trainer.cfg)
    if reset:
        trainer.say(f"train.reset_data: {', '.join(reset)} changed since {path}; the "
                    "weights and optimizer state resume, the data order starts afresh at step "
                    f"{trainer.train_sampler.start}")
    trainer.say(f"resumed from {path} (step {meta['step']})")
    trainer.schedule_steps, note = resumed_length(  # absent in older checkpoints
        meta.get("schedule_steps", meta["config"]["train"]["steps"]), trainer.cfg.train,
        meta["step"])
    if note:
        trainer.say(note)
    return meta["step"]
