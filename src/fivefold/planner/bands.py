"""An 80% band on every predicted step time, from the cross-validated residuals.

`fivefold plan validate --cross` predicts each published row with the constants fitted to the
other sources only (fivefold.planner.validation). The residual of a row is
log(published / held-out prediction). `band_table` groups the residuals by comparable rows
(`family`: the GPU architecture, dense or MoE, the stack) and keeps the 10th and 90th
percentile of each group, falling back to wider groups (architecture dropped, then dense/MoE,
then everything) when a group has fewer than MIN_ROWS rows. The command writes the table into
the package (band_table.json, with its date and command), so `simulate` and `plan` read it
instead of cross-validating at every call.

A prediction p gets [p * exp(lo), p * exp(hi)]. Where it lies outside what the rows calibrate
(a GPU architecture no row ran, a stack no row ran, or a stack release outside that stack's
calibrated releases) the band is the widest group's, with each side's log width doubled: a
stated rule, not a fitted one. A profile whose kernel tables were not measured on its
architecture (`HardwareProfile.kernels_measured` False: V100, B200, GB200; issue 32) gets its
group's band with each side's log width doubled the same way. The architecture is the
profile's `architecture` field, never a substring of its name. `coverage` measures the
bands honestly: each held-out row's band comes from the residuals of the other sources only.
"""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path

from fivefold.config import ConfigError
from fivefold.hardware import load_profile

TABLE = Path(__file__).with_name("band_table.json")
MIN_ROWS = 8
QUANTILES = (0.1, 0.9)
WIDEN = 2.0  # log-width factor outside the calibrated families (stated, not fitted)


def _profile(gpu: str):
    try:
        return load_profile(gpu)
    except ConfigError:
        return None


def architecture_family(gpu: str) -> str:
    """The architecture of profile `gpu` (a name or a profile file); "other" if unknown."""
    prof = _profile(gpu)
    arch = prof.architecture if prof is not None else "unknown"
    return "other" if arch == "unknown" else arch


def kernels_measured(gpu: str) -> bool:
    prof = _profile(gpu)
    return prof is not None and prof.kernels_measured


def family(gpu: str, moe: bool, stack: str) -> tuple[str, str, str]:
    """(architecture, "moe" | "dense", stack): the rows a prediction is compared with."""
    return architecture_family(gpu), "moe" if moe else "dense", stack


def run_family(run: dict) -> tuple[str, str, str]:
    spec = run["spec"]
    return family(spec["cluster"]["gpu"], bool(spec["model"].get("moe")),
                  spec.get("train", {}).get("stack", "fivefold"))


def pools(fam: tuple[str, str, str]) -> list[str]:
    """The group keys from the narrowest to everything."""
    arch, moe, stack = fam
    return [f"{arch}|{moe}|{stack}", f"*|{moe}|{stack}", f"*|*|{stack}", "*|*|*"]


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    i = int(math.floor(pos))
    j = min(i + 1, len(xs) - 1)
    return xs[i] + (xs[j] - xs[i]) * (pos - i)


def group_bands(residuals: list[tuple[tuple[str, str, str], float]]) -> dict[str, dict]:
    """Every group key with its row count and (lo, hi) log quantiles."""
    groups: dict[str, list[float]] = {}
    for fam, r in residuals:
        for key in pools(fam):
            groups.setdefault(key, []).append(r)
    return {k: {"rows": len(v), "lo": quantile(v, QUANTILES[0]), "hi": quantile(v, QUANTILES[1])}
            for k, v in sorted(groups.items())}


def pick(groups: dict[str, dict], fam: tuple[str, str, str], calibrated: bool,
         measured: bool = True) -> tuple[str, float, float]:
    """(group key, lo, hi) for a prediction of family `fam`; `measured` False (a profile
    without kernel measurements) widens the group's band by WIDEN."""
    if not calibrated:
        g = groups["*|*|*"]
        return "*|*|* widened", WIDEN * min(g["lo"], 0.0), WIDEN * max(g["hi"], 0.0)
    key, lo, hi = "*|*|*", groups["*|*|*"]["lo"], groups["*|*|*"]["hi"]
    for k in pools(fam):
        g = groups.get(k)
        if g and g["rows"] >= MIN_ROWS:
            key, lo, hi = k, g["lo"], g["hi"]
            break
    if not measured:
        key, lo, hi = f"{key} widened (no kernel measurements)", min(lo, 0.0), max(hi, 0.0)
        return key, WIDEN * lo, WIDEN * hi
    return key, lo, hi


def releases(runs: list[dict]) -> dict[str, list[str]]:
    """Per stack, the first and last release its rows state."""
    out: dict[str, list[str]] = {}
    for run in runs:
        train = run["spec"].get("train", {})
        rel = train.get("stack_release")
        if rel:
            lo_hi = out.setdefault(train.get("stack", "fivefold"), [rel, rel])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], rel), max(lo_hi[1], rel)
    return out


def is_calibrated(table: dict, fam: tuple[str, str, str], release: str | None) -> bool:
    arch, _, stack = fam
    if arch not in table["architectures"] or f"*|*|{stack}" not in table["groups"]:
        return False
    span = table["releases"].get(stack)
    return release is None or span is None or span[0] <= release <= span[1]


def band_table(runs: list[dict], held_out_s: list[float], command: str) -> dict:
    """The table `plan validate --cross` writes: residuals of every row's held-out
    prediction, grouped."""
    residuals = [(run_family(r), math.log(float(r["published"]["step_time_s"]) / p))
                 for r, p in zip(runs, held_out_s)]
    return {"about": __doc__.split("\n\n")[0].strip(),
            "date": datetime.date.today().isoformat(), "command": command,
            "rows": len(runs), "quantiles": list(QUANTILES), "min_rows": MIN_ROWS,
            "widen": WIDEN, "architectures": sorted({f[0] for f, _ in residuals}),
            "releases": releases(runs), "groups": group_bands(residuals)}


def coverage(runs: list[dict], held_out_s: list[float], sources: list[str]
             ) -> tuple[float, float, list[tuple[float, float]]]:
    """(share of rows inside their band, median band width over the point estimate, the
    bands): each row's band is built from the rows of the other sources only."""
    fams = [run_family(r) for r in runs]
    res = [math.log(float(r["published"]["step_time_s"]) / p) for r, p in zip(runs, held_out_s)]
    inside, widths, bands = 0, [], []
    for i, run in enumerate(runs):
        others = [(fams[j], res[j]) for j in range(len(runs)) if sources[j] != sources[i]]
        groups = group_bands(others)
        cal = {"architectures": sorted({f[0] for f, _ in others}), "groups": groups,
               "releases": releases([r for r, s in zip(runs, sources) if s != sources[i]])}
        rel = run["spec"].get("train", {}).get("stack_release")
        _, lo, hi = pick(groups, fams[i], is_calibrated(cal, fams[i], rel),
                         kernels_measured(run["spec"]["cluster"]["gpu"]))
        p = held_out_s[i]
        band = (p * math.exp(lo), p * math.exp(hi))
        bands.append(band)
        inside += band[0] <= float(run["published"]["step_time_s"]) <= band[1]
        widths.append((band[1] - band[0]) / p)
    return inside / len(runs), quantile(widths, 0.5), bands


def write_table(table: dict, path: Path | None = None) -> None:
    (path or TABLE).write_text(json.dumps(table, indent=1) + "\n")


def read_table(path: Path | None = None) -> dict | None:
    path = path or TABLE
    return json.loads(path.read_text()) if path.is_file() else None


def step_time_band(cfg, step_time_s: float, table: dict | None = None
                   ) -> tuple[list[float], str] | None:
    """([lo, hi] seconds, the group it came from) for a prediction of `cfg`; None when no
    table has been written."""
    table = table if table is not None else read_table()
    if table is None:
        return None
    fam = family(cfg.cluster.gpu, cfg.model.moe is not None, cfg.train.stack)
    key, lo, hi = pick(table["groups"], fam, is_calibrated(table, fam, cfg.train.stack_release),
                       kernels_measured(cfg.cluster.gpu))
    return [step_time_s * math.exp(lo), step_time_s * math.exp(hi)], key


def band_fields(cfg, step_time_s: float) -> dict:
    """The JSON fields `simulate --json` and `plan --json` add: `step_time_band_s` and the
    group of rows it came from (nothing when no table has been written)."""
    got = step_time_band(cfg, step_time_s)
    return {} if got is None else {"step_time_band_s": got[0], "step_time_band_rows": got[1]}
