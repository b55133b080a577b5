"""The stage-split and recompute ILP of one outer configuration (pulp; HiGHS by default).

It minimises exactly the step time ``autopar.cost_model.assemble`` computes (or, for the
infeasibility report, the largest rank's memory) over every contiguous split of the profile's
layers into S = pp * v stages and every per-layer recompute choice.

Formulation. Consecutive layers with identical cost terms form runs g = 0..G-1 (length L_g;
in a transformer: the embedding, the L identical blocks, the head). Layers of one run are
interchangeable inside a stage (assemble only sums them and takes a max), so the ILP counts them:

    Q[g][j]    integer in [0, L_g]: run-g layers in stages 0..j  (Q[g][S-1] = L_g, Q[g][-1] = 0)
    n[g][j][r] integer >= 0: run-g layers of stage j with recompute r
    f[g][j]    binary: run g is complete by the end of stage j (run g+1 may start)
    u[g][k][r] binary: rank k runs some run-g layer with recompute r (for the transient max)

    (count)     sum_r n[g][j][r] = Q[g][j] - Q[g][j-1]            (Q non-decreasing in j)
    (order)     Q[g][j] >= L_g f[g][j];  Q[g+1][j] <= L_{g+1} f[g][j]   (stages are contiguous)
    (nonempty)  sum_g (Q[g][j] - Q[g][j-1]) >= 1
    (transient) sum_{j on k} n[g][j][r] <= M u[g][k][r];  Mt_k >= transient_g(r) u[g][k][r]
    (mem)       static_k + inflight_k act_k + Mt_k + buffers <= capacity       (GiB inside the ILP)
    (bottleneck) Rmax >= R_k = sum_{j on k} (sum_{g,r} t_g(r) n[g][j][r] + p2p)
    (tail)      D_k >= dp_tail; D_k >= sum (dp_step - eta backward);  E >= D_k + optimizer_k
    objective   m Rmax + c sum_j T_j + E          (assemble.py's step time, term by term)

With every run of length 1 this is the per-layer binary assignment z[i][j][r]. A layer i can only
sit in stages max(0, i - (n - S)) .. min(i, S - 1), which fixes most Q outside that window.

Strength. Counts are bounded by what fits a rank's memory (count (static + inflight act) <=
capacity - buffers), which also gives the transient constraints a small M. For embedding +
blocks + head profiles, ``ilp_ranks.py`` counts the blocks per pipeline rank instead of per stage
(exact, and free of the symmetry between a rank's chunks); interchangeable ranks (same in-flight
count, chunks and layer kinds) are ordered by time, (order) R_k >= R_k'. There, ``ilp_hull.py``
also gives each rank the exact hull of its time as a function of its block count (the fastest
mix of recompute modes its memory allows), which the LP relaxation of the per-rank knapsack lacks.
An optional cutoff (step <= the planner's k-th best) lets a candidate that cannot compete end as
infeasible fast; the hull then drops the counts a rank could not afford under it.
"""

from __future__ import annotations

import contextlib
import operator
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pulp

from autopar.config import RECOMPUTE
from autopar.cost_model.assemble import pipeline_buffer_bytes
from autopar.cost_model.pipeline import bubble_coefficient, in_flight_microbatches
from autopar.cost_model.tables import CostTable, LayerCost
from autopar.schedules import rank_of_stage
from autopar.search.ilp_hull import add_rank_hull
from autopar.search.ilp_ranks import add_rank_counts, rank_aggregable, stage_counts, the_big_run
from autopar.search.options import SearchOptions
from autopar.units import GIB

__all__ = ["IlpModel", "IlpSolution", "build_ilp", "cost_signature", "decode", "layer_runs",
           "solve_ilp"]

# Memory is in GiB (``autopar.units.GIB``) inside the ILP (solver-friendly scale); the safety
MEM_SAFETY_GIB = 1e-6  # margin keeps solver feasibility tolerance (1e-7) from overfilling a rank
R = range(len(RECOMPUTE))


_SIGNATURE = operator.attrgetter(
    "compute_s", "backward_s", "recompute_s", "tp_comm_s", "ep_comm_s", "dp_microbatch_s",
    "act_bytes", "transient_bytes", "param_bytes", "grad_bytes", "optimizer_bytes", "dp_step_s",
    "optimizer_s", "cp_comm_s", "host_bytes",
)


def cost_signature(layer: LayerCost) -> tuple:
    """Every term assemble's step time and memory read; equal signatures are interchangeable."""
    return _SIGNATURE(layer)


def layer_runs(table: CostTable) -> tuple[tuple[int, int], ...]:
    """(first, last) layer index of each maximal run of layers with identical cost terms."""
    runs: list[tuple[int, int]] = []
    last = None
    for i, signature in enumerate(map(_SIGNATURE, table.layers)):
        if runs and signature == last:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
        last = signature
    return tuple(runs)


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


def _window(first: int, last: int, n: int, s: int) -> tuple[int, int]:
    """Stages a run spanning layers first..last can touch (each stage holds >= 1 layer)."""
    return max(0, first - (n - s)), min(s - 1, last)


def _var(prob: pulp.LpProblem, name: str, lo=None, hi=None, cat: str = "Continuous"):
    """A variable attached to ``prob`` (pulp >= 3.3 API; plain LpVariable before)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lo, hi, cat=cat)
    return pulp.LpVariable(name, lo, hi, cat)


def _const(x: object, value: int) -> bool:
    """Whether a Q entry is the fixed integer ``value`` (not a variable)."""
    return isinstance(x, int) and x == value


def _add_split(prob: pulp.LpProblem, table: CostTable, runs, s: int):
    """Variables Q, n, f and the count/order/nonempty constraints; returns (n, cnt)."""
    n_layers = len(table.layers)
    n: dict[tuple[int, int, int], pulp.LpVariable] = {}
    q: dict[tuple[int, int], Any] = {}
    for g, (a, b) in enumerate(runs):
        size, (lo, hi) = b - a + 1, _window(a, b, n_layers, s)
        for j in range(-1, s):
            if j < lo:
                q[g, j] = 0
            elif j >= hi:
                q[g, j] = size
            else:
                q[g, j] = _var(prob, f"Q[{table.layers[a].name}][{j}]", 0, size, "Integer")
        for j in range(lo, hi + 1):
            for r in R:
                n[g, j, r] = _var(
                    prob, f"n[{table.layers[a].name}][{j}][{RECOMPUTE[r]}]", 0, size, "Integer"
                )
    cnt = {(g, j): q[g, j] - q[g, j - 1] for g in range(len(runs)) for j in range(s)}
    # [Constraint] count: a run's layers in stage j, split by recompute mode (Q non-decreasing)
    for g, j, r0 in sorted(n):
        if r0 == 0:
            name = table.layers[runs[g][0]].name
            prob += pulp.lpSum(n[g, j, r] for r in R) == cnt[g, j], f"one_stage[{name}][{j}]"
    # [Constraint] order: run g+1 starts in a stage only once run g is complete (contiguity)
    for g in range(len(runs) - 1):
        size, size_next = runs[g][1] - runs[g][0] + 1, runs[g + 1][1] - runs[g + 1][0] + 1
        name = table.layers[runs[g][0]].name
        for j in range(s - 1):
            if _const(q[g + 1, j], 0) or _const(q[g, j], size):
                continue
            f = _var(prob, f"f[{name}][{j}]", 0, 1, "Binary")
            prob += q[g, j] >= size * f, f"done[{name}][{j}]"
            prob += q[g + 1, j] <= size_next * f, f"after[{name}][{j}]"
    # [Constraint] nonempty: every stage holds at least one layer
    for j in range(s):
        prob += pulp.lpSum(cnt[g, j] for g in range(len(runs))) >= 1, f"nonempty[stage{j}]"
    return n, cnt


def _tighten(table: CostTable, runs, slots, inflight: float, n, cap_gib: float) -> None:
    """Upper bounds on counts from memory: count (static + inflight act) + buffers <= capacity.

    Valid because every other memory term is >= 0; a tight bound is what keeps the transient
    big-M constraints (and so the LP relaxation) strong.
    """
    room = cap_gib - table.buffers_bytes / GIB
    for (g, j, r), var in n.items():
        lay = table.layers[runs[g][0]]
        per_layer = (lay.static_bytes + inflight * lay.act_bytes[r]) / GIB
        if j in slots and per_layer > 0:
            var.upBound = max(0, min(var.upBound, int(max(room, 0.0) / per_layer)))


def _memory_exprs(prob, table: CostTable, runs, slot_rank, n, cnt, cap_gib=None) -> list:
    """Per-rank memory in GiB (static + in-flight activations + transient max + buffers)."""
    cfg = table.config
    exprs = []
    for k in range(cfg.pp):
        stages = [j for j, rank in enumerate(slot_rank) if rank == k]
        inflight = in_flight_microbatches(
            cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches, k
        )
        if cap_gib is not None:
            _tighten(table, runs, stages, inflight, n, cap_gib)
        mt = _var(prob, f"transient[rank{k}]", 0)
        # [Constraint] transient: the rank's largest working set over the modes it uses
        for g, (a, _b) in enumerate(runs):
            lay = table.layers[a]
            for r in R:
                terms = [n[g, j, r] for j in stages if (g, j, r) in n]
                if not terms or lay.transient_bytes[r] <= 0:
                    continue
                u = _var(prob, f"u[{lay.name}][rank{k}][{RECOMPUTE[r]}]", 0, 1, "Binary")
                big_m = sum(var.upBound for var in terms)
                prob += pulp.lpSum(terms) <= big_m * u, f"uses[{lay.name}][rank{k}][{r}]"
                prob += mt >= lay.transient_bytes[r] / GIB * u, f"peak[{lay.name}][rank{k}][{r}]"
        static = pulp.lpSum(
            table.layers[a].static_bytes / GIB * cnt[g, j]
            for g, (a, _b) in enumerate(runs)
            for j in stages
        )
        act = pulp.lpSum(
            inflight * table.layers[runs[g][0]].act_bytes[r] / GIB * var
            for (g, j, r), var in sorted(n.items())
            if j in stages
        )
        # torch pipelining's receive buffers: a per-rank constant (assemble.pipeline_buffer_bytes)
        pbuf = pipeline_buffer_bytes(table, k) / GIB
        exprs.append(static + act + mt + table.buffers_bytes / GIB + pbuf)
    return exprs


def _twins(table: CostTable, slot_rank, slot_p2p, n) -> list[tuple[int, int]]:
    """Consecutive pairs of interchangeable ranks (same in-flight count, chunks and layer kinds).

    Per-rank counting makes such ranks exact twins: permuting their assignments changes nothing,
    so ordering their times removes the symmetry without losing any optimum.
    """
    cfg = table.config
    classes: dict[tuple, list[int]] = {}
    for k in range(cfg.pp):
        flight = in_flight_microbatches(
            cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches, k
        )
        kinds = tuple(sorted({g for (g, j, _r) in n if slot_rank[j] == k}))
        classes.setdefault((flight, slot_p2p[k], kinds), []).append(k)
    return [
        (ks[i], ks[i + 1])
        for (_f, _c, kinds), ks in classes.items()
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
    rmax, tail = _var(prob, "bottleneck_s", 0), _var(prob, "tail_s", 0)
    for k in range(cfg.pp):
        stages = [j for j, rank in enumerate(slot_rank) if rank == k]
        # [Constraint] bottleneck: Rmax bounds every rank's time per micro-batch
        prob += rmax >= pulp.lpSum(stage_t[j] for j in stages), f"bottleneck[rank{k}]"

        def on_k(attr, stages=stages):
            return pulp.lpSum(
                attr(table.layers[a]) * cnt[g, j] for g, (a, _b) in enumerate(runs) for j in stages
            )

        opt = on_k(lambda lay: lay.optimizer_s)
        if cfg.dp * cfg.cp > 1:
            d = _var(prob, f"dp_exposed[rank{k}]", 0)
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

    Returns:
        The IlpModel (see the module docstring for the formulation).
    """
    if objective not in ("time", "memory"):
        raise ValueError(f"objective must be 'time' or 'memory', got {objective!r}")
    s = table.config.num_stages
    runs = layer_runs(table)
    prob = pulp.LpProblem(f"split_{objective}", pulp.LpMinimize)
    if aggregate is None:
        aggregate = rank_aggregable(table, runs)
    placement = {}
    if aggregate:
        n, cnt, slot_rank, slot_p2p, placement = add_rank_counts(prob, table, runs, _var)
    else:
        n, cnt = _add_split(prob, table, runs, s)
        slot_rank = [rank_of_stage(table.config.schedule, table.config.pp, j) for j in range(s)]
        slot_p2p = [1] * s
    cap = (table.capacity_bytes if capacity_bytes is None else capacity_bytes) / GIB
    mems = _memory_exprs(prob, table, runs, slot_rank, n, cnt,
                         None if objective == "memory" else cap)
    if objective == "memory":
        peak = _var(prob, "peak_gib", 0)
        for k, mem in enumerate(mems):
            # [Constraint] peak: the objective bounds every rank's memory
            prob += peak >= mem, f"mem[rank{k}]"
        prob += peak
    else:
        layout = (slot_rank, slot_p2p, n, cnt)
        _add_time_objective(prob, table, runs, layout, mems, cap, aggregate, cutoff_s)
    return IlpModel(problem=prob, table=table, runs=runs, count=n, objective=objective,
                    per_rank=aggregate, placement=placement)


def _add_time_objective(prob, table: CostTable, runs, layout, mems, cap: float,
                        aggregate: bool, cutoff_s: float | None) -> None:
    """Memory caps, the rank hull and the step-time objective of ``build_ilp``'s time model."""
    slot_rank, slot_p2p, n, cnt = layout
    for k, mem in enumerate(mems):
        # [Constraint] mem: each pipeline rank's peak fits the usable device memory
        prob += mem <= cap - MEM_SAFETY_GIB, f"mem[rank{k}]"
    twins = _twins(table, slot_rank, slot_p2p, n) if aggregate else []
    if aggregate and table.config.num_stages > 1:
        add_rank_hull(
            prob, table, runs, n, the_big_run(runs, len(table.layers)), cap, _var, cutoff_s
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
        highs = pulp.HiGHS(threads=1, random_seed=0, **common)
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


def _plainest(layer: LayerCost, r: int) -> int:
    """The first mode (none, selective, full) whose time and memory terms equal mode r's.

    A layer without activations to drop (the embedding) costs the same under every mode; the
    plan then says "none" rather than whichever mode the solver happened to pick.
    """

    def terms(x: int) -> tuple:
        return (layer.time_per_microbatch_s(RECOMPUTE[x]), layer.act_bytes[x],
                layer.transient_bytes[x])  # fmt: skip

    return next(x for x in R if terms(x) == terms(r))


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
    if model.per_rank:
        counts = stage_counts(model.table, model.runs, counts)
    stages, recompute, start = [], [], 0
    for j in range(s):
        size = 0
        for g in range(len(model.runs)):
            for r in R:
                k = counts.get((g, j, r), 0)
                recompute.extend(
                    [RECOMPUTE[_plainest(model.table.layers[model.runs[g][0]], r)]] * k
                )
                size += k
        stages.append((start, start + size - 1))
        start += size
    return tuple(stages), tuple(recompute)
