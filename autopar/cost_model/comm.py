"""Communication terms: alpha-beta ring collectives over the cluster's link tiers.

Units: bytes and seconds. Collective sizes follow NCCL's convention (reference/formulas.md
section 6): ``size_bytes`` is the whole buffer (all-gather output, reduce-scatter input,
all-reduce buffer). With n ranks, per-GPU bus bandwidth B and per-step latency alpha:

    reduce_scatter(S) = all_gather(S) = (n - 1) / n * S / B + (n - 1) alpha
    all_reduce(S)     = reduce_scatter(S) + all_gather(S) = 2 (n - 1) / n * S / B + 2 (n - 1) alpha
    p2p(S)            = S / B + alpha

Rank placement (the mesh ("pp", "dp_replicate", "dp_shard", "cp", "tp"), torchtitan's order):
tensor parallel innermost, then context parallel, then the data-parallel shard group, then its
replicas (HSDP), then pipeline parallel:

    global_rank = pp_index * (dp cp tp) + dp_index * (cp tp) + cp_index * tp + tp_index

with dp_index = replica * dp_shard + shard_index. A tp group has stride 1, a cp group stride tp;
gradients are reduced (and ZeRO state sharded) over the dp_shard * cp ranks of stride tp ("dp"
below: the whole dp * cp without HSDP), HSDP replicas all-reduce over dp_replicate ranks of
stride dp_shard cp tp ("dp_replicate"), and a pp group has stride dp cp tp. A group whose
members all sit in one node uses the intra-node link. A group spanning nodes is bound by the
inter-node link: with g members per node the ring's node crossings share those g GPUs' NICs, so
B = min(intra, g * inter_per_gpu) (8 GPUs of a DGX-A100 in one group: 8 x 24 = 192 GB/s busbw,
formulas.md section 6; one member per node: one NIC, 24 GB/s).

At scale (a group spanning N > 1 nodes), from published nccl-tests figures
(benchmarks/data/nccl_busbw.json; the fit is benchmarks/nccl_scaling.py):

    all_reduce(S)      = 2 (n-1)/n S / (B (1 - d_tree)^log2 N) + l_tree log2 N
    reduce_scatter(S)  = (n-1)/n S / (B (1 - d_ring)^log2 N) + (n-1) alpha      (all_gather alike)

NCCL runs large all-reduces over its tree / NVLS-tree algorithms, whose bus bandwidth stays
nearly flat from 4 to 1,024 H100 nodes (d_tree 0.7% per doubling at 4-16 GiB) and whose
latency grows with log2 N (l_tree 0.09 ms per doubling, from the 16 MiB series); all-gather and
reduce-scatter have only the ring, whose bus bandwidth falls 2.2% per doubling of nodes (d_ring,
fitted with the rest to the published series, NVIDIA/nccl#1229 among them) and whose latency
grows with the ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

from autopar.config import ParallelConfig, mesh_strides
from autopar.cost_model.hardware import Cluster

# Fitted by benchmarks/nccl_scaling.py to benchmarks/data/nccl_busbw.json (H100 series; the
# same NCCL algorithms are assumed on the other parts).
TREE_DECAY_PER_DOUBLING = 0.0067  # all-reduce busbw loss per doubling of nodes, >= 4 GiB messages
TREE_LATENCY_PER_DOUBLING_S = 0.094e-3  # all-reduce latency per doubling of nodes (16 MiB series)
RING_DECAY_PER_DOUBLING = 0.022  # ring busbw loss per doubling of nodes, latency apart (nccl#1229)
# How much slower than modelled one collective in ten ran on the published clusters (1 - the
# 10th percentile of measured / modelled busbw, benchmarks/nccl_scaling.py): the extra width of
# the high end of a step-time interval per second of exposed communication.
COMM_SPREAD = 0.08

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "BUS_FACTORS",
    "COLLECTIVE_KINDS",
    "DEVICE_TO_HOST",
    "HOST_TO_DEVICE",
    "REDUCE_SCATTER",
    "SEND_RECV",
    "Collective",
    "GroupLink",
    "all_gather_s",
    "all_reduce_s",
    "bus_factor",
    "collective_s",
    "group_link",
    "host_copy_s",
    "p2p_s",
    "parallel_groups",
    "reduce_scatter_s",
    "ring_steps",
    "tp_spans_nodes",
]

# The collective kinds, by torch.distributed's function names (what the cost model charges,
# what calibrate measures and what autopar.runtime.count_collectives counts).
ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_tensor"
SEND_RECV = "send_recv"
ALL_TO_ALL = "all_to_all_single"  # expert parallelism's token exchange (moe.py)
# Offload's copies between a device and its host (offload.py), on the "pcie" axis.
HOST_TO_DEVICE = "host_to_device"
DEVICE_TO_HOST = "device_to_host"

# Bus factor of each collective as a function of the group size n (sourced: nccl-tests
# doc/PERFORMANCE.md): bytes each rank moves over the buffer size S.
BUS_FACTORS = MappingProxyType({
    ALL_REDUCE: lambda n: 2.0 * (n - 1) / n,
    ALL_GATHER: lambda n: (n - 1) / n,
    REDUCE_SCATTER: lambda n: (n - 1) / n,
    SEND_RECV: lambda n: 1.0,
})


def bus_factor(op: str, group_size: int) -> float:
    """Bytes moved per rank over the buffer size for collective ``op`` in a group of ``group_size``.

    Raises:
        ValueError: an unknown collective or a group smaller than 2.
    """
    if op not in BUS_FACTORS:
        raise ValueError(f"unknown collective {op!r}; use one of {sorted(BUS_FACTORS)}")
    if group_size < 2:
        raise ValueError(f"a collective needs a group of 2 or more ranks, got {group_size}")
    return BUS_FACTORS[op](group_size)


def ring_steps(op: str, group_size: int) -> int:
    """Latency-bound steps of one ring collective: all-reduce 2 (n - 1), AG/RS n - 1, p2p 1."""
    if op == ALL_REDUCE:
        return 2 * (group_size - 1)
    if op == SEND_RECV:
        return 1
    return group_size - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupLink:
    """The effective link of one process group.

    Attributes:
        size: ranks in the group (n).
        bandwidth_bytes_per_s: per-GPU bus bandwidth the group's ring achieves.
        latency_s: per ring step latency.
        spans_nodes: whether the group crosses a node boundary.
        time_factors: measured over ring-model time per collective kind (all-reduce,
            all-gather, reduce-scatter): the cluster's ``*_time_factor`` fields.
        nodes: nodes the group spans (1 inside a node).
    """

    size: int
    bandwidth_bytes_per_s: float
    latency_s: float
    spans_nodes: bool
    time_factors: tuple[float, float, float] = (1.0, 1.0, 1.0)
    nodes: int = 1

    @property
    def doublings(self) -> float:
        """log2 of the nodes spanned (0 inside a node)."""
        return math.log2(self.nodes) if self.nodes > 1 else 0.0


def tp_spans_nodes(tp: int, gpus_per_node: int) -> bool:
    """Whether some tp group (tp adjacent ranks, the innermost mesh axis) crosses a node
    boundary: ``group_link``'s rule for stride 1 (the group must fit a node and tile it)."""
    return tp > 1 and (tp > gpus_per_node or gpus_per_node % tp != 0)


def group_link(cluster: Cluster, size: int, stride: int) -> GroupLink:
    """Link of a group of ``size`` ranks spaced ``stride`` apart in global rank order.

    Groups of one kind tile the ranks in blocks of ``size * stride``; the group stays inside a
    node only if that block fits a node and tiles it (``gpus_per_node % (size * stride) == 0``),
    otherwise some group crosses a node boundary and the worst group sets the pace.
    """
    gpn = cluster.gpus_per_node
    block = size * stride
    factors = (cluster.all_reduce_time_factor, cluster.all_gather_time_factor,
               cluster.reduce_scatter_time_factor)
    if size <= 1 or cluster.nodes == 1 or (block <= gpn and gpn % block == 0):
        return GroupLink(
            size=size,
            bandwidth_bytes_per_s=cluster.intra_node.bandwidth_bytes_per_s,
            latency_s=cluster.intra_node.latency_s,
            spans_nodes=False,
            time_factors=factors,
        )
    per_node = 1 if stride >= gpn else max(1, min(size, gpn // stride))
    bw = min(
        cluster.intra_node.bandwidth_bytes_per_s,
        per_node * cluster.inter_node.bandwidth_bytes_per_s,
    )
    nodes = min(cluster.nodes, -(-size // per_node))
    # A ring over the group crosses nodes ``nodes`` times and stays inside one for the rest.
    hops = max(1, size - 1)
    latency = ((hops - min(nodes, hops)) * cluster.intra_node.latency_s
               + min(nodes, hops) * cluster.inter_node.latency_s) / hops
    return GroupLink(
        size=size,
        bandwidth_bytes_per_s=bw,
        latency_s=latency,
        spans_nodes=True,
        time_factors=factors,
        nodes=nodes,
    )


def parallel_groups(cluster: Cluster, config: ParallelConfig) -> dict[str, GroupLink]:
    """The tp, cp, dp (shard group), dp_replicate and pp groups' links (module docstring)."""
    stride = mesh_strides(config)  # the runtime's mesh order (config.MESH_AXES)
    # The ZeRO shard group is dp_shard x cp, contiguous from cp's stride (HSDP's replicas are
    # the outer part of dp).
    return {
        "tp": group_link(cluster, config.tp, stride["tp"]),
        "cp": group_link(cluster, config.cp, stride["cp"]),
        "dp": group_link(cluster, config.shard_ranks, stride["cp"]),
        "dp_replicate": group_link(cluster, config.dp_replicate,
                                   stride["dp"] * config.dp_shard),
        "pp": group_link(cluster, config.pp, stride["pp"]),
    }


def host_copy_s(link: GroupLink, size_bytes: float) -> float:
    """One host-device copy over the link of a device's PCIe: S / B + alpha."""
    if size_bytes <= 0:
        return 0.0
    return size_bytes / link.bandwidth_bytes_per_s + link.latency_s


def reduce_scatter_s(link: GroupLink, size_bytes: float) -> float:
    """Ring reduce-scatter of a ``size_bytes`` input: (n-1)/n S/B + (n-1) alpha; 0 for n=1
    (B falls by ``RING_DECAY_PER_DOUBLING`` per doubling of the nodes spanned)."""
    n = link.size
    if n <= 1 or size_bytes <= 0:
        return 0.0
    bw = link.bandwidth_bytes_per_s * (1.0 - RING_DECAY_PER_DOUBLING) ** link.doublings
    return (bus_factor(REDUCE_SCATTER, n) * size_bytes / bw
            + ring_steps(REDUCE_SCATTER, n) * link.latency_s)


def all_gather_s(link: GroupLink, size_bytes: float) -> float:
    """Ring all-gather of a ``size_bytes`` output: (n-1)/n S/B + (n-1) alpha; 0 for n=1."""
    return reduce_scatter_s(link, size_bytes)


def all_reduce_s(link: GroupLink, size_bytes: float) -> float:
    """All-reduce: inside a node the ring (reduce-scatter + all-gather of the same buffer);
    across N nodes NCCL's tree, 2 (n-1)/n S / (B (1 - d_tree)^log2 N) + l_tree log2 N."""
    n = link.size
    if link.nodes <= 1 or n <= 1 or size_bytes <= 0:
        return reduce_scatter_s(link, size_bytes) + all_gather_s(link, size_bytes)
    bw = link.bandwidth_bytes_per_s * (1.0 - TREE_DECAY_PER_DOUBLING) ** link.doublings
    return bus_factor(ALL_REDUCE, n) * size_bytes / bw + (
        TREE_LATENCY_PER_DOUBLING_S * link.doublings)


def collective_s(link: GroupLink, kind: str, size_bytes: float) -> float:
    """Time of one collective by its functional-collective kind (see ``COLLECTIVE_KINDS``)."""
    try:
        fn = COLLECTIVE_KINDS[kind]
    except KeyError:
        known = sorted(COLLECTIVE_KINDS)
        raise ValueError(f"unknown collective kind {kind!r}; known: {known}") from None
    return fn(link, size_bytes) * (link.time_factors[_FACTOR_INDEX[kind]]
                                   if kind in _FACTOR_INDEX else 1.0)


def p2p_s(link: GroupLink, size_bytes: float) -> float:
    """One point-to-point send between neighbouring ranks of the group: S/B + alpha."""
    if link.size <= 1 or size_bytes <= 0:
        return 0.0
    return size_bytes / link.bandwidth_bytes_per_s + link.latency_s


# Functional-collective kind (what autopar.runtime.count_collectives reports) -> time function.
_FACTOR_INDEX = {ALL_REDUCE: 0, ALL_GATHER: 1, REDUCE_SCATTER: 2}
COLLECTIVE_KINDS = {
    ALL_REDUCE: all_reduce_s,
    ALL_GATHER: all_gather_s,
    REDUCE_SCATTER: reduce_scatter_s,
    HOST_TO_DEVICE: host_copy_s,
    DEVICE_TO_HOST: host_copy_s,
}


# How often a charged collective repeats, and the compute it can overlap.
COLLECTIVE_PER: tuple[str, ...] = ("microbatch", "step")
COLLECTIVE_PHASES: tuple[str, ...] = ("forward", "backward")


@dataclass(frozen=True, slots=True, kw_only=True)
class Collective:
    """Calls of one collective kind on one mesh axis, all of one size: what a cost term charges.

    Attributes:
        kind: the functional-collective kind (``all_reduce``, ``all_gather_into_tensor``,
            ``reduce_scatter_tensor``), as ``autopar.runtime.count_collectives`` names it.
        axis: the mesh axis: "tp", "dp", "dp_replicate" (HSDP) or "pcie" (offload's copies).
        size_bytes: bytes of one call (NCCL convention: the whole buffer).
        calls: number of calls (fractional for DDP's buckets, see layer_costs).
        per: "microbatch" (repeated every micro-batch) or "step" (once per optimizer step).
        phase: "forward" or "backward": the compute it can overlap.
        counted: whether ``count_collectives`` sees it (DDP's C++ reducer: not).
    """

    kind: str
    axis: str
    size_bytes: float
    calls: float
    per: str
    phase: str
    counted: bool = True

    def __post_init__(self) -> None:
        # A misspelt value would be charged per micro-batch by one reader and once per step by
        # another (layer_costs.py reads both ways): refuse it where it is made.
        if self.per not in COLLECTIVE_PER:
            raise ValueError(f"Collective.per {self.per!r}: use one of {COLLECTIVE_PER}")
        if self.phase not in COLLECTIVE_PHASES:
            raise ValueError(f"Collective.phase {self.phase!r}: use one of {COLLECTIVE_PHASES}")

    def time_s(self, link: GroupLink) -> float:
        """All the calls on ``link``: calls * collective_s(kind, size)."""
        return self.calls * collective_s(link, self.kind, self.size_bytes)
