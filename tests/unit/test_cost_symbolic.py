"""The sympy formulas evaluate to what the numeric cost model computes; explain_plan prints them."""

from __future__ import annotations

import pytest

from autopar.config import ParallelConfig
from autopar.cost_model import comm
from autopar.cost_model.estimator import default_split, estimate
from autopar.cost_model.frameworks import FRAMEWORKS
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table
from autopar.cost_model.memory import layer_state
from autopar.cost_model.pipeline import bubble_coefficient
from autopar.cost_model.symbolic import (
    ALL_REDUCE,
    BUBBLE_COEFFICIENT,
    STEP_TIME,
    B,
    E_max,
    Psi,
    R_max,
    S,
    T_sum,
    alpha,
    c,
    d,
    explain,
    m,
    model_state_expr_for,
    n,
    p,
    state_byte_sizes,
    w,
)
from autopar.cost_model.symbolic import v as v_sym
from autopar.costing import explain_plan
from autopar.plan import Plan, StagePlan
from autopar.units import GIB, MIB
from tests.fixtures.profiles import analytic_transformer_profile
from tests.unit.test_search_planner import moe_profile

PROFILE = analytic_transformer_profile(6, 128, 4, 512, 64)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(("dp", "pp", "zero"), [(1, 1, 0), (4, 1, 0), (4, 2, 0), (4, 1, 1),
                                                (4, 1, 2), (4, 1, 3),
                                                (4, 2, 1), (4, 2, 2), (4, 2, 3)])
def test_model_state_expressions_match_memory(dtype, dp, pp, zero):
    cfg = ParallelConfig(dp=dp, pp=pp, zero=zero, dtype=dtype, global_batch=dp * 4)
    state = layer_state(1000.0, cfg)
    exprs = model_state_expr_for(cfg)
    values = {Psi: 1000.0, d: dp, w: 2 if dtype == "bf16" else 4, **state_byte_sizes()}
    got = [float(e.subs(values)) for e in exprs]
    assert got == pytest.approx([state.param_bytes, state.grad_bytes, state.optimizer_bytes])


def test_all_reduce_expression_matches_comm():
    link = comm.GroupLink(size=8, bandwidth_bytes_per_s=2e11, latency_s=5e-6, spans_nodes=False)
    value = float(ALL_REDUCE.subs({n: 8, S: 1e9, B: 2e11, alpha: 5e-6}))
    assert value == pytest.approx(comm.all_reduce_s(link, 1e9))


@pytest.mark.parametrize(("schedule", "v", "batch"), [
    ("1f1b", 1, 8), ("interleaved-1f1b", 2, 8), ("zbv-zero-bubble", 2, 8),
    ("interleaved-zero-bubble", 2, 8), ("gpipe", 1, 2),  # the last: m = 1 < p
])
def test_step_time_expression_matches_assemble(schedule, v, batch):
    cfg = ParallelConfig(dp=2, pp=2, global_batch=batch, schedule=schedule, virtual_stages=v)
    cluster = Cluster.preset("a100-80g", gpus_per_node=4)
    est = estimate(PROFILE, cluster, cfg)
    r = max(s.time_per_microbatch_s for s in est.stages)
    t_sum = sum(s.time_per_microbatch_s for s in est.stages)
    mb = cfg.num_microbatches
    e = est.step_time_s - mb * r - est.time_breakdown.bubble_s
    coef = bubble_coefficient(schedule, 2, v, mb)
    value = float(STEP_TIME.subs({m: mb, R_max: r, T_sum: t_sum, E_max: e, c: coef}))
    assert value == pytest.approx(est.step_time_s)
    if schedule == "1f1b" and mb >= 2:  # the printed 1F1B coefficient is the schedule's own
        assert float(BUBBLE_COEFFICIENT.subs({p: 2, v_sym: 1})) == pytest.approx(coef)


@pytest.mark.parametrize("schedule", ["zbv-zero-bubble", "interleaved-1f1b"])
def test_explain_prints_the_estimates_step(schedule):
    """explain's step line is the estimate's step for every schedule (a zero-bubble schedule's
    coefficient is not (p - 1) / (v p))."""
    cfg = ParallelConfig(dp=1, pp=4, global_batch=8, schedule=schedule, virtual_stages=2)
    cluster = Cluster.preset("a100-80g", gpus_per_node=4)
    table = build_cost_table(PROFILE, cluster, cfg)
    split, recompute = default_split(table)
    est = estimate(PROFILE, cluster, cfg)
    text = explain(PROFILE, cluster, cfg, split, recompute, "autopar")
    assert f"step = {est.step_time_s:.4f} s" in text


def test_explain_plan_prints_formulas_and_numbers():
    cfg = ParallelConfig(dp=2, tp=2, pp=2, zero=3, global_batch=8, schedule="1f1b")
    cluster = Cluster.preset("a100-80g", gpus_per_node=8)
    table = build_cost_table(PROFILE, cluster, cfg)
    split, recompute = default_split(table)
    est = estimate(PROFILE, cluster, cfg)
    stages = tuple(
        StagePlan(index=j, layers=(a, b),
                  layer_names=tuple(x.name for x in PROFILE.layers[a:b + 1]),
                  recompute=recompute[a:b + 1])
        for j, (a, b) in enumerate(split)
    )
    plan = Plan(config=cfg, stages=stages, estimate=est)
    text = explain_plan(PROFILE, cluster, plan)
    assert "Psi*o/d" in text and "R_max*m" in text and "fits" in text
    assert f"{est.tokens_per_s:,.0f} tokens/s" in text


def _printed_bytes(text: str, name: str) -> float:
    """The figure explain prints on ``name``'s memory line (``format_bytes``, 2 decimals)."""
    line = next(x for x in text.splitlines() if x.strip().startswith(f"{name} "))
    number, unit = line.rsplit("=", 1)[1].split()[:2]
    return float(number) * {"PiB": 1024**2 * GIB, "TiB": 1024 * GIB, "GiB": GIB, "MiB": MIB,
                            "KiB": 1024, "B": 1}[unit]


@pytest.mark.parametrize("framework", [*FRAMEWORKS, "megatron-lm+expert-tp-1"])
@pytest.mark.parametrize(("moe", "kwargs"), [
    (False, {"dp": 4, "zero": 1}),
    (False, {"dp": 2, "tp": 2, "zero": 3}),
    (True, {"dp": 4, "ep": 2, "zero": 1}),
    (True, {"dp": 4, "ep": 4, "zero": 3}),
    # experts whole on each tp rank (replicated or folded), held apart with ep or without
    (True, {"dp": 2, "tp": 2, "ep": 2, "zero": 1, "sequence_parallel": True}),
    (True, {"dp": 2, "tp": 2, "zero": 1, "sequence_parallel": True}),
    (True, {"dp": 2, "tp": 2, "ep": 2, "zero": 1}),
    (True, {"dp": 2, "tp": 2, "zero": 1}),
    # HSDP: the experts' shard group can equal the dense part's, still held apart
    (True, {"dp": 4, "dp_replicate": 2, "ep": 2, "zero": 3}),
])
def test_explains_model_state_is_the_estimates(framework, moe, kwargs):
    """Each model-state line of explain is the estimate's figure, under every framework's
    gradient and Adam moment bytes and with experts held apart under expert parallelism (it
    had charged 4-byte gradients to megatron-lm and deepspeed and every expert to each rank)."""
    profile = moe_profile(2, 64, 8, s=64) if moe else PROFILE
    cfg = ParallelConfig(global_batch=8, **kwargs)
    cluster = Cluster.preset("a100-80g", gpus_per_node=4)
    try:
        est = estimate(profile, cluster, cfg, framework=framework)
    except ValueError:  # a split this framework does not run
        pytest.skip(f"{framework} does not run {cfg.describe()}")
    split, recompute = default_split(build_cost_table(profile, cluster, cfg, framework))
    text = explain(profile, cluster, cfg, split, recompute, framework)
    memory = est.stages[0].memory
    for name, value in (("parameters", memory.parameters_bytes),
                        ("gradients", memory.gradients_bytes),
                        ("optimizer", memory.optimizer_bytes),
                        ("pipeline", memory.pipeline_buffers_bytes)):
        assert _printed_bytes(text, name) == pytest.approx(value, rel=0.006, abs=1), name
    assert "Psi_e" in text or cfg.ep == 1
    assert "on the device" not in text  # no offload: the formula's figure is the estimate's
