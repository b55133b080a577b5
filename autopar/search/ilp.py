"""The stage-split and recompute ILP of one outer configuration (pulp; HiGHS by default).

It minimises exactly the step time ``autopar.cost_model.assemble`` computes (or, for the
infeasibility report, the largest rank's memory) over every contiguous split of the profile's
layers into S = pp * v stages and every per-layer recompute choice.

Formulation. The split: per-stage counts of runs of identical layers (``ilp_stages.py``:
Q[g][j], n[g][j][r], the (count), (order) and (nonempty) constraints), a section of blocks that
repeat a few kinds counted by kind (``ilp_pattern.py``), or per-rank counts (``ilp_ranks.py``).
Then, with n[g][j][r] the run-g layers of stage j under recompute r:

    u[g][k][r] binary: rank k runs some run-g layer with recompute r (for the transient max)

    (transient) sum_{j on k} n[g][j][r] <= M u[g][k][r];  Mt_k >= transient_g(r) u[g][k][r]
    (mem)       static_k + sum_{j on k} c_j act_j + Mt_k + buffers <= capacity, for each count
                vector c of rank k (``held_counts.held_vectors``)        (GiB inside the ILP)
    (bottleneck) Rmax >= R_k = sum_{j on k} (sum_{g,r} t_g(r) n[g][j][r] + p2p)
    (tail)      D_k >= dp_tail; D_k >= sum (dp_step - eta backward);  E >= D_k + optimizer_k
    objective   m Rmax + c sum_j T_j + E          (assemble.py's step time, term by term)

Strength. Counts are bounded by what fits a rank's memory (count (static + charge act) <=
capacity - buffers, the charge a count the slot's layers are held for at least), which also
gives the transient constraints a small M. For embedding + blocks + head profiles,
``ilp_ranks.py`` counts the blocks per pipeline rank instead of per stage (exact, and free of the
symmetry between a rank's chunks where they hold one count at the rank's peak; elsewhere each
stage's blocks are counted too); interchangeable ranks (same count vectors, chunks and layer
kinds) are ordered by time, (order) R_k >= R_k'. There, ``ilp_hull.py``
also gives each rank the exact hull of its time as a function of its block count (the fastest
mix of recompute modes its memory allows), which the LP relaxation of the per-rank knapsack lacks.
An optional cutoff (step <= the planner's k-th best) lets a candidate that cannot compete end as
infeasible fast; the hull then drops the counts a rank could not afford under it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pulp

from autopar.config import RECOMPUTE
from autopar.cost_model.assemble import assemble, pipeline_buffer_bytes
from autopar.cost_model.held_counts import held_vectors, uniform_ranks
from autopar.cost_model.pipeline import bubble_coefficient
from autopar.cost_model.tables import CostTable
from autopar.schedules import rank_of_stage
from autopar.search.ilp_hull import add_rank_hull
from autopar.search.ilp_hull_kinds import add_kind_hull
from autopar.search.ilp_memory import MEM_SAFETY_GIB, memory_exprs
from autopar.search.ilp_pattern import (
    Pattern,
    add_kind_caps,
    add_pattern_counts,
    find_pattern,
    pattern_stages,
)
from autopar.search.ilp_rank_kinds import add_kind_rank_counts, kind_rank_keys, realize
from autopar.search.ilp_ranks import add_rank_counts, rank_aggregable, stage_counts, the_big_run
from autopar.search.ilp_stages import (
    add_nonempty,
    add_order,
    add_run_counts,
    cost_signature,
    layer_runs,
    new_var,
    plainest_mode,
)
from autopar.search.options import SearchOptions
from autopar.units import GIB

__all__ = ["IlpModel", "IlpSolution", "build_ilp", "cost_signature", "decode", "layer_runs",
           "realized", "solve_ilp"]

R = range(len(RECOMPUTE))


@dataclass(frozen=True, slots=True)
class IlpModel:
    """A built ILP: the pulp problem plus what decode needs."""

    problem: pulp.LpProblem
    table: CostTable
    runs: tuple[tuple[int, int], ...]
    count: dict[tuple[int, int, int], pulp.LpVariable]  # (run g, slot j, recompute r) -> n
    objective: str
    per_rank: bool = False  # slots are pipeline ranks (ilp_ranks.py), else stages
    placement: dict | None = None  # per-rank counting: edge layer (run, stage, mode) -> z
    section: Pattern | None = None  # a repeating section counted by kind (ilp_pattern.py)
    memory_relaxed: bool = False  # ranks charged their held floor (a relaxation: ``realized``)


@dataclass(frozen=True, slots=True, kw_only=True)
class IlpSolution:
    """Outcome of one solve.

    Attributes:
        status: "optimal" (proven within the gap), "feasible" (a limit stopped the solver with a
            solution), "infeasible" or "not-solved".
        objective: objective value (seconds, or GiB for the memory objective); inf if none.
        gap: relative MIP gap reported by the solver (0 when proven; 1 when unknown).
        time_limit_hit: the time limit stopped the solver.
        counts: (run, stage, recompute) -> number of layers.
    """

    status: str
    objective: float
    gap: float
    time_limit_hit: bool
    counts: dict[tuple, int]

    @property
    def has_solution(self) -> bool:
        """A split can be decoded."""
        return self.status in ("optimal", "feasible")


def _add_split(prob: pulp.LpProblem, table: CostTable, runs, s: int, by_kind: bool):
    """Per-stage counting (``ilp_stages.py``), a repeating section counted by kind where the
    table has one (``ilp_pattern.py``); returns (n, cnt, the runs as the ILP counts them, the
    section or None)."""
    n: dict[tuple[int, int, int], pulp.LpVariable] = {}
    cnt: dict[tuple[int, int], Any] = {}
    section = find_pattern(table) if by_kind else None
    if section is None:
        units = add_run_counts(prob, table, runs, s, new_var, n, cnt)
        keys = runs
    else:
        units, keys, section = add_pattern_counts(prob, table, section, s, new_var, n, cnt)
    add_order(prob, units, s, new_var)
    add_nonempty(prob, cnt, s)
    return n, cnt, keys, section


def _twins(table: CostTable, slot_rank, slot_p2p, n) -> list[tuple[int, int]]:
    """Consecutive pairs of interchangeable ranks (same count vectors, chunks, receive buffers
    and layer kinds).

    Per-rank counting makes such ranks exact twins: permuting their assignments changes nothing,
    so ordering their times removes the symmetry without losing any optimum. (The pipeline's
    first and last ranks hold fewer receive buffers than the others: not twins of them.)
    """
    cfg = table.config
    classes: dict[tuple, list[int]] = {}
    for k in range(cfg.pp):
        flight = held_vectors(cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches, k)
        kinds = tuple(sorted({g for (g, j, _r) in n if slot_rank[j] == k}))
        key = (flight, slot_p2p[k], pipeline_buffer_bytes(table, k), kinds)
        classes.setdefault(key, []).append(k)
    return [
        (ks[i], ks[i + 1])
        for (_f, _c, _b, kinds), ks in classes.items()
        if len(kinds) == 1  # ranks that may hold an edge layer are tied to its stages
        for i in range(len(ks) - 1)
    ]


def _time_objective(prob, table: CostTable, runs, slot_rank, slot_p2p, n, cnt, twins=()):
    """assemble's step time: m Rmax + c sum_j T_j + max_k E_k (E: exposed DP + optimizer)."""
    cfg = table.config
    p2p = table.p2p_s if cfg.pp > 1 else 0.0
    stage_t = [
        pulp.lpSum(
            table.layers[runs[g][0]].time_per_microbatch_s(RECOMPUTE[r]) * var
            for (g, jj, r), var in sorted(n.items())
            if jj == j
        )
        + p2p * slot_p2p[j]
        for j in range(len(slot_rank))
    ]
    rmax, tail = new_var(prob, "bottleneck_s", 0), new_var(prob, "tail_s", 0)
    for k in range(cfg.pp):
        stages = [j for j, rank in enumerate(slot_rank) if rank == k]
        # [Constraint] bottleneck: Rmax bounds every rank's time per micro-batch
        prob += rmax >= pulp.lpSum(stage_t[j] for j in stages), f"bottleneck[rank{k}]"

        def on_k(attr, stages=stages):
            return pulp.lpSum(
                attr(table.layers[a]) * cnt[g, j] for g, (a, _b) in enumerate(runs) for j in stages
            )

        opt = on_k(lambda lay: lay.optimizer_s)
        if cfg.data_ranks > 1:
            d = new_var(prob, f"dp_exposed[rank{k}]", 0)
            # [Constraint] tail: exposed DP reduction is at least the last bucket
            prob += d >= table.dp_tail_s, f"dp_tail[rank{k}]"
            # assemble's max(tail, s r, r - (1 - s) w): overlapped DP traffic (overlap.py)
            exposed = on_k(lambda lay: lay.dp_step_s - (1.0 - table.overlap_slowdown)
                           * table.overlap_efficiency * lay.backward_s)
            prob += d >= exposed, f"dp[rank{k}]"
            if table.overlap_slowdown > 0:
                prob += d >= on_k(lambda lay: table.overlap_slowdown * lay.dp_step_s), (
                    f"dp_slow[rank{k}]")
            prob += tail >= d + opt, f"tail[rank{k}]"
        else:
            prob += tail >= opt, f"tail[rank{k}]"
    # [Constraint] order: interchangeable ranks in non-increasing time (symmetry breaking)
    for k, k2 in twins:
        rank_t = [
            pulp.lpSum(t for j, t in enumerate(stage_t) if slot_rank[j] == x) for x in (k, k2)
        ]
        prob += rank_t[0] >= rank_t[1], f"order[rank{k}][rank{k2}]"
    c = bubble_coefficient(cfg.schedule, cfg.pp, cfg.virtual_stages, cfg.num_microbatches)
    return table.num_microbatches * rmax + c * pulp.lpSum(stage_t) + tail + table.step_fixed_s


def build_ilp(
    table: CostTable,
    *,
    capacity_bytes: float | None = None,
    objective: str = "time",
    aggregate: bool | None = None,
    cutoff_s: float | None = None,
    by_kind: bool = True,
    relax_kinds: bool = False,
) -> IlpModel:
    """Build the ILP of one outer configuration.

    Args:
        table: the configuration's cost terms.
        capacity_bytes: usable memory per GPU (default ``table.capacity_bytes``); ignored by the
            memory objective.
        objective: "time" (step time under the memory cap) or "memory" (largest rank's memory).
        aggregate: count layers per pipeline rank instead of per stage (``ilp_ranks.py``;
            exact when ``rank_aggregable``); None: whenever it is exact.
        cutoff_s: only splits faster than this are wanted (the planner's k-th best so far); the
            solve then ends "infeasible" when the candidate cannot beat it.
        by_kind: count a section of blocks that repeat a few kinds by kind (``ilp_pattern.py``;
            exact); False: per run, as every other profile (tests compare the two).
        relax_kinds: such a section between single edge layers is counted per rank instead
            (``ilp_rank_kinds.py``): a relaxation; ``realized`` says whether its solution is a
            split (then the optimum), else the caller solves the per-stage ILP.

    Returns:
        The IlpModel (see the module docstring for the formulation).
    """
    if objective not in ("time", "memory"):
        raise ValueError(f"objective must be 'time' or 'memory', got {objective!r}")
    prob = pulp.LpProblem(f"split_{objective}", pulp.LpMinimize)
    relax = relax_kinds and objective == "time"
    runs, section, aggregate, (n, cnt, slot_rank, slot_p2p, placement) = _split_model(
        prob, table, aggregate, by_kind, relax)
    cap = (table.capacity_bytes if capacity_bytes is None else capacity_bytes) / GIB
    cfg = table.config
    relaxed = section is not None and aggregate and not uniform_ranks(
        cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches)
    mems = memory_exprs(prob, table, runs, slot_rank, n, cnt,
                         None if objective == "memory" else cap,
                         None if relaxed else placement)
    if objective == "memory":
        peak = new_var(prob, "peak_gib", 0)
        for k, rank_mems in enumerate(mems):
            for c, mem in enumerate(rank_mems):
                # [Constraint] peak: the objective bounds every rank's memory
                prob += peak >= mem, f"mem[rank{k}][{c}]"
        prob += peak
    else:
        layout = (slot_rank, slot_p2p, n, cnt)
        _add_time_objective(prob, table, runs, layout, mems, cap, aggregate, cutoff_s, section)
    if section is not None and objective == "time":
        add_kind_caps(prob, table, section, n, slot_rank, cap - table.buffers_bytes / GIB)
    return IlpModel(problem=prob, table=table, runs=runs, count=n, objective=objective,
                    per_rank=aggregate, placement=placement, section=section,
                    memory_relaxed=relaxed)


def _split_model(prob: pulp.LpProblem, table: CostTable, aggregate: bool | None, by_kind: bool,
                 relax_kinds: bool):
    """The split's variables and constraints, counted per rank (one run of blocks, or a
    repeating section by kind when ``relax_kinds``) or per stage; returns (the keys' runs, the
    section or None, whether per rank, (n, cnt, slot_rank, slot_p2p, placement))."""
    s = table.config.num_stages
    runs = layer_runs(table)
    if aggregate is None:
        aggregate = rank_aggregable(table, runs)
    if relax_kinds and not aggregate and s > 1:
        pattern = find_pattern(table)
        kinds = None if pattern is None else kind_rank_keys(table, pattern)
        if kinds is not None:
            runs, section = kinds
            return runs, section, True, add_kind_rank_counts(prob, table, runs, section, new_var)
    if aggregate:
        return runs, None, True, add_rank_counts(prob, table, runs, new_var)
    n, cnt, runs, section = _add_split(prob, table, runs, s, by_kind)
    slot_rank = [rank_of_stage(table.config.schedule, table.config.pp, j) for j in range(s)]
    return runs, section, False, (n, cnt, slot_rank, [1] * s, {})


def _add_time_objective(prob, table: CostTable, runs, layout, mems, cap: float,
                        aggregate: bool, cutoff_s: float | None,
                        section: Pattern | None = None) -> None:
    """Memory caps, the rank hull and the step-time objective of ``build_ilp``'s time model."""
    slot_rank, slot_p2p, n, cnt = layout
    for k, rank_mems in enumerate(mems):
        for c, mem in enumerate(rank_mems):
            # [Constraint] mem: each pipeline rank's peak fits the usable device memory
            prob += mem <= cap - MEM_SAFETY_GIB, f"mem[rank{k}][{c}]"
    twins = _twins(table, slot_rank, slot_p2p, n) if aggregate else []  # one run of blocks
    if aggregate and table.config.num_stages > 1 and section is not None:
        add_kind_hull(prob, table, runs, section, n, cap, new_var, cutoff_s)
    elif aggregate and table.config.num_stages > 1:
        add_rank_hull(
            prob, table, runs, n, the_big_run(runs, len(table.layers)), cap, new_var, cutoff_s
        )
    step = _time_objective(prob, table, runs, slot_rank, slot_p2p, n, cnt, twins)
    if cutoff_s is not None:
        # [Constraint] cutoff: beat the k-th best plan found so far
        prob += step <= cutoff_s, "cutoff"
    prob += step


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Send file descriptor 1 to /dev/null (HiGHS prints a banner even with output off)."""
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _solver(options: SearchOptions):
    common = {"msg": False, "timeLimit": options.time_limit_s, "gapRel": options.mip_gap}
    if options.solver == "highs":
        # mip_feasibility_tolerance 1e-8 (HiGHS's default 1e-6): at the default, HiGHS 1.16.0
        # corrupted its heap on an ILP of the Llama 4 Maverick search and 1.11-1.15 returned a
        # wrong optimum of a relaxation (tests/unit/test_search_solver.py keeps both ILPs; the
        # lever is FlexMeasures' for its heap corruption, flexmeasures#2527).
        highs = pulp.HiGHS(threads=1, random_seed=0, mip_feasibility_tolerance=1e-8, **common)
        if highs.available():
            return highs
    with warnings.catch_warnings():  # pulp 3.3 flags its bundled CBC as deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(threads=1, **common)


def solve_ilp(model: IlpModel, options: SearchOptions) -> IlpSolution:
    """Solve with HiGHS (CBC when HiGHS is unavailable or asked for); stdout stays clean.

    The proven/feasible distinction comes from ``sol_status`` (pulp's LpStatus says "Optimal"
    even when the time limit stopped the solver with a merely feasible answer).
    """
    prob = model.problem
    with _quiet_stdout():
        prob.solve(_solver(options))
    sol = prob.sol_status
    status = {
        pulp.LpSolutionOptimal: "optimal",
        pulp.LpSolutionIntegerFeasible: "feasible",
        pulp.LpSolutionInfeasible: "infeasible",
    }.get(sol, "not-solved")
    if status == "not-solved" and prob.status == pulp.LpStatusInfeasible:
        status = "infeasible"  # CBC reports a proven infeasibility with no sol_status
    highs = getattr(prob, "solverModel", None)
    limit_hit = False
    gap = 0.0 if status == "optimal" else 1.0
    if highs is not None and status in ("optimal", "feasible"):
        gap = max(0.0, float(highs.getInfo().mip_gap))
        limit_hit = str(highs.getModelStatus()).endswith("kTimeLimit")
    if status == "feasible" and highs is None:
        limit_hit = True
    if status == "not-solved" and highs is not None:
        limit_hit = str(highs.getModelStatus()).endswith("kTimeLimit")
    counts: dict[tuple, int] = {}
    if status in ("optimal", "feasible"):
        counts = {key: round(var.varValue or 0.0) for key, var in sorted(model.count.items())}
        for (g, j, r), var in sorted((model.placement or {}).items()):
            counts[g, j, r, "stage"] = round(var.varValue or 0.0)
    objective = pulp.value(prob.objective) if counts else float("inf")
    return IlpSolution(
        status=status, objective=float(objective), gap=gap, time_limit_hit=limit_hit, counts=counts
    )


def realized(model: IlpModel, solution: IlpSolution) -> bool:
    """Whether ``decode`` can turn the solution into a split: always, except for the per-rank
    counts by kind (``relax_kinds``), where no contiguous split may give those counts; where
    that relaxation also charged ranks their held floor (``memory_relaxed``), the split must
    fit as ``assemble`` charges it, chunk by chunk (then it is the optimum)."""
    if not (model.per_rank and model.section is not None):
        return solution.has_solution
    if not (solution.has_solution and realize(model.table, model.runs, model.section,
                                              solution.counts) is not None):
        return False
    if not model.memory_relaxed:
        return True
    est = assemble(model.table, *decode(model, solution))
    return est.memory_per_gpu_bytes <= model.table.capacity_bytes - MEM_SAFETY_GIB * GIB


def decode(
    model: IlpModel, solution: IlpSolution
) -> tuple[tuple[tuple[int, int], ...], tuple[str, ...]]:
    """(stage layer ranges, per-layer recompute) of a solution.

    Inside a stage, a run's layers take their recompute modes in the order none, selective,
    full (any order gives the same estimate: layers of a run are interchangeable).
    """
    if not solution.has_solution:
        raise ValueError(f"no split to decode: the solve ended {solution.status}")
    s = model.table.config.num_stages
    counts = solution.counts
    if model.per_rank and model.section is not None:
        found = realize(model.table, model.runs, model.section, counts)
        if found is None:
            raise ValueError("the per-rank counts by kind are no contiguous split (realized)")
        counts = found
    elif model.per_rank:
        counts = stage_counts(model.table, model.runs, counts)
    if model.section is not None:
        return pattern_stages(model.table, model.runs, model.section, counts, s)
    stages, recompute, start = [], [], 0
    for j in range(s):
        size = 0
        for g in range(len(model.runs)):
            for r in R:
                k = counts.get((g, j, r), 0)
                recompute.extend(
                    [RECOMPUTE[plainest_mode(model.table.layers[model.runs[g][0]], r)]] * k
                )
                size += k
        stages.append((start, start + size - 1))
        start += size
    return tuple(stages), tuple(recompute)
