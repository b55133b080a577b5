"""Expert parallelism (ep): the cost terms of mixture-of-experts layers sharded over ep ranks.

Placement (torchtitan and Megatron-Core): the ep ranks of a group are ep consecutive ranks of the
data-parallel axis (``ep`` divides ``dp * cp``), so an ep group has stride tp in the global rank
order (comm.py). Each rank holds E / ep routed experts; the dense part of a layer (attention,
router, shared experts) stays replicated over dp as before. Routed experts are tensor-parallel
sharded like the rest of the layer (expert tensor parallelism = tp, Megatron-Core's default).

Per MoE layer and micro-batch, with T = b s tokens a rank routes (T / tp with sequence parallelism,
unless the MoE module gathers the whole sequence: framework_support ``moe_tp_mode``), k' =
the dispatched rows per token (k, or c k with a capacity factor c), h the width and w the bytes of
the training dtype:

- parameters: ``P_dense + E P_e / ep`` per rank (before tp); the routed experts' model state is
  sharded by ZeRO over the expert-data-parallel group of ``dp / ep`` ranks (their gradients are
  reduced there), the dense part over dp as before.
- all-to-all (``ep_collectives``, runtime/expert_parallel.py): a dispatch and a combine in the
  forward, their transposes in the backward: 4 calls of ``S = T k' h w`` bytes per rank, and
  before them two small ones, the split counts (8 ep bytes) and the rows' expert ids (8 T k'
  bytes); full recompute re-runs the forward's four. Each rank
  keeps 1/ep of S and sends ``S / ep`` to each other member; members in its node go over the
  intra-node link, the others through its own NIC (inter-node link):

      all_to_all(S) = max(S (g - 1) / ep / B_intra, S (ep - g) / ep / B_inter) + (ep - 1) alpha

  with g the members per node (NCCL runs all-to-all as concurrent send/recv pairs to every peer;
  nccl-tests' doc/PERFORMANCE.md: busbw = algbw (n - 1) / n). Not overlapped with compute (the
  experts wait for their tokens): charged as exposed.
- hierarchical dispatch (``Framework.ep_dispatch == "hierarchical"``: DeepEP's normal kernels,
  Megatron-Core's flex dispatcher with DeepEP or HybridEP; DeepSeek-V3 report, arXiv:2412.19437,
  section 3.2.2): a token crosses to each other node that hosts one of its experts once, to the
  GPU of the same in-node index, and NVLink forwards it to its experts there. With the ep group
  on n nodes of g members and the routing spread evenly over the experts (E / n a node), a
  token's k distinct experts leave its node for

      r = (n - 1) (1 - C(E - E / n, k) / C(E, k))        (``remote_nodes``)

  other nodes on average instead of k (n - 1) / n rows: the inter-node bytes are ``S (ep - g) /
  ep`` times ``r / (k (n - 1) / n)`` (``inter_node_share``), the intra-node link carries the rows
  for the node's other members and those forwarded on arrival, ``S ((g - 1) + (ep - g)
  (g - 1) / g) / ep``.
- load imbalance: a dropless router gives some ranks more tokens than T k' / ep; the busiest
  rank sets the pace (none where the framework forces the router's balance,
  ``Framework.moe_force_balance``: its benchmark mode). Its routed-expert compute and
  activations are scaled by the model's router imbalance (``MoEStructure.router_imbalance``;
  ``DROPLESS_IMBALANCE`` where the model states none), and so is what it receives in each
  all-to-all (its NIC and NVLink carry that many more rows). With a capacity factor every
  expert runs exactly its padded capacity (already counted in the profile's FLOPs): no further
  imbalance.
- expert GEMM calls (all ep degrees, ep = 1 included): a framework that loops over its local
  experts (``Framework.expert_gemm_calls`` = c calls per expert; a grouped GEMM is 0) pays each
  call's fixed cost. The device's half-efficiency work ``w_half`` is the fixed cost of a
  layer's ``GEMMS_PER_LAYER`` GEMMs (presets.py ``MATMUL_HALF_S``), so the layer's own curve
  covers one expert's calls and the other ``E / ep - 1`` local experts add, per micro-batch,

      fixed = (E / ep - 1) c w_half / GEMMS_PER_LAYER     (FLOP-equivalents at the max rate)

  forward, twice that backward (a data and a weight gradient GEMM per call), once more in a
  full recompute. Expert parallelism cuts the local experts ep-fold: fewer, larger GEMMs.
- experts whole on every tp rank (a framework without expert tensor parallelism):
  expert_tp.py.
- experts folded over tp (``experts_whole``: Megatron-Core's expert tensor parallel size 1,
  expert_tp.py): a rank holds E / ep whole experts, sharded by ZeRO over the ``tp dp cp / ep``
  ranks holding the same ones (``expert_dp``), and its ep group is ep consecutive ranks (stride
  1, Megatron-Core's expert rank order etp-ep-edp), so the all-to-all stays inside a node
  wherever ep fits in one.
- activations: the routed experts keep per dispatched row its input, the gate and up outputs,
  the activated product and the output (2 h + 4 f_e elements, what graph/moe.py's stand-in
  keeps); the busiest rank keeps the router imbalance times the average. The all-to-all send
  and receive buffers (2 S) are transient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.config import DTYPE_BYTES, ParallelConfig
from autopar.cost_model import comm, memory
from autopar.cost_model.compute import MATMUL_BACKWARD_RATIO
from autopar.cost_model.hardware import Cluster
from autopar.graph.types import LayerProfile, MoEStructure
from autopar.models.presets import MIXTRAL_ROUTER_IMBALANCE

__all__ = [
    "A2A",
    "DROPLESS_IMBALANCE",
    "EP_DISPATCHES",
    "EXPERT_TENSORS",
    "FITTED_ROUTER_IMBALANCE_RANGE",
    "GEMMS_PER_LAYER",
    "EpTerms",
    "all_to_all_s",
    "dispatch_share",
    "ep_collectives",
    "ep_layer_state",
    "ep_stride",
    "ep_terms",
    "expert_call_flops",
    "expert_dp",
    "experts_whole",
    "held_expert_params",
    "inter_node_share",
    "remote_nodes",
    "routed_imbalance",
    "state_parts",
    "unstated_imbalance",
]

# sourced: Switch Transformer (Fedus et al., JMLR 2022, section 2.2, Table 1) provisions 1.25x
# headroom (capacity factor) over a balanced share. The default for a model that states no
# ``router_imbalance``: the busiest expert-parallel rank carries 1.25x the average routed rows.
# It lies between the two families fitted by benchmarks/router_imbalance.py through this cost
# model to Megatron-MoE-ModelZoo's dropless / force-balanced pairs on H100 at EP 8 (Mixtral
# 8x22B 1.063; Qwen3-235B 1.64-1.85 at 16k-128k tokens).
DROPLESS_IMBALANCE = 1.25
# fitted: benchmarks/router_imbalance.py, the two families' medians (Mixtral 1.063, Qwen3 1.787):
# the range an unstated router's imbalance is taken to lie in, which the step-time interval
# of an expert-parallel split spans (assemble.py).
FITTED_ROUTER_IMBALANCE_RANGE = (MIXTRAL_ROUTER_IMBALANCE, 1.79)  # the Mixtral fit, one home
# sourced: autopar/models/moe.py Experts: two parameter tensors (gate_up_proj, down_proj).
EXPERT_TENSORS = 2
A2A = comm.ALL_TO_ALL  # the expert exchange: comm.py's name for it
# How a framework moves the routed rows (module docstring).
EP_DISPATCHES = ("all_to_all", "hierarchical")
# sourced: presets.py MATMUL_HALF_S: the half-efficiency work of a layer is the fixed cost of
# its ~5 GEMMs (about 1 GFLOP each on A100).
GEMMS_PER_LAYER = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class EpTerms:
    """The ep-specific terms of one layer per micro-batch on one rank.

    Attributes:
        extra_fwd_flops: forward FLOPs the busiest rank runs beyond the balanced share.
        extra_bwd_flops: backward FLOPs likewise.
        comm_s: exposed all-to-all time by recompute mode (none, selective, full).
        extra_act_bytes: activations beyond the balanced share, by recompute mode.
        buffer_bytes: the all-to-all send and receive buffers (transient).
    """

    extra_fwd_flops: float = 0.0
    extra_bwd_flops: float = 0.0
    comm_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    extra_act_bytes: tuple[float, float, float] = (0.0, 0.0, 0.0)
    buffer_bytes: float = 0.0


def experts_whole(layer: LayerProfile, tp: int) -> bool:
    """Whether ``layer``'s routed experts run whole on each of its ``tp`` ranks, each rank
    routing its own tokens (folded over tp: ``MoEStructure.expert_tp_folded``)."""
    return layer.moe is not None and layer.moe.expert_tp_folded and tp > 1


def expert_dp(config: ParallelConfig, whole: bool = False) -> int:
    """Ranks the routed experts' state is sharded / reduced over: ``dp * cp / ep``, or
    ``tp * dp * cp / ep`` with the experts whole on every tp rank (``whole``, folded)."""
    return max(1, config.data_ranks * (config.tp if whole else 1) // config.ep)


def ep_stride(layer: LayerProfile, config: ParallelConfig) -> int:
    """Global ranks between two members of an ep group: tp (ep cut from the data-parallel
    axis), or 1 for experts folded over tp (module docstring)."""
    return 1 if experts_whole(layer, config.tp) else config.tp


def held_expert_params(layer: LayerProfile, config: ParallelConfig, shard: int) -> float:
    """Routed-expert parameters of ``layer`` one rank holds apart from its dense part (after tp
    sharding by ``shard``): its E / ep experts, whole where folded over tp (``experts_whole``);
    0 where they stay in the dense part (ep 1, not folded)."""
    whole = experts_whole(layer, shard)
    if layer.moe is None or (config.ep <= 1 and not whole):
        return 0.0
    return layer.moe.routed_params / config.ep / (1 if whole else shard)


def state_parts(layer: LayerProfile, config: ParallelConfig,
                shard: int) -> tuple[tuple[float, int], ...]:
    """(parameters after tp sharding by ``shard``, ranks ZeRO shards them over) of each part of
    ``layer``'s model state on one rank: the dense part over the config's shard group
    (``config.shard_ranks``), and the rank's ``held_expert_params`` over the ``expert_dp``
    ranks where expert parallelism holds them apart."""
    held = held_expert_params(layer, config, shard)
    if not held:
        return ((layer.num_params / shard, config.shard_ranks),)
    assert layer.moe is not None  # held_expert_params: a MoE layer
    return (((layer.num_params - layer.moe.routed_params) / shard, config.shard_ranks),
            (held, expert_dp(config, experts_whole(layer, shard))))


def ep_layer_state(layer: LayerProfile, config: ParallelConfig, shard: int) -> memory.LayerState:
    """Model state of ``layer`` on one rank: the sum of ``memory.layer_state`` over its
    ``state_parts``."""
    parts = [memory.layer_state(p, config, shard_ranks=n)
             for p, n in state_parts(layer, config, shard)]
    return memory.LayerState(
        param_bytes=sum(x.param_bytes for x in parts),
        grad_bytes=sum(x.grad_bytes for x in parts),
        optimizer_bytes=sum(x.optimizer_bytes for x in parts),
        local_params=sum(x.local_params for x in parts),
    )


def remote_nodes(experts: int, top_k: int, nodes: int) -> float:
    """Other nodes a token's ``top_k`` distinct experts lie on, on average, with ``experts``
    spread evenly over ``nodes`` nodes and the routing over the experts (module docstring)."""
    if nodes <= 1 or top_k <= 0:
        return 0.0
    per_node = experts // nodes
    missed = math.comb(experts - per_node, top_k) / math.comb(experts, top_k)
    return (nodes - 1) * (1.0 - missed)


def inter_node_share(experts: int, top_k: int, nodes: int) -> float:
    """The hierarchical dispatch's inter-node rows over the plain all-to-all's (module
    docstring): ``remote_nodes / (k (n - 1) / n)``; 1 on one node."""
    if nodes <= 1 or top_k <= 0:
        return 1.0
    return min(1.0, remote_nodes(experts, top_k, nodes) / (top_k * (nodes - 1) / nodes))


def _members_per_node(cluster: Cluster, ep: int, stride: int) -> int:
    gpn = cluster.gpus_per_node
    per_node = ep if cluster.nodes == 1 or ep * stride <= gpn else max(1, gpn // stride)
    return min(per_node, ep)


def dispatch_share(cluster: Cluster, ep: int, stride: int, moe: MoEStructure,
                   dispatch: str) -> float:
    """``inter_node_share`` of ``moe``'s routing over the ep group's nodes for a hierarchical
    ``dispatch``; 1 for the plain all-to-all."""
    if dispatch != "hierarchical" or ep <= 1:
        return 1.0
    nodes = max(1, ep // _members_per_node(cluster, ep, stride))
    return inter_node_share(moe.experts, moe.top_k, nodes)


def all_to_all_s(cluster: Cluster, ep: int, stride: int, size_bytes: float,
                 inter_share: float = 1.0) -> float:
    """One all-to-all of ``size_bytes`` per rank over ep ranks spaced ``stride`` apart;
    ``inter_share`` < 1: the hierarchical dispatch, which sends that share of the inter-node
    rows and forwards the rest of its rows over the intra-node link (module docstring)."""
    if ep <= 1 or size_bytes <= 0:
        return 0.0
    per_node = _members_per_node(cluster, ep, stride)
    intra, inter = cluster.intra_node, cluster.inter_node
    intra_rows = (per_node - 1) + (
        (ep - per_node) * (per_node - 1) / per_node if inter_share < 1.0 else 0.0)
    intra_s = size_bytes * intra_rows / ep / intra.bandwidth_bytes_per_s
    inter_s = size_bytes * (ep - per_node) / ep * inter_share / inter.bandwidth_bytes_per_s
    latency = intra.latency_s if per_node == ep else inter.latency_s
    return max(intra_s, inter_s) + (ep - 1) * latency


def routed_imbalance(moe: MoEStructure, force_balance: bool = False) -> float:
    """The busiest ep rank's routed rows over the average: 1 with a capacity factor or a
    force-balanced router, else the model's ``router_imbalance`` where it states one, else
    ``DROPLESS_IMBALANCE``."""
    if moe.capacity_factor > 0 or force_balance:
        return 1.0
    return moe.router_imbalance or DROPLESS_IMBALANCE


def unstated_imbalance(moe: MoEStructure | None, force_balance: bool = False) -> bool:
    """Whether a layer's routed rows are costed at the default ``DROPLESS_IMBALANCE`` because
    its model states none (dropless, not force-balanced, no ``router_imbalance``)."""
    return (moe is not None and not moe.router_imbalance
            and routed_imbalance(moe, force_balance) == DROPLESS_IMBALANCE)


def ep_terms(
    layer: LayerProfile, config: ParallelConfig, cluster: Cluster, *, seq_len: int, shard: int,
    force_balance: bool = False, dispatch: str = "all_to_all", whole_sequence: bool = False,
) -> EpTerms:
    """The ep terms of ``layer`` (zero for a dense layer or ep == 1).

    Args:
        layer: the profile layer.
        config: the configuration (ep, tp, micro_batch, dtype, sequence_parallel).
        cluster: the cluster (its link tiers).
        seq_len: tokens per sample.
        shard: the tp degree the layer's compute is divided by (1 if not tp-sharded).
        force_balance: the framework forces the router's balance (no imbalance).
        dispatch: "all_to_all" or "hierarchical" (module docstring).
        whole_sequence: every tp rank routes the whole sequence under sequence parallelism
            (framework_support ``moe_routes_whole_sequence``), not its shard.
    """
    moe = layer.moe
    if moe is None or config.ep <= 1:
        return EpTerms()
    b, w = config.micro_batch, DTYPE_BYTES[config.dtype]
    rows = b * seq_len * moe.routed_rows_per_token()
    extra = routed_imbalance(moe, force_balance) - 1.0
    fwd = moe.routed_fwd_flops(b * seq_len) / shard
    size = rows / _tokens_div(config, whole_sequence) * moe.hidden * w
    act = extra * rows * moe.routed_saved_bytes_per_row(w) / shard
    stride = ep_stride(layer, config)
    share = dispatch_share(cluster, config.ep, stride, moe, dispatch)
    none, sel, full = (float(sum(c.calls * all_to_all_s(cluster, config.ep, stride,
                                                         c.size_bytes, share) for c in calls))
                       for calls in ep_collectives(layer, config, seq_len=seq_len,
                                                   force_balance=force_balance,
                                                   whole_sequence=whole_sequence))
    return EpTerms(
        extra_fwd_flops=extra * fwd,
        extra_bwd_flops=MATMUL_BACKWARD_RATIO * extra * fwd,
        comm_s=(none, sel, full),
        extra_act_bytes=(act, act, 0.0),
        buffer_bytes=2 * size,
    )


def expert_call_flops(layer: LayerProfile, config: ParallelConfig, calls_per_expert: int,
                      half_flops: float) -> float:
    """The forward fixed cost, in FLOP-equivalents at the max matmul rate, of the GEMM calls of
    ``layer``'s local experts beyond one expert's (module docstring): 0 for a dense layer or a
    grouped GEMM (``calls_per_expert`` 0)."""
    if layer.moe is None or calls_per_expert <= 0:
        return 0.0
    local = layer.moe.experts // max(1, config.ep)
    return max(0, local - 1) * calls_per_expert * half_flops / GEMMS_PER_LAYER


def _tokens_div(config: ParallelConfig, whole_sequence: bool) -> int:
    """What a tp rank's routed tokens are divided by: tp under sequence parallelism, unless
    the MoE module gathers the whole sequence (``whole_sequence``)."""
    return config.tp if config.sequence_parallel and not whole_sequence else 1


def ep_collectives(layer: LayerProfile, config: ParallelConfig, *, seq_len: int,
                   force_balance: bool = False, whole_sequence: bool = False,
                   ) -> tuple[tuple[comm.Collective, ...], ...]:
    """The all-to-alls of one MoE layer per micro-batch on the "ep" axis, by recompute mode
    (module docstring); the busiest rank receives (dispatch) and sends back (combine) its
    imbalanced share (its even share where the router's balance is forced). ``whole_sequence``
    as in ``ep_terms``."""
    moe = layer.moe
    if moe is None or config.ep <= 1:
        return (), (), ()
    rows = (config.micro_batch * seq_len * moe.routed_rows_per_token()
            / _tokens_div(config, whole_sequence))
    rows *= routed_imbalance(moe, force_balance)
    data = rows * moe.hidden * DTYPE_BYTES[config.dtype]

    def call(size: float, phase: str, calls: int) -> comm.Collective:
        return comm.Collective(kind=A2A, axis="ep", size_bytes=size, calls=calls,
                               per="microbatch", phase=phase)

    fwd = (call(8.0 * config.ep, "forward", 1), call(8.0 * rows, "forward", 1),
           call(data, "forward", 2))
    bwd = (call(data, "backward", 2),)
    return fwd + bwd, fwd + bwd, fwd + fwd + bwd

