"""What a finished run leaves: the memory report (measured against the planner's prediction,
fivefold.train.memory_report), a text sample, RUN_DIR/summary.json and the closing line.

A pipeline (pp > 1) or context-parallel (cp > 1) run samples no text: sampling runs the whole
model on whole sequences, which those layouts split. With tp > 1 every rank samples through
the gathered logits (and under ZeRO-3 every rank gathers), rank 0 writes.
"""

from __future__ import annotations

import json

from fivefold.parallel.tensor import GatheredLogits
from fivefold.train.sample import sample_text


def finish_run(trainer, initial_val: float | None, val_loss: float | None,
               train_time_s: float) -> dict:
    """The summary of `trainer`'s (fivefold.train.trainer.Trainer) completed run;
    summary.json is written by a run that started at step 0 (a resumed one lacks the
    initial validation loss)."""
    t, rt, run_dir = trainer.cfg.train, trainer.rt, trainer.run_dir
    summary = {"steps": t.steps, "initial_val_loss": initial_val, "final_val_loss": val_loss,
               "train_time_s": train_time_s}
    summary["memory"], memory_lines = trainer.memory.report(
        trainer.model, trainer.ledger.model_state_bytes, trainer._torch_optimizers(),
        trainer.predicted_memory, rt.rank, rt.device)
    if t.sample_tokens and (trainer.pipeline or trainer.plan.cp > 1):
        trainer.say("no text sample: sampling runs the whole model on whole sequences, which "
                    "pp > 1 and cp > 1 split")
    elif t.sample_tokens and trainer.data.tokenizer is not None:  # every rank: ZeRO-3 gathers
        model = (GatheredLogits(trainer.model, trainer.tp_axis, trainer.plan.sequence_parallel)
                 if trainer.tp_axis.size > 1 else trainer.model)
        text = sample_text(model, trainer.data.tokenizer, "def ", t.sample_tokens, t.seed,
                           rt.device)
        if rt.is_main:
            (run_dir / "sample.txt").write_text(text)
            trainer.say(f"sample:\n{text}")
    if rt.is_main:
        if initial_val is not None:
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        trainer.say("\n".join(memory_lines))
        trainer.say(f"done: {t.steps} steps in {train_time_s:.0f} s, final val_loss "
                    f"{val_loss:.4f}; metrics in {run_dir / 'metrics.jsonl'}")
    return summary
