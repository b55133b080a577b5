"""Rank-level counting of a repeating section by kind: a relaxation, exact when realised.

Where a section of blocks repeats a few kinds (``ilp_pattern.py``) between single edge layers,
the per-stage ILP stays symmetric between a rank's chunks and slow to bound (Llama 4 Maverick
under an interleaved schedule: 24-32 stages, its gap still 7% after 20 s). As with one run of
blocks (``ilp_ranks.py``), what the step time and memory read is each rank's total per kind
and mode, so the ILP counts, per pipeline rank k, kind kappa and mode r, N[kappa][k][r], and
places the edge layers on stages as ``ilp_ranks`` does. A rank's stages are contiguous windows of
the section, and a window of l layers holds l rho_kappa +- delta_kappa layers of kind kappa
(rho: the kind's share of a period; delta: the largest deviation over a period's windows), so

    (one_kind)  sum_{k,r} N[kappa][k][r] = the section's kind-kappa count
    (window)    |sum_r N[kappa][k][r] - rho_kappa c_k| <= w_k delta_kappa,  c_k = the rank's
                section layers, w_k its stages

with ``ilp_ranks``' (nonempty) and (room) on c_k. Not every such count is a contiguous split, so
this ILP is a relaxation: its optimum bounds the real one. ``realize`` then searches the stage
lengths in order (depth first, lengths nearest the rank's remaining share first, failed states
remembered) for a split with exactly these per-rank counts; found, it is the optimum; not found
within ``MAX_NODES``, the caller solves the per-stage ILP with this bound.
"""

from __future__ import annotations

from collections.abc import Callable

import pulp

from autopar.config import RECOMPUTE
from autopar.cost_model.tables import CostTable
from autopar.schedules import rank_of_stage
from autopar.search.ilp_pattern import Pattern, around
from autopar.search.ilp_ranks import (
    MAX_EDGE_LAYERS,
    add_edge_placements,
    add_rank_room,
    block_stages,
    placed_edges,
)

__all__ = ["MAX_NODES", "add_kind_rank_counts", "kind_rank_keys", "realize", "window_spread"]

R = range(len(RECOMPUTE))
MAX_NODES = 200_000  # stage-length choices tried before the realisation gives up


def kind_rank_keys(table: CostTable, pat: Pattern) -> tuple | None:
    """The ILP's keys (first, last layer of each edge run, a kind's first layer for each kind)
    and the pattern with its kinds' first key; None unless every layer outside the section is
    a single distinct edge layer, at most ``MAX_EDGE_LAYERS`` of them."""
    lead, trail, pat = around(table, pat)
    edges = (*lead, *trail)
    if len(edges) > MAX_EDGE_LAYERS or any(b > a for a, b in edges):
        return None
    return (*lead, *((rep, rep) for rep in pat.rep), *trail), pat


def window_spread(pat: Pattern, kappa: int) -> float:
    """delta: the largest |count - rho l| of kind ``kappa`` over windows of the section."""
    p, per = pat.period, pat.per_period(kappa)
    worst = 0.0
    for start in range(p):
        for length in range(p):
            count = sum(1 for i in range(start, start + length) if pat.kind_at(i) == kappa)
            worst = max(worst, abs(count - per * length / p))
    return worst


def add_kind_rank_counts(prob: pulp.LpProblem, table: CostTable, keys, pat: Pattern,
                         var: Callable):
    """Per-rank kind counts and edge placements; returns (n, cnt, slot_rank, slot_p2p, z)."""
    cfg = table.config
    s, p = cfg.num_stages, cfg.pp
    stage_rank = [rank_of_stage(cfg.schedule, p, j) for j in range(s)]
    kinds = range(pat.key0, pat.key0 + len(pat.rep))
    z, n, held, at, lead, trail = add_edge_placements(prob, table, keys, frozenset(kinds), var)
    for g in kinds:
        kappa, name = g - pat.key0, table.names[keys[g][0]]
        total = sum(1 for i in range(pat.size) if pat.kind_at(i) == kappa)
        for k in range(p):
            for r in R:
                n[g, k, r] = var(prob, f"N[{name}*][rank{k}][{RECOMPUTE[r]}]", 0, total,
                                 "Integer")
        # [Constraint] one_kind: every block of the kind is placed exactly once
        prob += pulp.lpSum(n[g, k, r] for k in range(p) for r in R) == total, (
            f"one_kind[{name}]")
    cnt = {(g, k): pulp.lpSum(n[g, k, r] for r in R if (g, k, r) in n)
           for g in range(len(keys)) for k in range(p)}
    for k in range(p):
        section_k = pulp.lpSum(cnt[g, k] for g in kinds)
        add_rank_room(prob, table, k, section_k, pat.size, (held, at, lead, trail))
        windows = stage_rank.count(k)
        for g in kinds:
            kappa = g - pat.key0
            share = pat.per_period(kappa) / pat.period
            spread = windows * window_spread(pat, kappa)
            name = table.names[keys[g][0]]
            # [Constraint] window: a rank's stages hold the kind's share, up to their spread
            prob += cnt[g, k] - share * section_k <= spread, f"window_hi[{name}][rank{k}]"
            prob += share * section_k - cnt[g, k] <= spread, f"window_lo[{name}][rank{k}]"
    return n, cnt, list(range(p)), [stage_rank.count(k) for k in range(p)], z


def _window_counts(pat: Pattern, start: int, length: int) -> tuple[int, ...]:
    counts = [0] * len(pat.rep)
    for i in range(start, start + length):
        counts[pat.kind_at(i)] += 1
    return tuple(counts)


def realize(table: CostTable, keys, pat: Pattern, counts: dict) -> dict | None:
    """Per-stage counts (key, stage, mode) of a per-rank solution, or None if no contiguous split
    of the section gives every rank its kind counts (within ``MAX_NODES`` tries)."""
    cfg = table.config
    s, p = cfg.num_stages, cfg.pp
    stage_rank = [rank_of_stage(cfg.schedule, p, j) for j in range(s)]
    out, placed = placed_edges(counts)
    allowed = block_stages(s, [j for g, j in placed.items() if g < pat.key0],
                           [j for g, j in placed.items() if g >= pat.key0 + len(pat.rep)],
                           set(placed.values()))
    kinds = len(pat.rep)
    need = {k: tuple(sum(counts.get((pat.key0 + c, k, r), 0) for r in R) for c in range(kinds))
            for k in range(p)}
    lengths = _search(pat, stage_rank, allowed, set(placed.values()), need)
    if lengths is None:
        return None
    pools = {(k, c): [r for r in R for _ in range(counts.get((pat.key0 + c, k, r), 0))]
             for k in range(p) for c in range(kinds)}
    start = 0
    for j, length in enumerate(lengths):
        for c, m in enumerate(_window_counts(pat, start, length)):
            for r in pools[stage_rank[j], c][:m]:
                out[pat.key0 + c, j, r] = out.get((pat.key0 + c, j, r), 0) + 1
            del pools[stage_rank[j], c][:m]
        start += length
    return out


def _search(pat: Pattern, stage_rank: list[int], allowed: list[bool], held: set[int],
            need: dict[int, tuple[int, ...]]) -> list[int] | None:
    """Section layers per stage, in order, meeting ``need`` per rank exactly; None if none."""
    s = len(stage_rank)
    failed: set[tuple] = set()
    nodes = [0]

    def go(j: int, at: int, rem: dict[int, tuple[int, ...]]) -> list[int] | None:
        if j == s:
            return [] if at == pat.size else None
        state = (j, at, tuple(sorted(rem.items())))
        if state in failed or nodes[0] > MAX_NODES:
            return None
        nodes[0] += 1
        k = stage_rank[j]
        if not allowed[j]:
            rest = go(j + 1, at, rem)
            return None if rest is None else [0, *rest]
        left = sum(1 for jj in range(j, s) if allowed[jj] and stage_rank[jj] == k)
        total = sum(rem[k])
        lo = 0 if j in held else 1
        options = [total] if left == 1 else range(lo, total + 1)
        for length in sorted(options, key=lambda x: abs(x - total / left)):
            if length < lo or at + length > pat.size:
                continue
            got = _window_counts(pat, at, length)
            if any(g > r for g, r in zip(got, rem[k], strict=True)):
                continue
            if left == 1 and got != rem[k]:
                continue
            rest = go(j + 1, at + length, {**rem, k: tuple(
                r - g for r, g in zip(rem[k], got, strict=True))})
            if rest is not None:
                return [length, *rest]
        failed.add(state)
        return None

    return go(0, 0, dict(need))
