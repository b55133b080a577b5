"""The planner end to end on synthetic GPT-like profiles: decisions, agreement, determinism."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.config import RECOMPUTE, ParallelConfig
from autopar.cost_model.framework_support import split_recompute_refusal
from autopar.cost_model.hardware import Cluster, LinkSpec
from autopar.errors import InfeasiblePlanError
from autopar.graph.types import LayerProfile, ModelProfile, MoEStructure, TPStructure
from autopar.search import SearchOptions, plan, plan_from_config
from autopar.search.planner import _candidates


def _block(i: int, h: int, s: int, heads: int, kv: int) -> LayerProfile:
    """One transformer block per sample, bf16 (Korthikanti et al. 2022 activation counts)."""
    p = f"layers.{i}"
    fwd = 24 * s * h * h + 4 * s * s * h
    return LayerProfile(
        name=p, kind="block", module_fqns=(p,), num_params=12 * h * h,
        param_bytes=24 * h * h, fwd_flops=fwd, bwd_flops=2 * fwd,
        recompute_flops={"none": 0.0, "selective": 4.0 * s * s * h, "full": float(fwd)},
        saved_bytes={"none": 34 * s * h, "selective": 30 * s * h, "full": 2 * s * h},
        saved_bytes_replicated={"none": 10 * s * h, "selective": 10 * s * h, "full": 2 * s * h},
        output_bytes=2 * s * h,
        tp=TPStructure(
            colwise=(*(f"{p}.attention.{w}" for w in ("wq", "wk", "wv")), f"{p}.feed_forward.w1"),
            rowwise=(f"{p}.attention.wo", f"{p}.feed_forward.w2"),
            sequence=(f"{p}.attention_norm", f"{p}.ffn_norm"),
            heads=heads, kv_heads=kv, allreduce_fwd_bytes=4 * s * h,
        ),
    )  # fmt: skip


def gpt_profile(layers: int, h: int, heads: int, *, s: int = 512, vocab: int = 1024,
                kv: int | None = None) -> ModelProfile:  # fmt: skip
    """A GPT-like profile (embedding, blocks, head) built from formulas, no tracing."""
    kv = kv or heads
    emb = LayerProfile(
        name="embedding", kind="embedding", module_fqns=("tok_embeddings",),
        num_params=vocab * h, param_bytes=2 * vocab * h, fwd_flops=0.0, bwd_flops=0.0,
        recompute_flops={"none": 0.0, "selective": 0.0, "full": 0.0},
        saved_bytes={"none": 0, "selective": 0, "full": 0},
        saved_bytes_replicated={"none": 0, "selective": 0, "full": 0},
        output_bytes=2 * s * h, tp=TPStructure(vocab_parallel=("tok_embeddings",)),
    )  # fmt: skip
    head = LayerProfile(
        name="head", kind="head", module_fqns=("norm", "output"), num_params=vocab * h,
        param_bytes=2 * vocab * h, fwd_flops=2.0 * s * h * vocab, bwd_flops=4.0 * s * h * vocab,
        recompute_flops={"none": 0.0, "selective": 0.0, "full": 2.0 * s * h * vocab},
        saved_bytes={"none": 2 * s * h + 4 * s * vocab, "selective": 2 * s * h + 4 * s * vocab,
                     "full": 2 * s * h},
        saved_bytes_replicated={"none": 2 * s * h, "selective": 2 * s * h, "full": 2 * s * h},
        output_bytes=4 * s, tp=TPStructure(vocab_parallel=("output",), sequence=("norm",)),
    )  # fmt: skip
    blocks = tuple(_block(i, h, s, heads, kv) for i in range(layers))
    return ModelProfile(
        name=f"gpt-{layers}x{h}", layers=(emb, *blocks, head), seq_len=s, dtype="bf16",
        hidden=h, heads=heads, kv_heads=kv, ffn_hidden=4 * h, vocab=vocab, num_blocks=layers,
    )  # fmt: skip


TINY = gpt_profile(2, 64, 4, s=128, vocab=256)
OPTS = SearchOptions(max_virtual_stages=2)


def test_tiny_model_on_few_gpus_gets_pure_dp() -> None:
    best = plan(TINY, Cluster.preset("a100-80g", nodes=1, gpus_per_node=4), global_batch=256)
    assert (best.config.dp, best.config.tp, best.config.pp) == (4, 1, 1)
    assert best.estimate.fits and best.tp_layout == {}


def test_model_too_large_for_pure_dp_gets_pp_tp_or_zero() -> None:
    big = gpt_profile(40, 5120, 40, s=2048, vocab=32000)  # ~13B parameters
    cluster = Cluster.preset("a100-80g", nodes=1)
    pure_dp = ParallelConfig(dp=8, micro_batch=1, global_batch=64)
    assert not autopar.estimate(big, cluster, pure_dp).fits
    best = plan(big, cluster, global_batch=64, options=OPTS)
    cfg = best.config
    assert best.estimate.fits and (cfg.tp > 1 or cfg.pp > 1 or cfg.zero > 0)


def test_slow_inter_node_link_keeps_tp_inside_nodes() -> None:
    model = gpt_profile(8, 4096, 32, s=1024, vocab=32000)
    fast = Cluster.preset("h100", nodes=2)
    slow = dataclasses.replace(fast, inter_node=LinkSpec(bandwidth_bytes_per_s=1e9, latency_s=5e-5))
    opts = dataclasses.replace(OPTS, allow_tp_across_nodes=True, zero_stages=(0, 1))
    best = plan(model, slow, global_batch=64, options=opts)
    assert best.config.tp <= slow.gpus_per_node
    # tp spanning both nodes is much slower on the slow link (its collectives cross nodes).
    across = ParallelConfig(tp=16, global_batch=64, sequence_parallel=True, recompute="full")
    assert autopar.estimate(model, slow, across).step_time_s > 2 * best.estimate.step_time_s


# Memory so tight that the planner must pipeline and recompute some layers only.
TIGHT_OPTS = dataclasses.replace(OPTS, micro_batch_sizes=(8,), zero_stages=(0,), max_tp=1)


def _tight_case():
    model = gpt_profile(6, 2048, 16, s=2048, vocab=8000)
    return model, Cluster.preset("a100-80g", nodes=1, gpus_per_node=2, gpu_memory_gb=11)


def test_plan_estimate_equals_estimate_of_plan_with_mixed_recompute() -> None:
    model, cluster = _tight_case()
    plans = plan(model, cluster, global_batch=32, top_k=3, options=TIGHT_OPTS)
    for p in plans:
        assert autopar.estimate(model, cluster, p).to_dict() == p.estimate.to_dict()
        assert p.estimate.fits
    sizes = {tuple(s.layers[1] - s.layers[0] for s in p.stages) for p in plans}
    assert any(len(set(sz)) > 1 for sz in sizes), "expected non-uniform stages"
    assert any(len(set(p.recompute_per_layer) - {"none"}) and "none" in p.recompute_per_layer
               for p in plans), "expected per-layer recompute"  # fmt: skip


def test_top_k_distinct_sorted_and_deterministic(capfd) -> None:
    model, cluster = _tight_case()
    first = plan(model, cluster, global_batch=32, top_k=3, options=TIGHT_OPTS)
    again = plan(model, cluster, global_batch=32, top_k=3, options=TIGHT_OPTS)
    out, _ = capfd.readouterr()
    assert out == ""  # HiGHS's banner never reaches stdout
    assert [p.to_json() for p in first] == [p.to_json() for p in again]
    assert len({p.config for p in first}) == 3
    steps = [p.estimate.step_time_s for p in first]
    assert steps == sorted(steps)
    doc = json.loads(first[0].to_json())
    assert doc["search"]["candidates_considered"] >= doc["search"]["candidates_pruned"]
    assert type(first[0]).from_json(first[0].to_json()) == first[0]


def test_plan_records_layout_and_fingerprints() -> None:
    model = gpt_profile(4, 1024, 8, s=1024, vocab=32000)
    cluster = Cluster.preset("a100-40g", nodes=1)
    cfg = ParallelConfig(dp=2, tp=4, micro_batch=1, global_batch=8, sequence_parallel=True)
    p = plan_from_config(model, cluster, cfg, model="gpt:test")
    assert p.estimate.to_dict() == autopar.estimate(model, cluster, cfg).to_dict()
    assert p.profile_fingerprint == model.fingerprint()
    assert p.cluster_fingerprint == cluster.fingerprint() and p.cluster == cluster.to_dict()
    assert p.model == "gpt:test"
    assert p.tp_layout["layers.*.attention.wq"] == "colwise"
    assert p.tp_layout["layers.*.feed_forward.w2"] == "rowwise"
    assert p.tp_layout["layers.*.ffn_norm"] == "sequence"
    assert p.tp_layout["tok_embeddings"] == "rowwise" and p.tp_layout["output"] == "colwise"


def test_infeasible_names_memory_and_closest_split() -> None:
    big = gpt_profile(8, 8192, 64, s=2048, vocab=32000)
    # 6 GB fit since one data rank offloads (dp=1 tp=2, the parameters on the host) and the
    # FSDP2 root's head is not counted twice
    cluster = Cluster.preset("a100-80g", nodes=1, gpus_per_node=2, gpu_memory_gb=5)
    with pytest.raises(InfeasiblePlanError) as info:
        plan(big, cluster, global_batch=8, options=OPTS)
    err = info.value
    assert "\n" not in str(err) and "GiB" in str(err)
    assert err.min_memory_bytes > cluster.usable_memory_bytes
    assert "dp=" in err.closest and err.closest in str(err)


def test_infeasible_closest_split_fits_the_host() -> None:
    """Offloading fits any GPU; where it overflows the host it is not the closest split."""
    big = gpt_profile(8, 8192, 64, s=256, vocab=32000)
    roomy = Cluster.preset("a100-80g", nodes=1, gpus_per_node=2, gpu_memory_gb=16)
    assert "offload" in plan(big, roomy, global_batch=8, options=OPTS).config.describe()
    tight = dataclasses.replace(roomy, host_memory_bytes_per_gpu=16 * 2**30)
    with pytest.raises(InfeasiblePlanError) as info:
        plan(big, tight, global_batch=8, options=OPTS)
    err = info.value
    assert err.min_memory_bytes > tight.usable_memory_bytes
    assert "offload" not in err.closest and err.closest in str(err)


def test_closest_split_skips_offloads_that_overflow_the_host_whatever_the_split(
        monkeypatch) -> None:
    """The same closest split as solving every candidate, with fewer memory ILPs: an offload
    variant whose host share overflows under any split is solved only while it could still be
    the closest host overflow."""
    from autopar.search import infeasible

    big = gpt_profile(8, 8192, 64, s=256, vocab=32000)
    tight = dataclasses.replace(Cluster.preset("a100-80g", nodes=1, gpus_per_node=2,
                                               gpu_memory_gb=16),
                                host_memory_bytes_per_gpu=16 * 2**30)
    solves = []
    real = infeasible.solve_ilp
    monkeypatch.setattr(infeasible, "solve_ilp", lambda *a: solves.append(1) or real(*a))

    def closest(skip: bool) -> tuple[float, str, int]:
        solves.clear()
        with monkeypatch.context() as m:
            if not skip:
                m.setattr(infeasible, "_overflows_host", lambda table: False)
            with pytest.raises(InfeasiblePlanError) as info:
                plan(big, tight, global_batch=8, options=OPTS)
        return info.value.min_memory_bytes, info.value.closest, len(solves)

    mem, desc, fewer = closest(True)
    mem_all, desc_all, every = closest(False)
    assert (mem, desc) == (mem_all, desc_all) and fewer < every


def test_progress_and_time_budget() -> None:
    calls = []
    cluster = Cluster.preset("a100-80g", nodes=1, gpus_per_node=4)
    best = plan(TINY, cluster, global_batch=64, progress=lambda *a: calls.append(a))
    assert calls[-1][0] == calls[-1][1] == len(_candidates(TINY, cluster, 64, SearchOptions()))
    assert not best.search.time_limit_hit and best.search.optimal
    with pytest.raises(InfeasiblePlanError, match="time budget"):
        plan(TINY, cluster, global_batch=64, time_budget_s=1e-9)


def test_bad_arguments() -> None:
    cluster = Cluster.preset("a100-80g", nodes=1, gpus_per_node=4)
    with pytest.raises(ValueError, match="top_k"):
        plan(TINY, cluster, global_batch=64, top_k=0)
    with pytest.raises(ValueError, match="seq_len"):
        plan(TINY, cluster, global_batch=64, seq_len=999)
    with pytest.raises(ValueError, match="global_batch 3"):
        plan(gpt_profile(1, 64, 4, s=128, vocab=256), cluster, global_batch=3,
             options=SearchOptions(max_tp=1))  # fmt: skip


@settings(max_examples=20, deadline=None)
@given(
    layers=st.integers(1, 4),
    h=st.sampled_from([256, 1024, 2048]),
    gpus=st.sampled_from([1, 2, 4]),
    batch=st.sampled_from([4, 8]),
    mem_gb=st.sampled_from([4, 16, 80]),
)
def test_planner_never_worse_than_uniform_partitions(layers, h, gpus, batch, mem_gb) -> None:
    model = gpt_profile(layers, h, 8, s=512, vocab=4096)
    cluster = Cluster.preset("h100", nodes=1, gpus_per_node=gpus, gpu_memory_gb=mem_gb)
    opts = SearchOptions(max_virtual_stages=2, zero_stages=(0, 3))
    uniform = []
    for cfg in _candidates(model, cluster, batch, opts):
        for r in RECOMPUTE:
            if split_recompute_refusal(cfg, (r,)):
                continue  # a mode under a split backward: refused (estimate raises)
            est = autopar.estimate(model, cluster, dataclasses.replace(cfg, recompute=r))
            if est.fits:
                uniform.append(est.step_time_s)
    if not uniform:
        return  # (a model nothing fits is covered by the InfeasiblePlanError test)
    best = plan(model, cluster, global_batch=batch, options=opts)
    assert best.estimate.step_time_s <= min(uniform) * (1 + 1e-3)


def test_warm_bound_solves_single_stage_candidates_exactly() -> None:
    """Under a tight memory cap the single-stage optimum mixes recompute modes; the warm bound
    takes it (below every balanced-uniform split) and hands the proven outcome to the search."""
    from autopar.search.planner import _bounded
    from autopar.search.solve import best_uniform, warm_bound

    model = gpt_profile(6, 2048, 16, s=2048, vocab=8000)
    cluster = Cluster.preset("a100-80g", nodes=1, gpus_per_node=1, gpu_memory_gb=10)
    cands = _bounded(model, cluster, _candidates(model, cluster, 32, TIGHT_OPTS), TIGHT_OPTS,
                     None, None)  # fmt: skip
    order = sorted(cands, key=lambda c: (c.time_lb_s, c.index))
    warm, seeded, ilps = warm_bound(order, 1, TIGHT_OPTS)
    uniform = min(o.step_s for o in map(best_uniform, (c.table for c in order)) if o)
    assert ilps == 1 and len(seeded) == 1
    (outcome,) = seeded.values()
    assert outcome.optimal and len(set(outcome.recompute)) > 1
    assert warm < uniform * (1 - 1e-3)
    best = plan(model, cluster, global_batch=32, options=TIGHT_OPTS)
    assert best.estimate.step_time_s <= warm and best.search.optimal
    assert best.recompute_per_layer == outcome.recompute


def moe_profile(layers: int, h: int, experts: int, *, s: int = 512) -> ModelProfile:
    """``gpt_profile`` whose blocks' MLPs are mixtures of ``experts`` experts of width 4h, top-2
    (the routed experts' parameters and the second expert's FLOPs added)."""
    dense = gpt_profile(layers, h, 8, s=s, vocab=4096)
    moe = MoEStructure(experts=experts, top_k=2, hidden=h, expert_hidden=4 * h,
                       expert_params=8 * h * h)
    out = []
    for layer in dense.layers:
        if layer.kind == "block":
            extra = moe.routed_params - moe.expert_params
            layer = dataclasses.replace(
                layer, moe=moe, num_params=layer.num_params + extra,
                param_bytes=layer.param_bytes + 2 * extra,
                fwd_flops=layer.fwd_flops + 16.0 * s * h * h,
                bwd_flops=layer.bwd_flops + 32.0 * s * h * h)
        out.append(layer)
    return dataclasses.replace(dense, layers=tuple(out))


@settings(max_examples=8, deadline=None)
@given(
    layers=st.integers(1, 3),
    h=st.sampled_from([256, 1024]),
    gpus=st.sampled_from([2, 4]),
    mem_gb=st.sampled_from([4, 80]),
)
def test_planner_with_ep_never_worse_than_uniform_partitions(layers, h, gpus, mem_gb) -> None:
    model = moe_profile(layers, h, 4)
    cluster = Cluster.preset("h100", nodes=1, gpus_per_node=gpus, gpu_memory_gb=mem_gb)
    opts = SearchOptions(max_virtual_stages=2, zero_stages=(0, 3), framework="torchtitan")
    cands = _candidates(model, cluster, 8, opts)
    assert {c.ep for c in cands} > {1}  # ep is in the space for a MoE model
    uniform = []
    for cfg in cands:
        for r in RECOMPUTE:
            if split_recompute_refusal(cfg, (r,)):
                continue  # a mode under a split backward: refused (estimate raises)
            cfg_r = dataclasses.replace(cfg, recompute=r)
            est = autopar.estimate(model, cluster, cfg_r, framework="torchtitan")
            if est.fits:
                uniform.append(est.step_time_s)
    if not uniform:
        return
    best = plan(model, cluster, global_batch=8, options=opts)
    assert best.estimate.step_time_s <= min(uniform) * (1 + 1e-3)


def test_ep_only_for_moe_models() -> None:
    cluster = Cluster.preset("h100", nodes=1, gpus_per_node=4)
    opts = SearchOptions(framework="torchtitan")
    assert {c.ep for c in _candidates(TINY, cluster, 8, opts)} == {1}
    cands = _candidates(moe_profile(2, 256, 2), cluster, 8, opts)
    assert {c.ep for c in cands} == {1, 2}
    assert all((c.dp % c.ep) == 0 for c in cands)


def test_fused_qkv_is_not_offered_under_fsdp_and_tp() -> None:
    """autopar's runtime refuses FSDP over a fused q/k/v tp split (a strided shard): the search
    drops it and estimate refuses it, for that framework only (framework_support.model_support);
    Megatron-LM runs its own attention module and keeps the splits."""
    layers = tuple(
        dataclasses.replace(layer, tp=dataclasses.replace(layer.tp, fused_qkv=layer.tp.colwise[:1]))
        if layer.kind == "block" else layer
        for layer in TINY.layers
    )
    fused = dataclasses.replace(TINY, layers=layers)
    cluster = Cluster.preset("a100-80g", nodes=1, gpus_per_node=4)
    plain = _candidates(TINY, cluster, 64, SearchOptions())
    kept = _candidates(fused, cluster, 64, SearchOptions())
    mixed = [c for c in plain if c.tp > 1 and c.dp > 1 and c.zero >= 1]
    assert mixed and not [c for c in kept if c.tp > 1 and c.dp > 1 and c.zero >= 1]
    assert len(kept) == len(plain) - len(mixed)
    with pytest.raises(ValueError, match="fused q/k/v"):
        autopar.estimate(fused, cluster, mixed[0])
    assert autopar.estimate(TINY, cluster, mixed[0]).step_time_s > 0
    megatron = SearchOptions(framework="megatron-lm")
    assert len(_candidates(fused, cluster, 64, megatron)) == len(
        _candidates(TINY, cluster, 64, megatron))
