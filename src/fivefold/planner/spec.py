"""Read a run spec (run_spec.md) for `plan` and `simulate`, and check it.

A spec is a config file (TOML or JSON, `load_config`) whose keys run_spec.md lists, or the
`spec` table of a runs file. On top of `validate`, a spec needs the cluster (cluster.gpus
and cluster.gpu, a profile name or file) and a model whose shape the layout can split
(`check_model_fits_layout`). A pipelined spec without
`parallel.stage_layers` gets the runtime's own balanced split written in
(fivefold.parallel.pipeline.partition), so the layout that is scored, printed and trained is
one and the same. Every problem raises `ConfigError` naming the key.
"""

from __future__ import annotations

import json

from fivefold.config import Config, ConfigError, ModelConfig, load_config
from fivefold.hardware import load_profile
from fivefold.parallel.plan import ParallelPlan
from fivefold.validate import validate, validate_cluster, validate_model


def cluster_gpus(cfg: Config) -> int:
    """cluster.gpus, which plan and simulate need; ConfigError when it is missing."""
    if cfg.cluster.gpus is None:
        raise ConfigError("cluster.gpus", "plan and simulate need the number of devices; set "
                                          "cluster.gpus, e.g. --set cluster.gpus=64")
    return cfg.cluster.gpus


def check_model_fits_layout(model: ModelConfig, lay: ParallelPlan) -> None:
    """Divisibility the planner's formulas assume; ConfigError naming the key otherwise."""
    if model.heads % lay.tp or model.n_kv_heads % lay.tp and lay.tp % model.n_kv_heads:
        raise ConfigError("parallel.tp", f"tp = {lay.tp} must divide model.heads = "
                                         f"{model.heads} (and kv_heads {model.n_kv_heads}, or be"
                                         " a multiple of it)")
    if lay.pp * lay.vpp > model.layers:
        raise ConfigError("parallel.pp", f"pp*vpp = {lay.pp * lay.vpp} stages exceed the "
                                         f"{model.layers} layers")
    if model.seq_len % lay.cp:
        raise ConfigError("parallel.cp", f"cp = {lay.cp} does not divide model.seq_len = "
                                         f"{model.seq_len}")
    stage = lay.dp * lay.cp * lay.tp  # the experts' grid's ranks (fivefold.expert_grid)
    if model.moe is not None and stage % (lay.ep * lay.etp):
        raise ConfigError("parallel.ep", f"ep x etp = {lay.ep * lay.etp} does not divide the "
                                         f"dp*cp*tp = {stage} ranks that hold the experts")
    if lay.etp > 1 and (model.moe is None or (model.moe.expert_ffn_hidden
                                              or model.ffn_hidden) % lay.etp):
        raise ConfigError("parallel.etp", f"etp = {lay.etp} needs a mixture-of-experts model "
                                          "whose expert width it divides")
    if model.moe is not None and model.moe.experts % lay.ep:
        raise ConfigError("parallel.ep", f"ep = {lay.ep} does not divide model.moe.experts = "
                                         f"{model.moe.experts}")
    if model.moe is None and lay.ep != 1:
        raise ConfigError("parallel.ep", "expert parallelism needs a mixture-of-experts model "
                                         "(model.moe); set parallel.ep = 1")


def prepare(cfg: Config) -> Config:
    """Validate `cfg` as a planning spec; fill the pipeline split the runtime would use."""
    validate_model(cfg)
    validate_cluster(cfg)
    cluster_gpus(cfg)
    if cfg.cluster.gpu is not None:
        load_profile(cfg.cluster.gpu)  # a name it knows or a file that parses
    p = cfg.parallel
    stages = p.pp * p.vpp
    if getattr(p, "stage_layers", "absent") is None and 1 < stages <= cfg.model.layers:
        from fivefold.parallel.pipeline.partition import stage_layer_ranges

        p.stage_layers = [len(r) for r in stage_layer_ranges(cfg.model, stages)]
    validate(cfg)
    return cfg


def load_spec(path: str | None, overrides: list[str] = ()) -> Config:
    return prepare(load_config(path, list(overrides)))


def spec_overrides(spec: dict, prefix: str = "") -> list[str]:
    """A nested spec table as `section.key=value` overrides (values as TOML literals)."""
    out = []
    for key, value in spec.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out += spec_overrides(value, dotted + ".")
        else:
            out.append(f"{dotted}={json.dumps(value)}")
    return out


def spec_config(spec: dict) -> Config:
    """A validated config from a spec table (the `spec` of a runs-file row)."""
    if not isinstance(spec, dict):
        raise ConfigError("spec", f"a run's spec must be a table, got {spec!r}")
    return prepare(load_config(None, spec_overrides(spec)))
