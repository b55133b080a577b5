"""The cost model's properties hold on real traced profiles (zoo GPT and Llama on meta)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.config import ParallelConfig
from autopar.cost_model.collectives import expected_collectives
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import charged_collectives
from tests.helpers import with_link_bandwidth_scaled

SHAPE = dict(layers=4, hidden=64, heads=4, vocab=256, seq_len=32)
PROFILES = {
    "gpt": autopar.profile(autopar.models.build("gpt", **SHAPE), seq_len=32),
    "llama": autopar.profile(autopar.models.build("llama", kv_heads=2, **SHAPE), seq_len=32),
}
SETTINGS = settings(max_examples=12, deadline=None)
KINDS = st.sampled_from(sorted(PROFILES))


def _est(kind: str, **kw):
    cfg = ParallelConfig(**{"global_batch": 16, **kw})
    cluster = Cluster.preset("a100-80g", nodes=1, gpus_per_node=cfg.world_size)
    return autopar.estimate(PROFILES[kind], cluster, cfg)


def _max_static(est) -> float:
    return max(s.memory.parameters_bytes + s.memory.gradients_bytes + s.memory.optimizer_bytes
               for s in est.stages)


def _non_increasing(values) -> bool:
    return all(b <= a * (1 + 1e-12) for a, b in itertools.pairwise(values))


def test_profiles_are_traced_zoo_models():
    for prof in PROFILES.values():
        assert [x.kind for x in prof.layers] == ["embedding"] + ["block"] * 4 + ["head"]
        assert prof.trace_method in ("fx", "export")


@SETTINGS
@given(kind=KINDS, dp=st.sampled_from([1, 2]), zero=st.sampled_from([0, 1, 2, 3]),
       dtype=st.sampled_from(["bf16", "fp32"]))
def test_memory_non_increasing_in_tp(kind, dp, zero, dtype):
    tps = (1, 2, 4) if PROFILES[kind].kv_heads % 4 == 0 else (1, 2)
    ests = [_est(kind, dp=dp, tp=tp, zero=zero, dtype=dtype) for tp in tps]
    assert _non_increasing([_max_static(e) for e in ests])
    # Everything but the constant communication buffers (64 MiB per process group in use).
    assert _non_increasing([e.memory_per_gpu_bytes - e.memory_breakdown.buffers_bytes
                            for e in ests])


@SETTINGS
@given(kind=KINDS, dp=st.sampled_from([2, 4]), tp=st.sampled_from([1, 2]),
       pp=st.sampled_from([1, 2]), dtype=st.sampled_from(["bf16", "fp32"]),
       mb=st.sampled_from([1, 2]))
def test_memory_non_increasing_in_zero(kind, dp, tp, pp, dtype, mb):
    ests = [_est(kind, dp=dp, tp=tp, pp=pp, zero=z, dtype=dtype, micro_batch=mb,
                 schedule="1f1b" if pp > 1 else "gpipe") for z in (0, 1, 2, 3)]
    assert _non_increasing([_max_static(e) for e in ests])


@SETTINGS
@given(kind=KINDS, tp=st.sampled_from([1, 2]), zero=st.sampled_from([0, 1, 3]))
def test_model_state_non_increasing_in_pp(kind, tp, zero):
    values = [_max_static(_est(kind, tp=tp, pp=pp, zero=zero, schedule="gpipe"))
              for pp in (1, 2, 3)]
    assert _non_increasing(values)


@SETTINGS
@given(kind=KINDS, tp=st.sampled_from([1, 2]), dtype=st.sampled_from(["bf16", "fp32"]))
def test_zero_has_no_effect_at_dp1(kind, tp, dtype):
    assert len({_est(kind, tp=tp, zero=z, dtype=dtype).memory_per_gpu_bytes
                for z in (0, 1, 2, 3)}) == 1


@SETTINGS
@given(kind=KINDS, mb=st.sampled_from([1, 2, 4]),
       recompute=st.sampled_from(["none", "selective", "full"]), tp=st.sampled_from([1, 2]))
def test_activations_grow_with_micro_batch(kind, mb, recompute, tp):
    small = _est(kind, tp=tp, micro_batch=mb, recompute=recompute)
    large = _est(kind, tp=tp, micro_batch=2 * mb, recompute=recompute)
    assert large.memory_breakdown.activations_bytes > small.memory_breakdown.activations_bytes


@SETTINGS
@given(kind=KINDS, tp=st.sampled_from([1, 2]))
def test_recompute_trades_memory_for_time(kind, tp):
    ests = [_est(kind, tp=tp, recompute=r) for r in ("none", "selective", "full")]
    assert _non_increasing([e.memory_breakdown.activations_bytes for e in ests])
    assert ests[2].step_time_s > ests[0].step_time_s


@SETTINGS
@given(kind=KINDS, scale=st.floats(1.5, 100), dp=st.sampled_from([2, 4]),
       tp=st.sampled_from([1, 2]), zero=st.sampled_from([0, 1, 2, 3]))
def test_time_falls_as_bandwidth_rises(kind, scale, dp, tp, zero):
    cfg = ParallelConfig(dp=dp, tp=tp, pp=2, global_batch=16, zero=zero, schedule="gpipe")
    slow = Cluster.preset("a100-80g", nodes=cfg.world_size // 2, gpus_per_node=2)
    fast = with_link_bandwidth_scaled(slow, scale)
    prof = PROFILES[kind]
    assert autopar.estimate(prof, fast, cfg).step_time_s < autopar.estimate(
        prof, slow, cfg).step_time_s


@pytest.mark.parametrize("kind", sorted(PROFILES))
@pytest.mark.parametrize(("dp", "tp", "pp", "zero", "sp", "recompute"), [
    (1, 2, 1, 0, True, "full"), (2, 2, 1, 3, False, "selective"), (2, 1, 2, 2, False, "none"),
    (2, 2, 2, 0, True, "full"), (2, 1, 2, 3, False, "full")])
def test_charged_equals_expected_on_zoo_profiles(kind, dp, tp, pp, zero, sp, recompute):
    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, zero=zero, sequence_parallel=sp,
                         recompute=recompute, global_batch=4 * dp,
                         schedule="1f1b" if pp > 1 else "gpipe")
    for rank in range(pp):
        assert charged_collectives(PROFILES[kind], cfg, rank) == expected_collectives(
            PROFILES[kind], cfg, rank)
