"""Cluster presets, YAML round-trip, validation errors and fingerprints."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from autopar.cost_model.hardware import Cluster
from autopar.errors import ClusterConfigError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "clusters"


@pytest.mark.parametrize("name", ["a100-40g", "a100-80g", "h100", "h200", "v100-32g", "cpu"])
def test_presets_round_trip_yaml_and_dict(name, tmp_path):
    cluster = Cluster.preset(name, nodes=2)
    assert cluster.num_gpus == 16
    path = tmp_path / "c.yaml"
    cluster.to_yaml(path)
    assert Cluster.from_yaml(path) == cluster
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    assert Cluster.from_yaml(path).fingerprint() == cluster.fingerprint()


def test_list_presets_and_memory_override():
    names = {"a100-40g", "a100-80g", "h100", "h200", "v100-32g", "cpu"}
    assert set(Cluster.list_presets()) >= names
    big = Cluster.preset("h100", nodes=16, gpu_memory_gb=96)
    assert big.device.memory_bytes == 96 * 2**30
    assert big.num_gpus == 128
    assert Cluster.preset("a100-80g").device.peak_flops("bf16") == 312e12
    assert Cluster.preset("h100").device.peak_flops("bf16") == 989e12


def test_fingerprint_is_stable_and_sensitive():
    a = Cluster.preset("a100-80g", nodes=2)
    assert a.fingerprint() == Cluster.preset("a100-80g", nodes=2).fingerprint()
    assert a.fingerprint() != Cluster.preset("a100-80g", nodes=3).fingerprint()
    assert len(a.fingerprint()) == 16


def test_fixture_files_load():
    files = sorted(FIXTURES.glob("*.yaml"))
    assert files
    for f in files:
        cluster = Cluster.from_yaml(f)
        assert cluster.num_gpus >= 1


def test_numeric_strings_accepted(tmp_path):
    data = Cluster.preset("a100-80g").to_dict()
    data["device"]["peak_bf16_flops"] = "312e12"  # YAML 1.1 reads this as a string
    assert Cluster.from_dict(data).device.peak_bf16_flops == 312e12


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["intra_node"].update(bandwidth_bytes_per_s=-1.0), "intra_node.bandwidth"),
        (lambda d: d.update(gpus_per_node=0), "gpus_per_node"),
        (lambda d: d.update(nodes=0), "nodes"),
        (lambda d: d["device"].pop("memory_bytes"), "device.memory_bytes"),
        (lambda d: d.pop("inter_node"), "inter_node"),
        (lambda d: d.update(bogus=1), "bogus"),
        (lambda d: d["device"].update(warp_speed=9), "warp_speed"),
        (lambda d: d.update(memory_headroom_fraction=1.5), "memory_headroom_fraction"),
        (lambda d: d["device"].update(matmul_efficiency_max=0.0), "matmul_efficiency_max"),
        (lambda d: d["inter_node"].update(latency_s="fast"), "inter_node.latency_s"),
    ],
)
def test_validation_names_the_field(edit, field):
    data = Cluster.preset("a100-80g", nodes=2).to_dict()
    edit(data)
    with pytest.raises(ClusterConfigError, match=field.replace(".", r"\.")):
        Cluster.from_dict(data)


def test_yaml_errors_are_cluster_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [1, 2\n")
    with pytest.raises(ClusterConfigError, match="not valid YAML"):
        Cluster.from_yaml(bad)
    with pytest.raises(ClusterConfigError, match="cannot read"):
        Cluster.from_yaml(tmp_path / "missing.yaml")
    listy = tmp_path / "list.yaml"
    listy.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ClusterConfigError, match="mapping"):
        Cluster.from_yaml(listy)


def test_unknown_preset():
    with pytest.raises(ClusterConfigError, match="unknown cluster preset"):
        Cluster.preset("tpu-v9")


def test_cpu_preset_shares_the_two_cores():
    one = Cluster.preset("cpu", gpus_per_node=1)
    four = Cluster.preset("cpu", gpus_per_node=4)
    assert four.device.peak_fp32_flops == pytest.approx(one.device.peak_fp32_flops / 2)
    assert four.intra_node.bandwidth_bytes_per_s < one.intra_node.bandwidth_bytes_per_s
