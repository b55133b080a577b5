"""Collective bus bandwidth at scale: published nccl-tests figures against autopar's model.

Usage:
    python benchmarks/nccl_scaling.py          # fit, then the model beside every record
    python benchmarks/nccl_scaling.py --json   # the fit and the residual percentiles as JSON

Reads benchmarks/data/nccl_busbw.json (every number with its source) and prints:
- the fit of ``comm.TREE_DECAY_PER_DOUBLING`` (all-reduce bus bandwidth per doubling of nodes,
  H100 series at >= 4 GiB, where latency is negligible), ``comm.TREE_LATENCY_PER_DOUBLING_S``
  (the 16 MiB H100 series' time beyond bandwidth, per doubling) and
  ``comm.RING_DECAY_PER_DOUBLING`` (the whole ring model, latency included, against the H100
  reduce-scatter series of NVIDIA/nccl#1229 and all-gather of nccl#1218; sizes a record leaves
  unstated are taken as 4 GiB, the large-message regime those reports describe);
- the model's bus bandwidth beside each multi-node record of a part autopar has a preset for
  (4 nodes and more: NCCL's 2-node tree reports more than the network carries), and the
  percentiles of measured over modelled bandwidth. ``comm.COMM_SPREAD`` is the 10th
  percentile's shortfall: how much slower than modelled one collective in ten ran.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autopar.cost_model import comm  # noqa: E402
from autopar.cost_model.hardware import Cluster  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "nccl_busbw.json"
PRESET = {"a100": "a100-80g", "h100": "h100", "h200": "h200"}
KIND = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
        "reduce_scatter": "reduce_scatter_tensor"}


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of log(busbw) against log2(nodes), as a loss per doubling."""
    x = np.array([math.log2(n) for n, _ in points])
    y = np.array([math.log(b) for _, b in points])
    m = np.polyfit(x, y, 1)[0]
    return 1.0 - math.exp(m)


def fit(records: list[dict]) -> dict[str, float]:
    """The three scaling constants from their series (see the module docstring)."""
    series: dict[tuple, list[tuple[float, float]]] = {}
    for r in records:  # one series per source and size: H100 all-reduce, >= 4 GiB, >= 4 nodes
        if r["gpu"] == "h100" and r["collective"] == "all_reduce" and r["nodes"] >= 4 and (
                (r["message_bytes"] or 0) >= 4 * 2**30):
            series.setdefault((r["source"], r["message_bytes"]), []).append(
                (r["nodes"], r["busbw_GBps"]))
    tree = [_slope(pts) for _, pts in sorted(series.items()) if len(pts) >= 4]
    node = Cluster.preset("h100", nodes=2)  # the bus bandwidth of one node's 8 NICs
    busbw = min(node.intra_node.bandwidth_bytes_per_s, 8 * node.inter_node.bandwidth_bytes_per_s)
    latency = []
    for r in records:
        if r["gpu"] == "h100" and r["collective"] == "all_reduce" and r["nodes"] >= 4 and (
                r["message_bytes"] == 16 * 2**20):
            n = 8 * r["nodes"]
            measured = 2 * (n - 1) / n * r["message_bytes"] / (r["busbw_GBps"] * 1e9)
            bandwidth = 2 * (n - 1) / n * r["message_bytes"] / busbw
            latency.append((measured - bandwidth) / math.log2(r["nodes"]))
    ring = [r for r in records if r["collective"] in ("reduce_scatter", "all_gather")
            and r["gpu"] == "h100" and r["nodes"] >= 4]
    return {"TREE_DECAY_PER_DOUBLING": statistics.mean(tree),
            "TREE_LATENCY_PER_DOUBLING_S": statistics.median(latency),
            "RING_DECAY_PER_DOUBLING": _fit_ring(ring)}


def _fit_ring(ring: list[dict]) -> float:
    """The ring decay that makes the whole model (latency included) best match the H100
    reduce-scatter / all-gather series, in squared log error (a bounded scalar search)."""
    from scipy.optimize import minimize_scalar

    def loss(decay: float) -> float:
        saved = comm.RING_DECAY_PER_DOUBLING
        comm.RING_DECAY_PER_DOUBLING = decay
        try:
            return sum(math.log(r["busbw_GBps"] / modelled_busbw(r)) ** 2 for r in ring)
        finally:
            comm.RING_DECAY_PER_DOUBLING = saved

    return float(minimize_scalar(loss, bounds=(0.0, 0.3), method="bounded").x)


def modelled_busbw(record: dict) -> float | None:
    """The model's bus bandwidth (GB/s) for one record: a group of every GPU of the nodes."""
    preset, kind = PRESET.get(record["gpu"]), KIND.get(record["collective"])
    size = record["message_bytes"] or 4 * 2**30  # unstated sizes: the large-message regime
    if preset is None or kind is None:
        return None
    gpn = record["gpus_per_node"] or 8
    cluster = Cluster.preset(preset, nodes=record["nodes"], gpus_per_node=gpn)
    n = cluster.num_gpus
    link = comm.group_link(cluster, n, 1)
    t = comm.collective_s(link, kind, size)
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return factor * size / t / 1e9


def residuals(records: list[dict]) -> list[tuple[dict, float, float]]:
    """(record, modelled, measured / modelled) of every multi-node record the model covers."""
    rows = []
    for r in records:
        if r["nodes"] < 4:
            continue
        model = modelled_busbw(r)
        if model:
            rows.append((r, model, r["busbw_GBps"] / model))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the fit and the model beside the data."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the fit and percentiles as JSON")
    args = ap.parse_args(argv)
    records = json.loads(DATA.read_text())["records"]
    fitted = fit(records)
    rows = residuals(records)
    ratios = sorted(x for *_, x in rows)
    pct = {q: ratios[min(len(ratios) - 1, int(q / 100 * len(ratios)))] for q in (10, 50, 90)}
    if args.json:
        print(json.dumps({"fit": fitted, "percentiles": pct, "records": len(rows)}, indent=2))
        return 0
    print("fit (per doubling of nodes):")
    for name, value in fitted.items():
        used = getattr(comm, name)
        print(f"  {name:30s} {value:.4g}   (autopar uses {used:.4g})")
    print(f"\n{'record':44s} {'coll':14s} {'nodes':>5s} {'MiB':>7s} {'meas':>6s} {'model':>6s}"
          " ratio")
    for r, model, ratio in rows:
        size = r["message_bytes"] / 2**20 if r["message_bytes"] else float("nan")
        print(f"{r['id'][:44]:44s} {r['collective']:14s} {r['nodes']:5d} {size:7.0f} "
              f"{r['busbw_GBps']:6.1f} {model:6.1f} {ratio:5.2f}")
    print(f"\n{len(rows)} records; measured / modelled busbw: p10 {pct[10]:.2f}, median "
          f"{pct[50]:.2f}, p90 {pct[90]:.2f}   (COMM_SPREAD = {comm.COMM_SPREAD:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
