"""Memory terms: model state (parameters, gradients, optimizer) and activations, per rank.

Units: bytes. Model state follows what the runtime does for each ``zero`` stage
(autopar/runtime/data_parallel.py, docs/runtime.md), per parameter held by the rank after
tensor-parallel and pipeline sharding (w = bytes of the training dtype, 2 for bf16/fp16, 4 for
fp32; n = dp_shard * cp, the ranks a ZeRO shard spans: dp without HSDP and context parallelism;
m = micro-batches per step; offload moves state to the host: offload.py):

| mechanism (dp > 1 unless noted)             | parameters  | gradients          | optimizer |
|---------------------------------------------|-------------|--------------------|-----------|
| none (dp == 1): autocast, fp32 params       | 4 + w'      | 4                  | 8         |
| zero 0, tp == pp == 1: DDP                  | 4 + w'      | 4 + 4 (buckets)    | 8         |
| zero 0, tp > 1 or pp > 1: replicate()       | 4 + w'      | 4 + 4 a            | 8         |
| zero 1: fully_shard(reshard=False)          | 4/n + w     | 4 a or 4/n         | 8/n       |
| zero 2: same, pp == 1                       | 4/n + w     | 4/n                | 8/n       |
| zero 2: pp > 1                              | 4/n + w     | 4 a or 4/n         | 8/n       |
| zero 3: fully_shard, pp == 1                | 4/n         | 4/n                | 8/n       |
| zero 3: pp > 1                              | 4/n + w u   | 4 a or 4/n         | 8/n       |

w' = w when the training dtype is 16-bit (the 16-bit copies autocast makes and the backward keeps;
FSDP2's unsharded compute copy for replicate()) and 0 for fp32. Optimizer = fp32 Adam moments
(8 bytes); the fp32 master weights are the 4-byte stored parameters. a = 1 when unsharded
gradients accumulate across micro-batches (m > 1 and zero 0 or 1, or m > 1 and pp > 1: the
pipeline schedule syncs gradients only in its last micro-batch), else 0; replicate() is FSDP2 over
a size-1 shard group and accumulates the same way (measured on CPU: both copies live at the last
micro-batch's backward); FSDP2 accumulates them in its
reduce dtype, fp32 (``FSDPParam.to_accumulated_grad_if_needed``), hence 4 bytes whatever w.
u = 1 when zero 3 runs under a pipeline schedule with m > 1 (parameters stay unsharded from the
first backward to the last), else 0. Zero 1 and 2 keep parameters unsharded from the first
forward to the last backward. Zero 3 at pp == 1 gathers one unit at a time: its unsharded
parameters (current + prefetched) and unsharded gradients are transient. The ZeRO paper's
accounting (16 bytes per parameter, sharded by stage, reference/formulas.md section 3) is
``zero_paper_model_state_bytes``; stage 3 at pp == 1 equals it.

Activations per micro-batch come from the profile's ``saved_bytes`` (bytes per sample at the
profile dtype), rescaled to the training dtype, sharded by tp except ``saved_bytes_replicated``
(sharded too when sequence parallelism is on). The loss's log-softmax is fp32 whatever the
training dtype (the zoo's ``cross_entropy_loss`` upcasts logits): 4 s V bytes per sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.config import DTYPE_BYTES, RECOMPUTE, ParallelConfig, dp_mechanism
from autopar.cost_model.presets import ALLOCATOR_RESERVE_BYTES, COMM_BUFFER_BYTES_PER_GROUP
from autopar.graph.types import LayerProfile

if TYPE_CHECKING:
    from autopar.cost_model.hardware import Cluster

__all__ = [
    "ALLOCATOR_RESERVE_BYTES",
    "COMM_BUFFER_BYTES_PER_GROUP",
    "LayerState",
    "activation_bytes",
    "buffers_bytes",
    "fsdp_accumulates_grads",
    "fsdp_keeps_params_unsharded",
    "layer_state",
    "transient_bytes",
    "zero_paper_model_state_bytes",
]

MASTER_BYTES = DTYPE_BYTES["fp32"]  # fp32 parameters (the master weights, mixed precision)
GRAD_BYTES = DTYPE_BYTES["fp32"]  # fp32 gradients (reduce dtype fp32)
ADAM_BYTES = 2 * DTYPE_BYTES["fp32"]  # fp32 exp_avg + exp_avg_sq
FP32_LOGPROB_BYTES = DTYPE_BYTES["fp32"]  # the loss's log-softmax is fp32


def zero_paper_model_state_bytes(psi: float, nd: int, stage: int, k: float = 12.0) -> float:
    """Per-GPU model-state bytes of ZeRO stage ``stage`` (Rajbhandari et al. 2020, Table 1).

    Mixed-precision Adam: 2 psi fp16 parameters, 2 psi fp16 gradients, K psi optimizer state.
    Stage 0: (2 + 2 + K) psi; 1: 4 psi + K psi / Nd; 2: 2 psi + (2 + K) psi / Nd;
    3: (2 + 2 + K) psi / Nd.
    """
    if stage == 0:
        return (4 + k) * psi
    if stage == 1:
        return 4 * psi + k * psi / nd
    if stage == 2:
        return 2 * psi + (2 + k) * psi / nd
    if stage == 3:
        return (4 + k) * psi / nd
    raise ValueError(f"ZeRO stage must be 0..3, got {stage}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerState:
    """Model-state bytes one rank holds for one layer.

    Attributes:
        param_bytes: stored parameters plus unsharded compute copies kept across the step.
        grad_bytes: gradients (and DDP's bucket copies).
        optimizer_bytes: Adam moments.
        local_params: parameters whose optimizer update this rank performs.
    """

    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    local_params: float


def fsdp_accumulates_grads(config: ParallelConfig) -> bool:
    """Whether FSDP2 keeps unsharded fp32 gradients across micro-batches (see the table).

    ``replicate()`` is FSDP2 over a size-1 shard group: with gradient sync off before the last
    micro-batch it accumulates into the same unsharded buffers, besides its reduced gradients.
    """
    if dp_mechanism(config) not in ("fsdp", "replicate") or config.num_microbatches == 1:
        return False
    return config.zero in (0, 1) or config.pp > 1


def fsdp_keeps_params_unsharded(config: ParallelConfig) -> bool:
    """Whether FSDP2 holds unsharded parameters through the step (zero 1/2; zero 3 under pp)."""
    if dp_mechanism(config) != "fsdp":
        return False
    return config.zero in (1, 2) or (config.pp > 1 and config.num_microbatches > 1)


def layer_state(
    params_per_rank: float, config: ParallelConfig, shard_ranks: int | None = None
) -> LayerState:
    """Model state of ``params_per_rank`` parameters (after tp sharding) under the config.

    ``shard_ranks``: the ranks ZeRO shards them over (default dp; routed experts under expert
    parallelism: dp / ep, cost_model/moe.py).
    """
    w = DTYPE_BYTES[config.dtype]
    copy = w if config.dtype != "fp32" else 0  # autocast / replicate() 16-bit compute copy
    # the ZeRO shard group: dp_shard * cp (HSDP, cp), or the caller's (ep's routed experts)
    p, n = params_per_rank, shard_ranks or config.shard_ranks
    kind = dp_mechanism(config)
    if kind in ("none", "replicate", "ddp"):
        buckets = GRAD_BYTES if kind == "ddp" else 0
        accumulated = GRAD_BYTES if fsdp_accumulates_grads(config) else 0  # replicate(), m > 1
        return LayerState(
            param_bytes=(MASTER_BYTES + copy) * p,
            grad_bytes=(GRAD_BYTES + buckets + accumulated) * p,
            optimizer_bytes=ADAM_BYTES * p,
            local_params=p,
        )
    sharded = p / n
    unsharded_params = w * p if fsdp_keeps_params_unsharded(config) else 0.0
    accumulated_grads = GRAD_BYTES * p if fsdp_accumulates_grads(config) else 0.0
    # A unit's sharded gradient appears at its reduce-scatter in the step's last backward, which
    # frees the unsharded accumulator it reduces (FSDP2 ``foreach_reduce``); with zero_grad
    # (set_to_none) at every step's end the two never coexist: max(4 p, 4 p / n) = 4 p.
    return LayerState(
        param_bytes=MASTER_BYTES * sharded + unsharded_params,
        grad_bytes=accumulated_grads or GRAD_BYTES * sharded,
        optimizer_bytes=ADAM_BYTES * sharded,
        local_params=sharded,
    )


def activation_bytes(
    layer: LayerProfile,
    config: ParallelConfig,
    *,
    dtype_ratio: float,
    tp_sharded: bool,
    logprob_elements: float,
    gathered_logits: bool = False,
    sp_gathered_bytes: float = 0.0,
    selective_keeps_gathered: bool = True,
    fp32_logprobs: bool = True,
) -> tuple[float, float, float]:
    """Bytes one rank saves for backward for one micro-batch, by recompute mode.

    Args:
        layer: the profile layer.
        config: the config (micro_batch, tp, sequence_parallel).
        dtype_ratio: training-dtype bytes over profile-dtype bytes.
        tp_sharded: whether tensor parallelism splits this layer's activations.
        logprob_elements: elements of the fp32 log-softmax per sample on this rank (head
            layer only: s * V / vocab shards), 0 elsewhere.
        gathered_logits: the head's vocab shards are all-gathered before the loss (the
            runtime's colwise head with ``Replicate()`` output): the log-softmax of
            ``logprob_elements`` is whole on every tp rank, not sharded.
        sp_gathered_bytes: bytes per sample (profile dtype) of the layer's inputs that sequence
            parallelism all-gathers before a column-parallel (or vocab-parallel) linear. The
            runtime's DTensor linears keep the gathered [b, s, h] input for the weight
            gradient (no re-gather in the backward), so under SP that part of the replicated
            bytes stays whole instead of shrinking by tp (Korthikanti's 34/t assumes a
            re-gather; autopar's runtime does not re-gather).
        fp32_logprobs: the loss keeps fp32 log-probabilities (torch's cross entropy); False for
            a fused loss kernel, which keeps the logits at the training dtype
            (``ModelProfile.loss``).
        selective_keeps_gathered: whether the ``selective`` mode keeps those gathered inputs
            (False for per-op checkpointing, whose save list holds no all-gather: they are
            gathered again in the backward).
    """
    b, tp = config.micro_batch, config.tp
    out = []
    for mode in RECOMPUTE:
        saved = layer.saved_bytes.get(mode, 0) * b * dtype_ratio
        rep = layer.saved_bytes_replicated.get(mode, 0) * b * dtype_ratio
        if tp_sharded and tp > 1:
            saved = (saved - rep) / tp + (rep / tp if config.sequence_parallel else rep)
            keeps = mode == "none" or (mode == "selective" and selective_keeps_gathered)
            if config.sequence_parallel and keeps:
                saved += sp_gathered_bytes * b * dtype_ratio * (1.0 - 1.0 / tp)
            if gathered_logits and mode != "full":  # the log-softmax is whole: undo its 1/tp
                whole = DTYPE_BYTES[config.dtype] * logprob_elements * b
                saved += whole * (1.0 - 1.0 / tp)
        # The profile counted the fp32 log-softmax at ratio-scaled size; restore its 4 bytes.
        if mode != "full" and fp32_logprobs:
            saved += FP32_LOGPROB_BYTES * logprob_elements * b * (1.0 - dtype_ratio)
        out.append(max(0.0, saved))
    return out[0], out[1], out[2]


def transient_bytes(
    act: tuple[float, float, float],
    *,
    output_bytes: float,
    gathered_param_bytes: float,
    unsharded_grad_bytes: float,
    logits_bytes: float,
) -> tuple[float, float, float]:
    """Working memory while one layer runs, by recompute mode (one micro-batch, one rank).

    Every mode: the output gradient and input gradient (2 x output bytes), gathered ZeRO-3
    parameters and unsharded gradients awaiting reduce-scatter, and the head's logits with
    the two fp32 gradients of the loss's backward (of the log-probabilities and of the
    logits, alive together: ``logits_bytes``). Selective recompute re-creates the attention
    core (act_none - act_sel), full recompute re-creates the whole layer (act_none -
    act_full) during its backward.
    """
    base = 2 * output_bytes + gathered_param_bytes + unsharded_grad_bytes + logits_bytes
    none, sel, full = act
    return base, base + max(0.0, none - sel), base + max(0.0, none - full)


def buffers_bytes(config: ParallelConfig, cluster: Cluster | None = None) -> float:
    """Communication buffers (one set per process group in use) plus the allocator reserve.

    The sizes are the cluster's ``comm_buffer_bytes_per_group`` and ``allocator_reserve_bytes``
    (GPU presets: the NCCL and CUDA figures above; the cpu preset: 0); without a cluster, the
    GPU figures.
    """
    per_group = COMM_BUFFER_BYTES_PER_GROUP if cluster is None else (
        cluster.comm_buffer_bytes_per_group)
    reserve = ALLOCATOR_RESERVE_BYTES if cluster is None else cluster.allocator_reserve_bytes
    groups = sum(1 for d in (config.tp, config.cp, config.shard_ranks,
                             config.dp_replicate, config.pp) if d > 1)
    return groups * per_group + reserve
