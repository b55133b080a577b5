"""The outer search space, the cheap bounds and the tensor-parallel layout."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_search_ilp import OPTIONS, block_tables, exhaustive, memory_bound_table, small_tables

from autopar.search import bounds
from autopar.search.bounds import (
    integer_bottleneck_s,
    memory_bottleneck_s,
    memory_lower_bound,
    time_lower_bound,
)
from autopar.search.ilp import build_ilp, solve_ilp
from autopar.search.layout import collapse_patterns
from autopar.search.options import SearchOptions
from autopar.search.space import enumerate_candidates, mesh_shapes, schedule_accepts


def test_mesh_shapes_respect_heads_nodes_and_layers() -> None:
    shapes = mesh_shapes(16, head_counts=(12, 4), gpus_per_node=8, num_layers=6)
    assert all(dp * tp * pp == 16 for dp, tp, pp in shapes)
    assert {tp for _, tp, _ in shapes} == {1, 2, 4}  # 8 and 16 do not divide 12 heads
    assert max(pp for *_, pp in shapes) == 4  # pp <= 6 layers among divisors of 16
    across = mesh_shapes(
        16, head_counts=(16,), gpus_per_node=8, num_layers=6, allow_tp_across_nodes=True
    )
    assert (1, 16, 1) in across
    assert (1, 16, 1) not in mesh_shapes(16, head_counts=(16,), gpus_per_node=8, num_layers=6)
    assert shapes == sorted(shapes, key=lambda s: (s[2], s[1]))


def test_schedule_rules_follow_torch() -> None:
    assert not schedule_accepts("1f1b", 4, 1, 3) and schedule_accepts("1f1b", 4, 1, 4)
    assert schedule_accepts("gpipe", 4, 1, 1)
    # Interleaved: m a multiple of rounds = max(1, m // pp).
    assert schedule_accepts("interleaved-1f1b", 4, 2, 8)
    assert not schedule_accepts("interleaved-1f1b", 4, 2, 10 - 1)  # rounds 2, 9 % 2 != 0
    assert schedule_accepts("interleaved-zero-bubble", 4, 2, 3)
    assert not schedule_accepts("zbv-zero-bubble", 4, 3, 8)
    assert not schedule_accepts("dualpipe-v", 4, 2, 7) and schedule_accepts("dualpipe-v", 4, 2, 8)


def _candidates(**over):
    kwargs = dict(
        world_size=8, gpus_per_node=4, head_counts=(8,), num_layers=6, global_batch=16,
        options=SearchOptions(max_virtual_stages=2),
    )  # fmt: skip
    kwargs.update(over)
    return list(enumerate_candidates(**kwargs))


def test_candidates_are_valid_deterministic_and_deduplicated() -> None:
    cands = _candidates()
    assert cands == _candidates() and len(set(cands)) == len(cands)
    for c in cands:
        assert c.world_size == 8 and c.tp <= 4 and c.num_stages <= 6
        assert c.global_batch % (c.dp * c.micro_batch) == 0
        assert c.pp == 1 or schedule_accepts(c.schedule, c.pp, c.virtual_stages, c.num_microbatches)
        assert c.dp > 1 or c.zero == 0  # ZeRO shards over dp: nothing to shard at dp = 1
        assert c.sequence_parallel == (c.tp > 1)
    schedules = {c.schedule for c in cands if c.pp > 1}
    assert {"gpipe", "1f1b", "interleaved-1f1b", "zbv-zero-bubble", "dualpipe-v"} <= schedules
    no_zb = _candidates(options=SearchOptions(max_virtual_stages=2, allow_zero_bubble=False))
    assert not {c.schedule for c in no_zb} & {"zbv-zero-bubble", "dualpipe-v"}
    only_mb2 = _candidates(options=SearchOptions(micro_batch_sizes=(2,)))
    assert {c.micro_batch for c in only_mb2} == {2}


def test_options_validate() -> None:
    for bad in (
        {"time_limit_s": 0},
        {"mip_gap": 1.0},
        {"schedules": ("pipedream",)},
        {"solver": "gurobi"},
        {"zero_stages": (4,)},
        {"max_virtual_stages": 1},
    ):
        with pytest.raises(ValueError):
            SearchOptions(**bad)


@settings(max_examples=20, deadline=None)
@given(table=st.one_of(small_tables(), block_tables()), frac=st.floats(0.0, 1.0))
def test_bounds_never_exceed_the_exhaustive_optimum(table, frac) -> None:
    results = list(exhaustive(table))
    mems = sorted(mem for *_, mem in results)
    cap = mems[0] + frac * (mems[-1] - mems[0]) + 1e5
    table = dataclasses.replace(table, capacity_bytes=cap)
    best = min(step for *_, step, mem in results if mem <= cap)
    assert time_lower_bound(table, refined=True) <= best * (1 + 1e-9)
    assert memory_lower_bound(table) <= mems[0] * (1 + 1e-9)


@pytest.mark.parametrize("capacity_bytes", [8e9, 1e10])
def test_memory_bottleneck_tightens_the_bound_not_past_the_optimum(monkeypatch,
                                                                   capacity_bytes) -> None:
    # 1F1B's first rank holds pp micro-batches' activations: under this cap it cannot take its
    # share of blocks without recomputing, which the memory-blind bounds do not see.
    table = memory_bound_table(capacity_bytes)
    best = solve_ilp(build_ilp(table), OPTIONS).objective
    bound = time_lower_bound(table, refined=True)
    assert memory_bottleneck_s(table) > integer_bottleneck_s(table) * 1.1
    monkeypatch.setattr(bounds, "memory_bottleneck_s", lambda *args: 0.0)
    blind = time_lower_bound(table, refined=True)
    assert blind < bound <= best * (1 + 1e-9)
    assert bound >= best * 0.95  # 23.42 s and 29.35 s against 24.05 s and 30.25 s


def test_layout_collapses_blocks_into_patterns() -> None:
    exact = {f"layers.{i}.attention.wq": "colwise" for i in range(3)}
    exact |= {
        "layers.0.mlp.w2": "rowwise",
        "layers.1.mlp.w2": "rowwise",
        "layers.2.mlp.w2": "colwise",
    }
    exact["tok_embeddings"] = "rowwise"
    out = collapse_patterns(exact)
    assert out["layers.*.attention.wq"] == "colwise" and out["tok_embeddings"] == "rowwise"
    assert "layers.*.mlp.w2" not in out and out["layers.2.mlp.w2"] == "colwise"
    assert list(out) == sorted(out)
