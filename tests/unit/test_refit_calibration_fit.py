"""Pure tests of the calibration fits and the refit (autopar/cost_model/calibration.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cost_model.calibration import (
    Calibration,
    CollectiveFit,
    calibration_to_cluster,
    fit_linear_relative,
    refit_cluster,
    refit_scale,
)
from autopar.cost_model.comm import bus_factor, ring_steps
from autopar.cost_model.hardware import Cluster


@settings(max_examples=25, deadline=None)
@given(
    fixed=st.floats(1e-6, 1e-2),
    rate=st.floats(1e6, 1e12),
    noise=st.lists(st.floats(-0.05, 0.05), min_size=6, max_size=6),
)
def test_linear_fit_recovers_fixed_cost_and_rate(fixed, rate, noise):
    xs = [rate * fixed * 4.0**k / 64 for k in range(6)]  # sizes around the knee
    ts = [(fixed + x / rate) * (1 + e) for x, e in zip(xs, noise)]
    fit = fit_linear_relative(xs, ts)
    assert fit.fixed_s >= 0 and fit.rate > 0
    assert fit.median_rel_error <= 0.06
    # The fitted curve stays within the noise band at every sample.
    for x, t in zip(xs, ts):
        assert abs(fit.predict_s(x) - t) / t <= 0.11


def test_linear_fit_exact_data():
    xs = [1e3, 1e4, 1e5, 1e6]
    fit = fit_linear_relative(xs, [2e-4 + x / 1e9 for x in xs])
    assert math.isclose(fit.fixed_s, 2e-4, rel_tol=1e-9)
    assert math.isclose(fit.rate, 1e9, rel_tol=1e-9)
    assert fit.max_rel_error < 1e-9


def test_linear_fit_flat_and_negative_intercept_stay_physical():
    flat = fit_linear_relative([1e3, 1e4, 1e5], [1e-3, 0.9e-3, 1e-3])
    assert flat.rate > 0 and flat.fixed_s >= 0
    steep = fit_linear_relative([1e3, 1e4, 1e5], [1e-6, 1.5e-5, 1.6e-4])
    assert steep.fixed_s >= 0 and steep.rate > 0


def test_linear_fit_rejects_bad_input():
    with pytest.raises(ValueError):
        fit_linear_relative([1.0, 1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        fit_linear_relative([1.0, 2.0], [1.0, 0.0])


def test_bus_factors_and_ring_steps():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather_into_tensor", 4) == pytest.approx(0.75)
    assert bus_factor("send_recv", 2) == 1.0
    assert ring_steps("all_reduce", 4) == 6 and ring_steps("reduce_scatter_tensor", 4) == 3
    with pytest.raises(ValueError):
        bus_factor("all_reduce", 1)


def test_refit_scale_direction():
    # predicted: 1.0 s compute + 0.5 s other = 1.5 s
    assert refit_scale(1.0, 2.0, 1.5) == pytest.approx(1.0 / 1.5)  # slower: less throughput
    assert refit_scale(1.0, 1.0, 1.5) == pytest.approx(2.0)  # faster: more throughput
    assert refit_scale(1.0, 1.5, 1.5) == pytest.approx(1.0)
    assert refit_scale(1.0, 0.1, 1.5) == pytest.approx(20.0)  # clamped at 5% of the part


def _breakdown(compute_s: float, comm_s: float) -> dict[str, float]:
    return {"compute_s": compute_s, "recompute_s": 0.0, "tp_comm_s": comm_s, "pp_comm_s": 0.0,
            "dp_comm_s": 0.0, "bubble_s": 0.0, "optimizer_s": 0.0}


@pytest.mark.parametrize(("measured", "up"), [(2.0, False), (1.2, True)])
def test_refit_cluster_moves_efficiency_the_right_way(measured, up):
    base = Cluster.preset("cpu", gpus_per_node=2)
    new = refit_cluster(base, _breakdown(1.0, 0.5), measured)
    old_rate = base.device.peak_fp32_flops * base.device.matmul_efficiency_max
    new_rate = new.device.peak_fp32_flops * new.device.matmul_efficiency_max
    assert (new_rate > old_rate) == up
    # The compute part is rescaled so that prediction == measurement: 1.0 * old/new + 0.5.
    assert 1.0 * old_rate / new_rate + 0.5 == pytest.approx(measured)
    assert new.device.hbm_bytes_per_s / base.device.hbm_bytes_per_s == pytest.approx(
        new_rate / old_rate)
    assert new.intra_node == base.intra_node
    assert new.name.endswith("-refit")
    assert Cluster.from_dict(new.to_dict()) == new


def test_refit_cluster_raises_peak_beyond_efficiency_one():
    base = Cluster.preset("cpu", gpus_per_node=2)
    new = refit_cluster(base, _breakdown(1.0, 0.0), 0.05)  # 20x faster than predicted
    assert new.device.matmul_efficiency_max == 1.0
    assert new.device.peak_fp32_flops == pytest.approx(
        20 * base.device.peak_fp32_flops * base.device.matmul_efficiency_max)


def _calibration(nproc: int = 2) -> Calibration:
    fits = tuple(
        CollectiveFit(op=op, group_size=nproc, latency_s=lat, bandwidth_bytes_per_s=bw,
                      median_rel_error=0.1, max_rel_error=0.2, samples=((4096, 1e-3),))
        for op, lat, bw in (("all_reduce", 4e-4, 1e9), ("all_gather_into_tensor", 2e-4, 2e9),
                            ("reduce_scatter_tensor", 3e-4, 3e9), ("send_recv", 1e-4, 5e9))
    )
    return Calibration(
        device_type="cpu", nproc=nproc, dtype="fp32", matmul_samples=((64, 64, 64, 1e-5),),
        matmul_fixed_s=2e-6, matmul_peak_flops=40e9, matmul_median_rel_error=0.05,
        collectives=fits, op_overhead_s=6e-6, layer_overhead_s=1e-3,
        dtensor_layer_overhead_s=5e-3, fsdp_layer_overhead_s=1e-3, memory_bytes_per_s=8e9,
        wall_s=10.0, nonblock_overhead_s=6e-4, dtensor_module_overhead_s=7e-4,
        optimizer_layer_overhead_s=2e-3, optimizer_nonblock_overhead_s=1e-3,
        dtensor_optimizer_layer_overhead_s=3e-3, recompute_layer_overhead_s=4e-3,
    )


def test_calibration_to_cluster_maps_the_fits(tmp_path):
    cal = _calibration()
    cluster = calibration_to_cluster(cal)
    dev = cluster.device
    assert dev.peak_fp32_flops * dev.matmul_efficiency_max == pytest.approx(40e9)
    # CPU: the framework overheads in their own fields, the matmul curve keeps t0 only
    assert dev.matmul_half_flops / 40e9 == pytest.approx(2e-6)
    assert dev.layer_overhead_s == 1e-3 and dev.edge_layer_overhead_s == pytest.approx(3e-4)
    assert dev.tp_module_overhead_s == 7e-4 and dev.fsdp_layer_overhead_s == 1e-3
    assert dev.optimizer_layer_overhead_s == 2e-3
    assert dev.dtensor_optimizer_layer_overhead_s == 3e-3
    assert dev.recompute_layer_overhead_s == 4e-3
    assert dev.shared_compute_processes == Cluster.preset("cpu", gpus_per_node=2).device.\
        shared_compute_processes
    assert cluster.comm_buffer_bytes_per_group == 0 and cluster.allocator_reserve_bytes == 0
    assert dev.hbm_bytes_per_s == 8e9
    assert cluster.intra_node.bandwidth_bytes_per_s == 2e9  # median of AR, AG, RS
    # per ring step: AR 4e-4 / 2, AG 2e-4 / 1, RS 3e-4 / 1 -> median 2e-4
    assert cluster.intra_node.latency_s == pytest.approx(2e-4)
    assert cluster.gpus_per_node == 2 and cluster.nodes == 1
    path = tmp_path / "c.yaml"
    cluster.to_yaml(path)
    assert Cluster.from_yaml(path) == cluster
    assert Calibration.from_dict(cal.to_dict()) == cal


def test_base_preset_follows_the_device_name():
    from dataclasses import replace

    from autopar.cost_model.calibration import base_preset

    cal = _calibration()
    assert base_preset(cal) == "cpu"
    gpu = replace(cal, device_type="cuda", dtype="bf16", device_name="NVIDIA H200")
    assert base_preset(gpu) == "h200"
    assert base_preset(replace(gpu, device_name="NVIDIA A100-SXM4-40GB")) == "a100-40g"
    cluster = calibration_to_cluster(replace(gpu, matmul_peak_flops=600e12))
    assert cluster.device.peak_bf16_flops * cluster.device.matmul_efficiency_max == pytest.approx(
        600e12)
    # GPU: the host's cost is the dispatch floor per block; the preset's matmul curve stays
    assert cluster.device.dispatch_floor_s == pytest.approx(cal.layer_overhead_s)
    assert cluster.device.matmul_half_flops == Cluster.preset("h200").device.matmul_half_flops
    assert cluster.device.layer_overhead_s == 0 and cluster.device.tp_module_overhead_s == 0
    assert cluster.comm_buffer_bytes_per_group == 64 * 2**20
    assert cluster.allocator_reserve_bytes == 256 * 2**20
    assert cluster.device.memory_bytes == Cluster.preset("h200").device.memory_bytes


def test_collective_lookup_by_group_size():
    from dataclasses import replace

    cal = _calibration(4)
    pair = replace(cal.collectives[0], group_size=2, latency_s=1e-4)
    cal = replace(cal, collectives=(*cal.collectives, pair))
    assert cal.collective("all_reduce").group_size == 4
    assert cal.collective("all_reduce", 2).latency_s == 1e-4
    with pytest.raises(KeyError):
        cal.collective("all_to_all")


def test_sweep_json_round_trip():
    from autopar.runtime.calibrate import Sweep

    for device_type in ("cpu", "cuda"):
        for quick in (False, True):
            sweep = Sweep.default(device_type, quick=quick)
            assert Sweep.from_json(sweep.to_json()) == sweep


def test_collective_time_factors_carry_what_one_link_cannot():
    from dataclasses import replace

    from autopar.cost_model.calibration import CollectiveFit, collective_time_factors
    from autopar.cost_model.comm import collective_s, group_link

    link = {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-3}
    # reduce-scatter over 4 ranks measured exactly twice the ring model, all-reduce exactly it.
    ring = lambda steps, size: steps * (1e-3 + size / 4 / 1e9)  # noqa: E731
    fits = [
        CollectiveFit(op="reduce_scatter_tensor", group_size=4, latency_s=0.0,
                      bandwidth_bytes_per_s=1.0, median_rel_error=0.0, max_rel_error=0.0,
                      samples=tuple((s, 2 * ring(3, s)) for s in (4096, 2**20))),
        CollectiveFit(op="all_reduce", group_size=4, latency_s=0.0, bandwidth_bytes_per_s=1.0,
                      median_rel_error=0.0, max_rel_error=0.0,
                      samples=tuple((s, ring(6, s)) for s in (4096, 2**20))),
    ]
    factors = collective_time_factors(fits, link)
    assert factors == {"all_reduce_time_factor": pytest.approx(1.0),
                       "reduce_scatter_time_factor": pytest.approx(2.0)}
    base = Cluster.preset("cpu", gpus_per_node=4)
    scaled = replace(base, reduce_scatter_time_factor=2.0)
    plain, slow = (group_link(c, 4, 1) for c in (base, scaled))
    rs, ar = "reduce_scatter_tensor", "all_reduce"
    assert collective_s(slow, rs, 1e6) == pytest.approx(2 * collective_s(plain, rs, 1e6))
    assert collective_s(slow, ar, 1e6) == collective_s(plain, ar, 1e6)
