"""The router's load imbalance as a model input: zoo option, profile, cost model, presets, plan."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import autopar
from autopar.config import ParallelConfig
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table
from autopar.cost_model.moe import DROPLESS_IMBALANCE
from autopar.graph.moe_structure import block_moe
from autopar.models import resolve_model
from autopar.models.presets import MIXTRAL_ROUTER_IMBALANCE, PRESETS
from tests.unit.test_search_planner import moe_profile

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import router_imbalance

TINY = "llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=256,seq_len=32,experts=4,top_k=2"
CLUSTER = Cluster.preset("h100", nodes=2)  # 16 GPUs, 8 a node


def _tiny_profile(options: str = ""):
    build, _ = resolve_model(TINY + options)
    return autopar.profile(build(), seq_len=32)


def test_zoo_option_reaches_the_profile_and_its_json_only_when_set():
    stated = _tiny_profile(",router_imbalance=1.1").layers[1].moe
    assert stated.router_imbalance == pytest.approx(1.1)
    assert stated.to_dict()["router_imbalance"] == pytest.approx(1.1)
    unstated = _tiny_profile().layers[1].moe
    assert unstated.router_imbalance == 0.0
    assert "router_imbalance" not in unstated.to_dict()


@pytest.mark.parametrize("options, needle", [
    (",router_imbalance=0.5", "router_imbalance must be 0 (unknown) or between 1"),
    (",router_imbalance=-1", "router_imbalance must be 0 (unknown) or between 1"),
])
def test_zoo_option_rejects_impossible_values(options, needle):
    with pytest.raises(autopar.AutoparError, match=re.escape(needle)):
        resolve_model(TINY + options)


def test_dense_model_with_router_imbalance_is_refused():
    dense = "llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=256,seq_len=32,router_imbalance=1.1"
    with pytest.raises(autopar.AutoparError, match="need experts > 0"):
        resolve_model(dense)


def test_a_model_of_ones_own_states_it_on_a_module_and_a_bad_value_is_named():
    build, _ = resolve_model(TINY)
    with torch.device("meta"):
        model = build()
    block = model.layers["0"]
    block.moe.router_imbalance = 0.0
    block.add_module("note", nn.Identity())
    block.note.router_imbalance = 1.3
    assert block_moe(block).router_imbalance == pytest.approx(1.3)
    block.note.router_imbalance = 0.9
    with pytest.raises(ValueError, match=r"module 'note' states router_imbalance 0\.9"):
        block_moe(block)


def _with(profile, factor):
    return router_imbalance.with_imbalance(profile, factor)


def test_cost_model_charges_the_models_imbalance_and_none_when_force_balanced():
    profile = moe_profile(2, 1024, 8, s=512)
    cfg = ParallelConfig(dp=16, ep=8, global_batch=32, micro_batch=1, zero=0)

    def block(p, framework="torchtitan"):
        return build_cost_table(p, CLUSTER, cfg, framework).layers[1]

    default, stated = block(profile), block(_with(profile, 1.06))
    # Unstated: costed at the default; only the interval's share of it differs.
    stated_default = block(_with(profile, DROPLESS_IMBALANCE))
    assert stated_default == dataclasses.replace(default, unstated_imbalance_s=(0.0, 0.0, 0.0))
    assert min(default.unstated_imbalance_s) > 0
    assert stated.compute_s < default.compute_s
    assert stated.ep_comm_s < default.ep_comm_s
    assert stated.act_bytes[0] < default.act_bytes[0]
    # 1.0 stated is what a force-balanced router costs.
    assert block(_with(profile, 1.0)) == block(profile, "torchtitan+moe-force-balance")
    # A capacity factor pads every expert instead: the stated imbalance changes nothing.
    padded = _with(profile, 1.5)
    padded = dataclasses.replace(padded, layers=tuple(
        dataclasses.replace(x, moe=dataclasses.replace(x.moe, capacity_factor=1.0))
        if x.moe else x for x in padded.layers))
    unpadded = dataclasses.replace(padded, layers=tuple(
        dataclasses.replace(x, moe=dataclasses.replace(x.moe, router_imbalance=1.0))
        if x.moe else x for x in padded.layers))
    assert block(padded) == block(unpadded)


def test_mixtral_presets_carry_their_familys_fitted_imbalance():
    for name in ("mixtral-8x7b", "mixtral-8x22b"):
        assert PRESETS[name][0]["router_imbalance"] == MIXTRAL_ROUTER_IMBALANCE
    pairs = [p for p in router_imbalance.load_pairs() if p["family"] == "mixtral"]
    assert pairs, "the Mixtral pair is in benchmarks/data/moe_router_balance.json"
    fitted = router_imbalance.family_fits(pairs)["mixtral"]
    assert fitted == pytest.approx(MIXTRAL_ROUTER_IMBALANCE, abs=0.01)
    # The fit reproduces the measured ratio it was fitted to.
    pair = pairs[0]
    ratio = router_imbalance.step_s(pair, fitted) / router_imbalance.step_s(pair, None)
    assert ratio == pytest.approx(router_imbalance.measured_ratio(pair), rel=1e-3)


def test_mixtral_plan_on_64_h100_uses_expert_parallelism():
    """Issue 14's acceptance: the plan for Mixtral 8x7B on 64 H100, global batch 512, uses ep
    (with the router imbalance the preset carries); with the default it is FSDP."""
    profile = autopar.profile(autopar.models.build("mixtral-8x7b"))
    cluster = autopar.Cluster.preset("h100", nodes=8)
    plan = autopar.plan(profile, cluster, 512)
    assert plan.config.ep > 1
    unknown = autopar.plan(_with(profile, DROPLESS_IMBALANCE), cluster, 512)
    assert unknown.estimate.step_time_s > plan.estimate.step_time_s


@pytest.mark.parametrize("options, args, says", [
    ("", ["--ep", "2", "--zero", "1"],
     "busiest of ep 2 ranks takes 1.25x its share of routed rows (the default: the model "
     "states no router_imbalance)"),
    (",router_imbalance=1.1", ["--ep", "2", "--zero", "1"],
     "busiest of ep 2 ranks takes 1.10x its share of routed rows (the model's router_imbalance)"),
    (",router_imbalance=1.1", ["--ep", "2", "--zero", "1", "--framework",
                               "torchtitan+moe-force-balance"],
     "takes 1.00x its share of routed rows (the framework forces the router's balance)"),
    ("", [], "no expert parallelism: each rank runs its own tokens' experts"),
    (",capacity_factor=1.25", [], "capacity factor 1.25: every expert runs its padded capacity"),
    ("", ["--dp", "2", "--tp", "2", "--ep", "2", "--zero", "1", "--sequence-parallel",
          "--framework", "megatron-lm+expert-tp-1"],
     "experts whole on each rank, each tp rank routing its own tokens (folded over tp"),
    ("", ["--dp", "2", "--tp", "2", "--zero", "1", "--sequence-parallel", "--framework",
          "torchtitan+expert-tp-1"], "no router imbalance to pay"),
])
def test_report_says_how_the_routed_rows_were_costed(capsys, options, args, says):
    from autopar.cli import main

    code = main(["estimate", TINY + options, "--gpus", "4", "--dp", "4", "--global-batch", "8",
                 *args])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert "Experts 4 routed, top-2" in out
    assert says in out
    if "--tp" in args and "--ep" not in args:  # torchtitan folds its experts with ep only
        assert "folded" not in out


HF_MIXTRAL = dict(model_type="mixtral", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=256, num_local_experts=4, num_experts_per_tok=2)


def test_hf_config_states_it_with_a_router_imbalance_key_and_a_block_wins_over_it(tmp_path):
    pytest.importorskip("transformers")
    from autopar.models.hf import from_hf_config

    def imbalances(model):
        return {x.moe.router_imbalance for x in autopar.profile(model, seq_len=32).layers
                if x.moe}

    assert imbalances(from_hf_config(HF_MIXTRAL)) == {0.0}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**HF_MIXTRAL, "router_imbalance": 1.06}))
    model = from_hf_config(str(path))
    assert imbalances(model) == {1.06}
    model.model.layers[0].mlp.router_imbalance = 1.5  # a block's own statement wins
    assert sorted(imbalances(model)) == [1.06, 1.5]
    bad = from_hf_config({**HF_MIXTRAL, "router_imbalance": 0.3})
    with pytest.raises(ValueError, match=r"the model's config states router_imbalance 0\.3"):
        autopar.profile(bad, seq_len=32)


def test_interval_spans_the_fitted_imbalance_range_where_the_model_states_none():
    """An ep split of a model that states no router imbalance is costed at the default; its
    interval reaches the fitted range's ends (the step at 1.06 and at 1.79, up to the band);
    a stated imbalance or a force-balanced router leaves only the framework's band."""
    from autopar.cost_model.moe import FITTED_ROUTER_IMBALANCE_RANGE

    profile = moe_profile(2, 1024, 8, s=512)
    cfg = ParallelConfig(dp=16, ep=8, global_batch=32, micro_batch=1, zero=1)

    def est(p, framework="torchtitan"):
        return autopar.estimate(p, CLUSTER, cfg, framework=framework)

    unstated, default = est(profile), est(_with(profile, DROPLESS_IMBALANCE))
    assert unstated.step_time_s == default.step_time_s
    low, high = unstated.step_time_interval_s
    d_low, d_high = default.step_time_interval_s
    assert low < d_low and high > d_high
    f_lo, f_hi = FITTED_ROUTER_IMBALANCE_RANGE
    up = est(_with(profile, f_hi)).step_time_s - default.step_time_s
    down = default.step_time_s - est(_with(profile, f_lo)).step_time_s
    assert high - d_high == pytest.approx(up, rel=0.05)
    assert d_low - low == pytest.approx(down, rel=0.05)
    balanced = est(profile, "torchtitan+moe-force-balance")
    assert balanced.step_time_interval_s == est(
        _with(profile, 1.0), "torchtitan+moe-force-balance").step_time_interval_s


def test_fitted_range_is_the_families_fits():
    from autopar.cost_model.moe import FITTED_ROUTER_IMBALANCE_RANGE

    fits = router_imbalance.family_fits(router_imbalance.load_pairs())
    assert FITTED_ROUTER_IMBALANCE_RANGE == pytest.approx(
        (min(fits.values()), max(fits.values())), abs=0.01)
