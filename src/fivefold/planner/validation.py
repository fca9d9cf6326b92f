"""Predicted against published step times: `fivefold plan validate [--cross]`.

A runs file (calibration_runs.json, shipped with this package) lists
published training runs, each with a run spec (run_spec.md keys) and its measured step time.
`validate_runs` simulates every spec as it stands and reports, per run, the prediction, the
publication and the absolute percentage error, and the mean (MAPE) overall and per hardware
profile. Nothing here is tuned per run, and the only constants fitted by a program are the
few of fivefold.planner.fitted, shared by every GPU profile and stack; but the stacks'
switches and release boundaries were chosen while reading these rows, and both reports list
them (fivefold.planner.fitted_to.FITTED_TO) next to the figures.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from fivefold.config import ConfigError
from fivefold.planner import bands
from fivefold.planner.fitted import BOUNDS, Fitted
from fivefold.planner.simulate import simulate
from fivefold.planner.spec import spec_config
from fivefold.planner.fitted_to import fitted_to_lines

DEFAULT_RUNS = Path(__file__).with_name("calibration_runs.json")


@dataclass(frozen=True)
class RunCheck:
    id: str
    gpu: str
    gpus: int
    predicted_s: float
    published_s: float
    tags: tuple[str, ...]
    fits: bool = True  # predicted to fit in device memory

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
                            tuple(run.get("tags", ())), est.fits))
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
    lines.append(fit_line(checks))
    lines += fitted_to_lines()
    return "\n".join(lines)


def fit_line(checks: list[RunCheck]) -> str:
    out = [c.id for c in checks if not c.fits]
    return (f"predicted to fit in memory: {len(checks) - len(out)} of {len(checks)}"
            + (f" (not: {', '.join(out)})" if out else ""))


# ------------------------------------------------------------------ fit and cross-validation

SOURCES = ("megatron21", "korthikanti", "mtnlg", "bloom", "megascale", "llama3", "deepseekv3",
           "torchtitan", "bridge", "nemo", "mcore")


def source_of(run: dict) -> str:
    """A row's source family: the tag that names who published it."""
    tags = run.get("tags", ())
    return next((t for t in SOURCES if t in tags), "other")


@dataclass(frozen=True)
class FitResult:
    fit: Fitted
    loss: float  # mean |log(predicted / published)| over the rows fitted
    at_bounds: tuple[str, ...]


def _log_predictions(configs: list, fit: Fitted) -> list[float]:
    return [math.log(simulate(cfg, fit=fit).step_time_s) for cfg in configs]


def fit_constants(configs: list, published_s: list[float], start: Fitted = Fitted(),
                  iterations: int = 3) -> FitResult:
    """The `Fitted` constants minimising the mean |log(predicted / published)| over the
    rows, within fivefold.planner.fitted.BOUNDS: Gauss-Newton steps on the log step times
    (finite-difference Jacobian, each step an L1 linear program inside a trust region),
    each step kept only if the exactly simulated loss falls. Needs scipy."""
    import numpy as np
    from scipy.optimize import linprog

    names = list(BOUNDS)
    lo = np.array([BOUNDS[k][0] for k in names])
    hi = np.array([BOUNDS[k][1] for k in names])
    y = np.log(np.array(published_s))
    x = np.array([getattr(start, k) for k in names], dtype=float)

    def make(v) -> Fitted:
        return Fitted(**{k: float(val) for k, val in zip(names, v)})

    def loss_of(f0) -> float:
        return float(np.mean(np.abs(f0 - y)))

    f0 = np.array(_log_predictions(configs, make(x)))
    best = loss_of(f0)
    radius = 0.25 * (hi - lo)
    n, k = len(y), len(names)
    for _ in range(iterations):
        h = 0.02 * (hi - lo)
        jac = np.empty((n, k))
        for j in range(k):
            xj = x.copy()
            xj[j] = xj[j] + h[j] if xj[j] + h[j] <= hi[j] else xj[j] - h[j]
            jac[:, j] = (np.array(_log_predictions(configs, make(xj))) - f0) / (xj[j] - x[j])
        # min sum t_i with |f0 + J dx - y| <= t; variables (dx, t)
        c = np.concatenate([np.zeros(k), np.ones(n)])
        r = f0 - y
        a_ub = np.block([[jac, -np.eye(n)], [-jac, -np.eye(n)]])
        b_ub = np.concatenate([-r, r])
        bounds = [(max(lo[j] - x[j], -radius[j]), min(hi[j] - x[j], radius[j]))
                  for j in range(k)] + [(0, None)] * n
        sol = linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
        if not sol.success:
            break
        x_new = np.clip(x + sol.x[:k], lo, hi)
        f_new = np.array(_log_predictions(configs, make(x_new)))
        if loss_of(f_new) < best:
            x, f0, best = x_new, f_new, loss_of(f_new)
        else:
            radius = radius / 3
    at = tuple(k for k, v, a, b in zip(names, x, lo, hi) if min(v - a, b - v) < 0.01 * (b - a))
    return FitResult(make(x), best, at)


@dataclass(frozen=True)
class CrossValidation:
    in_sample: list[RunCheck]
    in_sample_fit: FitResult
    held_out: list[RunCheck]  # each row predicted by the fit of the other sources
    fold_fits: dict[str, FitResult]
    sources: dict[str, str]  # run id -> source family
    band_table: dict | None = None  # fivefold.planner.bands.band_table of the held-out rows
    band_coverage: tuple[float, float] | None = None  # (share inside, median width / p)


def cross_validate(runs: list[dict], iterations: int = 5) -> CrossValidation:
    """In-sample fit on every row, and leave-one-source-out: each source family predicted
    by constants fitted to the other families only. Five Gauss-Newton steps: with three, a
    constant starting at one end of its range (nic_aggregation at 1) could move at most
    three trust-region radii (0.75 of the range) and stopped there, not at its optimum."""
    configs = [spec_config(r["spec"]) for r in runs]
    published = [float(r["published"]["step_time_s"]) for r in runs]
    fams = [source_of(r) for r in runs]

    def checks(idx: list[int], fit: Fitted) -> list[RunCheck]:
        out = []
        for i in idx:
            est = simulate(configs[i], fit=fit)
            out.append(RunCheck(runs[i]["id"], configs[i].cluster.gpu, configs[i].cluster.gpus,
                                est.step_time_s, published[i], tuple(runs[i].get("tags", ())),
                                est.fits))
        return out

    everything = fit_constants(configs, published, iterations=iterations)
    in_sample = checks(list(range(len(runs))), everything.fit)
    held_out: dict[int, RunCheck] = {}
    folds = {}
    for fam in sorted(set(fams)):
        train = [i for i, f in enumerate(fams) if f != fam]
        test = [i for i, f in enumerate(fams) if f == fam]
        folds[fam] = fit_constants([configs[i] for i in train], [published[i] for i in train],
                                   iterations=iterations)
        held_out.update(zip(test, checks(test, folds[fam].fit)))
    held = [held_out[i] for i in range(len(runs))]
    held_s = [c.predicted_s for c in held]
    table = bands.band_table(runs, held_s, "fivefold plan validate --cross")
    share, width, _ = bands.coverage(runs, held_s, fams)
    return CrossValidation(in_sample, everything, held, folds,
                           {r["id"]: f for r, f in zip(runs, fams)}, table, (share, width))


def record_bands(cv: CrossValidation) -> None:
    """Store the band table in the package (fivefold.planner.bands.TABLE), where `simulate`
    and `plan` read it."""
    bands.write_table(cv.band_table)


def cross_report(cv: CrossValidation) -> str:
    """The table `fivefold plan validate --cross` prints."""
    lines = [f"{'run':44} {'source':10} {'published s':>11} {'in-sample':>9} {'held out':>9}"]
    for a, b in zip(cv.in_sample, cv.held_out):
        lines.append(f"{a.id[:44]:44} {cv.sources[a.id]:10} {a.published_s:11.3f} "
                     f"{100 * a.error:+8.1f}% {100 * b.error:+8.1f}%")
    lines.append("")
    lines.append(f"{'source':12} {'rows':>4} {'in-sample MAPE':>15} {'held-out MAPE':>14}")
    for fam in sorted(set(cv.sources.values())):
        a = [c for c in cv.in_sample if cv.sources[c.id] == fam]
        b = [c for c in cv.held_out if cv.sources[c.id] == fam]
        lines.append(f"{fam:12} {len(a):4d} {100 * mape(a):14.1f}% {100 * mape(b):13.1f}%")
    lines.append(f"{'all':12} {len(cv.in_sample):4d} {100 * mape(cv.in_sample):14.1f}% "
                 f"{100 * mape(cv.held_out):13.1f}%")
    lines.append(fit_line(cv.in_sample))
    if cv.band_coverage:
        share, width = cv.band_coverage
        lines.append(f"80% bands, each held-out row's from the other sources' residuals: "
                     f"{100 * share:.0f}% of rows inside, median width {100 * width:.0f}% of "
                     "the point estimate")
    lines.append("")
    n_const = len(BOUNDS)
    lines.append(f"fitted constants: {n_const} (fivefold.planner.fitted) against "
                 f"{len(cv.in_sample)} rows, refitted in every fold")
    lines += fitted_to_lines()
    lines.append("in-sample fit: " + ", ".join(f"{k} = {v:.4g}" for k, v in
                                               cv.in_sample_fit.fit.as_dict().items()))
    lines.append("at their bounds (in-sample): " + (", ".join(cv.in_sample_fit.at_bounds)
                                                    or "none"))
    for fam, f in cv.fold_fits.items():
        lines.append(f"fit without {fam}: " + ", ".join(f"{k} = {v:.4g}" for k, v in
                                                        f.fit.as_dict().items())
                     + (f"  (at bounds: {', '.join(f.at_bounds)})" if f.at_bounds else ""))
    return "\n".join(lines)
