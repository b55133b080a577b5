"""Cluster buffer/reserve fields, framework overheads and core sharing in the cost terms."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.config import ParallelConfig
from autopar.cost_model.compute import busy_speedup
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table
from autopar.errors import ClusterConfigError
from tests.fixtures.profiles import analytic_transformer_profile

MIB = 2**20


def _profile():
    return analytic_transformer_profile(4, 256, 4, 512, 64, dtype="fp32")


def _with(cluster: Cluster, **device) -> Cluster:
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, **device))


def test_buffers_and_reserve_are_cluster_fields(tmp_path):
    gpu = Cluster.preset("h100")
    assert gpu.comm_buffer_bytes_per_group == 64 * MIB
    assert gpu.allocator_reserve_bytes == 256 * MIB
    cpu = Cluster.preset("cpu", gpus_per_node=4)
    assert cpu.comm_buffer_bytes_per_group == 0 and cpu.allocator_reserve_bytes == 0
    cfg = ParallelConfig(dp=2, tp=2, global_batch=8)
    table = build_cost_table(_profile(), gpu, cfg)
    assert table.buffers_bytes == 2 * 64 * MIB + 256 * MIB  # two groups in use
    assert build_cost_table(_profile(), cpu, cfg).buffers_bytes == 0
    odd = dataclasses.replace(gpu, comm_buffer_bytes_per_group=1.0, allocator_reserve_bytes=5.0)
    assert build_cost_table(_profile(), odd, cfg).buffers_bytes == 7.0
    path = tmp_path / "c.yaml"
    odd.to_yaml(path)
    assert Cluster.from_yaml(path) == odd


def test_old_files_without_the_new_fields_load_with_defaults():
    data = Cluster.preset("a100-80g").to_dict()
    del data["comm_buffer_bytes_per_group"], data["allocator_reserve_bytes"]
    for key in ("layer_overhead_s", "tp_module_overhead_s", "shared_compute_processes"):
        del data["device"][key]
    cluster = Cluster.from_dict(data)
    assert cluster == Cluster.preset("a100-80g")


@pytest.mark.parametrize(("section", "field", "value"), [
    ("", "allocator_reserve_bytes", -1.0),
    ("", "comm_buffer_bytes_per_group", -5.0),
    ("device", "tp_module_overhead_s", -1e-3),
    ("device", "shared_compute_processes", 0.5),
])
def test_new_fields_are_validated(section, field, value):
    data = Cluster.preset("cpu").to_dict()
    (data[section] if section else data)[field] = value
    with pytest.raises(ClusterConfigError, match=field):
        Cluster.from_dict(data)


def test_overheads_enter_the_layer_times():
    base = Cluster.preset("cpu", gpus_per_node=4)
    p = _profile()
    cfg = ParallelConfig(dp=4, global_batch=8, micro_batch=1)
    plain = build_cost_table(p, base, cfg)
    layered = build_cost_table(p, _with(base, layer_overhead_s=0.03), cfg)
    blocks = [i for i, x in enumerate(p.layers) if x.kind == "block"]
    for i in blocks:
        assert layered.layers[i].compute_s == pytest.approx(plain.layers[i].compute_s + 0.03)
        assert layered.layers[i].backward_s == pytest.approx(plain.layers[i].backward_s + 0.02)
    # full recompute re-runs the forward's share of it
    k = 2
    assert layered.layers[blocks[0]].recompute_s[k] == pytest.approx(
        plain.layers[blocks[0]].recompute_s[k] + 0.01)
    # TP: per tensor-parallel module, only when tp > 1
    tp_cfg = ParallelConfig(tp=4, global_batch=8, micro_batch=1)
    t0 = build_cost_table(p, base, tp_cfg)
    t1 = build_cost_table(p, _with(base, tp_module_overhead_s=1e-3), tp_cfg)
    modules = len(p.layers[blocks[0]].tp.colwise) + len(p.layers[blocks[0]].tp.rowwise)
    assert t1.layers[blocks[0]].compute_s - t0.layers[blocks[0]].compute_s == pytest.approx(
        modules * 1e-3)
    assert build_cost_table(p, _with(base, tp_module_overhead_s=1e-3), cfg).layers[
        blocks[0]].compute_s == pytest.approx(plain.layers[blocks[0]].compute_s)
    # FSDP2 units; the optimizer's fixed cost per block, more with DTensor parameters
    z3 = dataclasses.replace(cfg, zero=3)
    f0 = build_cost_table(p, base, z3)
    dev = {"fsdp_layer_overhead_s": 2e-3, "layer_overhead_s": 1e-2,
           "optimizer_layer_overhead_s": 4e-3, "dtensor_optimizer_layer_overhead_s": 1e-3}
    f1 = build_cost_table(p, _with(base, **dev), z3)
    assert f1.layers[blocks[0]].compute_s - f0.layers[blocks[0]].compute_s == pytest.approx(
        1e-2 + 2e-3)
    assert f1.layers[blocks[0]].optimizer_s - f0.layers[blocks[0]].optimizer_s == pytest.approx(
        5e-3)
    d1 = build_cost_table(p, _with(base, **dev), cfg)  # DDP: plain parameters, no units
    assert d1.layers[blocks[0]].optimizer_s - plain.layers[blocks[0]].optimizer_s == (
        pytest.approx(4e-3))


def test_gpu_presets_carry_no_overheads():
    for name in ("a100-80g", "h100", "h200"):
        d = Cluster.preset(name).device
        assert d.layer_overhead_s == d.tp_module_overhead_s == d.fsdp_layer_overhead_s == 0
        assert d.shared_compute_processes == 1


def test_busy_speedup_and_pipelines_on_shared_cores():
    dev = Cluster.preset("cpu", gpus_per_node=4).device
    assert dev.shared_compute_processes == 2.0  # 4 workers on 2 cores
    assert busy_speedup(dev, 1.0) == 1.0
    assert busy_speedup(dev, 0.5) == 2.0
    assert busy_speedup(dev, 0.8) == pytest.approx(1.25)
    assert busy_speedup(dev, 0.1) == 2.0
    gpu = Cluster.preset("h100").device
    assert busy_speedup(gpu, 0.1) == 1.0
    p = _profile()
    # Without the per-micro-batch parameter traffic, which differs between the two schedules.
    cluster = dataclasses.replace(Cluster.preset("cpu", gpus_per_node=4), param_traffic_factor=0.0)
    flat = build_cost_table(p, cluster, ParallelConfig(dp=4, global_batch=16, micro_batch=1))
    # gpipe over 4 ranks with m = 4: busy fraction 4 / (4 + 3) -> 1.75x faster per layer
    pipe = build_cost_table(p, cluster, ParallelConfig(pp=4, global_batch=4, micro_batch=1,
                                                       schedule="gpipe"))
    i = next(k for k, x in enumerate(p.layers) if x.kind == "block")
    assert flat.layers[i].compute_s / pipe.layers[i].compute_s == pytest.approx(1.75)


def test_one_microbatch_charges_activations_net_of_fresh_gradients():
    p = _profile()
    cluster = Cluster.preset("cpu", gpus_per_node=4)
    one = build_cost_table(p, cluster, ParallelConfig(dp=4, global_batch=8, micro_batch=2))
    two = build_cost_table(p, cluster, ParallelConfig(dp=4, global_batch=8, micro_batch=1))
    assert one.num_microbatches == 1 and two.num_microbatches == 2
    for a, b in zip(one.layers, two.layers):
        grad = 4.0 * a.num_params  # fp32 gradients, not sharded at zero 0
        for k in range(3):
            # micro_batch 2 saves twice micro_batch 1's activations; one micro-batch nets grads
            assert a.act_bytes[k] == pytest.approx(max(0.0, 2 * b.act_bytes[k] - grad))
        assert a.transient_bytes[0] >= b.transient_bytes[0]


def test_checkpointing_cost_enters_recompute_only():
    base = Cluster.preset("cpu", gpus_per_node=4)
    p = _profile()
    cfg = ParallelConfig(dp=4, global_batch=8, micro_batch=1)
    i = next(k for k, x in enumerate(p.layers) if x.kind == "block")
    dev = {"layer_overhead_s": 3e-3}
    plain = build_cost_table(p, _with(base, **dev), cfg).layers[i]
    ckpt = build_cost_table(p, _with(base, recompute_layer_overhead_s=5e-3, **dev), cfg).layers[i]
    assert ckpt.compute_s == plain.compute_s and ckpt.recompute_s[0] == 0.0
    # full: the measured 5 ms replaces the 1 ms forward share already charged
    assert ckpt.recompute_s[2] - plain.recompute_s[2] == pytest.approx(4e-3)
    assert 0.0 < ckpt.recompute_s[1] - plain.recompute_s[1] < 4e-3  # selective: its FLOP share
