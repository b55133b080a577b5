"""A plan is estimated on the cluster it was made for, or re-targeted on purpose."""

from __future__ import annotations

import dataclasses
import json

import pytest

import autopar
from autopar.cli import main
from autopar.errors import PlanMismatchError
from autopar.search import plan_from_config
from tests.fixtures.profiles import analytic_transformer_profile
from tests.helpers import one_error_line

TINY = analytic_transformer_profile(4, 256, 8, 1024, 128)
CLUSTER = autopar.Cluster.preset("a100-80g", nodes=1)
CONFIG = autopar.ParallelConfig(dp=2, tp=2, pp=2, micro_batch=1, global_batch=16)


def _plan() -> autopar.Plan:
    return plan_from_config(TINY, CLUSTER, CONFIG)


def test_estimate_on_another_cluster_names_the_mismatch() -> None:
    plan = _plan()
    assert autopar.estimate(TINY, CLUSTER, plan).to_dict() == plan.estimate.to_dict()
    slower = dataclasses.replace(
        CLUSTER, device=dataclasses.replace(CLUSTER.device, matmul_efficiency_max=0.3))
    with pytest.raises(ValueError, match=r"device\.matmul_efficiency_max") as info:
        autopar.estimate(TINY, slower, plan)
    assert isinstance(info.value, PlanMismatchError)
    assert plan.cluster_fingerprint in str(info.value)
    assert slower.fingerprint() in str(info.value)
    h100 = autopar.Cluster.preset("h100", nodes=1)
    with pytest.raises(ValueError, match=r"made for cluster a100-80g .* on cluster h100"):
        autopar.estimate(TINY, h100, plan)


def test_a_plan_is_estimated_explained_and_counted_on_its_own_model_only() -> None:
    plan = _plan()
    for other in (analytic_transformer_profile(4, 512, 8, 1024, 128),  # wider
                  analytic_transformer_profile(4, 256, 8, 1024, 256)):  # longer sequences
        for call in (lambda p: autopar.estimate(p, CLUSTER, plan),
                     lambda p: autopar.costing.explain_plan(p, CLUSTER, plan),
                     lambda p: autopar.costing.expected_collectives(p, plan)):
            with pytest.raises(PlanMismatchError, match="made for another model") as info:
                call(other)
            assert plan.profile_fingerprint in str(info.value)
            assert other.fingerprint() in str(info.value)
    hand_made = dataclasses.replace(plan, profile_fingerprint="")
    autopar.estimate(analytic_transformer_profile(4, 512, 8, 1024, 128), CLUSTER, hand_made)


def test_for_cluster_re_targets_a_plan_of_the_same_size_only() -> None:
    plan = _plan()
    slower = dataclasses.replace(
        CLUSTER, device=dataclasses.replace(CLUSTER.device, matmul_efficiency_max=0.3))
    moved = plan.for_cluster(slower)
    assert moved.cluster_fingerprint == slower.fingerprint()
    assert moved.stages == plan.stages and moved.config == plan.config
    assert (autopar.estimate(TINY, slower, moved).step_time_s
            > autopar.estimate(TINY, CLUSTER, plan).step_time_s)
    with pytest.raises(PlanMismatchError, match=r"= 8 does not equal the cluster.s 16 GPUs"):
        plan.for_cluster(autopar.Cluster.preset("a100-80g", nodes=2))


def test_a_hand_made_plan_without_fingerprint_is_not_checked() -> None:
    plan = dataclasses.replace(_plan(), cluster_fingerprint="")
    h100 = autopar.Cluster.preset("h100", nodes=1)
    assert plan.cluster_mismatch(h100) is None
    autopar.estimate(TINY, h100, plan)


def test_cli_verify_on_a_cluster_of_another_size_is_one_error_line(tmp_path, capfd) -> None:
    model = "gpt:layers=2,hidden=64,heads=4,vocab=256,seq_len=32"
    plan_path = tmp_path / "plan.json"
    assert main(["plan", model, "--gpus", "2", "--global-batch", "4", "--out",
                 str(plan_path)]) == 0
    cluster = json.loads(plan_path.read_text())["cluster"]
    other = tmp_path / "four.yaml"
    other.write_text(json.dumps({**cluster, "gpus_per_node": 4}))  # JSON is YAML
    capfd.readouterr()
    code = main(["verify", str(plan_path), "--cluster", str(other)])
    line = one_error_line(code, *capfd.readouterr(), "the plan's world size dp * cp * tp * pp")
    assert "= 2 does not equal the cluster's 4 GPUs" in line
