"""The planner: enumerate outer candidates, bound them, solve the survivors' ILPs, keep the k best.

Per candidate (a ParallelConfig from ``space.py``) the cost model builds one CostTable. Two cheap
bounds come from it (``bounds.py``): a lower bound on the step time over every split and
recompute choice, and a lower bound on the largest rank's memory. Candidates are visited in
increasing time bound (ties by enumeration order, so the search is deterministic): a candidate
whose bound cannot beat the k-th best plan so far ends the search (every later one is pruned too),
one whose memory bound exceeds the capacity is pruned as infeasible, one whose refined bound
(whole blocks, each rank's memory: ``time_lower_bound(refined=True)``) cannot beat it is pruned
without an ILP. The visiting order, hence every ILP's cutoff, does not depend on the refined
bound: it only skips solves that could not have returned a better split (a tighter bound leaves
every plan unchanged, even one an ILP stopped within its MIP gap). ILP cutoffs start from a warm
bound (balanced-uniform splits, and exact optima of single-stage candidates). ``solve.py`` solves
one candidate: the most balanced split with uniform recompute when it meets the bound within the
MIP gap, otherwise the ILP (``ilp.py``). Candidates whose ILP inputs are equal share one solution.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from autopar.config import MAX_GLOBAL_BATCH, RECOMPUTE, ParallelConfig
from autopar.cost_model.assemble import assemble
from autopar.cost_model.framework_names import DEFAULT_FRAMEWORK
from autopar.cost_model.framework_support import model_support, moe_sp_blocker, sp_runs_on
from autopar.cost_model.frameworks import get_framework
from autopar.cost_model.tables import CostTable, with_schedule
from autopar.cost_model.validate import check_inputs
from autopar.errors import InfeasiblePlanError
from autopar.plan import Plan, SearchInfo
from autopar.schedules import DEFAULT_SCHEDULE
from autopar.search.bounds import (
    TableSummary,
    ilp_key,
    memory_duals,
    memory_lower_bound,
    min_in_flight,
    recv_buffer_counts,
    summarize,
    time_lower_bound,
    unlimited_memory_time_bound,
)
from autopar.search.dimensions import (
    changed_by_settings,
    dtype_choices,
    framework_variants,
    offload_variants,
)
from autopar.search.infeasible import infeasible_error, no_split_error
from autopar.search.options import SearchOptions
from autopar.search.plan_records import plan_record, robust_order
from autopar.search.solve import Candidate, Outcome, fits_host, solve_candidate, warm_bound
from autopar.search.space import enumerate_candidates

__all__ = ["ProgressFn", "plan", "plan_from_config"]

ROBUST_POOL = 8  # plans the robust choice re-ranks

ProgressFn = Callable[[int, int, str], None]
# The config fields a CostTable depends on: all but the schedule and its virtual stages.
_TABLE_FIELDS = tuple(f.name for f in dataclasses.fields(ParallelConfig)
                      if f.name not in ("schedule", "virtual_stages"))


@dataclass(slots=True)
class _State:
    """Mutable bookkeeping of one search (local to one ``plan`` call)."""

    best: list[tuple[float, int, Outcome, Candidate]] = dataclasses.field(default_factory=list)
    considered: int = 0
    pruned: int = 0
    ilps: int = 0
    time_limit_hit: bool = False
    remaining_lb_s: float = float("inf")  # least bound of what the search did not resolve


def _cost_table(profile, cluster, config: ParallelConfig, options: SearchOptions,
                *, searched: bool = False) -> CostTable:
    """The config's cost table; ``searched`` under --robust: with the framework's memory band
    kept free (capacity / (1 + band)), so every split the search finds fits at the band's end."""
    from autopar.cost_model import build_cost_table

    table = build_cost_table(profile, cluster, config, options.framework)
    capacity = table.capacity_bytes
    if options.memory_headroom_bytes is not None:
        capacity = cluster.device.memory_bytes - options.memory_headroom_bytes
    if searched and options.robust:
        capacity /= 1.0 + table.framework.memory_band
    if capacity == table.capacity_bytes:
        return table
    return dataclasses.replace(table, capacity_bytes=capacity)


def _candidates(profile, cluster, global_batch, options) -> list[ParallelConfig]:
    head_counts = {profile.heads, profile.kv_heads}
    for layer in profile.layers:
        head_counts |= {layer.tp.heads, layer.tp.kv_heads}
    configs = enumerate_candidates(
        world_size=cluster.num_gpus,
        gpus_per_node=cluster.gpus_per_node,
        head_counts=tuple(sorted(h for h in head_counts if h)),
        num_layers=profile.num_layers,
        global_batch=global_batch,
        options=options,
        seq_len=profile.seq_len,
        dtypes=dtype_choices(cluster.device, options),
        expert_counts=tuple(sorted({x.moe.experts for x in profile.layers if x.moe})),
        moe_sequence_parallel=not any(moe_sp_blocker(get_framework(options.framework), x.moe)
                                      for x in profile.layers if x.moe),
        sequence_parallel=sp_runs_on(get_framework(options.framework), profile),
    )
    fw = get_framework(options.framework)
    return [c for c in configs if model_support(fw, c, profile) is None]


def _pipe_key(table: CostTable) -> tuple:
    """What ``recv_buffer_counts`` depends on."""
    cfg = table.config
    return (cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches,
            table.framework.pipeline_recv_buffers)


def _bounded(profile, cluster, configs, options, progress, deadline,
             start: int = 0) -> list[Candidate]:
    """Cost every candidate and bound it.

    The cost terms do not depend on the schedule or the virtual stages (only the assembly does,
    and a split backward's recomputation: ``tables.with_schedule``), so one table is built per
    (dp, tp, pp, micro-batch, ZeRO, SP) and shared by its schedule variants; the final plans'
    estimates are rebuilt from their own config (``_make_plan``).
    """
    out: list[Candidate] = []
    shared: dict[tuple, tuple[CostTable, TableSummary]] = {}
    flights: dict[tuple, float] = {}  # least in-flight count, by pipeline shape
    duals: dict[tuple, tuple] = {}  # memory_duals, by table and in-flight count
    for i, cfg in enumerate(configs, start):
        key = tuple(getattr(cfg, name) for name in _TABLE_FIELDS)
        if key not in shared:
            base = dataclasses.replace(cfg, schedule=DEFAULT_SCHEDULE, virtual_stages=1)
            table = _cost_table(profile, cluster, base, options, searched=True)
            shared[key] = (table, summarize(table))
            if deadline is not None and time.monotonic() > deadline:
                break
        table, summary = shared[key]
        table = with_schedule(table, cfg)
        pipe = (cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches)
        if pipe not in flights:
            flights[pipe] = min_in_flight(*pipe)
        fly = flights[pipe]
        if (key, fly) not in duals:
            duals[key, fly] = memory_duals(summary.runs, fly)
        out.append(Candidate(
            index=i, table=table, summary=summary,
            time_lb_s=time_lower_bound(table, summary, in_flight=fly, duals=duals[key, fly]),
            memory_lb_bytes=memory_lower_bound(table, summary, in_flight=fly)))
        if progress is not None and i % 1024 == 1023:
            progress(0, len(configs), f"costing candidates ({i + 1}/{len(configs)})")
    return out


def _search(cands: list[Candidate], top_k, options, progress, deadline,
            beat_s: float = math.inf) -> _State:
    state = _State()
    order = sorted(cands, key=lambda c: (c.time_lb_s, c.index))
    total = len(order)
    warm, cache, state.ilps = warm_bound(order, top_k, options, deadline)
    warm = min(warm, beat_s)  # a plan found elsewhere: only what beats it is of use
    recv: dict[tuple, tuple[int, ...]] = {}  # receive buffers per rank, by pipeline shape
    refined: dict[tuple, float] = {}  # refined time bounds, by what they read
    for pos, cand in enumerate(order):
        kth = state.best[top_k - 1][0] if len(state.best) >= top_k else float("inf")
        # Sorted by bound: once it cannot beat the k-th best, no later candidate can either.
        if cand.time_lb_s >= min(kth, warm):
            state.considered += total - pos
            state.pruned += total - pos
            break
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            state.time_limit_hit = True
            state.remaining_lb_s = min(state.remaining_lb_s, cand.time_lb_s)
            break
        state.considered += 1
        if cand.memory_lb_bytes > cand.table.capacity_bytes:
            state.pruned += 1
            continue
        pipe = _pipe_key(cand.table)
        if pipe not in recv:
            recv[pipe] = recv_buffer_counts(cand.table)
        key = (ilp_key(cand.table), recv[pipe])  # all the refined bound reads
        if key not in refined:
            refined[key] = time_lower_bound(cand.table, cand.summary, refined=True,
                                            recv=recv[pipe])
        limit = options.time_limit_s if remaining is None else min(options.time_limit_s,
                                                                   max(remaining, 0.1))
        _visit(state, cand, cache, options, (limit, min(kth, warm), refined[key], key[0]), top_k)
        if progress is not None:
            progress(pos + 1, total, cand.table.config.describe())
    if progress is not None:
        progress(total, total, "done")
    return state


def _visit(state: _State, cand: Candidate, cache: dict, options: SearchOptions, limits,
           top_k: int) -> None:
    """Solve one candidate (or reuse an equal ILP's solution) and keep it if it is in the top k.

    ``limits``: (solver time limit, cutoff: the k-th best step so far, its refined bound, its
    ``ilp_key``)."""
    limit, cutoff, lb, key = limits
    outcome = cache.get(key)
    if outcome is None:
        outcome = solve_candidate(cand.table, options, limit,
                                  cutoff if cutoff < float("inf") else None, lb_s=lb)
        if not outcome.split:  # a cutoff or infeasibility: the candidate cannot enter
            state.pruned += 1
        else:
            cache[key] = outcome
        state.ilps += outcome.used_ilp
        state.time_limit_hit |= outcome.time_limit_hit
        if outcome.time_limit_hit or (outcome.split and outcome.gap > options.mip_gap):
            # Not proven (a time limit, or envelopes' gap): its bound limits the search's claim.
            state.remaining_lb_s = min(state.remaining_lb_s, outcome.bound_s)
    if outcome.split and not fits_host(cand.table, outcome):
        state.pruned += 1
    elif outcome.split:
        step = assemble(cand.table, outcome.split, outcome.recompute).step_time_s
        state.best.append((step, cand.index, outcome, cand))
        state.best.sort(key=lambda b: (b[0], b[1]))
        del state.best[top_k:]


def _make_plan(profile, cluster, config, split, recompute, info, model, options) -> Plan:
    """The Plan record; its estimate is assemble() of the split under the plan's own config."""
    counts = collections.Counter(recompute)
    common = max(RECOMPUTE, key=lambda r: (counts[r], -RECOMPUTE.index(r)))
    config = dataclasses.replace(config, recompute=common)
    table = _cost_table(profile, cluster, config, options)
    return plan_record(profile, cluster, table, split, recompute, model=model, search=info)


def _info(state: _State, outcome: Outcome, step_s: float) -> SearchInfo:
    """The plan's search record; where some candidate was not solved to optimality (a time
    limit, or an envelope split's gap), the gap bounds the whole search."""
    gap = outcome.gap
    if state.remaining_lb_s < step_s:
        gap = max(gap, (step_s - max(state.remaining_lb_s, 0.0)) / step_s)
    return SearchInfo(
        candidates_considered=state.considered,
        candidates_pruned=state.pruned,
        ilps_solved=state.ilps,
        optimal=outcome.optimal,
        mip_gap=gap,
        time_limit_hit=state.time_limit_hit,
    )


def _check_inputs(global_batch: object, top_k: object, time_budget_s: object,
                  seq_len: int | None, profile, options: SearchOptions, cluster) -> None:
    """Reject impossible search inputs before any loop over them."""
    _check_headroom(options, cluster)
    for name, value, high in (("global_batch", global_batch, MAX_GLOBAL_BATCH),
                              ("top_k", top_k, 10_000)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {value!r}")
        if not 1 <= value <= high:
            raise ValueError(f"{name} must be from 1 to {high}, got {value}")
    if time_budget_s is not None and not (
        isinstance(time_budget_s, (int, float)) and 0 < time_budget_s < math.inf
    ):
        raise ValueError(f"time_budget_s must be a positive finite number, got {time_budget_s!r}")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)):
        raise TypeError(f"seq_len must be an integer, got {seq_len!r}")
    if seq_len is not None and seq_len != profile.seq_len:
        raise ValueError(
            f"seq_len {seq_len} differs from the profile's {profile.seq_len}; profile the model "
            f"with seq_len={seq_len}"
        )


def plan(
    profile,
    cluster,
    global_batch: int,
    *,
    top_k: int = 1,
    options: SearchOptions | None = None,
    progress: ProgressFn | None = None,
    time_budget_s: float | None = None,
    seq_len: int | None = None,
    model: str = "",
    framework: str | None = None,
) -> Plan | list[Plan]:
    """Search every split of ``profile`` over ``cluster`` and return the best Plan (or top k).

    Args:
        profile: the model's ModelProfile.
        cluster: the Cluster.
        global_batch: sequences per optimizer step.
        top_k: 1 returns one Plan; k > 1 a list of the k best distinct plans, best first.
        options: search options (SearchOptions()).
        progress: called as ``progress(done, total, message)`` while the search runs.
        time_budget_s: overall wall-clock budget; when it runs out the best plan so far is
            returned with ``search.time_limit_hit`` set and ``search.mip_gap`` bounding how far
            from the optimum it may be.
        seq_len: must equal the profile's sequence length if given (profiles are per length).
        model: how to rebuild the model, recorded in the plan (zoo name, spec, path).
        framework: the training framework that runs the plan (``autopar.FRAMEWORKS``;
            default ``options.framework``, "autopar"): only what it can run is proposed, costed
            as it runs it, and the Plan records it.

    Raises:
        ValueError: bad arguments, or no (dp, tp, pp) split satisfies the model's constraints.
        InfeasiblePlanError: no candidate fits the device memory.
    """
    check_inputs("plan", profile, cluster)
    options = SearchOptions() if options is None else options
    if not isinstance(options, SearchOptions):
        raise TypeError(f"options must be a SearchOptions, got {type(options).__name__}")
    if framework is not None:
        options = dataclasses.replace(options, framework=framework)
    _check_inputs(global_batch, top_k, time_budget_s, seq_len, profile, options, cluster)
    deadline = None if time_budget_s is None else time.monotonic() + time_budget_s
    plans: list[Plan] = []
    refusals: list[InfeasiblePlanError] = []
    specs = (framework_variants(options.framework, profile) if options.settings_search
             else (options.framework,))
    for index, spec in enumerate(specs):  # as given, then with each searched setting
        try:
            plans += _plan_one(profile, cluster, global_batch, top_k, model,
                               dataclasses.replace(options, framework=spec), progress,
                               (deadline, time_budget_s), changed_only=index > 0,
                               beat_s=_to_beat(plans, top_k, options))
        except InfeasiblePlanError as refused:
            refusals.append(refused)
    if not plans:
        raise refusals[0]  # the framework as asked for
    plans.sort(key=lambda p: p.estimate.step_time_s)  # stable: ties keep the asked-for one
    plans = robust_order(plans)[:top_k] if options.robust else plans[:top_k]
    return plans[0] if top_k == 1 else plans


def _check_headroom(options: SearchOptions, cluster) -> None:
    """ValueError when ``memory_headroom_bytes`` leaves the GPU no memory."""
    headroom = options.memory_headroom_bytes
    if headroom is not None and headroom >= cluster.device.memory_bytes:
        raise ValueError(
            f"memory_headroom_bytes {headroom:.4g} leaves nothing of the "
            f"{cluster.device.memory_bytes:.4g} bytes of a {cluster.device.name}: keep it "
            "below the GPU's memory")


def _to_beat(plans: list[Plan], top_k: int, options: SearchOptions) -> float:
    """The step time a searched setting's plans must beat: the k-th best so far (only the
    candidates it changes are searched with it; none under --robust, which re-ranks a wider
    pool by the pessimistic time)."""
    if len(plans) < top_k or options.robust:
        return math.inf
    return sorted(p.estimate.step_time_s for p in plans)[top_k - 1]


def _plan_one(profile, cluster, global_batch: int, top_k: int, model: str,
              options: SearchOptions, progress, budget: tuple, *,
              changed_only: bool = False, beat_s: float = math.inf) -> list[Plan]:
    """The best ``top_k`` plans of one framework spec (``plan``), best first; ``budget``:
    (the deadline, the whole search's time budget in seconds), both None without one;
    ``changed_only``: only the candidates a searched setting changes (``changed_by_settings``;
    the others were costed without it), and only plans faster than ``beat_s``: none, no
    plan."""
    deadline, time_budget_s = budget
    wanted = top_k
    if options.robust:  # re-rank the best few by their pessimistic step time (``_robust``)
        top_k = max(top_k, ROBUST_POOL)
    configs = _candidates(profile, cluster, global_batch, options)
    if changed_only:
        configs = changed_by_settings(get_framework(options.framework), configs)
        if not configs:
            return []
    if not configs:
        raise no_split_error(profile, cluster, global_batch, options,
                             lambda narrower: _candidates(profile, cluster, global_batch,
                                                          narrower))
    cands, state = _search_all(profile, cluster, configs, top_k, options, progress, deadline,
                               beat_s)
    if not state.best and options.robust:  # none fits with the band free: what fits at all
        cands, state = _search_all(profile, cluster, configs, top_k,
                                   dataclasses.replace(options, robust=False), progress,
                                   deadline, beat_s)
    if not state.best and changed_only:
        return []
    if not state.best and state.time_limit_hit:
        spent = ("the time budget ran out" if time_budget_s is None
                 else f"the time budget ({time_budget_s:g} s) ran out")
        if deadline is None or time.monotonic() < deadline:
            spent = f"every ILP tried hit its time limit ({options.time_limit_s:g} s)"
        raise InfeasiblePlanError(
            f"{spent} before any split was found; allow more time (time_budget_s / "
            "--time-budget, SearchOptions.time_limit_s) or narrow the search options"
        )
    if not state.best:
        raise infeasible_error(profile, cluster, cands, options, deadline, global_batch)
    return _best_plans(profile, cluster, state, model, options, wanted)


def _search_all(profile, cluster, configs, top_k, options, progress, deadline,
                beat_s: float = math.inf):
    """Cost, bound and search every candidate (only what beats ``beat_s``), then the offloaded
    variants of those that may gain by offloading (``_offload_worthy``). Returns (candidates,
    state); a search cut short by the deadline is flagged in the state."""
    cands = _bounded(profile, cluster, configs, options, progress, deadline)
    state = _search(cands, top_k, options, progress, deadline, beat_s)
    if len(cands) < len(configs):  # the deadline cut the costing short
        _cut_short(state, 0.0)
        return cands, state
    worthy = _offload_worthy(cands, state, top_k, beat_s)
    extra = offload_variants([c.table.config for c, _bound in worthy], cluster, options)
    if not extra:
        return cands, state
    if deadline is not None and time.monotonic() >= deadline:
        # no variant can beat its candidate's bound with unlimited memory
        _cut_short(state, min(bound() for _c, bound in worthy))
        return cands, state
    more = _bounded(profile, cluster, extra, options, None, deadline, len(cands))
    cands += more
    # searched on their own for what beats the k-th best so far, then merged
    _merge(state, _search(more, top_k, options, None, deadline,
                          min(beat_s, _kth(state, top_k))), top_k)
    if len(more) < len(extra):
        _cut_short(state, 0.0)
    return cands, state


def _cut_short(state: _State, bound_s: float) -> None:
    """Flag a search the deadline cut short; ``bound_s`` bounds what it left unsearched."""
    state.time_limit_hit = True
    state.remaining_lb_s = min(state.remaining_lb_s, bound_s)


def _kth(state: _State, top_k: int) -> float:
    """The k-th best step found (inf while fewer than k)."""
    return state.best[top_k - 1][0] if len(state.best) >= top_k else math.inf


def _merge(state: _State, other: _State, top_k: int) -> None:
    """Fold a search over more candidates into ``state``: the k best of both, the counts."""
    state.best = sorted(state.best + other.best, key=lambda b: (b[0], b[1]))[:top_k]
    state.considered += other.considered
    state.pruned += other.pruned
    state.ilps += other.ilps
    state.time_limit_hit |= other.time_limit_hit
    state.remaining_lb_s = min(state.remaining_lb_s, other.remaining_lb_s)


def _offload_worthy(cands: list[Candidate], state: _State, top_k: int,
                    beat_s: float) -> list[tuple[Candidate, Callable[[], float]]]:
    """The candidates whose offloaded variants are worth costing, each with its time bound with
    unlimited memory (``bounds.unlimited_memory_time_bound``, computed once, when first asked):
    those that could, memory aside, beat the k-th best plan found (and ``beat_s``); every one
    when the search found none and seeks no faster plan than one found elsewhere. Offload frees
    memory (a split that fit nowhere fits, or fits with less recomputation) and only adds time
    (copies, the CPU step), so a variant is no faster than that bound."""
    pairs: list[tuple[Candidate, Callable[[], float]]] = [
        (c, functools.cache(functools.partial(unlimited_memory_time_bound, c.table, c.summary)))
        for c in cands]
    if not state.best and beat_s == math.inf:
        return pairs
    limit = min(_kth(state, top_k), beat_s)
    return [(c, bound) for c, bound in pairs if bound() < limit]


def _best_plans(profile, cluster, state: _State, model: str, options: SearchOptions,
                wanted: int) -> list[Plan]:
    """The Plans of the search's best outcomes, best first (re-ranked when robust)."""
    plans = [_make_plan(profile, cluster, cand.table.config, outcome.split, outcome.recompute,
                        _info(state, outcome, step), model, options)
             for step, _, outcome, cand in state.best]  # fmt: skip
    return robust_order(plans)[:wanted] if options.robust else plans


def plan_from_config(profile, cluster, config: ParallelConfig, *, model: str = "",
                     framework: str = DEFAULT_FRAMEWORK,
                     split: tuple[tuple[int, int], ...] | None = None) -> Plan:
    """A Plan for a given config: its stages ``split`` (default the most balanced,
    ``estimator.default_split``) and ``config.recompute`` on every block (none elsewhere).

    Its estimate equals ``cost_model.estimator.estimate(profile, cluster, config, framework,
    split=split)``.
    """
    from autopar.cost_model.estimator import checked_split, checked_table

    table = checked_table(profile, cluster, config, framework)
    split, recompute = checked_split(table, split)
    return plan_record(profile, cluster, table, split, recompute, model=model)
