"""Collectives at scale: the model's bus bandwidth falls with node count where the cited
nccl-tests figures do (benchmarks/data/nccl_busbw.json, each with its source)."""

from __future__ import annotations

import importlib.util
import json
from collections import defaultdict
from pathlib import Path

import pytest

from autopar.cost_model import comm
from autopar.cost_model.hardware import Cluster

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("nccl_scaling", ROOT / "benchmarks" /
                                                  "nccl_scaling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = _script()
RECORDS = json.loads((ROOT / "benchmarks" / "data" / "nccl_busbw.json").read_text())["records"]


def _series() -> dict[tuple, list[dict]]:
    """Records of one source, GPU, kind and size over >= 4 node counts (4 nodes and up:
    NCCL's 2-node tree reports more than the network carries)."""
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in RECORDS:
        if r["nodes"] >= 4 and SCRIPT.modelled_busbw(r):
            out[(r["source"], r["gpu"], r["collective"], r["message_bytes"])].append(r)
    return {k: sorted(v, key=lambda r: r["nodes"]) for k, v in out.items() if len(v) >= 4}


def test_every_record_is_sourced() -> None:
    assert len(RECORDS) >= 100
    assert all(r["source"] and r["busbw_GBps"] > 0 for r in RECORDS)


@pytest.mark.parametrize("key", sorted(_series(), key=str))
def test_bandwidth_falls_with_node_count_where_the_data_does(key) -> None:
    series = _series()[key]
    first, last = series[0], series[-1]
    measured_drop = last["busbw_GBps"] / first["busbw_GBps"]
    modelled_drop = SCRIPT.modelled_busbw(last) / SCRIPT.modelled_busbw(first)
    if measured_drop < 0.95:  # the data falls: so must the model, by a like amount
        assert modelled_drop < 0.97, (key, measured_drop, modelled_drop)
        assert abs(modelled_drop - measured_drop) < 0.25, (key, measured_drop, modelled_drop)
    else:  # flat data (large all-reduces): the model stays within 10%
        assert modelled_drop > 0.85, (key, measured_drop, modelled_drop)


def test_the_model_matches_the_published_clusters() -> None:
    ratios = sorted(r["busbw_GBps"] / SCRIPT.modelled_busbw(r) for r in RECORDS
                    if r["nodes"] >= 4 and SCRIPT.modelled_busbw(r))
    median = ratios[len(ratios) // 2]
    assert 0.9 < median < 1.1
    assert ratios[len(ratios) // 10] >= 1 - comm.COMM_SPREAD - 0.02


def test_a_group_spanning_more_nodes_is_slower_per_byte() -> None:
    times = []
    for nodes in (4, 16, 64, 256):
        cluster = Cluster.preset("h100", nodes=nodes)
        link = comm.group_link(cluster, cluster.num_gpus, 1)
        times.append(comm.collective_s(link, "reduce_scatter_tensor", 2**30))
    assert times == sorted(times) and times[-1] > 1.05 * times[0]
