"""Megatron-Core's MoE parallel folding (setting ``expert-tp-1``): routed experts whole on each
rank, each tp rank routing its own tokens over an ep group of consecutive ranks."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.config import ParallelConfig
from autopar.cost_model.dp_comm import params_tp
from autopar.cost_model.ep_comm import edp_link
from autopar.cost_model.expert_tp import folded_experts
from autopar.cost_model.frameworks import get_framework
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table
from autopar.cost_model.moe import ep_stride, expert_dp, experts_whole
from autopar.exporters import export_plan
from autopar.search import plan_from_config
from tests.unit.test_search_planner import gpt_profile, moe_profile

PROFILE = moe_profile(2, 1024, 8, s=512)
MOE = PROFILE.layers[1].moe
TWO_NODES = Cluster.preset("h100", nodes=2)  # 16 GPUs, 8 a node
FOLDED = "megatron-lm+expert-tp-1"


def _cfg(**kw) -> ParallelConfig:
    base = dict(dp=4, tp=4, ep=4, zero=1, sequence_parallel=True, global_batch=32,
                micro_batch=1)
    return ParallelConfig(**{**base, **kw})


def _block(framework, cfg: ParallelConfig, cluster: Cluster = TWO_NODES):
    return build_cost_table(PROFILE, cluster, cfg, framework).layers[1]


def test_setting_folds_megatrons_and_torchtitans_experts_only():
    from autopar.cost_model.framework_support import moe_tp_mode

    fw = get_framework(FOLDED)
    assert fw.expert_tp_folded and moe_tp_mode(fw, _cfg()) == "linears"
    assert moe_tp_mode(get_framework("megatron-lm"), _cfg()) == "rows"
    assert not get_framework("megatron-lm").expert_tp_folded
    assert "expert_tp_folded" in fw.sources
    assert get_framework("torchtitan+expert-tp-1").fold_needs_ep
    with pytest.raises(ValueError, match="expert-tp-1"):
        get_framework("deepspeed+expert-tp-1")


def test_folded_experts_are_whole_and_zero_sharded_over_tp_dp_over_ep():
    """Each rank holds E / ep whole experts (not E / ep / tp), their ZeRO shard group the
    tp dp / ep ranks holding the same ones: the optimizer state per rank is the same, the
    16-bit weights tp times more; the FLOPs a rank runs are the same."""
    cfg = _cfg()
    layer, folded = PROFILE.layers[1], folded_experts(PROFILE, cfg.tp).layers[1]
    assert experts_whole(folded, cfg.tp) and not experts_whole(layer, cfg.tp)
    assert params_tp(folded, cfg) - params_tp(layer, cfg) == pytest.approx(
        MOE.routed_params / cfg.ep * (1 - 1 / cfg.tp))
    assert expert_dp(cfg, whole=True) == cfg.tp * cfg.dp // cfg.ep == 4
    assert expert_dp(cfg) == 1
    sharded, whole = _block("megatron-lm", cfg), _block(FOLDED, cfg)
    assert whole.model_flops_per_sample == pytest.approx(sharded.model_flops_per_sample)
    assert whole.recompute_flops_per_sample == pytest.approx(sharded.recompute_flops_per_sample)
    assert whole.optimizer_bytes == pytest.approx(sharded.optimizer_bytes)
    assert whole.param_bytes > sharded.param_bytes


def test_folded_moe_module_issues_no_routed_rows_over_tp():
    """Megatron's default (experts sharded over tp) all-gathers the dispatched rows over tp and
    reduce-scatters them back ("rows"); folded, only the listed linears talk over tp."""
    cfg = _cfg()
    sharded, whole = _block("megatron-lm", cfg), _block(FOLDED, cfg)
    linears = _block(dataclasses.replace(get_framework("megatron-lm"), moe_tp="linears"), cfg)
    assert whole.tp_comm_s == pytest.approx(linears.tp_comm_s)
    assert whole.tp_comm_s[0] < sharded.tp_comm_s[0]


def test_folded_ep_group_is_consecutive_ranks():
    """ep 4 at tp 4: ranks 4 apart span two 8-GPU nodes; folded, 4 consecutive ranks share
    one. The folded all-to-all on 8-GPU nodes costs what the sharded one costs where its
    group also fits in a node (16-GPU nodes)."""
    cfg = _cfg()
    folded = folded_experts(PROFILE, cfg.tp).layers[1]
    assert ep_stride(folded, cfg) == 1 and ep_stride(PROFILE.layers[1], cfg) == cfg.tp
    wide = Cluster.preset("h100", nodes=1, gpus_per_node=16)
    sharded, whole = _block("megatron-lm", cfg), _block(FOLDED, cfg)
    assert whole.ep_comm_s[0] < sharded.ep_comm_s[0] / 2
    in_node = _block(dataclasses.replace(get_framework("megatron-lm"), moe_tp="linears"),
                     cfg, wide)
    assert whole.ep_comm_s == pytest.approx(in_node.ep_comm_s, rel=0.01)
    # the experts' data-parallel group: tp dp / ep = 4 ranks, ep = 4 apart (0, 4, 8, 12)
    link = edp_link(TWO_NODES, cfg, whole=True)
    assert link == edp_link(TWO_NODES, dataclasses.replace(cfg, tp=1, dp=16), whole=False)


def test_folding_changes_nothing_without_tp():
    cfg = _cfg(dp=16, tp=1, sequence_parallel=False)
    plain, folded = _block("megatron-lm", cfg), _block(FOLDED, cfg)
    assert dataclasses.replace(folded, name=plain.name) == plain


def test_folded_experts_at_ep_1_are_whole_on_every_tp_rank():
    """ep 1, tp 4: every rank holds all routed experts whole, their ZeRO group tp dp."""
    cfg = _cfg(ep=1)
    folded = folded_experts(PROFILE, cfg.tp).layers[1]
    assert params_tp(folded, cfg) == pytest.approx(
        (PROFILE.layers[1].num_params - MOE.routed_params) / cfg.tp + MOE.routed_params)
    assert expert_dp(cfg, whole=True) == 16
    assert _block(FOLDED, cfg).ep_comm_s == (0.0, 0.0, 0.0)


def test_megatron_export_writes_the_folding():
    cluster = Cluster.preset("h100", nodes=1, gpus_per_node=4)
    profile = moe_profile(2, 256, 8, s=128)
    cfg = ParallelConfig(dp=2, tp=2, ep=2, zero=1, sequence_parallel=True, global_batch=8)
    folded = plan_from_config(profile, cluster, cfg, model="moe", framework=FOLDED)
    plain = plan_from_config(profile, cluster, cfg, model="moe", framework="megatron-lm")
    text = export_plan(folded, "megatron").text
    assert "--expert-tensor-parallel-size 1" in text and "--expert-tp-1" not in text
    assert "--expert-tensor-parallel-size" not in export_plan(plain, "megatron").text
    assert folded.framework == FOLDED


def test_planner_searches_the_folding_for_megatron_moe_models():
    """``expert-tp-1`` is a parallelism choice: the planner plans Megatron-LM with it off and on
    for a model with experts and keeps the faster plan, whose spec names it; nothing else."""
    from autopar.search.dimensions import framework_variants

    dense = gpt_profile(2, 256, 8, s=128, vocab=4096)
    assert framework_variants("megatron-lm", PROFILE) == ("megatron-lm", FOLDED)
    assert framework_variants("megatron-lm", dense) == ("megatron-lm",)
    assert framework_variants(FOLDED, PROFILE) == (FOLDED,)
    assert framework_variants("torchtitan", PROFILE) == ("torchtitan", "torchtitan+expert-tp-1")
    assert framework_variants("autopar", PROFILE) == ("autopar",)
    assert framework_variants("megatron-lm+moe-force-balance", PROFILE) == (
        "megatron-lm+moe-force-balance", "megatron-lm+expert-tp-1+moe-force-balance")


def test_a_searched_setting_recosts_only_the_candidates_it_changes():
    from autopar.search.dimensions import changed_by_settings

    configs = [_cfg(), _cfg(ep=1), _cfg(dp=16, tp=1, sequence_parallel=False)]
    assert changed_by_settings(get_framework("megatron-lm"), configs) == configs
    assert changed_by_settings(get_framework(FOLDED), configs) == configs[:2]
    assert changed_by_settings(get_framework("torchtitan+expert-tp-1"), configs) == configs[:1]


def test_planned_megatron_moe_split_is_the_faster_of_folded_and_not():
    from autopar.search import SearchOptions, plan
    from autopar.search.planner import _plan_one

    options = SearchOptions(framework="megatron-lm")
    best = plan(PROFILE, TWO_NODES, 64, options=options)
    each = [_plan_one(PROFILE, TWO_NODES, 64, 1, "", dataclasses.replace(
        options, framework=spec), None, (None, None))[0] for spec in ("megatron-lm", FOLDED)]
    faster = min(each, key=lambda p: p.estimate.step_time_s)
    assert best.estimate.step_time_s == faster.estimate.step_time_s
    assert best.framework == faster.framework
    assert best.to_json() == plan(PROFILE, TWO_NODES, 64, options=options).to_json()


def test_torchtitan_folds_its_experts_with_ep_only():
    """torchtitan's expert_tensor_parallel_degree = 1 ("partial dp + all tp -> ep") has no
    effect at ep 1: the experts stay split over tp there; at ep > 1 they are folded as
    Megatron-LM's, and the torchtitan export writes the degree the prediction assumed."""
    titan = "torchtitan+expert-tp-1"
    at_ep1 = _cfg(ep=1)
    plain, setting = _block("torchtitan", at_ep1), _block(titan, at_ep1)
    assert dataclasses.replace(setting, name=plain.name) == plain
    cfg = _cfg()
    split, whole = _block("torchtitan", cfg), _block(titan, cfg)
    assert whole.optimizer_bytes == pytest.approx(split.optimizer_bytes)
    assert whole.param_bytes > split.param_bytes and whole.ep_comm_s[0] < split.ep_comm_s[0]
    cluster = Cluster.preset("h100", nodes=1, gpus_per_node=4)
    profile = moe_profile(2, 256, 8, s=128)
    small = ParallelConfig(dp=2, tp=2, ep=2, zero=1, sequence_parallel=True, global_batch=8)
    for spec, etp in ((titan, 1), ("torchtitan", 2)):
        plan = plan_from_config(profile, cluster, small, model="moe", framework=spec)
        assert f"expert_tensor_parallel_degree = {etp}" in export_plan(plan, "torchtitan").text


@pytest.mark.parametrize("search, specs", [(True, ["megatron-lm", FOLDED]),
                                           (False, ["megatron-lm"])])
def test_setting_search_can_be_turned_off(monkeypatch, search, specs):
    """``SearchOptions.settings_search`` False (CLI ``--no-setting-search``): the framework is
    planned exactly as named, no searched setting tried."""
    from autopar.search import SearchOptions, planner

    searched = []
    one = planner._plan_one

    def spy(profile, cluster, batch, top_k, model, options, *args, **kw):
        searched.append(options.framework)
        return one(profile, cluster, batch, top_k, model, options, *args, **kw)

    monkeypatch.setattr(planner, "_plan_one", spy)
    options = SearchOptions(framework="megatron-lm", settings_search=search)
    assert planner.plan(PROFILE, TWO_NODES, 64, options=options).framework in specs
    assert searched == specs


def test_cli_no_setting_search(tmp_path):
    from autopar.cli import main

    out = tmp_path / "plan.json"
    spec = "llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=256,seq_len=32,experts=4,top_k=2"
    assert main(["plan", spec, "--gpus", "4", "--global-batch", "8", "--framework",
                 "megatron-lm", "--no-setting-search", "--out", str(out)]) == 0
    assert '"framework": "megatron-lm"' in out.read_text()
