"""Megatron-LM's gradient and optimizer-state dtypes: the bf16 main_grad buffer autopar costs
(and exports as ``--grad-reduce-in-bf16``) against Megatron-LM's fp32 accumulation under --bf16
(the ``accumulate-allreduce-grads-in-fp32`` setting), and Adam's moments in bf16 (the
``bf16-adam-moments`` setting: Megatron-LM's precision-aware optimizer)."""

from __future__ import annotations

import pytest

from autopar import estimate
from autopar.config import ParallelConfig
from autopar.cost_model.frameworks import get_framework
from autopar.cost_model.hardware import Cluster
from autopar.export_rules import MegatronArgs, megatron_violations
from autopar.exporters import export_plan
from autopar.search import plan_from_config
from tests.unit.test_search_planner import gpt_profile

PROFILE = gpt_profile(4, 1024, 16, s=1024)
H100 = Cluster.preset("h100", nodes=2, gpus_per_node=4)
FP32_GRADS = "megatron-lm+accumulate-allreduce-grads-in-fp32"
BF16_MOMENTS = "megatron-lm+bf16-adam-moments"


def _cfg(**kw) -> ParallelConfig:
    base = dict(dp=4, tp=2, zero=1, global_batch=16, micro_batch=1, dtype="bf16")
    return ParallelConfig(**{**base, **kw})


def test_fp32_accumulation_doubles_the_gradient_buffer_and_the_reduced_bytes():
    cfg = _cfg()
    bf16, fp32 = (estimate(PROFILE, H100, cfg, framework=f) for f in ("megatron-lm", FP32_GRADS))
    assert fp32.memory_breakdown.gradients_bytes == pytest.approx(
        2 * bf16.memory_breakdown.gradients_bytes)
    assert fp32.time_breakdown.dp_comm_s > bf16.time_breakdown.dp_comm_s
    # everything else is the same split
    assert fp32.memory_breakdown.parameters_bytes == bf16.memory_breakdown.parameters_bytes
    assert fp32.time_breakdown.compute_s == bf16.time_breakdown.compute_s
    assert get_framework(FP32_GRADS).grad_reduce_bytes == 4
    assert get_framework("megatron-lm").grad_reduce_bytes == 2


@pytest.mark.parametrize(("spec", "dtype", "written", "absent"), [
    ("megatron-lm", "bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"),
    ("megatron-lm", "fp8", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"),
    ("megatron-lm", "fp16", None, "--grad-reduce-in-bf16"),
    (FP32_GRADS, "bf16", "--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16"),
])
def test_the_export_runs_the_gradient_dtype_the_prediction_costed(spec, dtype, written, absent):
    plan = plan_from_config(PROFILE, H100, _cfg(dtype=dtype), framework=spec)
    out = export_plan(plan, "megatron")
    words = out.text.split()
    assert absent not in words
    if written is not None:
        assert written in words
    # the bf16 reduce is said, with the framework spec that costs fp32 accumulation instead
    said = [n for n in out.notes if n.startswith("--grad-reduce-in-bf16")]
    assert len(said) == (written == "--grad-reduce-in-bf16")
    assert all(FP32_GRADS in n for n in said)


def test_megatron_rules_refuse_grad_reduce_in_bf16_without_bf16():
    args = dict(world_size=8, num_layers=4, tp=2, pp=1, micro_batch=1, global_batch=16)
    assert megatron_violations(MegatronArgs(**args, bf16=True, grad_reduce_in_bf16=True)) == []
    broken = megatron_violations(MegatronArgs(**args, fp16=True, grad_reduce_in_bf16=True))
    assert len(broken) == 1 and "--grad-reduce-in-bf16" in broken[0]


def test_bf16_moments_halve_the_optimizer_state_and_nothing_else():
    cfg = _cfg()
    fp32, bf16 = (estimate(PROFILE, H100, cfg, framework=f) for f in ("megatron-lm", BF16_MOMENTS))
    assert bf16.memory_breakdown.optimizer_bytes == pytest.approx(
        fp32.memory_breakdown.optimizer_bytes / 2)
    assert bf16.memory_breakdown.parameters_bytes == fp32.memory_breakdown.parameters_bytes
    assert bf16.memory_breakdown.gradients_bytes == fp32.memory_breakdown.gradients_bytes
    assert bf16.step_time_s == pytest.approx(fp32.step_time_s)
    assert get_framework(BF16_MOMENTS).sources["adam_moment_bytes"].startswith("sourced:")


def test_a_split_that_fits_only_with_bf16_moments():
    big = gpt_profile(8, 4096, 32, s=2048)
    small = Cluster.preset("h100", nodes=1, gpus_per_node=2, gpu_memory_gb=14)
    cfg = ParallelConfig(dp=2, zero=1, global_batch=2, micro_batch=1, recompute="full")
    fp32 = estimate(big, small, cfg, framework="megatron-lm")
    bf16 = estimate(big, small, cfg, framework=BF16_MOMENTS)
    assert not fp32.fits and bf16.fits


@pytest.mark.parametrize("cfg", [_cfg(zero=0), _cfg(offload="optimizer")])
def test_bf16_moments_need_the_distributed_optimizer_on_the_device(cfg):
    with pytest.raises(ValueError, match="precision-aware-optimizer"):
        estimate(PROFILE, H100, cfg, framework=BF16_MOMENTS)


def test_the_export_writes_the_precision_aware_optimizer_with_bf16_moments():
    plan = plan_from_config(PROFILE, H100, _cfg(), framework=BF16_MOMENTS)
    text = " ".join(export_plan(plan, "megatron").text.split())
    for flag in ("--use-precision-aware-optimizer", "--exp-avg-dtype bf16",
                 "--exp-avg-sq-dtype bf16", "--use-distributed-optimizer"):
        assert flag in text


def test_at_dp_1_bf16_moments_need_no_zero_and_the_export_still_runs_the_distributed_optimizer():
    cfg = ParallelConfig(tp=2, global_batch=4, micro_batch=1, sequence_parallel=True)
    plan = plan_from_config(PROFILE, Cluster.preset("h100", nodes=1, gpus_per_node=2), cfg,
                            framework=BF16_MOMENTS)
    assert "--use-distributed-optimizer" in export_plan(plan, "megatron").text.split()


def test_plan_shows_what_bf16_moments_would_buy_when_it_recomputes():
    from autopar import plan as make_plan
    from autopar.cli.alternatives import alternatives_for

    big = gpt_profile(8, 4096, 32, s=2048)
    tight = Cluster.preset("h100", nodes=1, gpus_per_node=2, gpu_memory_gb=15)
    best = make_plan(big, tight, global_batch=8, framework="megatron-lm")
    assert any(mode != "none" for mode in best.recompute_per_layer)
    levers = [a for a in alternatives_for(big, tight, best) if BF16_MOMENTS in a.label]
    assert len(levers) == 1 and levers[0].config.recompute == "none"
    assert levers[0].label.endswith("no recompute")  # the same split otherwise
    again = estimate(big, tight, levers[0].config, framework=BF16_MOMENTS)
    assert levers[0].estimate.step_time_s == pytest.approx(again.step_time_s)
    assert levers[0].estimate.fits and levers[0].estimate.step_time_s < best.estimate.step_time_s
    roomy = make_plan(big, Cluster.preset("h100", nodes=1, gpus_per_node=2), global_batch=8,
                      framework="megatron-lm")
    assert all(mode == "none" for mode in roomy.recompute_per_layer)
    assert not [a for a in alternatives_for(big, tight, roomy) if BF16_MOMENTS in a.label]
