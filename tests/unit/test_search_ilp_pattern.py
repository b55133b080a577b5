"""A section of blocks that repeat a few kinds (dense and mixture-of-experts blocks alternating)
is counted by kind in the split ILP (search/ilp_pattern.py): the same optimum as the per-layer
formulation, a decoded split whose real step equals the ILP's objective, and the pigeonhole
infeasibility (a rank holds one MoE block, there are more MoE blocks than ranks) proven by the
LP relaxation alone. Counted per rank (search/ilp_rank_kinds.py), it is a relaxation whose
counts the realisation turns back into a split, or the per-stage ILP decides."""

from __future__ import annotations

import dataclasses

import pulp
from hypothesis import given, settings
from hypothesis import strategies as st
from table_fixtures import PLAIN_FRAMEWORK

from autopar.config import ParallelConfig
from autopar.cost_model.assemble import assemble
from autopar.cost_model.held_counts import uniform_ranks
from autopar.cost_model.stage_splits import balanced_splits
from autopar.cost_model.tables import CostTable, LayerCost
from autopar.schedules import rank_of_stage
from autopar.search import ilp as ilp_module
from autopar.search.ilp import build_ilp, decode, realized, solve_ilp
from autopar.search.ilp_pattern import MIN_PERIODS, Pattern, find_pattern
from autopar.search.ilp_rank_kinds import kind_rank_keys, realize, window_spread
from autopar.search.options import SearchOptions
from autopar.search.solve import solve_candidate

OPTIONS = SearchOptions(time_limit_s=60.0, mip_gap=0.0)


def _layer(name: str, compute: float, act: float, params: float) -> LayerCost:
    return LayerCost(
        name=name, num_params=10, model_flops_per_sample=6.0,
        recompute_flops_per_sample=(0.0, 1.0, 2.0), compute_s=compute, backward_s=0.6 * compute,
        recompute_s=(0.0, 0.1 * compute, 0.5 * compute), tp_comm_s=(0.0, 0.0, 0.02),
        dp_microbatch_s=0.0, act_bytes=(act, 0.6 * act, 0.1 * act),
        transient_bytes=(1e8, 1e8, 3e8), param_bytes=params, grad_bytes=params,
        optimizer_bytes=4 * params, dp_step_s=0.3 * params / 2e8, optimizer_s=0.02,
    )  # fmt: skip


def _table(layers, pp: int, schedule: str = "1f1b", v: int = 1, capacity: float = 1e13):
    cfg = ParallelConfig(dp=2, pp=pp, global_batch=16, schedule=schedule, virtual_stages=v)
    return CostTable(
        config=cfg, framework=PLAIN_FRAMEWORK, layers=tuple(layers), p2p_s=0.01, dp_tail_s=0.02,
        overlap_efficiency=0.8, buffers_bytes=1e8, capacity_bytes=capacity, peak_flops=1e12,
        tokens_per_step=128,
    )  # fmt: skip


@st.composite
def alternating_tables(draw) -> CostTable:
    """0-2 distinct layers, 3-4 periods of blocks repeating 2 or 3 kinds far apart (a dense
    block, an MoE block with 2-6x its parameters), 0-2 distinct layers; 2-4 ranks, 1 or 2 chunks
    each; memory a share of what no recompute needs."""
    dense = _layer("dense", 0.4, 6e8, 2e8)
    kinds = [dense, _layer("moe", 0.5, 7e8, 2e8 * draw(st.integers(2, 6)))]
    if draw(st.booleans()):
        kinds.append(_layer("local", 0.35, 5e8, 2e8))
    period = draw(st.integers(len(kinds), len(kinds) + 1))
    n = draw(st.integers(MIN_PERIODS * period, MIN_PERIODS * period + 3))
    blocks = [dataclasses.replace(kinds[min(i % period, len(kinds) - 1)], name=f"b{i}")
              for i in range(n)]
    lead = [_layer(f"e{i}", 0.1 * (i + 1), 1e8, 3e8) for i in range(draw(st.integers(0, 2)))]
    trail = [_layer(f"h{i}", 0.3 + 0.1 * i, 3e8, 3e8) for i in range(draw(st.integers(0, 2)))]
    pp = draw(st.sampled_from([2, 3, 4]))
    schedule, v = draw(st.sampled_from([("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)]))
    if v == 2 and pp > 2:
        pp = 2
    table = _table([*lead, *blocks, *trail], pp, schedule, v)
    need = assemble(table, balanced_splits(table, "none")[0], ("none",) * len(table.layers))
    # Shares off round numbers: a split whose memory lands exactly on the cap is decided by the
    # solver's feasibility tolerance, differently in the two formulations.
    share = draw(st.sampled_from([0.5013, 0.7029, 0.8507, 1.2011]))
    return dataclasses.replace(table, capacity_bytes=share * need.memory_per_gpu_bytes)


@settings(max_examples=15, deadline=None)
@given(alternating_tables())
def test_counting_by_kind_equals_the_per_layer_optimum(table: CostTable) -> None:
    assert find_pattern(table) is not None
    by_kind = build_ilp(table)
    assert by_kind.section is not None
    per_layer = build_ilp(table, by_kind=False)
    assert per_layer.section is None
    got, want = solve_ilp(by_kind, OPTIONS), solve_ilp(per_layer, OPTIONS)
    assert got.has_solution == want.has_solution
    if not want.has_solution:
        return
    assert got.status == want.status == "optimal"
    assert abs(got.objective - want.objective) <= 1e-6 * max(1.0, want.objective)
    split, recompute = decode(by_kind, got)
    assert split[0][0] == 0 and split[-1][1] == len(table.layers) - 1
    ends = (*split[1:], (len(table.layers), 0))
    assert all(b >= a and b + 1 == nxt for (a, b), (nxt, _) in zip(split, ends, strict=True))
    est = assemble(table, split, recompute)
    assert est.fits
    assert abs(est.step_time_s - got.objective) <= 1e-6 * max(1.0, got.objective)


def test_pattern_found_in_repeating_blocks_only() -> None:
    dense, moe = _layer("d", 0.4, 6e8, 2e8), _layer("m", 0.5, 7e8, 8e8)
    embed, head = _layer("embed", 0.1, 1e8, 3e8), _layer("head", 0.4, 3e8, 3e8)
    blocks = [dataclasses.replace(moe if i % 2 else dense, name=f"b{i}") for i in range(47)]
    pat = find_pattern(_table([embed, *blocks, head], 4))
    assert pat == Pattern(first=1, last=47, period=2, kind=(0, 1), rep=(1, 2))
    assert pat.size == 47 and pat.per_period(1) == 1 and pat.before(1, 1) == 0
    fourth = [dataclasses.replace(moe if i % 4 == 3 else dense, name=f"b{i}") for i in range(16)]
    found = find_pattern(_table([embed, *fourth, head], 2))
    assert found is not None and found.period == 4 and found.kind == (0, 0, 0, 1)
    assert found.first == 1  # the section starts at its first block, not mid-period
    uniform = [dataclasses.replace(dense, name=f"b{i}") for i in range(20)]
    assert find_pattern(_table([embed, *uniform, head], 2)) is None  # one run: per-rank counts
    assert find_pattern(_table([embed, *blocks[:4], head], 2)) is None  # two periods only
    assert find_pattern(_table([embed, *blocks, head], 1)) is None  # one stage: a knapsack


def test_lp_relaxation_proves_the_pigeonhole() -> None:
    """Twelve MoE blocks, eight ranks that hold one each next to their dense blocks: the by-kind
    ILP's relaxation is already infeasible (the per-layer one's is not)."""
    dense, moe = _layer("d", 0.4, 1e8, 1e8), _layer("m", 0.5, 1e8, 6e9)
    blocks = [dataclasses.replace(moe if i % 2 else dense, name=f"b{i}") for i in range(24)]
    table = _table(blocks, 8)
    one = assemble(table, balanced_splits(table, "full")[0], ("full",) * 24).memory_per_gpu_bytes
    table = dataclasses.replace(table, capacity_bytes=one * 0.8)  # < 2 MoE blocks a rank

    def relaxed_status(model) -> int:
        for var in model.problem.variables():
            var.cat = pulp.LpContinuous
        model.problem.solve(pulp.HiGHS(msg=False))
        return model.problem.status

    assert solve_ilp(build_ilp(table), OPTIONS).status == "infeasible"
    assert relaxed_status(build_ilp(table)) == pulp.LpStatusInfeasible
    assert relaxed_status(build_ilp(table, by_kind=False)) == pulp.LpStatusOptimal


def _single_edge_table(draw) -> CostTable:
    table = draw(alternating_tables())
    edges = [x for x in table.layers if x.name[0] in "eh"]
    blocks = [x for x in table.layers if x.name[0] == "b"]
    lead = [dataclasses.replace(x, name=f"e{i}") for i, x in enumerate(edges) if x.name[0] == "e"]
    trail = [x for x in edges if x.name[0] == "h"]
    return dataclasses.replace(table, layers=(*lead, *blocks, *trail), names=())


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_per_rank_relaxation_then_realisation_finds_the_optimum(data) -> None:
    """solve_candidate counts the section per rank (a relaxation), realises its counts as a
    split, and falls back to the per-stage ILP when it cannot: the per-layer optimum either way.
    Where a rank's chunks hold different counts at its peak (interleaved schedules), the
    relaxation charges each rank its held floor, and a realised split must also fit as assemble
    charges it chunk by chunk."""
    table = _single_edge_table(data.draw)
    relaxed = build_ilp(table, relax_kinds=True)
    cfg = table.config
    alike = uniform_ranks(cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches)
    assert relaxed.per_rank and relaxed.section is not None
    assert relaxed.memory_relaxed == (not alike)
    want = solve_ilp(build_ilp(table, by_kind=False), OPTIONS)
    bound = solve_ilp(relaxed, OPTIONS)
    if not want.has_solution:
        out = solve_candidate(table, OPTIONS, 60.0)
        assert not out.split
        return
    assert bound.has_solution and bound.objective <= want.objective * (1 + 1e-6)
    if realized(relaxed, bound):  # the relaxation's optimum is a split: the optimum
        split, recompute = decode(relaxed, bound)
        est = assemble(table, split, recompute)
        assert est.fits and abs(est.step_time_s - bound.objective) <= 1e-6 * bound.objective
        assert abs(bound.objective - want.objective) <= 1e-6 * want.objective
    out = solve_candidate(table, OPTIONS, 60.0)
    assert out.split and out.optimal
    assert abs(out.step_s - want.objective) <= 1e-6 * want.objective


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_every_split_realises_its_own_per_rank_counts(data) -> None:
    """The per-rank kind counts of any contiguous split are found again as a split."""
    table = _single_edge_table(data.draw)
    pat = find_pattern(table)
    keys, pat = kind_rank_keys(table, pat)
    n, s = len(table.layers), table.config.num_stages
    cuts = sorted(data.draw(st.lists(st.integers(1, n - 1), min_size=s - 1, max_size=s - 1,
                                     unique=True)))
    bounds = (0, *cuts, n)
    split = [(bounds[j], bounds[j + 1] - 1) for j in range(s)]
    counts: dict = {}
    for j, (a, b) in enumerate(split):
        k = rank_of_stage(table.config.schedule, table.config.pp, j)
        for i in range(a, b + 1):
            if pat.first <= i <= pat.last:
                key = (pat.key0 + pat.kind_at(i - pat.first), k, 0)
            else:
                g = next(g for g, (x, _y) in enumerate(keys) if x == i)
                key = (g, j, 0, "stage")
            counts[key] = counts.get(key, 0) + 1
    out = realize(table, keys, pat, counts)
    assert out is not None
    got: dict = {}
    for (g, j, _r), m in out.items():
        if pat.key0 <= g < pat.key0 + len(pat.rep):
            k = rank_of_stage(table.config.schedule, table.config.pp, j)
            got[g, k, 0] = got.get((g, k, 0), 0) + m
    assert got == {key: v for key, v in counts.items() if len(key) == 3}


def test_window_spread() -> None:
    alternating = Pattern(first=0, last=9, period=2, kind=(0, 1), rep=(0, 1))
    assert window_spread(alternating, 0) == window_spread(alternating, 1) == 0.5
    maverick = Pattern(first=0, last=47, period=4, kind=(0, 1, 0, 2), rep=(0, 1, 3))
    assert window_spread(maverick, 0) == 0.5  # a dense block alone: 1 against 1/2
    assert window_spread(maverick, 1) == 0.75  # one MoE block in 1 layer: 1 against 1/4


@settings(max_examples=10, deadline=None)
@given(st.data())
def test_kind_hull_tightens_the_relaxation_not_its_optimum(data) -> None:
    """The per-rank hull by count vector (search/ilp_hull_kinds.py) leaves the relaxation's
    optimum as it was and raises (never lowers) its LP bound."""
    table = _single_edge_table(data.draw)
    with_hull = build_ilp(table, relax_kinds=True)
    saved = ilp_module.add_kind_hull
    ilp_module.add_kind_hull = lambda *args, **kwargs: None
    try:
        without = build_ilp(table, relax_kinds=True)
    finally:
        ilp_module.add_kind_hull = saved
    a, b = solve_ilp(with_hull, OPTIONS), solve_ilp(without, OPTIONS)
    assert a.has_solution == b.has_solution
    if a.has_solution:
        assert abs(a.objective - b.objective) <= 1e-6 * max(1.0, b.objective)

    def lp_bound(model) -> float:
        for var in model.problem.variables():
            var.cat = pulp.LpContinuous
        model.problem.solve(pulp.HiGHS(msg=False))
        status = model.problem.status
        return pulp.value(model.problem.objective) if status == 1 else float("inf")

    assert lp_bound(with_hull) >= lp_bound(without) * (1 - 1e-6)


def test_kind_hull_charges_no_block_transient_to_a_rank_without_blocks() -> None:
    """A rank holding only the head (too big to share) pays no block's working set: the hull
    keeps that case, so the relaxation finds the same split with and without it."""
    dense = dataclasses.replace(_layer("d", 0.4, 1e8, 1e8), transient_bytes=(4e9, 4e9, 4e9))
    moe = dataclasses.replace(_layer("m", 0.5, 1e8, 2e8), transient_bytes=(4e9, 4e9, 4e9))
    blocks = [dataclasses.replace(moe if i % 2 else dense, name=f"b{i}") for i in range(12)]
    head = dataclasses.replace(_layer("head", 9.0, 1e8, 5e9), transient_bytes=(1e8,) * 3)
    table = _table([_layer("embed", 0.1, 1e8, 1e8), *blocks, head], 3)
    split = ((0, 6), (7, 12), (13, 13))
    need = assemble(table, split, ("none",) * 14).memory_per_gpu_bytes
    table = dataclasses.replace(table, capacity_bytes=need * 1.01)
    with_hull = solve_ilp(build_ilp(table, relax_kinds=True), OPTIONS)
    saved = ilp_module.add_kind_hull
    ilp_module.add_kind_hull = lambda *args, **kwargs: None
    try:
        without = solve_ilp(build_ilp(table, relax_kinds=True), OPTIONS)
    finally:
        ilp_module.add_kind_hull = saved
    assert without.has_solution and with_hull.has_solution
    assert abs(with_hull.objective - without.objective) <= 1e-6 * without.objective
