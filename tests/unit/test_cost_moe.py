"""Expert parallelism in the cost model: sharded experts, all-to-all by link tier, imbalance."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.config import ParallelConfig
from autopar.cost_model.frameworks import framework_cluster, get_framework
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table
from autopar.cost_model.moe import (
    DROPLESS_IMBALANCE,
    GEMMS_PER_LAYER,
    all_to_all_s,
    inter_node_share,
    remote_nodes,
)
from autopar.graph.types import MoEStructure
from tests.unit.test_search_planner import moe_profile

H = 1024
PROFILE = moe_profile(2, H, 8, s=512)
MOE = PROFILE.layers[1].moe
CLUSTER = Cluster.preset("h100", nodes=2)  # 16 GPUs, 8 a node


def _cfg(**kw) -> ParallelConfig:
    base = dict(dp=16, global_batch=32, micro_batch=1, zero=0)
    return ParallelConfig(**{**base, **kw})


def _block(cfg: ParallelConfig, profile=PROFILE, cluster=CLUSTER):
    return build_cost_table(profile, cluster, cfg, "torchtitan").layers[1]


def test_all_to_all_charged_by_link_tier():
    c = CLUSTER
    size = 64 * 2**20
    intra, inter = c.intra_node, c.inter_node
    # 8 ranks in one node: 7/8 of the buffer over NVLink.
    assert all_to_all_s(c, 8, 1, size) == pytest.approx(
        size * 7 / 8 / intra.bandwidth_bytes_per_s + 7 * intra.latency_s)
    # 16 ranks over 2 nodes: half the buffer leaves the node through each GPU's NIC.
    assert all_to_all_s(c, 16, 1, size) == pytest.approx(max(
        size * 7 / 16 / intra.bandwidth_bytes_per_s,
        size * 8 / 16 / inter.bandwidth_bytes_per_s) + 15 * inter.latency_s)
    assert all_to_all_s(c, 16, 1, size) > all_to_all_s(c, 8, 1, size)
    assert all_to_all_s(c, 1, 1, size) == 0.0


def test_ep_shards_routed_expert_state():
    w = 2  # bf16
    dense, sharded = _block(_cfg(ep=1)), _block(_cfg(ep=8))
    off = MOE.routed_params * (1 - 1 / 8)
    # zero 0: fp32 master + 16-bit copy, fp32 grads (+ DDP bucket copy absent: replicate / DDP)
    assert dense.param_bytes - sharded.param_bytes == pytest.approx((4 + w) * off)
    assert dense.optimizer_bytes - sharded.optimizer_bytes == pytest.approx(8 * off)
    # zero 3 shards the routed experts over dp / ep ranks instead: the same share per rank.
    z3, z3_ep = _block(_cfg(ep=1, zero=3)), _block(_cfg(ep=8, zero=3))
    assert z3_ep.optimizer_bytes == pytest.approx(z3.optimizer_bytes)


def test_all_to_all_time_and_imbalance_in_the_layer():
    base, ep = _block(_cfg(ep=1)), _block(_cfg(ep=8))
    size = 512 * MOE.top_k * H * 2  # one micro-batch's dispatched rows, bf16
    # The busiest rank receives (and sends back) DROPLESS_IMBALANCE x its balanced share; the
    # forward first exchanges the split counts and the rows' expert ids (int64).
    one = all_to_all_s(CLUSTER, 8, 1, size * DROPLESS_IMBALANCE)
    meta = all_to_all_s(CLUSTER, 8, 1, 8 * 8) + all_to_all_s(
        CLUSTER, 8, 1, 8 * 512 * MOE.top_k * DROPLESS_IMBALANCE)
    assert ep.ep_comm_s == pytest.approx((4 * one + meta, 4 * one + meta, 6 * one + 2 * meta))
    assert base.ep_comm_s == (0.0, 0.0, 0.0)
    extra_act = (DROPLESS_IMBALANCE - 1) * 512 * MOE.top_k * (2 * H + 4 * MOE.expert_hidden) * 2
    extra_act *= 1 + get_framework("torchtitan").fragmentation_fraction
    assert ep.act_bytes[0] - base.act_bytes[0] == pytest.approx(extra_act, rel=1e-6)
    # A capacity factor pads every expert to its capacity (counted in the profile's FLOPs): no
    # imbalance beyond it; dropless, the busiest rank runs DROPLESS_IMBALANCE x its routed share.
    capped = dataclasses.replace(MOE, capacity_factor=1.25)
    prof = dataclasses.replace(PROFILE, layers=tuple(
        dataclasses.replace(x, moe=capped) if x.moe else x for x in PROFILE.layers))
    balanced = _block(_cfg(ep=8), prof)
    assert balanced.compute_s <= ep.compute_s
    assert balanced.ep_comm_s[0] == pytest.approx(4 * all_to_all_s(CLUSTER, 8, 1, size * 1.25)
                                                  + meta)
    # (big enough micro-batches that the matmuls, not the dispatch floor, set the time)
    big = dict(ep=8, micro_batch=16, global_batch=512)
    assert _block(_cfg(**big), prof).compute_s < _block(_cfg(**big)).compute_s
    assert balanced.act_bytes[0] == pytest.approx(base.act_bytes[0])


def test_looped_experts_pay_their_gemm_calls_and_ep_cuts_them():
    own = get_framework("autopar")  # loops over its local experts, 2 GEMM calls each
    grouped = dataclasses.replace(own, expert_gemm_calls=0)
    device = framework_cluster(CLUSTER, own).device
    call_s = device.matmul_half_flops / GEMMS_PER_LAYER / (
        device.peak_flops("bf16") * device.matmul_efficiency_max)
    assert MOE.experts == 8
    for ep, local in ((1, 8), (2, 4), (8, 1)):
        looped, one_call = (build_cost_table(PROFILE, CLUSTER, _cfg(ep=ep), fw).layers[1]
                            for fw in (own, grouped))
        # forward and backward (a data and a weight gradient GEMM per call): 3x the calls
        assert looped.compute_s - one_call.compute_s == pytest.approx(
            3 * (local - 1) * own.expert_gemm_calls * call_s)
        assert looped.recompute_s[2] - one_call.recompute_s[2] == pytest.approx(
            (local - 1) * own.expert_gemm_calls * call_s)
    dense = build_cost_table(PROFILE, CLUSTER, _cfg(), own).layers[0]
    assert dense == build_cost_table(PROFILE, CLUSTER, _cfg(), grouped).layers[0]


def test_estimate_reports_ep_and_checks_it():
    est = autopar.estimate(PROFILE, CLUSTER, _cfg(ep=8), framework="megatron-lm")
    assert est.time_breakdown.ep_comm_s > 0
    assert "ep_comm_s" in est.time_breakdown.to_dict()
    dense_est = autopar.estimate(PROFILE, CLUSTER, _cfg(ep=1), framework="megatron-lm")
    assert "ep_comm_s" not in dense_est.time_breakdown.to_dict()
    with pytest.raises(ValueError, match="must divide the number of experts"):
        autopar.estimate(PROFILE, CLUSTER, _cfg(ep=16), framework="megatron-lm")
    with pytest.raises(ValueError, match="does not divide dp"):
        autopar.estimate(PROFILE, CLUSTER, _cfg(dp=8, tp=2, ep=16), framework="megatron-lm")
    dense = moe_profile(2, H, 8)
    dense = dataclasses.replace(dense, layers=tuple(
        dataclasses.replace(x, moe=None) for x in dense.layers))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        autopar.estimate(dense, CLUSTER, _cfg(ep=2), framework="megatron-lm")


def test_frameworks_declare_ep():
    from autopar.cost_model.frameworks import framework_supports, get_framework

    cfg = _cfg(ep=2)
    for name in ("torchtitan", "megatron-lm", "deepspeed"):
        sharded = dataclasses.replace(cfg, zero=1)
        assert framework_supports(get_framework(name), sharded) is None
        assert get_framework(name).sources["expert_parallel"].startswith("sourced:")
    # torchtitan takes ep from its sharded data-parallel dimension only.
    assert "zero >= 1" in framework_supports(get_framework("torchtitan"), cfg)
    autopar = get_framework("autopar")
    assert framework_supports(autopar, cfg) is None
    assert framework_supports(autopar, dataclasses.replace(cfg, zero=3)) is None
    # Every tp rank holds its ep rank's experts whole (runtime/expert_parallel.py ep_groups).
    assert framework_supports(autopar, dataclasses.replace(cfg, dp=8, tp=2)) is None


def test_routed_flops_closed_form():
    moe = MoEStructure(experts=8, top_k=2, hidden=64, expert_hidden=32, expert_params=3 * 64 * 32)
    assert moe.routed_fwd_flops(10) == 2 * 10 * 2 * 3 * 64 * 32
    assert moe.routed_params == 8 * 3 * 64 * 32


def test_experts_whole_on_every_tp_rank_without_expert_tensor_parallelism():
    """autopar's runtime shards linears only: at tp = 2 each rank holds and runs all routed
    experts (tests/distributed/test_runtime_moe.py), where Megatron-LM and torchtitan shard
    them; the repeated work is hardware FLOPs, not model FLOPs; no sequence parallelism."""
    from autopar.search import SearchOptions
    from autopar.search.planner import _candidates

    cfg = _cfg(dp=8, tp=2)
    fw = get_framework("autopar")
    assert not fw.expert_tensor_parallel and get_framework("megatron-lm").expert_tensor_parallel
    whole = build_cost_table(PROFILE, CLUSTER, cfg, fw).layers[1]
    split = build_cost_table(PROFILE, CLUSTER, cfg, dataclasses.replace(
        fw, expert_tensor_parallel=True)).layers[1]
    assert whole.model_flops_per_sample == pytest.approx(split.model_flops_per_sample)
    routed_fwd = MOE.routed_fwd_flops(512)  # per sample; tp - 1 = 1 more copy, fwd + bwd
    for mode in range(3):
        assert whole.recompute_flops_per_sample[mode] - split.recompute_flops_per_sample[
            mode] == pytest.approx(3 * routed_fwd + (routed_fwd if mode == 2 else 0.0))
    # zero 0: fp32 master + bf16 copy of the half of the routed experts tp no longer shards
    assert whole.param_bytes - split.param_bytes == pytest.approx(6 * MOE.routed_params / 2)
    assert whole.compute_s > split.compute_s
    sp = dataclasses.replace(cfg, sequence_parallel=True)
    # This profile names no module holding the router and the experts to gather into.
    with pytest.raises(ValueError, match="no one module of this model holds both"):
        autopar.estimate(PROFILE, CLUSTER, sp, framework="autopar")
    assert autopar.estimate(PROFILE, CLUSTER, sp, framework="torchtitan").step_time_s > 0
    opts = SearchOptions(max_virtual_stages=2, framework="autopar")
    cands = _candidates(PROFILE, Cluster.preset("h100", nodes=1, gpus_per_node=4), 8, opts)
    assert any(c.tp > 1 for c in cands)
    assert not any(c.sequence_parallel for c in cands)


def test_nemo_recommended_mixtral_split_fits_on_80gb_under_megatron() -> None:
    """Mixtral 8x7B as NeMo's performance recipe runs it on 64 H100 80GB (NeMo
    scripts/performance/recommended_model_configs/model_configs_h100.csv: seq 4096, TP 1 PP 4
    EP 8 VP 8, micro-batch 1, global batch 256, no recompute, no activation offload; the
    Megatron-Core MoE README names TP1 EP8 PP4 its training split): it fits under megatron-lm.
    With Megatron's own layout (one block a stage, the embedding with the first, the head with
    the last), the pipeline's first rank, which holds the most micro-batches, is the one that
    binds; the last holds its head chunk's activations for one micro-batch at a time."""
    from autopar.cost_model.assemble import assemble

    profile = autopar.profile(autopar.models.build("mixtral-8x7b"))
    cluster = autopar.Cluster.preset("h100", nodes=8)
    cfg = ParallelConfig(dp=16, pp=4, ep=8, zero=1, micro_batch=1, global_batch=256,
                         schedule="interleaved-1f1b", virtual_stages=8)
    est = autopar.estimate(profile, cluster, cfg, framework="megatron-lm")
    assert est.fits, est.memory_per_gpu_bytes / 2**30
    table = build_cost_table(profile, cluster, cfg, "megatron-lm")
    split = ((0, 1), *((j, j) for j in range(2, 32)), (32, 33))
    even = assemble(table, split, ("none",) * profile.num_layers)
    per_rank = [s.memory_bytes for s in even.stages]
    assert per_rank[0] == max(per_rank) and even.fits


@settings(max_examples=40, deadline=None)
@given(nodes=st.sampled_from([1, 2, 4]), per_node=st.integers(1, 3), top_k=st.integers(1, 4))
def test_remote_nodes_equals_the_enumerated_mean(nodes, per_node, top_k):
    """The hierarchical dispatch's remote nodes per token: the mean, over every set of k distinct
    experts, of the other nodes (not node 0) holding one of them."""
    experts = nodes * per_node
    if top_k > experts:
        return
    sets = list(itertools.combinations(range(experts), top_k))
    mean = sum(len({e // per_node for e in s} - {0}) for s in sets) / len(sets)
    assert remote_nodes(experts, top_k, nodes) == pytest.approx(mean)
    share = inter_node_share(experts, top_k, nodes)
    assert 0.0 < share <= 1.0
    if nodes == 1 or top_k == 1:  # one row a token already crosses once
        assert share == pytest.approx(1.0)


def test_hierarchical_dispatch_and_forced_balance_in_the_layer():
    """``ep-deepep`` sends each token once to each other node its experts are on (share r /
    (k (n - 1) / n) of the inter-node rows) and forwards over NVLink; ``moe-force-balance``
    drops the dropless imbalance. Settings of torchtitan and Megatron-LM both."""
    size = 512 * MOE.top_k * H * 2
    for name in ("torchtitan", "megatron-lm"):
        fw = get_framework(name)
        both = fw.with_settings(("ep-deepep", "moe-force-balance"))
        assert both.ep_dispatch == "hierarchical" and both.moe_force_balance
        plain, fast = (build_cost_table(PROFILE, CLUSTER, _cfg(ep=16), f).layers[1]
                       for f in (fw, both))
        assert fast.ep_comm_s[0] < plain.ep_comm_s[0]
        assert fast.compute_s < plain.compute_s  # the busiest rank's extra rows are gone
        assert fast.act_bytes[0] < plain.act_bytes[0]
        dense = [build_cost_table(PROFILE, CLUSTER, _cfg(ep=1), f).layers[1] for f in (fw, both)]
        assert dense[0] == dense[1]
    # ep 16 over 2 nodes of 8, 8 experts (4 a node), top-2
    share = inter_node_share(8, MOE.top_k, 2)
    assert share == pytest.approx((1 - 6 / 28) / (2 * 1 / 2))
    one = all_to_all_s(CLUSTER, 16, 1, size, share)
    intra = size * (7 + 8 * 7 / 8) / 16 / CLUSTER.intra_node.bandwidth_bytes_per_s
    inter = size * 8 / 16 * share / CLUSTER.inter_node.bandwidth_bytes_per_s
    assert one == pytest.approx(max(intra, inter) + 15 * CLUSTER.inter_node.latency_s)
    assert one < all_to_all_s(CLUSTER, 16, 1, size)


def test_published_moe_runs_name_what_autopar_expresses():
    """The published MoE records (benchmarks/moe_published.py) are data: sourced, and every
    framework setting they state is one the framework has; every one ran a force-balanced
    router (a dropless one's imbalance is a model input no record states); fp8-tensorwise is
    Megatron-LM's current scaling, costed as torchao's dynamic scaling."""
    import json
    from pathlib import Path

    runs = [r for r in json.loads((Path(__file__).parents[2] / "benchmarks" / "data"
                                   / "published_runs.json").read_text())
            if (r["plan"].get("ep") or 1) > 1]
    assert runs
    for rec in runs:
        measured = rec["measured"]
        assert rec["source"] and (measured.get("tokens_per_s_per_gpu") or 0) + (
            measured.get("tflops_per_gpu") or 0) > 0
        fw = get_framework(rec["framework"]).with_settings(tuple(rec["framework_settings"]))
        p = rec["plan"]
        assert p["dp"] * p["tp"] * p["pp"] * p["cp"] == rec["cluster"]["n_gpus"]
        assert fw.moe_force_balance
    assert get_framework("megatron-lm").fp8_scaling == "delayed"
    assert get_framework("megatron-lm+fp8-tensorwise").fp8_scaling == "dynamic"
