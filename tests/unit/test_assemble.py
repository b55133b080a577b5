"""The step-time/memory assembly on hand-made cost tables (formula checks, no profile)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from table_fixtures import PLAIN_FRAMEWORK

from autopar.config import ParallelConfig
from autopar.cost_model.assemble import assemble
from autopar.cost_model.pipeline import bubble_ratio, in_flight_microbatches
from autopar.cost_model.tables import CostTable, LayerCost
from autopar.schedules import rank_of_stage


def _layer(name: str, t: float = 1.0, act: float = 10.0, static: float = 100.0) -> LayerCost:
    return LayerCost(
        name=name,
        num_params=1,
        model_flops_per_sample=6.0,
        recompute_flops_per_sample=(0.0, 1.0, 2.0),
        compute_s=t,
        backward_s=2 * t / 3,
        recompute_s=(0.0, 0.1 * t, t / 3),
        tp_comm_s=(0.0, 0.0, 0.0),
        dp_microbatch_s=0.0,
        act_bytes=(act, act / 2, act / 10),
        transient_bytes=(0.0, 0.0, act),
        param_bytes=static / 4,
        grad_bytes=static / 4,
        optimizer_bytes=static / 2,
        dp_step_s=0.5,
        optimizer_s=0.01,
    )


def _table(cfg: ParallelConfig, n: int, p2p: float = 0.0) -> CostTable:
    return CostTable(
        config=cfg, framework=PLAIN_FRAMEWORK,
        layers=tuple(_layer(f"l{i}") for i in range(n)),
        p2p_s=p2p,
        dp_tail_s=0.05,
        overlap_efficiency=1.0,
        buffers_bytes=7.0,
        capacity_bytes=1e9,
        peak_flops=1e12,
        tokens_per_step=cfg.global_batch * 16,
    )


def test_bubble_vectors() -> None:
    assert bubble_ratio("1f1b", 8, 32) == pytest.approx(0.21875)
    assert bubble_ratio("interleaved-1f1b", 8, 32, 2) == pytest.approx(0.109375)
    assert bubble_ratio("gpipe", 1, 32) == 0.0
    # Korthikanti's interleaving factor for p=8, v=3 on the first rank: 1 + (p-1)/(p v).
    assert in_flight_microbatches("interleaved-1f1b", 8, 3, 100, 0) / 8 == pytest.approx(
        1.2917, 1e-4
    )
    assert [in_flight_microbatches("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert rank_of_stage("zbv-zero-bubble", 2, 3) == 0 and rank_of_stage("1f1b", 2, 3) == 1


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 4), v=st.integers(1, 3), k=st.integers(1, 4), per=st.integers(1, 3))
def test_uniform_stages_reproduce_bubble_ratio(p: int, v: int, k: int, per: int) -> None:
    sched = "1f1b" if v == 1 else "interleaved-1f1b"
    cfg = ParallelConfig(pp=p, global_batch=p * k, schedule=sched, virtual_stages=v)
    n = p * v * per
    est = assemble(
        _table(cfg, n), [(j * per, j * per + per - 1) for j in range(p * v)], ["none"] * n
    )
    ideal = cfg.num_microbatches * v * per * 1.0
    assert est.time_breakdown.bubble_s == pytest.approx(
        ideal * bubble_ratio(sched, p, cfg.num_microbatches, v)
    )
    assert est.time_breakdown.total_s == pytest.approx(est.step_time_s)
    assert est.tokens_per_s * est.step_time_s == pytest.approx(cfg.global_batch * 16)


def test_memory_and_recompute_terms() -> None:
    cfg = ParallelConfig(pp=2, global_batch=8, schedule="1f1b")
    table = _table(cfg, 4)
    est = assemble(table, [(0, 1), (2, 3)], ["none", "full", "none", "none"])
    rank0 = est.stages[0].memory
    # rank 0 holds min(m=8, p-0=2) micro-batches of layers 0 and 1, plus layer 1's transient.
    assert rank0.activations_bytes == pytest.approx(2 * (10 + 1) + 10)
    assert rank0.parameters_bytes + rank0.gradients_bytes + rank0.optimizer_bytes == 200
    assert rank0.buffers_bytes == 7.0
    assert est.hardware_tflops_per_gpu > est.tflops_per_gpu
    with pytest.raises(ValueError, match="contiguous"):
        assemble(table, [(0, 1), (3, 3)], ["none"] * 4)
