"""What a schedule that splits backwards (torch's ``stage_backward_input`` then
``stage_backward_weight``) does to recomputation, in the cost table and the checks:

- full recompute: the weight pass re-runs a checkpointed block's forward once per weight op
  (tests/unit/test_graph_weight_pass.py measures it), so the full mode's re-run terms count
  1 + ``weight_ops`` times the share of backwards split (``held_counts.split_share``);
- selective recompute: torch's selective checkpointing allows one backward per region, so the
  table costs it as none (a plan says none) and estimate, export and the runtime refuse it.
"""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.config import ParallelConfig
from autopar.cost_model.estimator import estimate as estimate_split
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.held_counts import split_share
from autopar.cost_model.layer_costs import build_cost_table
from autopar.errors import AutoparError
from autopar.exporters import export_refusal
from autopar.models import build
from autopar.runtime.apply import check_plan_runnable
from autopar.search.planner import plan_from_config

SHAPE = dict(layers=8, hidden=64, heads=4, kv_heads=2, vocab=128, seq_len=16)


@pytest.fixture(scope="module")
def profile():
    return autopar.profile(build("llama", **SHAPE), dtype="fp32")


def _cluster():
    return Cluster.preset("h100", nodes=1, gpus_per_node=2)


def _block(profile, schedule: str, m: int = 8):
    cfg = ParallelConfig(pp=2, virtual_stages=2, schedule=schedule, global_batch=m,
                         micro_batch=1)
    table = build_cost_table(profile, _cluster(), cfg)
    index = next(i for i, lay in enumerate(profile.layers) if lay.kind == "block")
    return table.layers[index], profile.layers[index].weight_ops


@pytest.mark.parametrize(("schedule", "m"), [("interleaved-zero-bubble", 8),
                                             ("zbv-zero-bubble", 8), ("dualpipe-v", 8),
                                             ("dualpipe-v", 16)])
def test_weight_pass_reruns_are_charged_to_full_recompute(profile, schedule, m):
    plain, weight_ops = _block(profile, "interleaved-1f1b", m)
    split, _ = _block(profile, schedule, m)
    assert weight_ops >= 9  # four linears of attention, three of the MLP, two norms
    reruns = weight_ops * split_share(schedule, 2, m)
    assert 0 < split_share(schedule, 2, m) <= 1
    for name in ("recompute_s", "tp_comm_s", "recompute_flops_per_sample"):
        none, _sel, full = getattr(plain, name)
        assert getattr(split, name)[2] == pytest.approx(full + reruns * (full - none))
    assert split.recompute_s[2] > plain.recompute_s[2] * (1 + reruns / 2)
    assert split.time_per_microbatch_s("full") > plain.time_per_microbatch_s("full")
    # none is untouched; selective costs as none
    assert split.time_per_microbatch_s("none") == pytest.approx(
        plain.time_per_microbatch_s("none"))
    assert split.time_per_microbatch_s("selective") == split.time_per_microbatch_s("none")
    assert split.act_bytes[1] == split.act_bytes[0]


def test_selective_under_a_split_backward_is_refused(profile):
    cluster = _cluster()
    cfg = ParallelConfig(pp=2, virtual_stages=2, schedule="interleaved-zero-bubble",
                         global_batch=8, micro_batch=1, recompute="selective")
    with pytest.raises(ValueError, match="selective activation checkpointing runs one backward"):
        autopar.estimate(profile, cluster, cfg)
    plain = dataclasses.replace(cfg, recompute="none")
    modes = tuple("selective" if lay.kind == "block" else "none" for lay in profile.layers)
    with pytest.raises(ValueError, match="splits backwards into input and weight passes"):
        estimate_split(profile, cluster, plain, recompute=modes)
    # the same modes under a schedule whose backwards are whole
    whole = dataclasses.replace(plain, schedule="interleaved-1f1b")
    assert estimate_split(profile, cluster, whole, recompute=modes).step_time_s > 0

    plan = plan_from_config(profile, cluster, plain)
    stages = tuple(dataclasses.replace(s, recompute=tuple(
        "selective" if n.startswith("layers.") else r for n, r in zip(s.layer_names,
                                                                        s.recompute)))
        for s in plan.stages)
    edited = dataclasses.replace(plan, stages=stages)
    with pytest.raises(ValueError, match="selective activation checkpointing"):
        autopar.estimate(profile, cluster, edited)
    with pytest.raises(AutoparError, match="selective activation checkpointing"):
        check_plan_runnable(build("llama", **SHAPE), edited)
    assert "selective activation checkpointing" in export_refusal(edited, "torchtitan")
    check_plan_runnable(build("llama", **SHAPE), plan)
    assert export_refusal(plan, "torchtitan") is None


def test_plans_under_a_split_backward_never_say_selective(profile):
    """The search sees selective cost as none: the plan names none (``plainest_mode``)."""
    cluster = _cluster()
    cfg = ParallelConfig(pp=2, virtual_stages=2, schedule="interleaved-zero-bubble",
                         global_batch=8, micro_batch=1, recompute="none")
    table = build_cost_table(profile, cluster, cfg)
    from autopar.search.ilp_stages import plainest_mode

    for layer in table.layers:
        assert plainest_mode(layer, 1) == 0
