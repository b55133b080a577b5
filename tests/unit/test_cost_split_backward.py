"""A schedule that splits backwards (torch's ``stage_backward_input`` then
``stage_backward_weight``) recomputes nothing: torch's weight pass and activation checkpointing do
not compose (tests/unit/test_graph_weight_pass.py shows why). The cost table costs every mode as
none there, so a plan says none, and estimate, export and the runtime refuse a mode.
"""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.config import RECOMPUTE, ParallelConfig
from autopar.cost_model.estimator import estimate as estimate_split
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table
from autopar.errors import AutoparError
from autopar.exporters import export_refusal
from autopar.models import build
from autopar.runtime.apply import check_plan_runnable
from autopar.search import SearchOptions, plan
from autopar.search.planner import plan_from_config

SHAPE = dict(layers=8, hidden=64, heads=4, kv_heads=2, vocab=128, seq_len=16)
SPLIT = ("interleaved-zero-bubble", "zbv-zero-bubble", "dualpipe-v")


@pytest.fixture(scope="module")
def profile():
    return autopar.profile(build("llama", **SHAPE), dtype="fp32")


def _cluster(gpu_memory_gb: float | None = None):
    extra = {} if gpu_memory_gb is None else {"gpu_memory_gb": gpu_memory_gb}
    return Cluster.preset("h100", nodes=1, gpus_per_node=2, **extra)


def _config(schedule: str, **kw) -> ParallelConfig:
    return ParallelConfig(pp=2, virtual_stages=2, schedule=schedule, global_batch=8,
                          micro_batch=1, **kw)


@pytest.mark.parametrize("schedule", SPLIT)
def test_every_mode_costs_none_under_a_split_backward(profile, schedule):
    whole = build_cost_table(profile, _cluster(), _config("interleaved-1f1b"))
    split = build_cost_table(profile, _cluster(), _config(schedule))
    block = next(i for i, lay in enumerate(profile.layers) if lay.kind == "block")
    assert whole.layers[block].act_bytes[2] < whole.layers[block].act_bytes[0]
    for mode in RECOMPUTE:
        assert split.layers[block].time_per_microbatch_s(mode) == pytest.approx(
            whole.layers[block].time_per_microbatch_s("none"))
        assert split.layers[block].act_bytes[RECOMPUTE.index(mode)] == pytest.approx(
            whole.layers[block].act_bytes[0])


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_a_mode_under_a_split_backward_is_refused(profile, mode):
    cluster = _cluster()
    with pytest.raises(ValueError, match=f"cannot run {mode} activation checkpointing"):
        autopar.estimate(profile, cluster, _config("zbv-zero-bubble", recompute=mode))
    plain = _config("interleaved-zero-bubble")
    modes = tuple(mode if lay.kind == "block" else "none" for lay in profile.layers)
    with pytest.raises(ValueError, match="splits backwards into input and weight passes"):
        estimate_split(profile, cluster, plain, recompute=modes)
    # the same modes under a schedule whose backwards are whole
    whole = dataclasses.replace(plain, schedule="interleaved-1f1b")
    assert estimate_split(profile, cluster, whole, recompute=modes).step_time_s > 0

    made = plan_from_config(profile, cluster, plain)
    stages = tuple(dataclasses.replace(s, recompute=tuple(
        mode if n.startswith("layers.") else r for n, r in zip(s.layer_names, s.recompute)))
        for s in made.stages)
    edited = dataclasses.replace(made, stages=stages)
    with pytest.raises(ValueError, match="activation checkpointing"):
        autopar.estimate(profile, cluster, edited)
    with pytest.raises(AutoparError, match="activation checkpointing"):
        check_plan_runnable(build("llama", **SHAPE), edited)
    assert "activation checkpointing" in export_refusal(edited, "torchtitan")
    check_plan_runnable(build("llama", **SHAPE), made)
    assert export_refusal(made, "torchtitan") is None


def test_tight_plans_recompute_only_under_whole_backwards():
    """Memory tight enough that recompute pays: the search recomputes under the schedules whose
    backwards are whole, and proposes the ones that split them only without recompute."""
    profile = autopar.profile(build("llama", layers=8, hidden=256, heads=4, kv_heads=2,
                                    vocab=512, seq_len=1024), dtype="fp32")
    opts = SearchOptions(max_virtual_stages=2, zero_stages=(0,), micro_batch_sizes=(4,))
    plans = plan(profile, _cluster(gpu_memory_gb=0.8), global_batch=8, top_k=8, options=opts)
    assert any(set(p.recompute_per_layer) != {"none"} for p in plans)
    assert any(p.config.pp > 1 and p.config.schedule in SPLIT for p in plans)
    for p in plans:
        if p.config.pp > 1 and p.config.schedule in SPLIT:
            assert set(p.recompute_per_layer) == {"none"}, p.config
