"""Predicted against published step times: `fivefold plan validate`.

A runs file (shared/reference/calibration_runs.json; a copy ships with this package) lists
published training runs, each with a run spec (run_spec.md keys) and its measured step time.
`validate_runs` simulates every spec as it stands and reports, per run, the prediction, the
publication and the absolute percentage error, and the mean (MAPE) overall and per hardware
profile. Nothing here is tuned per run: the only knobs are the per-profile efficiencies of
fivefold.hardware.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fivefold.config import ConfigError
from fivefold.planner.simulate import simulate
from fivefold.planner.spec import spec_config

DEFAULT_RUNS = Path(__file__).with_name("calibration_runs.json")


@dataclass(frozen=True)
class RunCheck:
    id: str
    gpu: str
    gpus: int
    predicted_s: float
    published_s: float
    tags: tuple[str, ...]

    @property
    def error(self) -> float:
        """Signed relative error of the prediction."""
        return self.predicted_s / self.published_s - 1.0


def read_runs(path: str | Path | None = None) -> list[dict]:
    p = Path(path) if path else DEFAULT_RUNS
    if not p.is_file():
        raise ConfigError("RUNS", f"runs file {str(p)!r} does not exist")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError("RUNS", f"{p} does not parse: {err}") from None
    runs = data.get("runs") if isinstance(data, dict) else data
    if not isinstance(runs, list):
        raise ConfigError("RUNS", f"{p} must hold a list of runs (or {{'runs': [...]}})")
    return runs


def validate_runs(runs: list[dict]) -> list[RunCheck]:
    out = []
    for run in runs:
        cfg = spec_config(run["spec"])
        est = simulate(cfg)
        out.append(RunCheck(run["id"], cfg.cluster.gpu, cfg.cluster.gpus, est.step_time_s,
                            float(run["published"]["step_time_s"]),
                            tuple(run.get("tags", ()))))
    return out


def mape(checks: list[RunCheck]) -> float:
    return sum(abs(c.error) for c in checks) / len(checks) if checks else float("nan")


def report(checks: list[RunCheck]) -> str:
    """The table `fivefold plan validate` prints."""
    lines = [f"{'run':44} {'gpu':10} {'gpus':>5} {'predicted s':>12} {'published s':>12} "
             f"{'error':>7}"]
    for c in checks:
        lines.append(f"{c.id[:44]:44} {c.gpu:10} {c.gpus:5d} {c.predicted_s:12.3f} "
                     f"{c.published_s:12.3f} {100 * c.error:+6.1f}%")
    lines.append("")
    for gpu in sorted({c.gpu for c in checks}):
        rows = [c for c in checks if c.gpu == gpu]
        lines.append(f"MAPE {gpu:10} {100 * mape(rows):5.1f}%  ({len(rows)} runs)")
    lines.append(f"MAPE {'all':10} {100 * mape(checks):5.1f}%  ({len(checks)} runs)")
    return "\n".join(lines)
