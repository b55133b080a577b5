"""The search over cp, HSDP, offload and dtype: what it proposes, and that it misses nothing."""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table
from autopar.errors import InfeasiblePlanError
from autopar.search import SearchOptions, plan
from autopar.search.planner import _candidates
from autopar.search.solve import best_uniform
from tests.fixtures.profiles import analytic_transformer_profile


def llama(seq_len: int, layers: int = 4):
    return analytic_transformer_profile(layers, 1024, 16, 4096, seq_len, kv_heads=4,
                                        gated_mlp=True, ffn_hidden=2816, dropout=False,
                                        bias=False, position_embeddings=False,
                                        tied_embeddings=False)


NODE = Cluster.preset("h100")


def test_long_sequences_use_context_parallelism() -> None:
    """Two sequences of 65,536 tokens on 8 GPUs: dp stops at 2, cp shards each sequence."""
    best = plan(llama(65536), NODE, 2, framework="torchtitan")
    assert best.config.cp > 1 and best.config.dp * best.config.cp * best.config.tp == 8
    assert best.estimate.time_breakdown.cp_comm_s > 0
    assert autopar.estimate(llama(65536), NODE, best.config, framework="torchtitan").to_dict() \
        == best.estimate.to_dict()
    short = plan(llama(65536), NODE, 2, framework="torchtitan",
                 options=SearchOptions(context_parallel=False))
    assert short.config.cp == 1 and short.estimate.step_time_s >= best.estimate.step_time_s


def test_frameworks_get_only_their_dimensions() -> None:
    # autopar's runtime runs cp (all-gathered K/V, runtime/context_parallel.py), not fp8.
    ap = _candidates(llama(65536), NODE, 2, SearchOptions(framework="autopar"))
    assert all(c.dtype == "bf16" for c in ap) and any(c.cp > 1 for c in ap)
    ds = _candidates(llama(65536), Cluster.preset("h100", nodes=2), 16,
                     SearchOptions(framework="deepspeed"))
    assert all(c.cp == 1 and c.dp_replicate == 1 and c.dtype == "bf16" for c in ds)
    tt = _candidates(llama(65536), Cluster.preset("h100", nodes=2), 16,
                     SearchOptions(framework="torchtitan"))
    assert any(c.dp_replicate > 1 for c in tt) and any(c.cp > 1 for c in tt)
    assert {c.dtype for c in tt} == {"bf16", "fp8"}


def test_the_default_dtype_search_is_never_slower_than_a_dtype_asked_for() -> None:
    """A small Llama on 8 GB H100s under Megatron-LM: fp8's casts outweigh its matmuls at the
    split that wins (dp=8, four sequences a micro-batch), not at tp=4 with one: the search costs
    bf16 beside fp8 and keeps the faster (it had dropped bf16 after the tp=4 check, 9.5%
    slower)."""
    profile = autopar.profile(autopar.models.build("llama", layers=8, hidden=1024, heads=16,
                                                   kv_heads=4, vocab=8192, seq_len=2048))
    cluster = Cluster.preset("h100", gpu_memory_gb=8)

    def best(dtype):
        return plan(profile, cluster, 32,
                    options=SearchOptions(framework="megatron-lm", dtype=dtype)).estimate

    found, bf16, fp8 = best(None), best("bf16"), best("fp8")
    assert bf16.step_time_s < fp8.step_time_s
    assert found.step_time_s == min(bf16.step_time_s, fp8.step_time_s)


def test_v100_plans_are_fp16() -> None:
    best = plan(llama(2048), Cluster.preset("v100-32g"), 16)
    assert best.config.dtype == "fp16" and "no bf16 tensor cores" in best.estimate.precision
    # bf16 asked for on a V100: the report says what fp16 would run at, not "fp16's speed".
    asked = autopar.estimate(llama(2048), Cluster.preset("v100-32g"), dataclasses.replace(
        best.config, dtype="bf16")).precision
    assert "as asked" in asked and "--dtype fp16" in asked and "fp16's speed" not in asked


@pytest.mark.parametrize(("memory_gb", "offload"), [(0.7, "params"), (0.85, "optimizer")])
def test_offload_only_when_nothing_fits_without(memory_gb: float, offload: str) -> None:
    cluster = Cluster.preset("a100-80g", gpus_per_node=2, gpu_memory_gb=memory_gb)
    # DeepSpeed's offload_optimizer keeps the 16-bit parameters on the GPU, offload_param not.
    best = plan(llama(1024, layers=8), cluster, 2, framework="deepspeed")
    assert best.config.offload == offload and best.estimate.fits
    assert 0 < best.estimate.host_memory_per_gpu_bytes <= cluster.host_memory_bytes_per_gpu
    # autopar's runtime moves the parameters to the host for either (FSDP2 CPUOffloadPolicy).
    own = plan(llama(1024, layers=8), cluster, 2)
    assert own.config.offload != "none" and own.estimate.fits
    roomy = plan(llama(1024, layers=8), dataclasses.replace(cluster, device=dataclasses.replace(
        cluster.device, memory_bytes=2 * 2**30)), 2)
    assert roomy.config.offload == "none"
    with pytest.raises(InfeasiblePlanError):
        plan(llama(1024, layers=8), cluster, 2, options=SearchOptions(offloads=("none",)))
    no_host = dataclasses.replace(cluster, host_memory_bytes_per_gpu=2**20)
    with pytest.raises(InfeasiblePlanError):
        plan(llama(1024, layers=8), no_host, 2)


def test_a_split_that_needs_offload_to_fit_is_searched_beside_fitting_ones() -> None:
    """GPT-3 1.3B on 8 GPUs of 3.05 GB under Megatron-LM: tp=8 fits without offload (4.56 s),
    dp=2 tp=4 only with the optimizer offloaded (2.84 s). The search used to try offloading
    only when nothing fit, so 5% more memory than 3.0 GB (where nothing fits) made the plan 60%
    slower; more memory now never slows the plan here."""
    profile = autopar.profile(autopar.models.build("gpt3-1.3b"))
    steps = []
    for memory_gb in (3.0, 3.05, 3.3):
        cluster = Cluster.preset("a100-80g", gpu_memory_gb=memory_gb)
        best = plan(profile, cluster, 64, framework="megatron-lm")
        assert best.estimate.fits
        steps.append(best.estimate.step_time_s)
    assert steps[1] <= steps[0] * (1 + 1e-9) and steps[2] <= steps[1] * (1 + 1e-9)
    tight = Cluster.preset("a100-80g", gpu_memory_gb=3.05)
    no_offload = plan(profile, tight, 64, framework="megatron-lm",
                      options=SearchOptions(offloads=("none",)))
    assert no_offload.config.offload == "none" and no_offload.config.tp == 8
    assert steps[1] < 0.7 * no_offload.estimate.step_time_s


def test_more_memory_never_slows_an_offloading_plan_and_one_gpu_offloads() -> None:
    """GPT-3 350M on 2 x 4 A100 at global batch 512: from 1.7 to 1.8 GB the plan had slowed by
    9% (a candidate whose memory bound is under the capacity though no split of it fits was
    never offloaded); on one 6 GB A100 nothing had fitted, one data rank (zero 0) being never
    offloaded, where ZeRO-Offload on one GPU fits (autopar's FSDP2 over the one rank)."""
    profile = autopar.profile(autopar.models.build("gpt3-350m"))
    steps = [plan(profile, Cluster.preset("a100-80g", nodes=2, gpus_per_node=4,
                                          gpu_memory_gb=memory_gb), 512).estimate.step_time_s
             for memory_gb in (1.7, 1.8, 2.4)]
    assert steps == sorted(steps, reverse=True)
    one = plan(profile, Cluster.preset("a100-80g", gpus_per_node=1, gpu_memory_gb=6), 8)
    assert one.config.offload != "none" and one.config.zero >= 1 and one.estimate.fits


def test_planner_never_worse_than_any_candidate_of_the_enlarged_space() -> None:
    """Over every (dp, cp, tp, pp, HSDP, dtype, ...) candidate, the plan is at least as fast as
    the candidate's best balanced split with uniform recompute."""
    profile, cluster = llama(32768), Cluster.preset("h100", nodes=2)
    options = SearchOptions(framework="torchtitan", max_virtual_stages=2)
    best = plan(profile, cluster, 4, options=options)
    configs = _candidates(profile, cluster, 4, options)
    assert any(c.cp > 1 for c in configs) and any(c.dp_replicate > 1 for c in configs)
    for cfg in configs:
        outcome = best_uniform(build_cost_table(profile, cluster, cfg, "torchtitan"))
        if outcome is not None:
            assert best.estimate.step_time_s <= outcome.step_s * (1 + 1e-9), cfg.describe()


def test_a_sequence_too_long_without_cp_is_sharded_by_autopar_and_torchtitan() -> None:
    small = Cluster.preset("h100", gpu_memory_gb=3)
    assert plan(llama(65536), small, 2, framework="torchtitan").config.cp > 1
    assert plan(llama(65536), small, 2).config.cp > 1  # autopar's runtime runs cp too


def test_options_that_leave_nothing_say_so() -> None:
    """Search options that narrow the space to nothing are named (the error had advised a
    global batch that is a multiple of the GPU count, which 16 on 8 GPUs already is); a
    headroom of the whole GPU is refused before the search (it had planned for -20 GiB)."""
    with pytest.raises(ValueError, match=r"micro_batch_sizes=\(7,\)\): widen them"):
        plan(llama(1024), NODE, 16, options=SearchOptions(micro_batch_sizes=(7,)))
    with pytest.raises(ValueError, match=r"memory_headroom_bytes .* keep it below"):
        plan(llama(1024), NODE, 16, options=SearchOptions(memory_headroom_bytes=100 * 2**30))
    # nothing in the whole space (one sequence, 24 GPUs, tp <= 4 and 3 layers): the batch
    with pytest.raises(ValueError, match="multiple of 24"):
        plan(llama(1024, layers=1), Cluster.preset("h100", nodes=3), 1)
