"""Context parallelism: each sequence sharded over cp ranks, attention run as a ring.

Units: bytes, FLOPs, seconds. With cp ranks a rank holds s / cp tokens of every sequence of its
micro-batch (torchtitan's ``context_parallel``, round-robin load balanced so every rank does
the same share of the causal attention): its compute, its activations and its tensor-parallel
and pipeline messages are those of a sequence of s / cp tokens, and attention FLOPs per rank
are 1/cp of the whole (``local_profile``). Parameters are whole on every cp rank: gradients
are reduced, and ZeRO state sharded, over dp * cp (comm.parallel_groups).

Ring attention (Liu et al. 2023, arXiv:2310.01889; torch's ``_templated_ring_attention``):
in the forward each rank passes its K and V blocks around the ring, cp - 1 steps, each step's
transfer overlapping the attention of the block it already holds; the backward passes K and V
again with their gradients dK and dV (twice the bytes), cp - 1 steps. Per block and
micro-batch:

    kv      = 2 * b * (s / cp) * (kv_heads / shard) * (h / heads) * w       (K and V, bytes)
    a_f     = attention-core forward time of the rank / cp                   (one ring step)
    exposed = (cp - 1) * (over(p2p(kv), a_f) + over(p2p(2 kv), a_b))
    over(c, a) = overlapped_s(c, a, slowdown)                                 (overlap.py)

Full and selective recompute re-run the attention core, hence the forward ring, once more.
The ring is point-to-point between neighbouring cp ranks: inside a node at the NVLink
bandwidth, across nodes at one GPU's NIC (a rank sends over its own NIC).
"""

from __future__ import annotations

import dataclasses

from autopar.config import DTYPE_BYTES, ParallelConfig
from autopar.cost_model import comm
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.overlap import overlapped_s
from autopar.graph.types import LayerProfile, ModelProfile

__all__ = ["cp_link", "kv_bytes", "local_profile", "ring_exchange_s"]

_CACHE: dict[tuple[int, int], tuple[ModelProfile, ModelProfile]] = {}


def _scaled_layer(layer: LayerProfile, cp: int) -> LayerProfile:
    def div(values: dict) -> dict:
        return {k: v / cp for k, v in values.items()}

    return dataclasses.replace(
        layer,
        fwd_flops=layer.fwd_flops / cp,
        bwd_flops=layer.bwd_flops / cp,
        recompute_flops=div(layer.recompute_flops),
        saved_bytes=div(layer.saved_bytes),
        saved_bytes_replicated=div(layer.saved_bytes_replicated),
        output_bytes=layer.output_bytes / cp,
        tp=dataclasses.replace(layer.tp, allreduce_fwd_bytes=layer.tp.allreduce_fwd_bytes / cp),
        op_sac=None if layer.op_sac is None else dataclasses.replace(
            layer.op_sac, saved_bytes=layer.op_sac.saved_bytes / cp,
            saved_bytes_replicated=layer.op_sac.saved_bytes_replicated / cp,
            recompute_flops=layer.op_sac.recompute_flops / cp),
    )


def local_profile(profile: ModelProfile, cp: int) -> ModelProfile:
    """What one of cp ranks computes and holds per sample: the profile of s / cp tokens.

    Every per-sample count (FLOPs, saved and output bytes, tp all-reduce bytes) is divided by
    cp and ``seq_len`` is s / cp; parameters are unchanged. Attention's quadratic FLOPs per
    rank are 1/cp of the whole too: the load-balanced ring gives each rank s / cp queries
    against all s keys, causally masked alike.
    """
    if cp == 1:
        return profile
    key = (id(profile), cp)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1]
    local = dataclasses.replace(
        profile,
        seq_len=profile.seq_len // cp,
        layers=tuple(_scaled_layer(layer, cp) for layer in profile.layers),
    )
    if len(_CACHE) > 16:
        _CACHE.clear()
    _CACHE[key] = (profile, local)
    return local


def cp_link(cluster: Cluster, config: ParallelConfig) -> comm.GroupLink:
    """The ring's neighbour link: NVLink inside a node, one GPU's NIC across nodes."""
    link = comm.group_link(cluster, config.cp, config.tp)
    if not link.spans_nodes:
        return link
    return dataclasses.replace(
        link, bandwidth_bytes_per_s=min(link.bandwidth_bytes_per_s,
                                        cluster.inter_node.bandwidth_bytes_per_s),
        latency_s=cluster.inter_node.latency_s)


def kv_bytes(profile: ModelProfile, layer: LayerProfile, config: ParallelConfig,
             shard: int) -> float:
    """K and V of one micro-batch's s / cp tokens on one rank (``profile``: the local one)."""
    if layer.kind != "block" or not profile.heads:
        return 0.0
    kv_heads = layer.tp.kv_heads or profile.kv_heads
    head_dim = profile.hidden / profile.heads
    w = DTYPE_BYTES["bf16" if config.dtype == "fp8" else config.dtype]
    return 2.0 * config.micro_batch * profile.seq_len * kv_heads / shard * head_dim * w


def ring_exchange_s(kv: float, attn_fwd_s: float, attn_bwd_s: float, config: ParallelConfig,
                    link: comm.GroupLink, slowdown: float) -> tuple[float, float, float]:
    """Exposed ring-attention traffic of one block and micro-batch, by recompute mode.

    Args:
        kv: K and V bytes of the rank's tokens (``kv_bytes``).
        attn_fwd_s: the rank's attention-core forward time of the micro-batch.
        attn_bwd_s: its attention-core backward time.
        config: the config (cp).
        link: the ring's link (``cp_link``).
        slowdown: compute slowed per second of overlapped communication.
    """
    cp = config.cp
    if cp <= 1 or kv <= 0:
        return 0.0, 0.0, 0.0
    fwd = (cp - 1) * overlapped_s(comm.p2p_s(link, kv), attn_fwd_s / cp, slowdown)
    bwd = (cp - 1) * overlapped_s(comm.p2p_s(link, 2.0 * kv), attn_bwd_s / cp, slowdown)
    return fwd + bwd, 2.0 * fwd + bwd, 2.0 * fwd + bwd
