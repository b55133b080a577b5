"""The GPU-measured terms: dispatch floor, per-micro-batch parameter traffic, short pipelines,
and the zoo's 16-bit residual stream under autocast (benchmarks/results/h200/)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.config import ParallelConfig
from autopar.cost_model.compute import layer_compute, param_traffic_bytes_per_param
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.pipeline import bubble_coefficient
from autopar.models.norms import LayerNorm, RMSNorm
from tests.fixtures.profiles import analytic_transformer_profile


def test_dispatch_floor_bounds_small_blocks_only() -> None:
    dev = Cluster.preset("h200").device
    assert dev.dispatch_floor_s == pytest.approx(2.0e-3)
    peak = dev.peak_flops("bf16")
    small = layer_compute(dev, peak, fwd_flops=1e9, bwd_flops=2e9, recompute_flops=(0, 0, 0),
                          elementwise_bytes=0.0, floor_s=dev.dispatch_floor_s)
    assert small.forward_s + small.backward_s == pytest.approx(dev.dispatch_floor_s)
    assert small.forward_s == pytest.approx(dev.dispatch_floor_s / 3)
    big = layer_compute(dev, peak, fwd_flops=1e14, bwd_flops=2e14, recompute_flops=(0, 0, 0),
                        elementwise_bytes=0.0, floor_s=dev.dispatch_floor_s)
    free = layer_compute(dev, peak, fwd_flops=1e14, bwd_flops=2e14, recompute_flops=(0, 0, 0),
                         elementwise_bytes=0.0)
    assert big == free


def test_param_traffic_by_runtime_regime() -> None:
    # autocast at pp == 1: cast per micro-batch (6) + upcast gradient (6) + accumulate 12 (m-1)/m
    assert param_traffic_bytes_per_param(autocast=True, casts_per_step=False,
                                         num_microbatches=4) == (6.0, 6.0 + 9.0)
    # under a pipeline schedule the cast happens once per step
    assert param_traffic_bytes_per_param(autocast=True, casts_per_step=True,
                                         num_microbatches=4) == (1.5, 15.0)
    assert param_traffic_bytes_per_param(autocast=False, casts_per_step=False,
                                         num_microbatches=1) == (0.0, 0.0)


def test_param_traffic_enters_the_step_and_can_be_switched_off() -> None:
    profile = analytic_transformer_profile(4, 1024, 16, 32000, 1024)
    cluster = Cluster.preset("h200", gpus_per_node=1)
    cfg = ParallelConfig(micro_batch=1, global_batch=8)
    with_traffic = autopar.estimate(profile, cluster, cfg).step_time_s
    off = dataclasses.replace(cluster, param_traffic_factor=0.0)
    assert autopar.estimate(profile, off, cfg).step_time_s < with_traffic


@pytest.mark.parametrize("v", [1, 2])
def test_short_pipelines_get_no_interleaving_or_zero_bubble_gain(v: int) -> None:
    p = 4
    # m = p: the usual (p - 1) / (v p), reduced by zero-bubble schedules.
    assert bubble_coefficient("1f1b", p, v, p) == pytest.approx((p - 1) / (v * p))
    assert bubble_coefficient("zbv-zero-bubble", p, 2, p) < (p - 1) / (2 * p)
    # m = 1: one micro-batch crosses all v p chunks in turn: (v p - 1) / (v p) of the total.
    assert bubble_coefficient("interleaved-1f1b", p, v, 1) == pytest.approx((v * p - v) / (v * p))
    assert bubble_coefficient("interleaved-zero-bubble", p, 2, 1) == pytest.approx(6 / 8)


@pytest.mark.parametrize("norm_type", [LayerNorm, RMSNorm])
def test_norms_keep_the_autocast_dtype_and_match_torch_without_it(norm_type) -> None:
    torch.manual_seed(0)
    norm = norm_type(32)
    x = torch.randn(2, 8, 32)
    plain = (torch.nn.LayerNorm if norm_type is LayerNorm else torch.nn.RMSNorm)(32)
    plain.load_state_dict(norm.state_dict())
    torch.testing.assert_close(norm(x), plain(x))  # no autocast: torch's own norm
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), plain(x), atol=0.05, rtol=0.05)


def test_zoo_residual_stream_is_16_bit_under_autocast() -> None:
    model = autopar.models.build("gpt", layers=2, hidden=32, heads=4, vocab=64, seq_len=8,
                                 device="cpu", seed=0)
    seen: list[torch.dtype] = []
    model.layers["1"].register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 64, (2, 8)))
    model(torch.randint(0, 64, (2, 8)))
    assert seen == [torch.bfloat16, torch.float32]
