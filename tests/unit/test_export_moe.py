"""Mixture-of-experts plans: the Plan records its experts; exports set ep or refuse clearly."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.config import ParallelConfig
from autopar.cost_model.hardware import Cluster
from autopar.exporters import export_plan
from autopar.plan import Plan
from autopar.search import plan_from_config
from tests.unit.test_search_planner import moe_profile

PROFILE = moe_profile(2, 256, 8, s=128)
CLUSTER = Cluster.preset("h100", nodes=1, gpus_per_node=4)


def _plan(framework: str, **kw) -> Plan:
    cfg = ParallelConfig(**{"dp": 4, "ep": 2, "zero": 1, "global_batch": 8, **kw})
    return plan_from_config(PROFILE, CLUSTER, cfg, model="moe", framework=framework)


def test_plan_json_keeps_the_experts():
    plan = _plan("megatron-lm")
    assert plan.moe == PROFILE.layers[1].moe
    again = Plan.from_json(plan.to_json())
    assert again.moe == plan.moe and again.config.ep == 2


def test_megatron_flags_for_ep():
    text = export_plan(_plan("megatron-lm"), "megatron").text
    for flag in ("--num-experts 8", "--moe-router-topk 2", "--expert-model-parallel-size 2",
                 "--moe-ffn-hidden-size 1024", "--moe-token-dispatcher-type alltoall"):
        assert flag in text
    # Megatron-LM's MoE layer wants sequence parallelism under tp: no such plan is made for
    # it, and a torchtitan plan without it is not exported to it.
    with pytest.raises(ValueError, match="only with sequence parallelism"):
        _plan("megatron-lm", dp=2, tp=2)
    with pytest.raises(ValueError, match="only with sequence parallelism"):
        export_plan(_plan("torchtitan", dp=2, tp=2), "megatron")


def test_torchtitan_sets_expert_parallel_degree():
    text = export_plan(_plan("torchtitan"), "torchtitan").text
    assert "expert_parallel_degree = 2" in text
    assert "expert_tensor_parallel_degree = 1" in text


def test_deepspeed_names_ep_where_its_model_code_sets_it():
    """DeepSpeed's JSON has no expert-parallel key: the export says where ep goes (it had
    refused a plan the deepspeed framework was allowed to make)."""
    two = export_plan(_plan("deepspeed"), "deepspeed")
    assert any("MoE(num_experts=8, ep_size=2, k=2)" in n
               and "split_params_into_different_moe_groups_for_optimizer" in n
               for n in two.notes)
    one = export_plan(_plan("deepspeed", ep=1), "deepspeed")
    assert any("MoE(num_experts=8, ep_size=1, k=2)" in n for n in one.notes)
    # DeepSpeed's engine refuses its MoE layers under ZeRO-3: no such plan is made for it.
    with pytest.raises(ValueError, match="ZeRO stages 0, 1, 2 only; use zero 2"):
        _plan("deepspeed", zero=3)


def test_megatron_exports_ep_in_fp16():
    """Megatron-LM runs ep in fp16 (its fp16 assert went in #2495, before the commit the
    export rules are read at); the megatron-lm framework plans it, so the export writes it."""
    text = export_plan(_plan("megatron-lm", dtype="fp16"), "megatron").text
    assert "--fp16" in text and "--expert-model-parallel-size 2" in text


def test_slurm_runs_what_autopars_runtime_runs():
    # autopar's runtime runs ep with tp > 1, and mixture-of-experts blocks under sequence
    # parallelism where one module holds the router and the experts (the plan records it).
    sp = _plan("megatron-lm", dp=2, tp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="no one module of this model holds both"):
        export_plan(sp, "slurm")
    held = dataclasses.replace(sp, moe=dataclasses.replace(sp.moe, module="moe"))
    assert "ep=2 mb=1 zero=1 recompute=none sp bf16" in export_plan(held, "slurm").text
    assert "dp=2 tp=2 pp=1 ep=2" in export_plan(_plan("torchtitan", dp=2, tp=2), "slurm").text
    assert "autopar run" in export_plan(_plan("megatron-lm"), "slurm").text
    # Experts autopar's runtime cannot run one at a time (the plan records why): slurm refuses
    # their ep, the tools that run their own implementation do not.
    blocked = _plan("megatron-lm")
    blocked = dataclasses.replace(blocked, moe=dataclasses.replace(
        blocked.moe, ep_blocker="its experts are [E f, h] matrices"))
    with pytest.raises(ValueError, match=r"experts it runs one at a time .* \[E f, h\]"):
        export_plan(blocked, "slurm")
    assert "--expert-model-parallel-size 2" in export_plan(blocked, "megatron").text


def test_alternatives_show_the_ep_choice():
    from autopar.cli.alternatives import alternatives_for

    best = _plan("megatron-lm", ep=1)
    labels = [a.label for a in alternatives_for(PROFILE, CLUSTER, best)]
    assert "ep=4" in labels  # the chosen split with its experts over the largest ep
    assert any(label.startswith("FSDP + ep (dp=4, zero=3, ep=4") for label in labels)
    dense = [a.label for a in alternatives_for(_dense(), CLUSTER, best)]
    assert not any("ep" in label for label in dense)


def _dense():
    import dataclasses

    return dataclasses.replace(PROFILE, layers=tuple(
        dataclasses.replace(x, moe=None) for x in PROFILE.layers))


def test_exports_write_the_moe_settings_the_prediction_assumed():
    """The flags of the settings a plan's framework carries: DeepEP's hierarchical dispatch,
    the forced router balance, and Megatron-LM's fp8 recipe (delayed unless fp8-tensorwise)."""
    spec = "megatron-lm+ep-deepep+fp8-tensorwise+moe-force-balance"
    text = export_plan(_plan(spec, dtype="fp8"), "megatron").text
    for flag in ("--moe-token-dispatcher-type flex", "--moe-flex-dispatcher-backend deepep",
                 "--moe-router-force-load-balancing", "--fp8-recipe tensorwise"):
        assert flag in text
    for bad in ("--ep-deepep", "--moe-force-balance", "--fp8-tensorwise", "alltoall"):
        assert bad not in text
    plain = export_plan(_plan("megatron-lm", dtype="fp8"), "megatron").text
    assert "--fp8-recipe delayed" in plain and "--moe-router-force" not in plain
    titan = export_plan(_plan("torchtitan+ep-deepep+moe-force-balance"), "torchtitan").text
    assert 'expert_parallel_comm_backend = "deepep"' in titan
    assert "moe_force_load_balance = true" in titan
    assert "deepep" not in export_plan(_plan("torchtitan"), "torchtitan").text


def test_expandable_segments_is_a_launch_note_and_three_percent():
    from autopar.cost_model.frameworks import get_framework

    fw = get_framework("megatron-lm+expandable-segments")
    assert fw.fragmentation_fraction == 0.03 < get_framework("megatron-lm").fragmentation_fraction
    out = export_plan(_plan("megatron-lm+expandable-segments"), "megatron")
    assert "--expandable-segments" not in out.text
    assert any("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in n for n in out.notes)
