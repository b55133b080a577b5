"""One outer candidate's best split: the balanced-uniform shortcut, the warm bound, the ILP.

The planner (``planner.py``) orders and prunes the candidates; this module solves one: when the
most balanced split with uniform recompute meets the candidate's lower bound it is optimal and no
ILP is needed, otherwise the ILP (``ilp.py``) decides the split and per-layer recompute exactly.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from autopar.config import RECOMPUTE
from autopar.cost_model.assemble import assemble
from autopar.cost_model.recompute_layers import (
    blocks_recompute,
    pattern_counts,
    pattern_recompute,
    stage_ranks,
)
from autopar.cost_model.stage_splits import framework_splits
from autopar.cost_model.tables import CostTable
from autopar.search.bounds import (
    FLOAT_SLACK,
    TableSummary,
    ilp_key,
    time_lower_bound,
)
from autopar.search.envelope import envelope_table, lower_bound_holds, pattern_blocks
from autopar.search.ilp import build_ilp, decode, realized, solve_ilp
from autopar.search.ilp_memory import MEM_SAFETY_GIB
from autopar.search.options import SearchOptions
from autopar.units import GIB

__all__ = ["Candidate", "Outcome", "best_pattern", "best_uniform", "fits_host", "solve_candidate",
           "warm_bound"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One outer candidate: its cost table (under its own config), summary and cheap bounds."""

    index: int
    table: CostTable
    summary: TableSummary
    time_lb_s: float
    memory_lb_bytes: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """A candidate's best split (or none), and how it was found."""

    split: tuple[tuple[int, int], ...] = ()
    recompute: tuple[str, ...] = ()
    step_s: float = float("inf")
    optimal: bool = True
    gap: float = 0.0
    time_limit_hit: bool = False
    used_ilp: bool = False
    bound_s: float = 0.0  # lower bound on the candidate's optimum (matters when not proven)


def best_uniform(table: CostTable, *, quick: bool = False) -> Outcome | None:
    """The fastest fitting split among the most balanced ones (of those the framework cuts)
    with uniform recompute; ``quick``: without the rank-balanced split, whose local search is
    the slow one (for the warm bound, which needs only some upper bound)."""
    return _fastest(table, ((split, _uniform(table, mode)) for mode in RECOMPUTE
                            for split in framework_splits(table, mode, rank_balanced=not quick)))


def _uniform(table: CostTable, mode: str) -> tuple[str, ...]:
    """``mode`` on every block, none on the other layers (``blocks_recompute``)."""
    return blocks_recompute((mode,) * len(table.layers), table.block_mask)


def best_pattern(table: CostTable) -> Outcome | None:
    """The fastest fitting split of a framework that sets fewer per-layer recompute choices or
    stage splits than the ILP's (``recompute_layers.py``, ``stage_splits.py``): uniform
    recompute on the most balanced splits it cuts (``framework_splits``), or its pattern (the
    first n blocks of every stage, every n-th block of a rank) with every count n on each."""
    kind, ranks = table.framework.recompute_layers, stage_ranks(table.config)
    splits = dict.fromkeys(s for mode in RECOMPUTE for s in framework_splits(table, mode))
    tried = [(split, _uniform(table, mode)) for split in splits for mode in RECOMPUTE]
    blocks = table.block_mask
    tried += [(split, pattern_recompute(kind, n, split, blocks, ranks)) for split in splits
              for n in pattern_counts(kind, split, blocks, ranks)]
    return _fastest(table, tried)


def _fastest(table: CostTable, tried) -> Outcome | None:
    """The fastest of (split, recompute) pairs that fits the device and the host (None if
    none does), not proven optimal."""
    best = None
    room = table.capacity_bytes - MEM_SAFETY_GIB * GIB  # the ILP's own memory margin
    for split, recompute in tried:
        est = assemble(table, split, recompute)
        host_ok = est.host_memory_per_gpu_bytes <= table.host_capacity_bytes
        if est.memory_per_gpu_bytes <= room and host_ok and (
                best is None or est.step_time_s < best.step_s):
            best = Outcome(split=split, recompute=recompute, step_s=est.step_time_s,
                           optimal=False)
    return best


def warm_bound(
    order: list[Candidate],
    top_k: int,
    options: SearchOptions,
    deadline: float | None = None,
    count: int = 32,
    exact: int = 16,
) -> tuple[float, dict[tuple, Outcome], int]:
    """An upper bound on the k-th best plan, so ILPs can be cut off before the search has its
    own incumbents: the k-th best step among the balanced-uniform splits of the first ``count``
    fitting candidates and the exact optima of the first ``exact`` fitting single-stage ones.

    A single-stage candidate's ILP is a small knapsack over recompute modes (milliseconds), and
    under a tight memory cap it is often the best plan while the balanced-uniform splits are far
    from it; without it, multi-stage ILPs run with a loose cutoff and can reach their time limit.
    Returns (bound, proven outcomes by ``ilp_key`` for the search to reuse, ILPs solved).
    """
    steps: list[float] = []
    seeded: dict[Any, Outcome] = {}
    ilps, uniform, singles = 0, 0, 0
    for cand in order:
        if uniform >= count and singles >= exact:
            break
        if cand.memory_lb_bytes > cand.table.capacity_bytes:
            continue
        remaining = float("inf") if deadline is None else deadline - time.monotonic()
        outcome: Outcome | None
        if cand.table.config.num_stages == 1 and singles < exact and remaining > 0:
            singles += 1
            lb_s = time_lower_bound(cand.table, cand.summary, refined=True)
            outcome = solve_candidate(cand.table, options, min(options.time_limit_s, remaining),
                                      lb_s=lb_s)
            ilps += outcome.used_ilp
            if not fits_host(cand.table, outcome):
                outcome = Outcome()
            if outcome.split and outcome.optimal and not outcome.time_limit_hit:
                seeded.setdefault(ilp_key(cand.table), outcome)
        elif uniform < count:
            uniform += 1
            outcome = best_uniform(cand.table, quick=True)
        else:
            continue
        steps.append(outcome.step_s if outcome is not None and outcome.split else float("inf"))
    steps.sort()
    bound = steps[top_k - 1] * (1 + FLOAT_SLACK) if len(steps) >= top_k else float("inf")
    return bound, seeded, ilps


def fits_host(table: CostTable, outcome: Outcome) -> bool:
    """Whether an outcome's offloaded state fits the host memory (the ILP bounds the device's)."""
    if table.config.offload == "none" or not outcome.split:
        return True
    est = assemble(table, outcome.split, outcome.recompute)
    return est.host_memory_per_gpu_bytes <= table.host_capacity_bytes


def solve_candidate(
    table: CostTable, options: SearchOptions, time_limit_s: float, cutoff_s: float | None = None,
    lb_s: float | None = None,
) -> Outcome:
    """Best split of one candidate: balanced uniform recompute if provably optimal, else the ILP
    (``lb_s``: its refined ``time_lower_bound`` when the caller has it)."""
    lb = time_lower_bound(table, refined=True) if lb_s is None else lb_s
    if cutoff_s is not None and lb >= cutoff_s:
        return Outcome()  # cannot enter the top k
    if table.framework.recompute_layers != "any" or table.framework.stage_splits != "any":
        # The framework sets one mode for all blocks or a pattern, or cuts its own splits:
        # its choices on balanced splits (not proven optimal over uneven ones).
        return best_pattern(table) or Outcome()
    uniform = best_uniform(table)
    if uniform is not None and uniform.step_s <= lb * (1 + options.mip_gap):
        return dataclasses.replace(uniform, optimal=True)  # meets the lower bound
    blocks = pattern_blocks(table)
    if blocks is not None:  # blocks of a few alternating kinds: by their envelopes
        enveloped = _by_envelopes(table, blocks, options, time_limit_s, lb, cutoff_s)
        if enveloped is not None:  # no split: nothing real fits or beats the cutoff either
            return _better_of(enveloped, uniform, options) if enveloped.split else enveloped
    from_uniform = uniform is not None and (cutoff_s is None or uniform.step_s < cutoff_s)
    if from_uniform and uniform is not None:
        cutoff_s = uniform.step_s * (1 + FLOAT_SLACK)
    model, sol, lb = _solve_split(table, options, time_limit_s, cutoff_s, lb)
    if sol.status == "infeasible":
        # Nothing beats the cutoff: the balanced split is optimal, or the candidate cannot
        # enter the top k (or fits nowhere).
        if from_uniform and uniform is not None:
            return dataclasses.replace(uniform, optimal=True, used_ilp=True)
        return Outcome(used_ilp=True)
    if not sol.has_solution:  # the time limit stopped the solver before any solution
        if uniform is not None:
            return dataclasses.replace(
                uniform, optimal=False, gap=1.0, time_limit_hit=True, used_ilp=True,
                bound_s=lb,
            )  # fmt: skip
        return Outcome(used_ilp=True, time_limit_hit=True, bound_s=lb)
    split, rec = decode(model, sol)
    step = assemble(table, split, rec).step_time_s
    out = Outcome(
        split=split,
        recompute=rec,
        step_s=step,
        optimal=sol.status == "optimal",
        gap=sol.gap,
        time_limit_hit=sol.time_limit_hit,
        used_ilp=True,
        bound_s=max(lb, sol.objective * (1 - sol.gap)),
    )
    if uniform is not None and uniform.step_s < step:  # a limit stopped the solver
        out = dataclasses.replace(
            out,
            split=uniform.split,
            recompute=uniform.recompute,
            step_s=uniform.step_s,
        )
    return out


def _solve_split(table: CostTable, options: SearchOptions, time_limit_s: float,
                 cutoff_s: float | None, lb: float):
    """(model, solution, lower bound) of the split ILP; a repeating section's per-rank
    relaxation first (``ilp_rank_kinds.py``), the per-stage ILP where its counts are no split."""
    limited = dataclasses.replace(options, time_limit_s=time_limit_s)
    model = build_ilp(table, cutoff_s=cutoff_s, relax_kinds=True)
    sol = solve_ilp(model, limited)
    if sol.has_solution and not realized(model, sol):
        lb = max(lb, sol.objective * (1 - sol.gap))  # the relaxation's bound
        model = build_ilp(table, cutoff_s=cutoff_s)
        sol = solve_ilp(model, limited)
    return model, sol, lb


def _by_envelopes(table: CostTable, blocks: tuple[int, int], options: SearchOptions,
                  time_limit_s: float, lb: float, cutoff_s: float | None) -> Outcome | None:
    """The best split of the upper-envelope table, costed on the real layers, with the
    lower-envelope optimum as its bound (``envelope.py``); an empty outcome when even the lower
    envelope cannot beat ``cutoff_s`` or fit; None when nothing fits the upper envelope (the
    exact ILP decides then)."""
    bound, limit_hit = lb, False
    if lower_bound_holds(table):
        lower = solve_candidate(envelope_table(table, blocks, upper=False), options,
                                time_limit_s, cutoff_s)
        if not lower.split and not lower.time_limit_hit:
            return Outcome(used_ilp=True)  # no real split fits or beats the cutoff either
        limit_hit = lower.time_limit_hit
        proven = lower.split and lower.optimal and not lower.time_limit_hit
        bound = max(bound, lower.step_s * (1 - lower.gap) if proven else lower.bound_s)
    upper = solve_candidate(envelope_table(table, blocks, upper=True), options, time_limit_s)
    if not upper.split:
        return None
    step = assemble(table, upper.split, upper.recompute).step_time_s
    gap = max(0.0, 1.0 - bound / step)
    return Outcome(split=upper.split, recompute=upper.recompute, step_s=step,
                   optimal=gap <= options.mip_gap, gap=gap,
                   time_limit_hit=limit_hit or upper.time_limit_hit, used_ilp=True,
                   bound_s=min(bound, step))


def _better_of(out: Outcome, uniform: Outcome | None, options: SearchOptions) -> Outcome:
    """``out``, or the balanced uniform split where it is faster, with the same bound."""
    if uniform is None or uniform.step_s >= out.step_s:
        return out
    gap = max(0.0, 1.0 - out.bound_s / uniform.step_s)
    return dataclasses.replace(out, split=uniform.split, recompute=uniform.recompute,
                               step_s=uniform.step_s, gap=gap, optimal=gap <= options.mip_gap)
