"""Schedule replay behind the plot, the PNG figures, and the sweep's Pareto front."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from report_fixtures import make_plan

from autopar.config import ParallelConfig
from autopar.plotting import plot_plan, plot_sweep, simulate_schedule
from autopar.sweep import SweepPoint, mark_pareto, parse_prices

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(schedule, pp, microbatches, virtual=1, chunk_s=3.0):
    cfg = ParallelConfig(pp=pp, global_batch=microbatches, schedule=schedule,
                         virtual_stages=virtual)
    num = pp * virtual
    if schedule in ("zbv-zero-bubble", "dualpipe-v"):
        place = {s: s if s < pp else 2 * pp - 1 - s for s in range(num)}
    else:
        place = {s: s % pp for s in range(num)}
    ops = simulate_schedule(cfg, place, dict.fromkeys(range(num), chunk_s / virtual))
    return cfg, ops, max(op.end_s for op in ops)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_chunk_schedules_have_the_textbook_bubble(schedule):
    # (pp - 1) / (m + pp - 1) of the step is bubble (Huang et al. 2019; Narayanan et al. 2021)
    _, _, makespan = _run(schedule, pp=4, microbatches=8)
    assert makespan == pytest.approx(8 * 3.0 + 3 * 3.0)


def test_interleaving_divides_the_bubble_by_v():
    # Megatron interleaved 1F1B: bubble = (pp - 1) * (t_f + t_b) / v
    _, _, makespan = _run("interleaved-1f1b", pp=4, microbatches=8, virtual=2)
    assert makespan == pytest.approx(8 * 3.0 + 3 * 3.0 / 2)


def test_one_f_one_b_keeps_at_most_pp_minus_rank_in_flight():
    _, ops, _ = _run("1f1b", pp=4, microbatches=8)
    for rank in range(4):
        inflight = peak = 0
        for op in sorted((o for o in ops if o.rank == rank), key=lambda o: o.start_s):
            inflight += 1 if op.kind == "F" else -1
            peak = max(peak, inflight)
        assert peak == 4 - rank


@settings(max_examples=25, deadline=None)
@given(schedule=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zbv-zero-bubble",
                                 "interleaved-zero-bubble", "dualpipe-v"]),
       pp=st.integers(1, 4), microbatches=st.integers(1, 9))
def test_replay_respects_dependencies_and_never_overlaps_a_rank(schedule, pp, microbatches):
    virtual = 2 if schedule not in ("gpipe", "1f1b") and pp > 1 else 1
    if pp == 1:
        schedule = "1f1b"
    _cfg, ops, _ = _run(schedule, pp, microbatches, virtual)
    end = {(o.kind, o.microbatch, o.stage): o.end_s for o in ops}
    num = pp * virtual
    kinds = {o.kind for o in ops}
    assert len(ops) == microbatches * num * len(kinds)
    for o in ops:
        if o.kind == "F" and o.stage > 0:
            assert o.start_s >= end[("F", o.microbatch, o.stage - 1)] - 1e-12
        if o.kind == "B" and o.stage < num - 1:
            assert o.start_s >= end[("B", o.microbatch, o.stage + 1)] - 1e-12
        if o.kind == "W":
            assert o.start_s >= end[("B", o.microbatch, o.stage)] - 1e-12
    for rank in range(pp):
        mine = sorted((o for o in ops if o.rank == rank), key=lambda o: o.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in itertools.pairwise(mine))


def test_plot_plan_writes_a_png():
    plan = make_plan()
    png = plot_plan(plan.config, plan.estimate)
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def _point(gpu, n, days, cost, error=""):
    return SweepPoint(gpu=gpu, num_gpus=n, days=days, gpu_hours=n * days * 24, cost=cost,
                      error=error)


def test_pareto_front_keeps_the_undominated_points():
    points = mark_pareto([_point("a", 64, 10, 100), _point("a", 128, 6, 120),
                          _point("h", 64, 7, 130), _point("h", 128, 4, 200),
                          _point("x", 8, 0, 0, error="does not fit")])
    assert [p.pareto for p in points] == [True, True, False, True, False]


def test_sweep_plot_and_prices():
    points = mark_pareto([_point("a", 64, 10, 100), _point("h", 64, 7, 130)])
    assert plot_sweep(points).startswith(PNG_MAGIC)
    assert parse_prices("2.5", ["a", "h"]) == {"a": 2.5, "h": 2.5}
    assert parse_prices("a=1,h=3", ["a", "h"]) == {"a": 1.0, "h": 3.0}
    with pytest.raises(ValueError, match="no price for h"):
        parse_prices("a=1", ["a", "h"])
