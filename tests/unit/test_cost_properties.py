"""Property tests of the cost model (hypothesis), each with the other degrees fixed."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.config import ParallelConfig
from autopar.cost_model import comm
from autopar.cost_model.estimator import estimate
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.memory import layer_state
from tests.fixtures.profiles import analytic_transformer_profile
from tests.helpers import with_link_bandwidth_scaled

PROFILE = analytic_transformer_profile(8, 256, 8, 1024, 128)
SETTINGS = settings(max_examples=15, deadline=None)


def _cluster(world: int) -> Cluster:
    return Cluster.preset("a100-80g", nodes=1, gpus_per_node=world)


def _est(profile=PROFILE, **kw):
    cfg = ParallelConfig(**{"global_batch": 16, **kw})
    return estimate(profile, _cluster(cfg.world_size), cfg)


def _static(est) -> float:
    m = est.memory_breakdown
    return m.parameters_bytes + m.gradients_bytes + m.optimizer_bytes


def _max_static(est) -> float:
    return max(
        s.memory.parameters_bytes + s.memory.gradients_bytes + s.memory.optimizer_bytes
        for s in est.stages
    )


@SETTINGS
@given(dp=st.sampled_from([1, 2]), zero=st.sampled_from([0, 1, 2, 3]),
       dtype=st.sampled_from(["bf16", "fp32"]))
def test_model_state_non_increasing_in_tp(dp, zero, dtype):
    values = [_max_static(_est(dp=dp, tp=tp, zero=zero, dtype=dtype)) for tp in (1, 2, 4, 8)]
    assert all(b <= a for a, b in itertools.pairwise(values))


@SETTINGS
@given(tp=st.sampled_from([1, 2]), zero=st.sampled_from([0, 1, 3]))
def test_model_state_non_increasing_in_pp(tp, zero):
    values = [_max_static(_est(tp=tp, pp=pp, zero=zero, schedule="gpipe")) for pp in (1, 2, 4)]
    assert all(b <= a for a, b in itertools.pairwise(values))


@SETTINGS
@given(dp=st.sampled_from([2, 4, 8]), tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]),
       dtype=st.sampled_from(["bf16", "fp16", "fp32"]))
def test_model_state_non_increasing_in_zero(dp, tp, pp, dtype):
    values = [_max_static(_est(dp=dp, tp=tp, pp=pp, zero=z, dtype=dtype, schedule="gpipe"))
              for z in (0, 1, 2, 3)]
    assert all(b <= a for a, b in itertools.pairwise(values))


@SETTINGS
@given(tp=st.sampled_from([1, 2, 4]), dtype=st.sampled_from(["bf16", "fp32"]))
def test_zero_has_no_effect_at_dp1(tp, dtype):
    values = {_static(_est(tp=tp, zero=z, dtype=dtype)) for z in (0, 1, 2, 3)}
    assert len(values) == 1


@SETTINGS
@given(params=st.integers(1, 10**9), dp=st.integers(2, 64), dtype=st.sampled_from(["bf16", "fp32"]))
def test_zero3_state_times_dp_is_unsharded(params, dp, dtype):
    cfg = ParallelConfig(dp=dp, zero=3, global_batch=dp, dtype=dtype)
    s = layer_state(params, cfg)
    total = s.param_bytes + s.grad_bytes + s.optimizer_bytes
    assert total * dp == pytest.approx(16 * params)  # fp32 master + grads + Adam moments


@SETTINGS
@given(mb=st.sampled_from([1, 2, 4]), recompute=st.sampled_from(["none", "selective", "full"]),
       tp=st.sampled_from([1, 2]))
def test_activations_grow_with_micro_batch(mb, recompute, tp):
    a = _est(tp=tp, micro_batch=mb, recompute=recompute).memory_breakdown.activations_bytes
    b = _est(tp=tp, micro_batch=2 * mb, recompute=recompute).memory_breakdown.activations_bytes
    assert b > a


@SETTINGS
@given(seq=st.sampled_from([64, 128, 256]), recompute=st.sampled_from(["none", "full"]))
def test_activations_grow_with_sequence_length(seq, recompute):
    short = analytic_transformer_profile(4, 128, 4, 512, seq)
    long = analytic_transformer_profile(4, 128, 4, 512, 2 * seq)
    a = _est(short, recompute=recompute).memory_breakdown.activations_bytes
    b = _est(long, recompute=recompute).memory_breakdown.activations_bytes
    assert b > a


LINK = comm.GroupLink(size=8, bandwidth_bytes_per_s=100e9, latency_s=5e-6, spans_nodes=False)


@SETTINGS
@given(n=st.integers(1, 64), size=st.floats(0, 1e10), bw=st.floats(1e6, 1e12),
       alpha=st.floats(0, 1e-3))
def test_all_reduce_is_reduce_scatter_plus_all_gather(n, size, bw, alpha):
    link = comm.GroupLink(size=n, bandwidth_bytes_per_s=bw, latency_s=alpha, spans_nodes=False)
    assert comm.all_reduce_s(link, size) == pytest.approx(
        comm.reduce_scatter_s(link, size) + comm.all_gather_s(link, size)
    )


@SETTINGS
@given(size=st.floats(0, 1e10))
def test_group_of_one_costs_nothing(size):
    one = dataclasses.replace(LINK, size=1)
    for fn in (comm.all_reduce_s, comm.all_gather_s, comm.reduce_scatter_s, comm.p2p_s):
        assert fn(one, size) == 0.0


def test_nccl_all_reduce_vector():
    # formulas.md section 6: 1 GiB over 8 GPUs at busbw 230 GB/s -> 8.17 ms.
    link = comm.GroupLink(size=8, bandwidth_bytes_per_s=230e9, latency_s=0.0, spans_nodes=False)
    assert comm.all_reduce_s(link, 2**30) == pytest.approx(8.17e-3, abs=0.01e-3)


def test_group_placement_tp_innermost():
    cluster = Cluster.preset("a100-80g", nodes=4)
    groups = comm.parallel_groups(cluster, ParallelConfig(dp=4, tp=8, global_batch=4))
    assert not groups["tp"].spans_nodes
    assert groups["dp"].spans_nodes
    assert groups["dp"].bandwidth_bytes_per_s == cluster.inter_node.bandwidth_bytes_per_s
    flat = comm.parallel_groups(cluster, ParallelConfig(dp=32, global_batch=32))["dp"]
    assert flat.bandwidth_bytes_per_s == pytest.approx(8 * cluster.inter_node.bandwidth_bytes_per_s)


@SETTINGS
@given(scale=st.floats(1.5, 100), dp=st.sampled_from([2, 4]), tp=st.sampled_from([1, 2]),
       zero=st.sampled_from([0, 3]))
def test_time_falls_as_bandwidth_rises(scale, dp, tp, zero):
    cfg = ParallelConfig(dp=dp, tp=tp, pp=2, global_batch=16, zero=zero, schedule="gpipe")
    slow = Cluster.preset("a100-80g", nodes=cfg.world_size // 2, gpus_per_node=2)
    fast = with_link_bandwidth_scaled(slow, scale)
    assert estimate(PROFILE, fast, cfg).step_time_s < estimate(PROFILE, slow, cfg).step_time_s


@SETTINGS
@given(mb=st.sampled_from([1, 2, 4]), recompute=st.sampled_from(["none", "selective", "full"]),
       dtype=st.sampled_from(["bf16", "fp32"]))
def test_degree_one_reduces_to_single_gpu(mb, recompute, dtype):
    est = _est(micro_batch=mb, recompute=recompute, dtype=dtype)
    t = est.time_breakdown
    assert t.tp_comm_s == t.pp_comm_s == t.dp_comm_s == t.bubble_s == 0.0
    assert est.step_time_s == pytest.approx(t.compute_s + t.recompute_s + t.optimizer_s)
    # The same split with a trivial dp/tp/pp of 1 spelled out on a bigger node: no change.
    single = estimate(PROFILE, _cluster(1), ParallelConfig(
        global_batch=16, micro_batch=mb, recompute=recompute, dtype=dtype))
    assert single.step_time_s == est.step_time_s


@SETTINGS
@given(p=st.integers(2, 8), k=st.integers(1, 4))
def test_uniform_pipeline_bubble_matches_formula(p, k):
    prof = analytic_transformer_profile(4 * p - 2, 128, 4, 512, 64, tied_embeddings=False)
    m = p * k
    est = _est(prof, pp=p, global_batch=m, schedule="1f1b")
    t = est.time_breakdown
    ideal = est.step_time_s - t.bubble_s - t.optimizer_s
    # Stages are not exactly uniform (embedding, head): the ratio is within 35% of (p-1)/m.
    assert t.bubble_s / ideal == pytest.approx((p - 1) / m, rel=0.35)
