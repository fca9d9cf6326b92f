"""What a run directory holds, read for the report: metrics.jsonl, summary.json and the config
and parallel plan of its latest checkpoint (checkpoints/step_*/meta.json).

Every piece may be absent (a run still in progress, stopped before its first checkpoint or
before its end): `RunData.missing` then says what is not there and why, and the page says so
instead of drawing it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fivefold.config import ConfigError


@dataclass
class RunData:
    run_dir: Path
    records: list[dict] = field(default_factory=list)  # metrics.jsonl, one per step
    summary: dict | None = None  # summary.json (written at the end of a run)
    config: dict | None = None  # the checkpoint's config (Config.to_dict())
    plan: dict | None = None  # the checkpoint's ParallelPlan.to_dict()
    checkpoint: Path | None = None
    missing: list[str] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> int | None:
        """Global batch x sequence length: the tokens one optimizer step trains on."""
        if self.plan is None or self.config is None:
            return None
        return self.plan["global_batch"] * self.config["model"]["seq_len"]

    def step_times_s(self) -> list[tuple[int, float]]:
        """(step, measured seconds) per logged step, from its tokens/s."""
        tokens = self.tokens_per_step
        if tokens is None:
            return []
        return [(r["step"], tokens / r["tokens_per_s"]) for r in self.records
                if r.get("tokens_per_s")]


def read_run(run_dir: str | Path) -> RunData:
    """Read the run at `run_dir`; ConfigError if it is not a run directory at all."""
    root = Path(run_dir)
    metrics, summary = root / "metrics.jsonl", root / "summary.json"
    if not root.is_dir() or not (metrics.is_file() or (root / "checkpoints").is_dir()):
        raise ConfigError("RUN_DIR", f"{str(root)!r} is not a run directory (no metrics.jsonl "
                                     "and no checkpoints/); pass the --run-dir of a "
                                     "`fivefold train` run")
    run = RunData(root)
    if metrics.is_file():
        run.records = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    if not run.records:
        run.missing.append("metrics.jsonl has no steps yet: no curves to draw")
    if summary.is_file():
        run.summary = json.loads(summary.read_text())
    else:
        run.missing.append("summary.json is absent (the run has not finished): no memory "
                           "report")
    _read_checkpoint_meta(run)
    return run


def _read_checkpoint_meta(run: RunData) -> None:
    from fivefold.train.checkpoint import latest_checkpoint

    step = latest_checkpoint(run.run_dir)
    if step is None:
        run.missing.append("no finished checkpoint under checkpoints/: the config and the "
                           "predicted step timeline need one")
        return
    meta = json.loads((step / "meta.json").read_text())
    run.checkpoint, run.config, run.plan = step, meta.get("config"), meta.get("plan")
