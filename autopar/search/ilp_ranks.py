"""Rank-level counting for the split ILP: exact, symmetry-free, for embedding + blocks + head.

When the profile is one run of identical layers (the blocks) with at most one distinct layer
before it (layer 0) and one after it (layer n-1), where a layer sits inside its pipeline rank
does not matter: assemble only sums per stage, sums stages per rank, and takes maxima per rank.
Any per-rank count of blocks is realised by a contiguous split as long as every stage that holds
neither the first nor the last layer gets at least one block. So the ILP counts, per pipeline
rank k and recompute mode r, the blocks N[k][r] (and places the first and last layers on the
ranks of stages 0 and S-1), instead of counting per stage: S / p times fewer variables and none
of the symmetry between a rank's chunks that makes the per-stage model slow at large S.

    (one_stage) sum_{k,r} N[g][k][r] = L_g
    (nonempty)  sum_r N[blocks][k][r] >= stages of rank k holding neither layer 0 nor layer n-1

``stage_counts`` turns a solution back into per-stage counts: each rank's blocks spread as evenly
as possible over its stages (stages without an edge layer first), modes in the order none,
selective, full.
"""

from __future__ import annotations

from collections.abc import Callable

import pulp

from autopar.config import RECOMPUTE
from autopar.cost_model.pipeline import rank_of_stage
from autopar.cost_model.tables import CostTable

__all__ = [
    "add_rank_counts",
    "big_run",
    "edge_stages",
    "rank_aggregable",
    "stage_counts",
]

R = range(len(RECOMPUTE))


def big_run(runs, n_layers: int) -> int | None:
    """Index of the one run longer than a layer, when every other run is layer 0 or n-1."""
    big = [g for g, (a, b) in enumerate(runs) if b > a]
    others = [run for g, run in enumerate(runs) if g not in big]
    if len(big) != 1 or any(run not in ((0, 0), (n_layers - 1, n_layers - 1)) for run in others):
        return None
    return big[0]


def rank_aggregable(table: CostTable, runs) -> bool:
    """Whether per-rank counting is exact for this table (see the module docstring)."""
    return table.config.num_stages == 1 or big_run(runs, len(table.layers)) is not None


def edge_stages(table: CostTable, runs) -> dict[int, int]:
    """Run index -> the one stage it must sit in (the first and last layers)."""
    s, n_layers = table.config.num_stages, len(table.layers)
    big = big_run(runs, n_layers)
    return {g: (0 if a == 0 else s - 1) for g, (a, _b) in enumerate(runs) if g != big}


def add_rank_counts(prob: pulp.LpProblem, table: CostTable, runs, var: Callable):
    """Per-rank count variables and constraints; returns (n, cnt, slot_rank, slot_p2p)."""
    cfg = table.config
    s, p = cfg.num_stages, cfg.pp
    stage_rank = [rank_of_stage(cfg.schedule, p, j) for j in range(s)]
    edges = edge_stages(table, runs) if s > 1 else {}
    n: dict[tuple[int, int, int], pulp.LpVariable] = {}
    for g, (a, b) in enumerate(runs):
        ranks = [stage_rank[edges[g]]] if g in edges else range(p)
        for k in ranks:
            for r in R:
                n[g, k, r] = var(
                    prob, f"N[{table.layers[a].name}][rank{k}][{RECOMPUTE[r]}]", 0, b - a + 1,
                    "Integer",
                )  # fmt: skip
    cnt = {
        (g, k): pulp.lpSum(n[g, k, r] for r in R) if (g, k, 0) in n else 0
        for g in range(len(runs))
        for k in range(p)
    }
    # [Constraint] one_stage: every layer of a run is placed exactly once
    for g, (a, b) in enumerate(runs):
        total = pulp.lpSum(var_ for (gg, _k, _r), var_ in sorted(n.items()) if gg == g)
        prob += total == b - a + 1, f"one_stage[{table.layers[a].name}]"
    # [Constraint] nonempty: a rank's stages without an edge layer hold at least one block each
    if s > 1:
        big = big_run(runs, len(table.layers))
        covered = set(edges.values())
        for k in range(p):
            need = sum(1 for j in range(s) if stage_rank[j] == k and j not in covered)
            if need:
                prob += cnt[big, k] >= need, f"nonempty[rank{k}]"
    slot_p2p = [stage_rank.count(k) for k in range(p)]
    return n, cnt, list(range(p)), slot_p2p


def stage_counts(table: CostTable, runs, counts: dict) -> dict[tuple[int, int, int], int]:
    """Per-stage counts (run, stage, mode) of a per-rank solution (see the module docstring)."""
    cfg = table.config
    s, p = cfg.num_stages, cfg.pp
    if s == 1:
        return dict(counts)
    stage_rank = [rank_of_stage(cfg.schedule, p, j) for j in range(s)]
    edges = edge_stages(table, runs)
    big = big_run(runs, len(table.layers))
    out: dict[tuple[int, int, int], int] = {}
    for g, j in edges.items():
        for r in R:
            out[g, j, r] = counts.get((g, stage_rank[j], r), 0)
    covered = set(edges.values())
    for k in range(p):
        mine = [j for j in range(s) if stage_rank[j] == k]
        order = [j for j in mine if j not in covered] + [j for j in mine if j in covered]
        pool = [r for r in R for _ in range(counts.get((big, k, r), 0))]
        base, extra = divmod(len(pool), len(mine))
        size = {j: base + (1 if pos < extra else 0) for pos, j in enumerate(order)}
        start = 0
        for j in mine:
            for r in pool[start : start + size[j]]:
                out[big, j, r] = out.get((big, j, r), 0) + 1
            start += size[j]
    return out
