"""Mixture-of-experts blocks under sequence parallelism as autopar's runtime runs them: the MoE
module gathers the whole sequence (runtime/tp_styles.py GatherSequence), so its tp calls, the
inputs kept whole, and ep's all-to-all sizes differ from the rest of the block's
(``collectives.block_tp_calls``, framework_support ``moe_tp_mode``); the runtime's
collective table and the cost model's charged calls agree; the search offers SP for such
models."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest

import autopar
from autopar.config import ParallelConfig
from autopar.cost_model.collectives import block_tp_calls, expected_collectives
from autopar.cost_model.framework_support import moe_tp_mode
from autopar.cost_model.frameworks import get_framework
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import charged_collectives
from autopar.cost_model.moe import ep_collectives
from autopar.cost_model.tp_comm import sp_gathered_inputs
from autopar.graph.types import LayerProfile, ModelProfile

SHAPE = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 256, "seq_len": 32,
         "experts": 4, "top_k": 2}
AG, RS, AR = "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"


def _profile(shared: int) -> ModelProfile:
    model = autopar.models.build("llama", device="meta", shared_experts=shared, **SHAPE)
    return autopar.profile(model, seq_len=SHAPE["seq_len"])


WITH_SHARED, ROUTED_ONLY = _profile(1), _profile(0)


def _block(profile: ModelProfile) -> LayerProfile:
    return profile.layers[1]


def test_the_profile_names_the_module_holding_router_and_experts() -> None:
    moe = _block(WITH_SHARED).moe
    assert moe is not None and moe.module == "moe"
    assert moe.holds("layers.0.moe.shared_experts.w1")
    assert not moe.holds("layers.0.attention.wq") and not moe.holds("moe.w1")
    again = ModelProfile.from_dict(json.loads(WITH_SHARED.to_json()))
    assert again.layers[1].moe == moe
    assert "module" not in dataclasses.replace(moe, module="").to_dict()


def test_gathering_moe_calls_by_rule() -> None:
    # Routed experts only: the attention's all-gather and reduce-scatter, plus the MoE's
    # all-gather in each of forward and backward; a full recompute re-runs all three forward.
    fwd, bwd, rerun = block_tp_calls(_block(ROUTED_ONLY), sp=True, first_block=False,
                                     moe_tp="gather")
    assert (fwd, bwd, rerun) == (Counter({AG: 2, RS: 1}), Counter({RS: 1, AG: 2}),
                                 Counter({AG: 2, RS: 1}))
    # Shared experts inside the MoE module: split as without SP (all-reduces), the last one
    # (their output, which nothing saves) not re-run.
    fwd, bwd, rerun = block_tp_calls(_block(WITH_SHARED), sp=True, first_block=True,
                                     moe_tp="gather")
    assert (fwd, bwd, rerun) == (Counter({AG: 2, RS: 1, AR: 1}),
                                 Counter({RS: 1, AG: 3, AR: 1}), Counter({AG: 2, RS: 1}))
    # A framework that splits its experts over tp: the shared experts as a second MLP.
    fwd, bwd, _ = block_tp_calls(_block(WITH_SHARED), sp=True, first_block=False,
                                 moe_tp="linears")
    assert (fwd, bwd) == (Counter({AG: 2, RS: 2}), Counter({RS: 2, AG: 2}))


def test_inputs_kept_whole_include_the_moe_input() -> None:
    assert sp_gathered_inputs(_block(ROUTED_ONLY), "gather") == 2  # attention, MoE
    assert sp_gathered_inputs(_block(ROUTED_ONLY)) == 1
    # The shared experts' gathered input is the MoE's.
    assert sp_gathered_inputs(_block(WITH_SHARED), "gather") == 2


@pytest.mark.parametrize("profile", [WITH_SHARED, ROUTED_ONLY], ids=["shared", "routed"])
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("ep", [1, 2])
def test_runtime_table_equals_charged_calls(profile: ModelProfile, recompute: str,
                                            ep: int) -> None:
    cfg = ParallelConfig(dp=2, tp=2, ep=ep, zero=1, global_batch=4, micro_batch=1,
                         sequence_parallel=True, recompute=recompute)
    assert expected_collectives(profile, cfg) == charged_collectives(profile, cfg)


def test_all_to_alls_carry_the_whole_sequence() -> None:
    layer = _block(ROUTED_ONLY)
    cfg = ParallelConfig(dp=2, tp=2, ep=2, global_batch=4, sequence_parallel=True)
    whole = ep_collectives(layer, cfg, seq_len=32, whole_sequence=True)[0]
    shard = ep_collectives(layer, cfg, seq_len=32)[0]
    assert [c.size_bytes for c in whole][1:] == [2 * c.size_bytes for c in shard][1:]
    assert moe_tp_mode(get_framework("autopar"), cfg) == "gather"
    assert moe_tp_mode(get_framework("torchtitan"), cfg) == "linears"  # ep on


def test_autopar_plans_sequence_parallel_for_moe_models() -> None:
    from autopar.search import SearchOptions
    from autopar.search.planner import _candidates

    cluster = Cluster.preset("h100", nodes=1, gpus_per_node=4)
    opts = SearchOptions(max_virtual_stages=2, framework="autopar")
    cands = _candidates(ROUTED_ONLY, cluster, 8, opts)
    assert any(c.tp > 1 and c.sequence_parallel for c in cands)
    cfg = ParallelConfig(dp=2, tp=2, global_batch=8, sequence_parallel=True)
    sp = autopar.estimate(ROUTED_ONLY, cluster, cfg, framework="autopar")
    no_sp = autopar.estimate(ROUTED_ONLY, cluster, dataclasses.replace(
        cfg, sequence_parallel=False), framework="autopar")
    assert (sp.memory_breakdown.activations_bytes
            < no_sp.memory_breakdown.activations_bytes)


@pytest.mark.parametrize("profile", [WITH_SHARED, ROUTED_ONLY], ids=["shared", "routed"])
def test_torchtitan_reduces_the_moe_once_at_its_boundary(profile: ModelProfile) -> None:
    """torchtitan with ep off (MOE_SHARDING.md): routed experts TP-sharded, the MoE input
    gathered and its output (shared experts' included) reduced once: an MLP's calls per MoE
    block, none of the shared experts' own; charged in its step time."""
    for sp, calls in ((True, (Counter({AG: 2, RS: 2}), Counter({RS: 2, AG: 2}))),
                      (False, (Counter({AR: 2}), Counter({AR: 2})))):
        fwd, bwd, _ = block_tp_calls(_block(profile), sp=sp, first_block=False,
                                     moe_tp="boundary")
        assert (+fwd, +bwd) == calls
    titan = get_framework("torchtitan")
    cfg = ParallelConfig(dp=2, tp=2, global_batch=8, sequence_parallel=True)
    assert moe_tp_mode(titan, cfg) == "boundary"
    assert moe_tp_mode(titan, dataclasses.replace(cfg, ep=2)) == "linears"
    cluster = Cluster.preset("h100", nodes=1, gpus_per_node=4)
    boundary = autopar.estimate(profile, cluster, cfg, framework="torchtitan")
    linears = autopar.estimate(profile, cluster, cfg, framework=dataclasses.replace(
        titan, moe_tp="linears"))
    if profile is ROUTED_ONLY:  # the routed experts' pair was missing
        assert boundary.time_breakdown.tp_comm_s > linears.time_breakdown.tp_comm_s
    else:  # one pair for the whole MoE module, where the shared experts had one
        assert boundary.time_breakdown.tp_comm_s == pytest.approx(
            linears.time_breakdown.tp_comm_s)


def test_megatron_gathers_the_routed_rows_over_tp() -> None:
    """Megatron-Core's alltoall dispatcher all-gathers the dispatched rows over (expert) tp
    before the experts and reduce-scatters them after (token_dispatcher.py): k rows a token,
    each [h], forward and backward; its MoE layer wants sequence parallelism under tp."""
    megatron = get_framework("megatron-lm")
    cluster = Cluster.preset("h100", nodes=1, gpus_per_node=4)
    cfg = ParallelConfig(dp=2, tp=2, global_batch=8, sequence_parallel=True)
    rows = autopar.estimate(ROUTED_ONLY, cluster, cfg, framework="megatron-lm")
    linears = autopar.estimate(ROUTED_ONLY, cluster, cfg, framework=dataclasses.replace(
        megatron, moe_tp="linears"))
    assert rows.time_breakdown.tp_comm_s > linears.time_breakdown.tp_comm_s
    # The gathered rows (k = 2 of [h] a token, bf16) are kept whole for the experts' backward.
    kept = (rows.memory_breakdown.activations_bytes
            - linears.memory_breakdown.activations_bytes)
    b, s, h = cfg.micro_batch, ROUTED_ONLY.seq_len, ROUTED_ONLY.hidden
    layers = sum(1 for layer in ROUTED_ONLY.layers if layer.moe is not None)
    # pp 1: one micro-batch's activations; the allocator's fragmentation share on top.
    assert kept >= layers * b * s * 2 * h * 2 * (1 - 1 / 2)
    with pytest.raises(ValueError, match="only with sequence parallelism"):
        autopar.estimate(ROUTED_ONLY, cluster, dataclasses.replace(
            cfg, sequence_parallel=False), framework="megatron-lm")


@pytest.mark.parametrize("framework", ["autopar", "deepspeed"])
def test_experts_whole_on_every_tp_rank_keep_their_activations_once(framework: str) -> None:
    """A framework running every routed expert whole on each tp rank (no sequence
    parallelism: each rank sees the whole sequence) keeps the routed activations of tp = 1 on
    every rank, and the attention's share falls by tp: a block's activations do not rise with
    tp. The zoo's profile records the routed activations as replicated (its experts are outside
    the tensor-parallel structure); a profile whose per-expert linears are column-parallel
    records their 4 f_e elements a row as sharded, and those come back whole."""
    from autopar.cost_model.layer_costs import build_cost_table

    cluster = Cluster.preset("a100-80g", nodes=1)
    moe = _block(ROUTED_ONLY).moe
    routed = SHAPE["seq_len"] * moe.routed_rows_per_token() * moe.routed_saved_bytes_per_row(2)
    fe_part = SHAPE["seq_len"] * moe.routed_rows_per_token() * 4 * moe.expert_hidden * 2
    block = _block(ROUTED_ONLY)
    linears = dataclasses.replace(block, tp=dataclasses.replace(block.tp, colwise=(
        *block.tp.colwise, "layers.0.moe.experts.0.w1")), saved_bytes_replicated={
        m: b - (0 if m == "full" else fe_part) for m, b in block.saved_bytes_replicated.items()})
    per_expert = dataclasses.replace(ROUTED_ONLY, layers=(
        ROUTED_ONLY.layers[0], linears, *ROUTED_ONLY.layers[2:]))
    for profile in (ROUTED_ONLY, per_expert):
        act = {}
        for tp in (1, 2, 4):  # two micro-batches at every tp
            cfg = ParallelConfig(dp=8 // tp, tp=tp, global_batch=2 * (8 // tp), zero=1)
            act[tp] = build_cost_table(profile, cluster, cfg, framework).layers[1].act_bytes[0]
        assert act[4] <= act[2] <= act[1]
        assert act[4] >= routed
