"""Per-step metrics: RUN_DIR/metrics.jsonl, TensorBoard, and the terminal progress bar.

Only rank 0 writes. `metrics.jsonl` holds one JSON object per optimizer step (step, loss, lr,
grad_norm, tokens_per_s, mfu (null where not measured) and mfu_profile (the hardware profile it
is measured against, fivefold.train.mfu), peak_mem_bytes, skipped_steps (updates the
non-finite guard has dropped so far), val_loss on validation steps and, for an MoE model,
`moe`: per MoE layer tokens_per_expert, dropped_fraction, imbalance (max / mean) and aux_loss,
which TensorBoard gets as moe/LAYER/KEY). On resume, lines for steps after the checkpoint are
dropped first, so the file always describes one consistent run. The progress bar (rich) shows
loss and throughput (and the MFU with its profile); every `log_every` steps a
plain line is printed too, which is what a log file or CI output keeps.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MetricsLog:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int, enabled: bool,
                 tensorboard: bool, log_every: int):
        self.enabled, self.log_every = enabled, log_every
        self.console = Console(stderr=True)
        self.path = Path(run_dir) / "metrics.jsonl"
        self.writer = None
        self.progress = None
        if not enabled:
            return
        self._truncate_after(start_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # slow import; only when used
            self.writer = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=start_step + 1)
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                                 console=self.console, transient=True)
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                           status="")
        self.progress.start()

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        kept = [ln for ln in lines if ln.strip() and json.loads(ln)["step"] <= step]
        self.path.write_text("".join(ln + "\n" for ln in kept))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = record["step"]
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"train/{key}", value, step)
            for layer, stats in record.get("moe", {}).items():  # fivefold.train.moe_stats
                for key, value in stats.items():
                    if isinstance(value, list):
                        self.writer.add_scalars(f"moe/{layer}/{key}",
                                                {str(e): v for e, v in enumerate(value)}, step)
                    else:
                        self.writer.add_scalar(f"moe/{layer}/{key}", value, step)
        status = f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s"
        self.progress.update(self.task, completed=step, status=status)
        if step % self.log_every == 0 or "val_loss" in record:
            val = f"  val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
            mfu = (f"  mfu {record['mfu']:.1%} ({record['mfu_profile']})"
                   if record.get("mfu") is not None else "")
            skipped = (f"  skipped {record['skipped_steps']} non-finite"
                       if record.get("skipped_steps") else "")
            self.print(f"step {step:>6}  loss {record['loss']:.4f}{val}  lr {record['lr']:.2e}"
                       f"  grad_norm {record['grad_norm']:.3f}  "
                       f"{record['tokens_per_s']:,.0f} tok/s{mfu}{skipped}")

    def print(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.writer is not None:
            self.writer.close()
