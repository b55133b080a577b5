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
              (its wall time: x the layer's LayerCompute.floor_stretch where the host's
              dispatch floor holds the layer up)
    exposed = (cp - 1) * (over(p2p(kv), a_f) + over(p2p(2 kv), a_b))
    over(c, a) = overlapped_s(c, a, slowdown)                                 (overlap.py)

Full and selective recompute re-run the attention core, hence the forward ring, once more.
The ring is point-to-point between neighbouring cp ranks: inside a node at the NVLink
bandwidth, across nodes at one GPU's NIC (a rank sends over its own NIC).

All-gather variant (``Framework.cp_comm == "all_gather"``: autopar's runtime,
runtime/context_parallel.py; Llama 3, arXiv:2407.21783 section 3.3.2): each attention
all-gathers K and V stacked (one ``all_gather_into_tensor`` over the cp group, output
``cp * kv`` bytes) and waits for it at once; its autograd rule reduce-scatters their gradient
(one ``reduce_scatter_tensor`` of the same size). Nothing overlaps them: exposed, ring
collectives on the cp group (comm.py). Full recompute re-runs the gather; selective saves the
gathered K/V (recompute.py) and does not. The attention saves the gathered K/V for its
backward: ``(cp - 1) kv`` bytes beyond the rank's own per block and micro-batch (none and
selective; with full recompute they live while the block's backward runs).

Gather-then-compute variant (``Framework.cp_comm == "all_gather_rotate"``: torch's
``context_parallel`` with its "allgather" rotate method, torchtitan's default): the forward
issues one all-gather of K and V (``cp * kv`` bytes out) before the attention of the rank's own
block and waits for it after: it overlaps 1/cp of the attention; the backward gathers K and V
again the same way and passes the gradients dK and dV around the ring (cp - 1 steps, each
overlapping one block's backward) in fp32 (``_ContextParallelOptions.convert_to_f32``: twice
the bytes of K and V). Nothing gathered is saved for backward; the gathered K/V are transient:

    exposed = over(ag(cp kv), a_f / cp) + over(ag(cp kv), a_b / cp)
              + (cp - 1) * over(p2p(2 kv), a_b / cp)
"""

from __future__ import annotations

import dataclasses

from autopar.config import DTYPE_BYTES, ParallelConfig
from autopar.cost_model import comm
from autopar.cost_model.compute import MATMUL_BACKWARD_RATIO, attention_ratio, matmul_efficiency
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.identity_cache import IdentityCache
from autopar.cost_model.overlap import overlapped_s
from autopar.cost_model.precision import attention_peak_flops
from autopar.graph.types import LayerProfile, ModelProfile

__all__ = [
    "CP_COMMS", "CpTerms", "cp_exchange_s", "cp_link", "cp_terms", "gather_collectives",
    "gather_exchange_s", "gathered_kv_bytes", "kv_bytes", "local_profile", "ring_exchange_s",
    "rotate_gather_s",
]

# How a framework exchanges K/V under context parallelism (module docstring).
CP_COMMS = ("ring", "all_gather", "all_gather_rotate")
# sourced: torch _ContextParallelOptions.convert_to_f32 = True: the backward accumulates dK and
# dV in fp32 and passes them so (twice the bytes of 16-bit K and V).
DKV_FP32_RATIO = 2.0

_LOCAL: IdentityCache[ModelProfile] = IdentityCache()


def _scaled_layer(layer: LayerProfile, cp: int) -> LayerProfile:
    def div(values: dict) -> dict:
        return {k: v / cp for k, v in values.items()}

    return dataclasses.replace(
        layer,
        fwd_flops=layer.fwd_flops / cp,
        bwd_flops=layer.bwd_flops / cp,
        recompute_flops=div(layer.recompute_flops),
        saved_bytes=div(layer.saved_bytes),
        swiglu_saved_bytes=layer.swiglu_saved_bytes // cp,
        kv_repeat_saved_bytes=layer.kv_repeat_saved_bytes // cp,
        linear_saved_bytes=(layer.linear_saved_bytes[0] // cp, layer.linear_saved_bytes[1] // cp),
        linear_shared_bytes=(layer.linear_shared_bytes[0] // cp,
                             layer.linear_shared_bytes[1] // cp),
        weight_pass_grad_bytes=tuple(b // cp for b in layer.weight_pass_grad_bytes),
        input_pass_freed_bytes=tuple(b // cp for b in layer.input_pass_freed_bytes),
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
    return _LOCAL.get((profile,), cp, lambda: dataclasses.replace(
        profile,
        seq_len=profile.seq_len // cp,
        layers=tuple(_scaled_layer(layer, cp) for layer in profile.layers),
    ))


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
    w = DTYPE_BYTES[config.dtype]  # fp8 runs attention in bf16: 2 bytes, as its entry
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


def rotate_gather_s(kv: float, attn_fwd_s: float, attn_bwd_s: float, config: ParallelConfig,
                    gather_link: comm.GroupLink, ring_link: comm.GroupLink,
                    slowdown: float) -> tuple[float, float, float]:
    """Exposed seconds of the gather-then-compute variant per block and micro-batch, by
    recompute mode (module docstring; recompute re-runs the forward's gather)."""
    cp = config.cp
    if cp <= 1 or kv <= 0:
        return 0.0, 0.0, 0.0
    gather = comm.collective_s(gather_link, comm.ALL_GATHER, cp * kv)
    fwd = overlapped_s(gather, attn_fwd_s / cp, slowdown)
    bwd = overlapped_s(gather, attn_bwd_s / cp, slowdown) + (cp - 1) * overlapped_s(
        comm.p2p_s(ring_link, DKV_FP32_RATIO * kv), attn_bwd_s / cp, slowdown)
    return fwd + bwd, 2.0 * fwd + bwd, 2.0 * fwd + bwd


def gather_collectives(kv: float, config: ParallelConfig) -> tuple[tuple[comm.Collective, ...],
                                                                  ...]:
    """The all-gather variant's collectives of one block per micro-batch, by recompute mode
    (none, selective, full): the K/V all-gather forward (again in full recompute's re-run)
    and their gradient's reduce-scatter backward, on the "cp" axis (module docstring)."""
    if config.cp <= 1 or kv <= 0:
        return (), (), ()
    size = config.cp * kv

    def call(kind: str, phase: str, calls: int) -> comm.Collective:
        return comm.Collective(kind=kind, axis="cp", size_bytes=size, calls=calls,
                               per="microbatch", phase=phase)

    once = (call(comm.ALL_GATHER, "forward", 1), call(comm.REDUCE_SCATTER, "backward", 1))
    full = (call(comm.ALL_GATHER, "forward", 2), once[1])
    return once, once, full


def gather_exchange_s(kv: float, config: ParallelConfig,
                      link: comm.GroupLink) -> tuple[float, float, float]:
    """Exposed seconds of the all-gather variant per block and micro-batch, by recompute mode
    (every call waited on at once: nothing overlaps)."""
    return tuple(sum(c.time_s(link) for c in calls)  # type: ignore[return-value]
                 for calls in gather_collectives(kv, config))


def gathered_kv_bytes(kv: float, config: ParallelConfig) -> tuple[float, float]:
    """(saved, transient) bytes the gathered K/V add per block and micro-batch: saved for the
    backward without full recompute, live during a fully recomputed block's backward."""
    if config.cp <= 1 or kv <= 0:
        return 0.0, 0.0
    return (config.cp - 1) * kv, (config.cp - 1) * kv


@dataclasses.dataclass(frozen=True, slots=True)
class CpTerms:
    """One layer's context-parallel memory per micro-batch, each by recompute mode (none,
    selective, full): bytes saved for backward, transient bytes."""

    saved_bytes: tuple[float, float, float] = (0.0, 0.0, 0.0)
    transient_bytes: tuple[float, float, float] = (0.0, 0.0, 0.0)


def cp_terms(profile: ModelProfile, layer: LayerProfile, cfg: ParallelConfig, shard: int,
             fw) -> CpTerms:
    """The memory of one layer's K/V exchange as ``fw`` runs it (``Framework.cp_comm``): the
    all-gather variant saves the gathered K/V; the rotating gather holds it while the attention
    runs; the ring keeps nothing beyond its in-flight block (``profile``: the local one)."""
    if cfg.cp == 1 or fw.cp_comm == "ring":
        return CpTerms()
    kv = kv_bytes(profile, layer, cfg, shard)
    if fw.cp_comm == "all_gather":
        saved, live = gathered_kv_bytes(kv, cfg)
        return CpTerms(saved_bytes=(saved, saved, 0.0), transient_bytes=(0.0, 0.0, live))
    live = (cfg.cp - 1) * kv
    return CpTerms(transient_bytes=(live, live, live))


def cp_exchange_s(profile: ModelProfile, layer: LayerProfile, cfg: ParallelConfig,
                  cluster: Cluster, groups: dict, attn_flops: float, shard: int, fw,
                  stretch: tuple[float, float] = (1.0, 1.0)) -> tuple[float, float, float]:
    """Exposed seconds of one layer's K/V exchange per micro-batch, by recompute mode, as ``fw``
    runs it: the all-gather variant on the "cp" group, or the ring on ``groups["cp_ring"]``
    (``profile``: the local one; ``attn_flops``: the rank's attention-core forward FLOPs per
    micro-batch; ``stretch``: the layer's ``LayerCompute.floor_stretch``, its attention's wall
    time over its kernels')."""
    if cfg.cp == 1:
        return 0.0, 0.0, 0.0
    kv = kv_bytes(profile, layer, cfg, shard)
    if fw.cp_comm == "all_gather":
        return gather_exchange_s(kv, cfg, groups["cp"])
    # The window: the attention core at the 16-bit rate, the layer's efficiency and its
    # kernel's speed (compute.attention_ratio).
    rate = matmul_efficiency(cluster.device, layer.fwd_flops * cfg.micro_batch / shard)
    rate *= attention_peak_flops(cluster.device, cfg.dtype, attention_ratio(
        cluster.device, fw.attention_kernel, profile.attention))
    attn_fwd_s = attn_flops / rate
    attn_bwd_s = attn_fwd_s * (layer.bwd_flops / layer.fwd_flops if layer.fwd_flops
                              else MATMUL_BACKWARD_RATIO) * stretch[1]
    attn_fwd_s *= stretch[0]
    if fw.cp_comm == "all_gather_rotate":
        return rotate_gather_s(kv, attn_fwd_s, attn_bwd_s, cfg, groups["cp"], groups["cp_ring"],
                               fw.overlap_slowdown)
    return ring_exchange_s(kv, attn_fwd_s, attn_bwd_s, cfg, groups["cp_ring"],
                           fw.overlap_slowdown)
