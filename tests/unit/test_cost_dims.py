"""Cost terms of cp, HSDP, offload and precision against closed forms, and their monotonicity."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.config import ParallelConfig, dp_mechanism
from autopar.cost_model import comm, memory
from autopar.cost_model.cp_comm import (
    cp_link,
    kv_bytes,
    local_profile,
    ring_exchange_s,
    rotate_gather_s,
)
from autopar.cost_model.dp_comm import dp_collectives
from autopar.cost_model.framework_support import framework_supports
from autopar.cost_model.frameworks import get_framework
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table, charged_collectives
from autopar.cost_model.offload import (
    CPU_ADAM_PARAMS_PER_S_PER_NODE,
    HOST_BYTES_PER_PARAM,
    cpu_adam_s,
    offload_state,
)
from autopar.cost_model.overlap import overlapped_s
from autopar.cost_model.precision import supported_dtypes
from autopar.graph.types import OpSacCounts
from tests.fixtures.profiles import analytic_transformer_profile

LLAMA = analytic_transformer_profile(4, 1024, 16, 4096, 8192, kv_heads=4, gated_mlp=True,
                                     ffn_hidden=2816, dropout=False, bias=False,
                                     position_embeddings=False, tied_embeddings=False)
H100 = Cluster.preset("h100", nodes=2)


def _block(table):
    return next(layer for layer in table.layers if layer.name.startswith("layers."))


def _flat_device(cluster: Cluster) -> Cluster:
    """No matmul-size curve, elementwise traffic, dispatch floor, slower attention kernel:
    compute = FLOPs / rate."""
    device = dataclasses.replace(cluster.device, matmul_half_flops=0.0,
                                 elementwise_traffic_factor=0.0, dispatch_floor_s=0.0,
                                 flash2_attention_ratio=1.0)
    return dataclasses.replace(cluster, device=device, param_traffic_factor=0.0)


def test_cp_divides_activations_and_compute_by_cp() -> None:
    cluster = _flat_device(H100)
    one = ParallelConfig(dp=2, global_batch=8, zero=3)
    two = dataclasses.replace(one, cp=2)
    # The ring (torchtitan) keeps only the rank's own K/V: activations exactly halve.
    a, b = (_block(build_cost_table(LLAMA, cluster, cfg, "torchtitan")) for cfg in (one, two))
    assert b.act_bytes == pytest.approx(tuple(x / 2 for x in a.act_bytes))
    # autopar's all-gather variant saves the gathered K/V too, (cp - 1) kv more (cp_comm.py).
    a, b = (_block(build_cost_table(LLAMA, cluster, cfg)) for cfg in (one, two))
    kv = kv_bytes(local_profile(LLAMA, 2), LLAMA.layers[1], two, shard=1)
    kv *= 1 + get_framework("autopar").fragmentation_fraction
    assert b.act_bytes == pytest.approx((a.act_bytes[0] / 2 + kv, a.act_bytes[1] / 2 + kv,
                                         a.act_bytes[2] / 2))
    assert b.model_flops_per_sample == pytest.approx(a.model_flops_per_sample)
    block = LLAMA.layers[1]
    rate = cluster.device.peak_bf16_flops * cluster.device.matmul_efficiency_max
    assert b.compute_s == pytest.approx((block.fwd_flops + block.bwd_flops) / 2 / rate)
    assert local_profile(LLAMA, 2).seq_len == LLAMA.seq_len // 2
    op = OpSacCounts(saved_bytes=800, saved_bytes_replicated=80, recompute_flops=1e6)
    measured = dataclasses.replace(LLAMA, layers=tuple(
        dataclasses.replace(x, op_sac=op) if x.kind == "block" else x for x in LLAMA.layers))
    assert local_profile(measured, 4).layers[1].op_sac == OpSacCounts(
        saved_bytes=200, saved_bytes_replicated=20, recompute_flops=2.5e5)


def test_ring_exchange_closed_form() -> None:
    cfg = ParallelConfig(dp=1, cp=4, global_batch=1)
    link = comm.GroupLink(size=4, bandwidth_bytes_per_s=1e9, latency_s=1e-5, spans_nodes=False)
    kv = 1e6
    f, b = kv / 1e9 + 1e-5, 2 * kv / 1e9 + 1e-5
    assert ring_exchange_s(kv, 0.0, 0.0, cfg, link, 0.2) == pytest.approx(
        (3 * (f + b), 3 * (2 * f + b), 3 * (2 * f + b)))
    hidden = ring_exchange_s(kv, 10.0, 20.0, cfg, link, 0.2)  # every step hidden
    assert hidden[0] == pytest.approx(3 * 0.2 * (f + b))
    assert hidden[0] == pytest.approx(3 * (overlapped_s(f, 2.5, 0.2) + overlapped_s(b, 5.0, 0.2)))
    local = local_profile(LLAMA, 4)
    block = local.layers[1]
    two = dataclasses.replace(cfg, micro_batch=2, global_batch=2)
    assert kv_bytes(local, block, two, shard=2) == 2 * 2 * (8192 / 4) * (4 / 2) * (1024 / 16) * 2


def test_cp_ring_across_nodes_runs_at_one_nic() -> None:
    cfg = ParallelConfig(dp=1, cp=16, global_batch=1)
    link = cp_link(H100, cfg)
    assert link.spans_nodes
    assert link.bandwidth_bytes_per_s == H100.inter_node.bandwidth_bytes_per_s
    inside = cp_link(H100, dataclasses.replace(cfg, cp=8, dp=2, global_batch=2))
    assert inside.bandwidth_bytes_per_s == H100.intra_node.bandwidth_bytes_per_s


def test_hsdp_shards_within_and_all_reduces_across() -> None:
    cfg = ParallelConfig(dp=16, dp_replicate=2, global_batch=16, zero=3)
    groups = comm.parallel_groups(H100, cfg)
    assert (groups["dp"].size, groups["dp"].spans_nodes) == (8, False)
    assert (groups["dp_replicate"].size, groups["dp_replicate"].spans_nodes) == (2, True)
    calls = dp_collectives(cfg, 1000.0)
    reduce = [c for c in calls if c.axis == "dp_replicate"]
    assert len(reduce) == 1 and reduce[0].kind == "all_reduce"
    assert reduce[0].size_bytes == memory.GRAD_BYTES * 1000.0 / 8
    state = memory.layer_state(800.0, cfg)
    assert state.optimizer_bytes == memory.ADAM_BYTES * 800.0 / 8


@pytest.mark.parametrize("offload", ["optimizer", "params"])
def test_offload_moves_state_to_the_host(offload: str) -> None:
    cfg = ParallelConfig(dp=8, global_batch=8, zero=3, offload=offload)
    plain = memory.layer_state(800.0, dataclasses.replace(cfg, offload="none"))
    device, host = offload_state(plain, cfg, 800.0)
    assert host == HOST_BYTES_PER_PARAM * 100.0 == 1600.0
    assert device.optimizer_bytes == 0.0
    assert device.param_bytes == (2 * 100.0 if offload == "optimizer" else 0.0)
    rate = CPU_ADAM_PARAMS_PER_S_PER_NODE / H100.gpus_per_node
    up = 2 * 100.0 / H100.pcie_bytes_per_s if offload == "optimizer" else 0.0
    assert cpu_adam_s(H100, cfg, 100.0) == pytest.approx(100.0 / rate + up)


def test_offload_lowers_gpu_memory_and_fails_without_host_memory() -> None:
    cfg = ParallelConfig(dp=16, global_batch=16, zero=3)
    base = autopar.estimate(LLAMA, H100, cfg)
    off = autopar.estimate(LLAMA, H100, dataclasses.replace(cfg, offload="optimizer"))
    assert off.memory_per_gpu_bytes < base.memory_per_gpu_bytes
    assert off.step_time_s > base.step_time_s and off.host_memory_per_gpu_bytes > 0
    small = dataclasses.replace(H100, host_memory_bytes_per_gpu=1.0)
    tight = autopar.estimate(LLAMA, small, dataclasses.replace(cfg, offload="optimizer"))
    assert not tight.fits and tight.binding.startswith("host memory")


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 4), st.sampled_from(["none", "selective", "full"]), st.integers(0, 3))
def test_more_cp_never_raises_activation_memory(mb: int, recompute: str, zero: int) -> None:
    prev = float("inf")
    for cp in (1, 2, 4, 8):
        cluster = Cluster.preset("h100", nodes=max(1, 2 * cp // 8), gpus_per_node=min(8, 2 * cp))
        cfg = ParallelConfig(dp=2, cp=cp, micro_batch=mb, global_batch=8 * mb, zero=zero,
                             recompute=recompute)
        act = autopar.estimate(LLAMA, cluster, cfg, framework="torchtitan").memory_breakdown
        act = act.activations_bytes
        assert act <= prev * (1 + 1e-12)
        prev = act


@settings(max_examples=15, deadline=None)
@given(st.floats(1e9, 1e11), st.floats(1.0, 8.0), st.sampled_from(["optimizer", "params"]))
def test_more_pcie_bandwidth_never_slower(pcie: float, factor: float, offload: str) -> None:
    cfg = ParallelConfig(dp=16, global_batch=32, zero=3, offload=offload)
    slow = dataclasses.replace(H100, pcie_bytes_per_s=pcie)
    fast = dataclasses.replace(H100, pcie_bytes_per_s=pcie * factor)
    assert (autopar.estimate(LLAMA, fast, cfg).step_time_s
            <= autopar.estimate(LLAMA, slow, cfg).step_time_s * (1 + 1e-12))


def test_fp8_speedup_matches_torchao_figure_and_needs_fp8_cores() -> None:
    """torchao float8 (training docs): up to 1.25x at 8 GPU / 8B parameters (torchtitan Llama 3
    8B on 8 H100, tensorwise: 7,186 vs 5,760 tokens/s)."""
    llama8b = analytic_transformer_profile(32, 4096, 32, 128256, 8192, kv_heads=8,
                                           gated_mlp=True, ffn_hidden=14336, dropout=False,
                                           bias=False, position_embeddings=False,
                                           tied_embeddings=False)
    one_node = Cluster.preset("h100")
    cfg = ParallelConfig(dp=8, global_batch=32, zero=3, recompute="full")
    bf16 = autopar.estimate(llama8b, one_node, cfg, framework="torchtitan")
    fp8 = autopar.estimate(llama8b, one_node, dataclasses.replace(cfg, dtype="fp8"),
                           framework="torchtitan")
    assert 1.1 <= bf16.step_time_s / fp8.step_time_s <= 1.4
    assert fp8.memory_per_gpu_bytes == pytest.approx(bf16.memory_per_gpu_bytes)
    assert "fp8" in fp8.precision
    with pytest.raises(ValueError, match="fp8 tensor cores"):
        autopar.estimate(llama8b, Cluster.preset("a100-80g"), dataclasses.replace(
            cfg, dtype="fp8"), framework="torchtitan")


def test_precision_per_gpu() -> None:
    assert supported_dtypes(Cluster.preset("v100-32g").device) == ("fp16",)
    assert supported_dtypes(Cluster.preset("a100-80g").device) == ("bf16",)
    assert supported_dtypes(Cluster.preset("h100").device) == ("bf16", "fp8")
    assert supported_dtypes(Cluster.preset("cpu", gpus_per_node=2).device) == ("bf16",)


def test_fp8_delayed_scaling_moves_less_than_dynamic_and_caches_weights() -> None:
    """Transformer Engine's delayed scaling (Megatron-LM) casts without an amax pass (1.5 bytes
    per bf16 byte instead of 2.5) and casts the weights once per step; torchao's dynamic
    scaling casts them every micro-batch."""
    from autopar.cost_model.frameworks import get_framework
    from autopar.cost_model.precision import fp8_cast_bytes

    act, params = 1e9, 1e8
    dyn = fp8_cast_bytes("dynamic", act, params, num_microbatches=4)
    delayed = fp8_cast_bytes("delayed", act, params, num_microbatches=4)
    assert dyn == pytest.approx((2.5 * act + 5.0 * params, 2.5 * act))
    assert delayed == pytest.approx((1.5 * act + 3.0 * params / 4, 1.5 * act))
    cfg = ParallelConfig(dp=8, global_batch=64, zero=1, recompute="full", dtype="fp8")
    h100 = Cluster.preset("h100")
    megatron = get_framework("megatron-lm")
    assert megatron.fp8_scaling == "delayed"
    as_dynamic = dataclasses.replace(megatron, fp8_scaling="dynamic")
    assert (autopar.estimate(LLAMA, h100, cfg, framework=megatron).step_time_s
            < autopar.estimate(LLAMA, h100, cfg, framework=as_dynamic).step_time_s)
    with pytest.raises(ValueError, match="fp8_scaling"):
        dataclasses.replace(megatron, fp8_scaling="blockwise")


def test_the_precision_line_names_the_frameworks_fp8_scaling() -> None:
    """The report's precision line says how the framework scales its fp8 linears: Megatron-LM's
    Transformer Engine delayed scaling, its fp8-tensorwise setting and torchtitan dynamic."""
    cfg = ParallelConfig(dp=8, global_batch=64, zero=1, recompute="full", dtype="fp8")
    h100 = Cluster.preset("h100")

    def line(spec: str) -> str:
        return autopar.estimate(LLAMA, h100, cfg, framework=spec).precision

    assert "Transformer Engine delayed scaling" in line("megatron-lm")
    assert "tensorwise dynamic scaling" in line("megatron-lm+fp8-tensorwise")
    assert "tensorwise dynamic scaling" in line("torchtitan")
    assert "bf16" in autopar.estimate(LLAMA, h100, dataclasses.replace(cfg, dtype="bf16"),
                                      framework="megatron-lm").precision


def test_autopar_charges_its_kv_all_gather_the_others_their_ring() -> None:
    cluster = Cluster.preset("h100", nodes=1, gpus_per_node=4)
    cfg = ParallelConfig(dp=2, cp=2, global_batch=8, zero=3)
    kv = kv_bytes(local_profile(LLAMA, 2), LLAMA.layers[1], cfg, shard=1)
    link = comm.parallel_groups(cluster, cfg)["cp"]
    ag = comm.collective_s(link, "all_gather_into_tensor", 2 * kv)
    rs = comm.collective_s(link, "reduce_scatter_tensor", 2 * kv)
    own = _block(build_cost_table(LLAMA, cluster, cfg))
    assert own.cp_comm_s == pytest.approx((ag + rs, ag + rs, 2 * ag + rs))
    blocks = sum(layer.kind == "block" for layer in LLAMA.layers)
    counts = charged_collectives(LLAMA, cfg)
    assert counts["all_gather_into_tensor@cp"] == counts["reduce_scatter_tensor@cp"] == (
        blocks * cfg.num_microbatches)
    for name in ("torchtitan+cp-rotate-alltoall", "megatron-lm"):
        assert get_framework(name).cp_comm == "ring"
        ring = _block(build_cost_table(LLAMA, cluster, cfg, name)).cp_comm_s
        assert ring != pytest.approx(own.cp_comm_s)


def test_torchtitan_gathers_kv_under_its_own_block_and_rings_the_gradients() -> None:
    """torch's "allgather" rotate method (torchtitan's default): the K/V gather overlaps the
    rank's own block forward and backward, dK/dV (fp32) pass the ring, nothing is saved."""
    link = comm.GroupLink(size=4, bandwidth_bytes_per_s=1e9, latency_s=1e-5, spans_nodes=False)
    cfg = ParallelConfig(dp=1, cp=4, global_batch=1)
    kv, fwd, bwd = 1e6, 4e-3, 8e-3
    gather = comm.collective_s(link, "all_gather_into_tensor", 4 * kv)
    f = overlapped_s(gather, fwd / 4, 0.2)
    b = overlapped_s(gather, bwd / 4, 0.2) + 3 * overlapped_s(2 * kv / 1e9 + 1e-5, bwd / 4, 0.2)
    assert rotate_gather_s(kv, fwd, bwd, cfg, link, link, 0.2) == pytest.approx(
        (f + b, 2 * f + b, 2 * f + b))
    assert rotate_gather_s(kv, fwd, bwd, dataclasses.replace(cfg, cp=1), link, link, 0.2) == (
        0.0, 0.0, 0.0)
    cluster = Cluster.preset("h100", nodes=1, gpus_per_node=4)
    two = ParallelConfig(dp=2, cp=2, global_batch=8, zero=3)
    titan = get_framework("torchtitan")
    assert titan.cp_comm == "all_gather_rotate"
    gathered, ring = (_block(build_cost_table(LLAMA, cluster, two, fw)) for fw in (
        titan, "torchtitan+cp-rotate-alltoall"))
    assert gathered.act_bytes == ring.act_bytes  # the gathered K/V are not saved
    local_kv = kv_bytes(local_profile(LLAMA, 2), LLAMA.layers[1], two, shard=1)
    frag = 1 + titan.fragmentation_fraction
    assert gathered.transient_bytes == pytest.approx(tuple(
        x + local_kv * frag for x in ring.transient_bytes))
    assert gathered.cp_comm_s[0] > 0 and gathered.cp_comm_s != pytest.approx(ring.cp_comm_s)


def test_autopar_runs_expert_parallelism_with_cp() -> None:
    # Its ep groups are cut from the dp x cp ranks (runtime/expert_parallel.py ep_groups).
    cfg = ParallelConfig(dp=4, cp=2, ep=2, zero=1, global_batch=8)
    assert framework_supports(get_framework("autopar"), cfg) is None
    assert framework_supports(get_framework("megatron-lm"), cfg) is None
    assert framework_supports(get_framework("deepspeed"), cfg) is not None


def test_autopar_optimizer_offload_is_costed_as_what_fsdp2_moves() -> None:
    cluster = Cluster.preset("h100", nodes=1, gpus_per_node=2)
    cfg = ParallelConfig(dp=2, zero=3, offload="optimizer", global_batch=8)
    params = dataclasses.replace(cfg, offload="params")
    # autopar's runtime runs both as FSDP2 CPUOffloadPolicy: parameters live on the host too.
    assert _block(build_cost_table(LLAMA, cluster, cfg)) == _block(
        build_cost_table(LLAMA, cluster, params))
    # So does its zero=1 "optimizer" offload: the device keeps only the step's gathered copy.
    one = _block(build_cost_table(LLAMA, cluster, dataclasses.replace(cfg, zero=1)))
    assert one.param_bytes == pytest.approx(2 * LLAMA.layers[1].num_params)
    assert one.optimizer_bytes == 0
    # Megatron-LM's --optimizer-cpu-offload keeps its parameter shard on the GPU as well.
    mlm = _block(build_cost_table(LLAMA, cluster, dataclasses.replace(cfg, zero=1),
                                  "megatron-lm"))
    assert mlm.param_bytes > one.param_bytes


def test_one_gpu_offload_runs_fsdp2_over_one_rank_and_is_costed() -> None:
    # ZeRO-Offload on one GPU: the runtime wraps FSDP2 over the single rank to move the state
    # (config.dp_mechanism), so the cost model charges the host state it moves.
    cluster = Cluster.preset("h100", nodes=1, gpus_per_node=1)
    cfg = ParallelConfig(dp=1, zero=1, global_batch=8)
    assert dp_mechanism(cfg) == "none"
    off = dataclasses.replace(cfg, offload="optimizer")
    assert dp_mechanism(off) == "fsdp"
    base, moved = (autopar.estimate(LLAMA, cluster, c) for c in (cfg, off))
    assert moved.host_memory_per_gpu_bytes > 0 == base.host_memory_per_gpu_bytes
    assert moved.memory_per_gpu_bytes < base.memory_per_gpu_bytes


def _faster(cluster: Cluster, k: float) -> Cluster:
    """``cluster`` with every peak FLOP rate and the HBM bandwidth ``k`` times as high."""
    doc = cluster.to_dict()
    for field in ("peak_bf16_flops", "peak_fp16_flops", "peak_fp8_flops", "hbm_bytes_per_s"):
        doc["device"][field] *= k
    return Cluster.from_dict(doc)


@pytest.mark.parametrize("framework", ["megatron-lm", "torchtitan"])
def test_a_faster_gpu_never_slows_a_context_parallel_step(framework):
    """The ring's K/V exchange hides under the attention's wall time: where the host's dispatch
    floor holds a small layer up, a faster GPU does not shrink that window (it had: the window
    was the attention's FLOPs at peak, and a 3x faster GPU predicted a slower step)."""
    profile = analytic_transformer_profile(4, 256, 4, 512, 4096, gated_mlp=True)
    cfg = ParallelConfig(dp=1, cp=4, global_batch=4, zero=1)
    base = Cluster.preset("h100", gpus_per_node=4)
    steps = [autopar.estimate(profile, _faster(base, k), cfg, framework=framework).step_time_s
             for k in (1, 2, 3, 4, 8)]
    assert steps == sorted(steps, reverse=True)
    exposed = [autopar.estimate(profile, _faster(base, k), cfg, framework=framework)
               .time_breakdown.cp_comm_s for k in (1, 8)]
    assert exposed[1] <= exposed[0] * (1 + 1e-9)
