"""Rank-level counting for the split ILP: exact and symmetry-free for transformer-like profiles.

Applies when the profile is one long run of identical layers (the blocks) with a few distinct
layers before it (the embedding, a first block that differs) and after it (the head). Where a
block sits inside its pipeline rank does not matter to time: assemble only sums per stage, sums
stages per rank and takes maxima per rank. So the ILP counts, per pipeline rank k and recompute
mode r, the blocks N[k][r], and places each edge (non-block) layer i on a stage with binaries
z[i][j][r]:

    (one_stage)  sum_{j,r} z[i][j][r] = 1 per edge layer;  sum_{k,r} N[k][r] = L
    (edge_order) consecutive edge layers of one side: stage(i+1) - stage(i) in {0, 1}, and the
                 last leading edge layer's stage <= the first trailing edge layer's stage
    (held)       h_j = 1 iff stage j holds an edge layer
    (nonempty)   sum_r N[k][r] >= sum_{j on k} (1 - h_j)          (block-only stages get one)
    (room)       sum_r N[k][r] <= L sum_{j on k} (1 - h_j + last_lead_j + first_trail_j)
    edge layers enter the rank sums as n[i][k][r] = sum_{j on k} z[i][j][r]

Nor does it matter to memory where every rank's chunks hold one count at its peak (one chunk a
rank, or chunks the schedule fills alike: ``held_counts.uniform_ranks``). Elsewhere a rank's
memory is a max over count vectors of per-chunk sums, and each stage's blocks are counted too:

    (chunks)     B[j][r] blocks of stage j: sum_{j on k} B[j][r] = N[k][r];
                 sum_r B[j][r] >= 1 - h_j;
                 sum_r B[j][r] <= L (1 - h_j + last_lead_j + first_trail_j)

Any per-rank count satisfying these is realised by a contiguous split: each rank's blocks go to
its stages that may hold blocks (block-only stages first, one each), the stages in order.
``stage_counts`` performs exactly that, modes in the order none, selective, full (or takes the
stages' own counts B where the ILP has them).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pulp

from autopar.config import RECOMPUTE
from autopar.cost_model.held_counts import uniform_ranks
from autopar.cost_model.tables import CostTable
from autopar.schedules import rank_of_stage

__all__ = ["MAX_EDGE_LAYERS", "add_edge_placements", "add_rank_counts", "add_rank_room", "big_run",
           "block_stages", "placed_edges", "rank_aggregable", "stage_counts", "the_big_run"]

R = range(len(RECOMPUTE))
MAX_EDGE_LAYERS = 8  # more distinct layers than this around the blocks: use per-stage counting


def big_run(runs, num_layers: int) -> int | None:
    """Index of the one run of >= 2 layers when every other run is a single layer."""
    big = [g for g, (a, b) in enumerate(runs) if b > a]
    if len(big) != 1 or len(runs) - 1 > MAX_EDGE_LAYERS:
        return None
    return big[0]


def the_big_run(runs, num_layers: int) -> int:
    """``big_run`` where per-rank counting applies (``rank_aggregable``); ValueError otherwise."""
    big = big_run(runs, num_layers)
    if big is None:
        raise ValueError("per-rank counting needs one run of blocks among single edge layers")
    return big


def rank_aggregable(table: CostTable, runs) -> bool:
    """Whether per-rank counting is exact for this table (see the module docstring)."""
    return table.config.num_stages == 1 or big_run(runs, len(table.layers)) is not None


def _window(i: int, n: int, s: int) -> range:
    return range(max(0, i - (n - s)), min(i, s - 1) + 1)


def _edge_vars(prob, table: CostTable, runs, blocks: frozenset[int], var: Callable):
    """z[g, j, r] for every edge run g (not in ``blocks``), its stage index expression, h_j."""
    s, num_layers = table.config.num_stages, len(table.layers)
    z: dict[tuple[int, int, int], pulp.LpVariable] = {}
    for g, (a, _b) in enumerate(runs):
        if g not in blocks:
            for j in _window(a, num_layers, s):
                for r in R:
                    z[g, j, r] = var(
                        prob, f"z[{table.names[a]}][{j}][{RECOMPUTE[r]}]", 0, 1, "Binary"
                    )
    stage = {
        g: pulp.lpSum(j * v for (gg, j, _r), v in sorted(z.items()) if gg == g)
        for g in range(len(runs))
        if g not in blocks
    }
    at = {
        (g, j): pulp.lpSum(z[g, j, r] for r in R if (g, j, r) in z) for g in stage for j in range(s)
    }
    held = {}
    for j in range(s):
        here = [at[g, j] for g in stage if any((g, j, r) in z for r in R)]
        if not here:
            held[j] = 0
            continue
        h = held[j] = var(prob, f"held[stage{j}]", 0, 1, "Binary")
        # [Constraint] held: h_j is 1 exactly when stage j holds an edge layer
        prob += h <= pulp.lpSum(here), f"held_some[stage{j}]"
        for g in stage:
            if any((g, j, r) in z for r in R):
                prob += h >= at[g, j], f"held[{table.names[runs[g][0]]}][{j}]"
    return z, stage, at, held


def _single_stage_counts(prob: pulp.LpProblem, table: CostTable, runs, var: Callable):
    """One stage: every layer on rank 0, only the recompute modes are free."""
    n = {
        (g, 0, r): var(
            prob, f"N[{table.names[a]}][rank0][{RECOMPUTE[r]}]", 0, b - a + 1, "Integer"
        )
        for g, (a, b) in enumerate(runs)
        for r in R
    }
    for g, (a, b) in enumerate(runs):
        # [Constraint] one_stage: every layer of a run is placed exactly once
        prob += (
            pulp.lpSum(n[g, 0, r] for r in R) == b - a + 1,
            f"one_stage[{table.names[a]}]",
        )
    cnt = {(g, 0): pulp.lpSum(n[g, 0, r] for r in R) for g in range(len(runs))}
    return n, cnt, [0], [1], {}


def _edge_rank_counts(prob: pulp.LpProblem, table: CostTable, runs, z, stage, stage_rank,
                      var: Callable) -> dict[tuple[int, int, int], object]:
    """Binary per-rank counts of the edge layers, tied to their stage placements ``z``."""
    n: dict[tuple[int, int, int], object] = {}
    for g in stage:
        name = table.names[runs[g][0]]
        # [Constraint] one_stage: every edge layer sits on exactly one stage
        prob += (
            pulp.lpSum(v for (gg, _j, _r), v in sorted(z.items()) if gg == g) == 1,
            (f"one_stage[{name}]"),
        )
        for k in range(table.config.pp):
            for r in R:
                terms = [z[g, j, r] for j in range(len(stage_rank))
                         if stage_rank[j] == k and (g, j, r) in z]
                if terms:
                    v = n[g, k, r] = var(
                        prob, f"n[{name}][rank{k}][{RECOMPUTE[r]}]", 0, 1, "Binary"
                    )
                    prob += v == pulp.lpSum(terms), f"on_rank[{name}][rank{k}][{r}]"
    return n


def _edge_order(prob: pulp.LpProblem, table: CostTable, runs, stage, lead, trail) -> None:
    # [Constraint] edge_order: edge layers advance one stage at most, leading before trailing
    for side in (lead, trail):
        for g, g2 in itertools.pairwise(side):
            prob += stage[g2] - stage[g] >= 0, f"edge_order[{table.names[runs[g2][0]]}]"
            prob += stage[g2] - stage[g] <= 1, f"edge_step[{table.names[runs[g2][0]]}]"
    if lead and trail:
        prob += stage[trail[0]] >= stage[lead[-1]], "edge_order[lead_before_trail]"


def add_edge_placements(prob: pulp.LpProblem, table: CostTable, runs, blocks: frozenset[int],
                        var: Callable):
    """The edge layers' stage binaries z, their per-rank counts n and (edge_order); returns
    (z, n, held, at, lead, trail): h_j, at[g, j] and the edge runs before and after the blocks."""
    cfg = table.config
    stage_rank = [rank_of_stage(cfg.schedule, cfg.pp, j) for j in range(cfg.num_stages)]
    z, stage, at, held = _edge_vars(prob, table, runs, blocks, var)
    lead = [g for g in stage if g < min(blocks)]
    trail = [g for g in stage if g > max(blocks)]
    n = _edge_rank_counts(prob, table, runs, z, stage, stage_rank, var)
    _edge_order(prob, table, runs, stage, lead, trail)
    return z, n, held, at, lead, trail


def add_rank_room(prob: pulp.LpProblem, table: CostTable, k: int, blocks_k, size: int,
                  placed: tuple) -> None:
    """(nonempty) / (room) of rank k: its block-only stages get a block; blocks only where a
    stage may hold them. ``placed`` is (held, at, lead, trail) of ``add_edge_placements``."""
    cfg = table.config
    held, at, lead, trail = placed
    mine = [j for j in range(cfg.num_stages) if rank_of_stage(cfg.schedule, cfg.pp, j) == k]
    bare = pulp.lpSum(1 - held[j] for j in mine)
    room = bare + pulp.lpSum(
        (at[lead[-1], j] if lead else 0) + (at[trail[0], j] if trail else 0) for j in mine
    )
    # [Constraint] nonempty / room: block-only stages get a block; blocks only where allowed
    prob += blocks_k >= bare, f"nonempty[rank{k}]"
    prob += blocks_k <= size * room, f"room[rank{k}]"


def add_rank_counts(prob: pulp.LpProblem, table: CostTable, runs, var: Callable):
    """Per-rank counts and edge placements; returns (n, cnt, slot_rank, slot_p2p, z)."""
    cfg = table.config
    s, p = cfg.num_stages, cfg.pp
    if s == 1:
        return _single_stage_counts(prob, table, runs, var)
    stage_rank = [rank_of_stage(cfg.schedule, p, j) for j in range(s)]
    big = the_big_run(runs, len(table.layers))
    a_big, b_big = runs[big]
    z, n, held, at, lead, trail = add_edge_placements(prob, table, runs, frozenset({big}), var)
    size = b_big - a_big + 1
    for k in range(p):
        for r in R:
            n[big, k, r] = var(
                prob, f"N[{table.names[a_big]}][rank{k}][{RECOMPUTE[r]}]", 0, size, "Integer"
            )
    # [Constraint] one_stage: every block is placed exactly once
    prob += (
        pulp.lpSum(n[big, k, r] for k in range(p) for r in R) == size,
        (f"one_stage[{table.names[a_big]}]"),
    )
    cnt = {
        (g, k): pulp.lpSum(n[g, k, r] for r in R if (g, k, r) in n)
        for g in range(len(runs))
        for k in range(p)
    }
    for k in range(p):
        add_rank_room(prob, table, k, cnt[big, k], size, (held, at, lead, trail))
    if not uniform_ranks(cfg.schedule, p, cfg.virtual_stages, table.num_microbatches):
        z = {**z, **_chunk_counts(prob, table, runs, big, n, (held, at, lead, trail), var)}
    return n, cnt, list(range(p)), [stage_rank.count(k) for k in range(p)], z


def _chunk_counts(prob: pulp.LpProblem, table: CostTable, runs, big: int, n: dict,
                  placed: tuple, var: Callable) -> dict[tuple[int, int, int], pulp.LpVariable]:
    """(chunks): the blocks of each stage, B[big, j, r], summing to their rank's counts."""
    cfg = table.config
    held, at, lead, trail = placed
    a_big, b_big = runs[big]
    size, name = b_big - a_big + 1, table.names[a_big]
    b: dict[tuple[int, int, int], pulp.LpVariable] = {}
    for j in range(cfg.num_stages):
        for r in R:
            b[big, j, r] = var(prob, f"B[{name}][{j}][{RECOMPUTE[r]}]", 0, size, "Integer")
        here = pulp.lpSum(b[big, j, r] for r in R)
        bare = 1 - held[j]
        # [Constraint] chunks: a block-only stage gets a block; blocks only where allowed
        prob += here >= bare, f"chunk_nonempty[{j}]"
        ends = (at[lead[-1], j] if lead else 0) + (at[trail[0], j] if trail else 0)
        prob += here <= size * (bare + ends), f"chunk_room[{j}]"
    for k in range(cfg.pp):
        mine = [j for j in range(cfg.num_stages) if rank_of_stage(cfg.schedule, cfg.pp, j) == k]
        for r in R:
            # [Constraint] chunks: the stages' blocks are the rank's
            prob += pulp.lpSum(b[big, j, r] for j in mine) == n[big, k, r], (
                f"chunk_sum[rank{k}][{r}]")
    return b


def placed_edges(counts: dict) -> tuple[dict[tuple[int, int, int], int], dict[int, int]]:
    """(per-stage counts of the edge layers, the stage of each) of a per-rank solution, read
    from its placements (g, j, r, "stage")."""
    out: dict[tuple[int, int, int], int] = {}
    where: dict[int, int] = {}
    for key, v in counts.items():
        if len(key) == 4 and v:
            g, j, r, _ = key
            out[g, j, r] = out.get((g, j, r), 0) + v
            where[g] = j
    return out, where


def block_stages(s: int, lead: list[int], trail: list[int], held: set[int]) -> list[bool]:
    """Which stages may hold blocks: from the last leading edge layer's stage to the first
    trailing one's, stages holding an edge layer only at those two ends."""
    first, last = (max(lead) if lead else 0), (min(trail) if trail else s - 1)
    return [first <= j <= last and (j not in held or j in (first, last)) for j in range(s)]


def stage_counts(table: CostTable, runs, counts: dict) -> dict[tuple[int, int, int], int]:
    """Per-stage counts (run, stage, mode) of a per-rank solution (see the module docstring).

    ``counts`` holds the per-rank counts (g, k, r) and the edge placements (g, j, r, "stage").
    """
    cfg = table.config
    s, p = cfg.num_stages, cfg.pp
    if s == 1:
        return {key: v for key, v in counts.items() if len(key) == 3}
    stage_rank = [rank_of_stage(cfg.schedule, p, j) for j in range(s)]
    big = the_big_run(runs, len(table.layers))
    chunks = {key[:3]: v for key, v in counts.items() if len(key) == 4 and key[0] == big}
    out, where = placed_edges({key: v for key, v in counts.items()
                               if not (len(key) == 4 and key[0] == big)})
    if chunks:  # the ILP counted each stage's blocks (``_chunk_counts``)
        return {**out, **{key: v for key, v in chunks.items() if v}}
    held = set(where.values())
    ok = block_stages(s, [where[g] for g in where if g < big],
                      [where[g] for g in where if g > big], held)
    for k in range(p):
        allowed = [j for j in range(s) if stage_rank[j] == k and ok[j]]
        pool = [r for r in R for _ in range(counts.get((big, k, r), 0))]
        if not pool:
            continue
        order = [j for j in allowed if j not in held] + [j for j in allowed if j in held]
        base, extra = divmod(len(pool), len(order))
        size = {j: base + (1 if pos < extra else 0) for pos, j in enumerate(order)}
        start = 0
        for j in allowed:
            for r in pool[start : start + size[j]]:
                out[big, j, r] = out.get((big, j, r), 0) + 1
            start += size[j]
    return out
