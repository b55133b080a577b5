"""Communication terms: alpha-beta ring collectives over the cluster's link tiers.

Units: bytes and seconds. Collective sizes follow NCCL's convention (reference/formulas.md
section 6): ``size_bytes`` is the whole buffer (all-gather output, reduce-scatter input,
all-reduce buffer). With n ranks, per-GPU bus bandwidth B and per-step latency alpha:

    reduce_scatter(S) = all_gather(S) = (n - 1) / n * S / B + (n - 1) alpha
    all_reduce(S)     = reduce_scatter(S) + all_gather(S) = 2 (n - 1) / n * S / B + 2 (n - 1) alpha
    p2p(S)            = S / B + alpha

Rank placement (the runtime's mesh ("pp", "dp", "tp")): tensor parallel innermost, then data
parallel, then pipeline parallel:

    global_rank = pp_index * (dp * tp) + dp_index * tp + tp_index

so a tp group has stride 1, a dp group stride tp and a pp group stride tp * dp. A group whose
members all sit in one node uses the intra-node link. A group spanning nodes is bound by the
inter-node link: with g members per node the ring's node crossings share those g GPUs' NICs, so
B = min(intra, g * inter_per_gpu) (8 GPUs of a DGX-A100 in one group: 8 x 24 = 192 GB/s busbw,
formulas.md section 6; one member per node: one NIC, 24 GB/s).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.config import ParallelConfig
from autopar.cost_model.hardware import Cluster

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "GroupLink",
    "all_gather_s",
    "all_reduce_s",
    "collective_s",
    "group_link",
    "p2p_s",
    "parallel_groups",
    "reduce_scatter_s",
]


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
    """

    size: int
    bandwidth_bytes_per_s: float
    latency_s: float
    spans_nodes: bool
    time_factors: tuple[float, float, float] = (1.0, 1.0, 1.0)


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
    return GroupLink(
        size=size,
        bandwidth_bytes_per_s=bw,
        latency_s=cluster.inter_node.latency_s,
        spans_nodes=True,
        time_factors=factors,
    )


def parallel_groups(cluster: Cluster, config: ParallelConfig) -> dict[str, GroupLink]:
    """The tp, dp and pp groups' links under TP-innermost, then DP, then PP placement."""
    tp, dp, pp = config.tp, config.dp, config.pp
    return {
        "tp": group_link(cluster, tp, 1),
        "dp": group_link(cluster, dp, tp),
        "pp": group_link(cluster, pp, tp * dp),
    }


def reduce_scatter_s(link: GroupLink, size_bytes: float) -> float:
    """Ring reduce-scatter of a ``size_bytes`` input: (n-1)/n S/B + (n-1) alpha; 0 for n=1."""
    n = link.size
    if n <= 1 or size_bytes <= 0:
        return 0.0
    return (n - 1) / n * size_bytes / link.bandwidth_bytes_per_s + (n - 1) * link.latency_s


def all_gather_s(link: GroupLink, size_bytes: float) -> float:
    """Ring all-gather of a ``size_bytes`` output: (n-1)/n S/B + (n-1) alpha; 0 for n=1."""
    return reduce_scatter_s(link, size_bytes)


def all_reduce_s(link: GroupLink, size_bytes: float) -> float:
    """Ring all-reduce = reduce-scatter + all-gather of the same buffer."""
    return reduce_scatter_s(link, size_bytes) + all_gather_s(link, size_bytes)


def collective_s(link: GroupLink, kind: str, size_bytes: float) -> float:
    """Time of one collective by its functional-collective kind (see ``COLLECTIVE_KINDS``)."""
    try:
        fn = COLLECTIVE_KINDS[kind]
    except KeyError:
        known = sorted(COLLECTIVE_KINDS)
        raise ValueError(f"unknown collective kind {kind!r}; known: {known}") from None
    return fn(link, size_bytes) * link.time_factors[_FACTOR_INDEX[kind]]


def p2p_s(link: GroupLink, size_bytes: float) -> float:
    """One point-to-point send between neighbouring ranks of the group: S/B + alpha."""
    if link.size <= 1 or size_bytes <= 0:
        return 0.0
    return size_bytes / link.bandwidth_bytes_per_s + link.latency_s


# Functional-collective kind (what autopar.runtime.count_collectives reports) -> time function.
_FACTOR_INDEX = {"all_reduce": 0, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 2}
COLLECTIVE_KINDS = {
    "all_reduce": all_reduce_s,
    "all_gather_into_tensor": all_gather_s,
    "reduce_scatter_tensor": reduce_scatter_s,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Collective:
    """Calls of one collective kind on one mesh axis, all of one size: what a cost term charges.

    Attributes:
        kind: the functional-collective kind (``all_reduce``, ``all_gather_into_tensor``,
            ``reduce_scatter_tensor``), as ``autopar.runtime.count_collectives`` names it.
        axis: the mesh axis: "tp" or "dp".
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

    def time_s(self, link: GroupLink) -> float:
        """All the calls on ``link``: calls * collective_s(kind, size)."""
        return self.calls * collective_s(link, self.kind, self.size_bytes)
