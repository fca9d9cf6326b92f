"""Context-parallel attention (fivefold.parallel.context) against dense causal attention.

On gloo ranks in float64: each mode's output and input gradients (dq, dk, dv for a random
dout) equal dense causal attention over the unsplit sequence to 1e-10 (float64 rounding of
a few blockwise reorderings is ~1e-15; 1e-10 leaves room and still catches any wrong mask,
merge or gradient path), at cp 2, 4 and 8, hybrid 2x2, 2x4 and 4x2, with multi-head and
grouped-query attention including fewer key/value heads than the Ulysses degree (replicated).
The ledger of every call equals the byte formulas of the module docstrings, from the shapes.
The ring's gradients come from its own backward (the graph holds no communication, and its
block backward runs once per ring step). Ranks start once per world size.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from fivefold.comm.collectives import Axis
from fivefold.comm.ledger import Ledger
from fivefold.parallel.context import layout as cp_layout
from fivefold.parallel.context import ring_attention as ring_mod
from fivefold.parallel.context.attention import context_attention
from fivefold.parallel.context.layout import (check_sequence_split, context_layout,
                                              context_positions, mode_degrees, shard_sequence,
                                              unshard_sequence)
from fivefold.parallel.context.heads import check_ulysses_heads, ulysses_kv_heads
from fivefold.parallel.context.zigzag import (check_zigzag, zigzag_positions, zigzag_shard,
                                              zigzag_unshard)
from fivefold.testing import run_on_ranks

B, E = 2, 8
TOL = 1e-10
F64 = 8  # bytes per element


def heads_for(world: int) -> int:
    return max(4, world)  # Ulysses at cp 8 needs 8 query heads


def seq_len_for(world: int) -> int:
    return 8 * world * 2


def cases(world: int) -> list[tuple[str, int, int]]:
    """(mode, Ulysses degree, kv heads) checked on `world` ranks."""
    h = heads_for(world)
    splits = [("ring", 1), ("ulysses", world)]
    splits += [("hybrid", u) for u in (2, 4) if u < world and world % u == 0]
    return [(mode, u, kv) for mode, u in splits for kv in (h, 2, 1)]


# ---------------------------------------------------------------- the dense reference

def dense_causal_attention(q_BHTE, k_BKTE, v_BKTE):
    """softmax(q k^T / sqrt(E) + causal mask) v, by explicit matmuls (GQA: repeated heads)."""
    groups = q_BHTE.shape[1] // k_BKTE.shape[1]
    k, v = k_BKTE.repeat_interleave(groups, 1), v_BKTE.repeat_interleave(groups, 1)
    T = q_BHTE.shape[2]
    s = q_BHTE @ k.transpose(-2, -1) / q_BHTE.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def _inputs(seed, heads, kv_heads, T):
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, heads, T, E, generator=gen, dtype=torch.float64) for _ in "qo")
    k, v = (torch.randn(B, kv_heads, T, E, generator=gen, dtype=torch.float64) for _ in "kv")
    return q, k, v, dout


# ---------------------------------------------------------------- expected ledgers

def expected_ledger(mode, world, u, heads, kv_heads, T) -> Counter:
    """Counter of (op, axis name, purpose, bytes) per call, from the docstrings' formulas."""
    ring, u = mode_degrees(mode, world, u)
    local = T // world
    out = Counter()
    if u > 1:
        moved = ulysses_kv_heads(kv_heads, u)
        q_bytes, kv_bytes = B * heads * local * E * F64, B * moved * local * E * F64
        name = "cp" if mode == "ulysses" else "cp_ulysses"
        for purpose, nbytes in (("cp_q", q_bytes), ("cp_k", kv_bytes), ("cp_v", kv_bytes),
                                ("cp_out", q_bytes)):
            out[("all_to_all", name, purpose, nbytes)] += 1
            out[("all_to_all", name, purpose + "_grad", nbytes)] += 1
        kv_heads, local = moved // u, local * u  # what the ring sees after the all-to-all
    if ring > 1:
        block = 2 * B * kv_heads * local * E * F64  # k and v stacked
        name = "cp" if mode == "ring" else "cp_ring"
        for op in ("send", "recv"):
            out[(op, name, "cp_kv", block)] += 2 * (ring - 1)  # forward and backward
            out[(op, name, "cp_dkv", block)] += ring
    return out


# ---------------------------------------------------------------- on the ranks

def _axes(world: int) -> dict:
    """Every rank builds every group in the same order: the whole cp axis, and for each
    Ulysses degree u of the hybrids the inner (u neighbours) and outer (stride u) sub-axes."""
    def axis(name, ranks_list):
        mine = None
        for ranks in ranks_list:
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = Axis(name, group, len(ranks), ranks.index(dist.get_rank()), Ledger())
        return mine

    axes = {"cp": axis("cp", [list(range(world))])}
    for mode, u, _ in cases(world):
        if mode == "hybrid" and ("ulysses", u) not in axes:
            r = world // u
            axes[("ulysses", u)] = axis("cp_ulysses", [list(range(j * u, (j + 1) * u))
                                                       for j in range(r)])
            axes[("ring", u)] = axis("cp_ring", [list(range(i, world, u)) for i in range(u)])
    return axes


def _graph_nodes(fn) -> set[str]:
    seen, todo, names = set(), [fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(nxt for nxt, _ in node.next_functions)
    return names


def _check_all(rt):
    world, rank = rt.world_size, rt.rank
    axes = _axes(world)
    heads, T = heads_for(world), seq_len_for(world)
    block_backward = ring_mod.block_attention_backward
    calls = []

    def counted(*args):
        calls.append(1)
        return block_backward(*args)

    ring_mod.block_attention_backward = counted
    results = []
    for seed, (mode, u, kv_heads) in enumerate(cases(world)):
        q, k, v, dout = _inputs(seed, heads, kv_heads, T)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out = dense_causal_attention(*ref)
        ref_out.backward(dout)

        positions = context_positions(T, mode, world, rank, u)
        local = [shard_sequence(t, positions, dim=2).requires_grad_() for t in (q, k, v)]
        if mode == "hybrid":
            uax = dataclasses.replace(axes[("ulysses", u)], ledger=Ledger())
            rax = dataclasses.replace(axes[("ring", u)], ledger=uax.ledger)
            kwargs = dict(ulysses_axis=uax, ring_axis=rax)
            ledger = uax.ledger
        else:
            cax = dataclasses.replace(axes["cp"], ledger=Ledger())
            kwargs, ledger = dict(cp_axis=cax), cax.ledger
        out = context_attention(*local, mode, **kwargs)
        nodes = _graph_nodes(out.grad_fn)
        calls.clear()
        out.backward(shard_sequence(dout, positions, dim=2))

        errors = {"out": (out - shard_sequence(ref_out, positions, dim=2)).abs().max().item()}
        for name, mine, full in zip(("dq", "dk", "dv"), local, ref):
            expect = shard_sequence(full.grad, positions, dim=2)
            errors[name] = (mine.grad - expect).abs().max().item()
        ledger_calls = Counter((r.op, r.mesh_dim, r.purpose, r.bytes) for r in ledger.records)
        results.append(dict(case=(mode, u, kv_heads), errors=errors, ledger=ledger_calls,
                            nodes=nodes, block_backward_calls=len(calls)))
    ring_mod.block_attention_backward = block_backward
    return results


@pytest.mark.parametrize("world", [2, 4, 8])
def test_context_attention_matches_dense(world):
    per_rank = run_on_ranks(_check_all, world)
    heads, T = heads_for(world), seq_len_for(world)
    for rank, results in enumerate(per_rank):
        assert [r["case"] for r in results] == cases(world)
        for r in results:
            mode, u, kv_heads = r["case"]
            where = f"rank {rank}, {mode} u={u} kv_heads={kv_heads}"
            assert max(r["errors"].values()) < TOL, (where, r["errors"])
            assert r["ledger"] == expected_ledger(mode, world, u, heads, kv_heads, T), where
            ring, _ = mode_degrees(mode, world, u)
            # the ring's gradients are its own backward's: one block backward per ring step,
            # and no communication (nor anything else) in the graph between out and q, k, v
            assert r["block_backward_calls"] == (ring if ring > 1 else 0), where
            if mode == "ring":
                assert r["nodes"] == {"_RingAttentionBackward", "AccumulateGrad"}, where


# ---------------------------------------------------------------- layouts (no ranks)

@pytest.mark.parametrize("degree", [1, 2, 3, 4, 8])
def test_zigzag_round_trip_and_positions(degree):
    T = 4 * degree
    x = torch.randn(2, T, 3)
    shards = [zigzag_shard(x, degree, i) for i in range(degree)]
    assert torch.equal(zigzag_unshard(shards), x)
    for i, shard in enumerate(shards):
        pos = zigzag_positions(T, degree, i)
        assert torch.equal(shard, x[:, pos])
        chunk = T // (2 * degree)
        assert pos.tolist() == (list(range(i * chunk, (i + 1) * chunk))
                                + list(range((2 * degree - 1 - i) * chunk,
                                             (2 * degree - i) * chunk)))
    # the balance: every rank holds the same number of causal (query, key) pairs
    pairs = {int((zigzag_positions(T, degree, i) + 1).sum()) for i in range(degree)}
    assert len(pairs) == 1


@pytest.mark.parametrize("mode,cp,u", [("ring", 4, None), ("ulysses", 4, None),
                                       ("hybrid", 4, 2), ("hybrid", 8, 2), ("hybrid", 8, 4)])
def test_layout_positions_partition_the_sequence(mode, cp, u):
    T = 32
    positions = [context_positions(T, mode, cp, i, u) for i in range(cp)]
    assert sorted(torch.cat(positions).tolist()) == list(range(T))
    x = torch.randn(2, T, 3)
    assert torch.equal(unshard_sequence([shard_sequence(x, p) for p in positions], positions), x)
    ring, u = mode_degrees(mode, cp, u)
    for j in range(ring):  # a Ulysses group's pieces, in rank order, are its ring rank's part
        group = torch.cat(positions[j * u:(j + 1) * u])
        expect = zigzag_positions(T, ring, j) if ring > 1 else torch.arange(T)
        assert torch.equal(group, expect)


def test_layout_per_mode():
    assert [context_layout(m) for m in ("ring", "ulysses", "hybrid")] == [
        "zigzag", "contiguous", "zigzag-ring"]
    # the hybrid's rule covers both: all-Ulysses is contiguous, all-ring is zigzag
    assert torch.equal(context_positions(32, "hybrid", 4, 1, 4),
                       context_positions(32, "ulysses", 4, 1))
    assert torch.equal(context_positions(32, "hybrid", 4, 3, 1),
                       context_positions(32, "ring", 4, 3))
    with pytest.raises(ValueError, match="cp_mode"):
        context_layout("stripes")


def test_bad_splits_raise_naming_the_problem():
    with pytest.raises(ValueError, match="2 x cp = 8"):
        check_zigzag(12, 4)
    with pytest.raises(ValueError, match="divisible by 8"):
        check_sequence_split(36, 2, 4)  # 36 = 2 x 2 x 9 splits over the ring, not over 8
    with pytest.raises(ValueError, match="cp_ulysses = 3"):
        mode_degrees("hybrid", 4, 3)


def test_ulysses_kv_heads_rule():
    assert ulysses_kv_heads(8, 4) == 8  # split: 2 per rank
    assert ulysses_kv_heads(2, 4) == 4  # replicated twice: 1 per rank
    assert ulysses_kv_heads(1, 8) == 8
    with pytest.raises(ValueError, match="kv_heads = 6 neither divides by 4"):
        ulysses_kv_heads(6, 4)
    with pytest.raises(ValueError, match="heads = 6 does not divide by 4"):
        check_ulysses_heads(6, 2, 4)
    assert check_ulysses_heads(8, 2, 4) == 4
    assert set(cp_layout.MODES) == {"ring", "ulysses", "hybrid"}


@pytest.mark.parametrize("causal", [True, False])
def test_block_attention_by_query_chunks_equals_one_chunk(causal, monkeypatch):
    """The math path's query-row chunks (block_attention.QUERY_CHUNK) change nothing but the
    memory: forward and backward with 3-row chunks (uneven: 10 rows) equal one chunk, fp64,
    to 1e-12, with grouped-query attention."""
    from fivefold.parallel.context import block_attention as ba

    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, h, 10, E, generator=gen, dtype=torch.float64)
                     for h in (4, 2, 2, 4))
    runs = []
    for chunk in (1000, 3):
        monkeypatch.setattr(ba, "QUERY_CHUNK", chunk)
        out, lse = ba.block_attention_forward(q, k, v, causal, 0.3)
        runs.append((out, lse, *ba.block_attention_backward(q, k, v, out, dout, lse, causal,
                                                            0.3)))
    for whole, chunked in zip(*runs):
        torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-12)


def test_cpu_query_chunks_keep_scores_below_the_heap_threshold():
    """On the CPU a chunk holds at most CPU_SCORE_BYTES of scores (glibc's mmap threshold,
    block_attention's docstring), at least one row and at most QUERY_CHUNK; elsewhere it is
    QUERY_CHUNK rows."""
    from fivefold.parallel.context import block_attention as ba

    assert ba.query_chunk_rows("cpu", 4 * 8, 512, 4) == 128  # 4 x 8 heads x 512 keys, fp32
    assert ba.query_chunk_rows("cpu", 1, 64, 4) == ba.QUERY_CHUNK
    assert ba.query_chunk_rows("cpu", 4096, 4096, 8) == 1
    assert ba.query_chunk_rows("cuda", 4 * 8, 512, 4) == ba.QUERY_CHUNK
    rows = ba.query_chunk_rows("cpu", 6, 1000, 8)
    assert rows * 6 * 1000 * 8 <= ba.CPU_SCORE_BYTES < (rows + 1) * 6 * 1000 * 8
