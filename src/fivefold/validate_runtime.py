"""What the runtime of today needs of a config beyond `validate`, feature by feature: the
tensor-parallel split of heads and MLP columns, the context-parallel split of sequences and
heads (ring, Ulysses, hybrid) and fp8 GEMM units. fivefold.validate.validate_for_training
runs them; each failure raises `ConfigError` naming the key and the fix. Torch-free.
"""

from __future__ import annotations

import math

from fivefold.config import Config, ConfigError
from fivefold.models.validate_model import divisors as _divisors


def validate_tensor_parallel(cfg: Config) -> None:
    """What the tensor-parallel runtime (fivefold.parallel.tensor) needs: whole attention and
    key/value heads and whole MLP columns per rank, and with sequence parallelism an even split
    of the sequence. The vocabulary needs nothing: it is padded to a multiple of tp."""
    p, m = cfg.parallel, cfg.model
    if p.tp == 1:
        return
    common = _divisors(math.gcd(m.heads, m.n_kv_heads, m.ffn_hidden))
    for key, value, what in (("heads", m.heads, "attention heads"),
                             ("kv_heads", m.n_kv_heads, "key/value heads"),
                             ("ffn_hidden", m.ffn_hidden, "MLP columns")):
        if value % p.tp:
            raise ConfigError("parallel.tp", f"{p.tp} does not divide model.{key} = {value}: each "
                                             f"tensor-parallel rank needs whole {what}; choose "
                                             f"tp among {common}")
    if p.sequence_parallel and m.seq_len % p.tp:
        raise ConfigError("parallel.sequence_parallel", f"model.seq_len = {m.seq_len} does not "
                                                        f"split evenly over tp = {p.tp} ranks; "
                                                        f"use a multiple of {p.tp} or turn "
                                                        "sequence parallelism off")


def validate_context_parallel(cfg: Config) -> None:
    """What the context-parallel runtime (fivefold.parallel.context) needs; what it does not
    compose with is in fivefold.compositions. Ring attention's zigzag split cuts each
    sequence into 2 cp equal chunks; Ulysses gives each rank heads / (tp cp) query heads and
    needs a tp rank's key/value heads to split over cp too, or to be fewer and divide cp
    (each is then replicated to fit)."""
    p, m = cfg.parallel, cfg.model
    if p.cp == 1:
        return
    ring, ulysses = context_degrees(p.cp, p.cp_mode, p.cp_ulysses)
    key = "parallel.cp_ulysses" if p.cp_mode == "hybrid" else "parallel.cp"
    if ring > 1 and m.seq_len % (2 * p.cp):
        raise ConfigError("model.seq_len", f"ring attention's balanced (zigzag) split cuts "
                                           f"each sequence into 2 x ring = {2 * ring} equal "
                                           f"chunks, each over {ulysses} Ulysses rank(s), "
                                           f"but seq_len is {m.seq_len}; use a multiple of "
                                           f"{2 * p.cp}")
    if ulysses > 1:
        if m.seq_len % p.cp:
            raise ConfigError("model.seq_len", f"context parallelism splits each sequence into "
                                               f"cp = {p.cp} shards, but seq_len is "
                                               f"{m.seq_len}; use a multiple of {p.cp}")
        heads, kv_heads = m.heads // p.tp, m.n_kv_heads // p.tp  # a tp rank's
        if heads % ulysses:
            raise ConfigError(key, f"Ulysses gives each of its {ulysses} ranks heads / "
                                   f"{ulysses} query heads, but a tp rank holds {heads} "
                                   f"(model.heads {m.heads} / tp {p.tp}); choose a Ulysses "
                                   f"degree among {_divisors(heads)}")
        if kv_heads % ulysses and ulysses % kv_heads:
            raise ConfigError(key, f"Ulysses splits a tp rank's {kv_heads} key/value heads "
                                   f"over {ulysses} ranks, or replicates them when they are "
                                   "fewer and divide the degree; neither holds: choose a "
                                   "Ulysses degree dividing or divided by model.kv_heads / "
                                   "parallel.tp")


def context_degrees(cp: int, mode: str, cp_ulysses: int | None) -> tuple[int, int]:
    """(ring degree, Ulysses degree) of `cp` context-parallel ranks in `mode`; ConfigError for
    a hybrid whose Ulysses degree (`parallel.cp_ulysses`) is missing or does not divide cp."""
    if mode == "ring":
        return cp, 1
    if mode == "ulysses":
        return 1, cp
    if cp_ulysses is None or cp % cp_ulysses:
        raise ConfigError("parallel.cp_ulysses", f"the hybrid mode runs a Ulysses degree times a "
                                                 f"ring degree on cp = {cp} ranks: set "
                                                 f"cp_ulysses to one of {_divisors(cp)}, got "
                                                 f"{cp_ulysses}")
    return cp // cp_ulysses, cp_ulysses


def validate_fp8_runtime(cfg: Config, fp8_units: bool) -> None:
    """What fp8 training (fivefold.parallel.fp8) needs of the device: fp8 GEMM units unless
    emulated. What it needs of the other features (an optimizer that keeps fp32 master
    weights, activation scales over the one-process run's tokens; docs/fp8.md, "Layouts")
    are rows of fivefold.compositions.REFUSALS."""
    p = cfg.parallel
    if p.fp8_emulate is False and not fp8_units:
        raise ConfigError("parallel.fp8_emulate", "this device has no fp8 matrix units (they "
                                                  "need a GPU of compute capability 8.9 or "
                                                  "later: Ada, Hopper, Blackwell); set "
                                                  "parallel.fp8_emulate = true (or leave it "
                                                  "unset) to emulate fp8 in fp32")
