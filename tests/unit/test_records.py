"""ParallelConfig validation and Plan JSON round-trips (records only; no search)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.config import ParallelConfig
from autopar.cost_model.estimate import Estimate, MemoryBreakdown, StageEstimate, TimeBreakdown
from autopar.plan import Plan, PlanFormatError, StagePlan


def _estimate() -> Estimate:
    mem = MemoryBreakdown(parameters_bytes=1.0, activations_bytes=2.0)
    return Estimate(
        step_time_s=1.5,
        tokens_per_s=100.0,
        tflops_per_gpu=1.0,
        hardware_tflops_per_gpu=1.2,
        mfu=0.4,
        memory_per_gpu_bytes=3.0,
        memory_capacity_bytes=10.0,
        fits=True,
        time_breakdown=TimeBreakdown(compute_s=1.0, bubble_s=0.5),
        memory_breakdown=mem,
        stages=tuple(
            StageEstimate(rank=r, stages=(r,), layers=(pair,), num_params=7,
                          time_per_microbatch_s=0.1, memory=mem)
            for r, pair in enumerate(((0, 1), (2, 3)))
        ),
        binding="compute",
    )


def test_config_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="dp"):
        ParallelConfig(dp=0, global_batch=8)
    with pytest.raises(ValueError, match="divisible"):
        ParallelConfig(dp=3, micro_batch=2, global_batch=8)
    with pytest.raises(ValueError, match="schedule"):
        ParallelConfig(global_batch=8, schedule="2f2b")
    with pytest.raises(ValueError, match="virtual_stages"):
        ParallelConfig(pp=2, global_batch=8, schedule="interleaved-1f1b", virtual_stages=1)
    with pytest.raises(ValueError, match="zero"):
        ParallelConfig(global_batch=8, zero=4)


@settings(max_examples=30, deadline=None)
@given(
    dp=st.integers(1, 8),
    tp=st.integers(1, 8),
    pp=st.integers(1, 4),
    mb=st.integers(1, 4),
    k=st.integers(1, 4),
    zero=st.integers(0, 3),
)
def test_config_round_trip(dp, tp, pp, mb, k, zero) -> None:
    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch=mb, global_batch=dp * mb * k, zero=zero)
    assert ParallelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.num_microbatches == k and cfg.world_size == dp * tp * pp


def test_plan_round_trip_and_validation() -> None:
    cfg = ParallelConfig(pp=2, global_batch=4)
    stages = (
        StagePlan(
            index=0,
            layers=(0, 1),
            layer_names=("embedding", "layers.0"),
            recompute=("none", "full"),
        ),
        StagePlan(
            index=1,
            layers=(2, 3),
            layer_names=("layers.1", "head"),
            recompute=("selective", "none"),
        ),
    )
    plan = Plan(
        config=cfg,
        stages=stages,
        estimate=_estimate(),
        tp_layout={"layers.*.attention.wq": "colwise"},
    )
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.to_json() == Plan.from_json(plan.to_json()).to_json()
    assert plan.recompute_per_layer == ("none", "full", "selective", "none")
    assert [s.index for s in plan.stages_for_rank(1)] == [1]
    with pytest.raises(PlanFormatError, match="stages"):
        Plan(config=cfg, stages=stages[:1], estimate=_estimate())
    with pytest.raises(PlanFormatError, match="schema_version"):
        Plan.from_json(json.dumps({"config": {}}))
    bad = json.loads(plan.to_json())
    bad["schema_version"] = 99
    with pytest.raises(PlanFormatError, match="not supported"):
        Plan.from_json(json.dumps(bad))
    with pytest.raises(PlanFormatError, match="JSON"):
        Plan.from_json("{not json")
