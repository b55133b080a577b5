"""CostTable: every per-layer cost term of one outer configuration, in one place.

``build_cost_table(profile, cluster, config)`` (autopar/cost_model/layer_costs.py) fills it;
``assemble`` (autopar/cost_model/assemble.py) turns it plus a stage split and per-layer recompute
choices into an Estimate; the search's ILP encodes the very same formula over the very same
table, so the ILP objective, the plan's estimate and ``estimate(plan)`` never disagree.

Units: seconds and bytes. "per micro-batch" terms are for one micro-batch on one rank (after
tensor-parallel sharding); "per step" terms happen once per optimizer step. Tuples indexed by
recompute mode follow ``autopar.config.RECOMPUTE`` = ("none", "selective", "full").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autopar.config import RECOMPUTE, ParallelConfig
from autopar.cost_model.framework_names import DEFAULT_FRAMEWORK
from autopar.cost_model.frameworks import Framework, get_framework
from autopar.cost_model.held_counts import splits_backward
from autopar.cost_model.identity_cache import IdentityCache

__all__ = ["RECOMPUTE_INDEX", "CostTable", "LayerCost", "with_schedule"]

RECOMPUTE_INDEX: dict[str, int] = {name: i for i, name in enumerate(RECOMPUTE)}
# The LayerCost fields given by recompute mode.
BY_MODE = ("recompute_flops_per_sample", "recompute_s", "tp_comm_s", "act_bytes",
           "transient_bytes", "ep_comm_s", "cp_comm_s", "unstated_imbalance_s",
           "weight_pass_bytes", "input_pass_freed_bytes")


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerCost:
    """Cost terms of one profile layer under one outer configuration.

    Attributes:
        name: the name of the profile layer the terms were computed for (repeated blocks share
            one LayerCost, their first occurrence's: ``CostTable.names`` names every position).
        num_params: parameters of the layer (unsharded).
        model_flops_per_sample: forward + backward FLOPs per sample (unsharded; for MFU).
        recompute_flops_per_sample: extra forward FLOPs per sample, by recompute mode.
        compute_s: forward + backward compute of one micro-batch on one rank.
        backward_s: the backward part of ``compute_s`` (the window that hides DP reduction).
        recompute_s: re-run forward time per micro-batch, by recompute mode.
        tp_comm_s: exposed tensor-parallel communication per micro-batch, by recompute mode
            (full recompute repeats the forward's collectives).
        dp_microbatch_s: exposed data-parallel communication per micro-batch (ZeRO-3 parameter
            all-gathers in forward and backward).
        act_bytes: activations saved for backward per micro-batch on one rank, by recompute mode.
        transient_bytes: working memory while the layer runs (e.g. the activations a fully
            recomputed layer re-creates during its backward, gathered parameters), by mode.
        param_bytes: parameter bytes held per rank (after tp and ZeRO sharding).
        grad_bytes: gradient bytes held per rank.
        optimizer_bytes: optimizer-state bytes per rank (fp32 master weights and Adam moments).
        dp_step_s: data-parallel gradient reduction time per step for this layer, before overlap.
        optimizer_s: optimizer step time for this layer's local state (with offload: the CPU
            step and the parameters' copy back).
        ep_comm_s: exposed expert-parallel all-to-all time per micro-batch, by recompute mode
            (cost_model/moe.py; 0 for a dense layer or ep == 1).
        cp_comm_s: exposed ring-attention K/V exchange per micro-batch, by recompute mode
            (context parallelism, cp_comm.py; recompute repeats the forward ring).
        host_bytes: host memory this rank holds for the layer (offload.py).
        unstated_imbalance_s: per micro-batch, by recompute mode, what the busiest expert-
            parallel rank spends beyond a balanced router (routed-expert compute and
            all-to-all, included in the terms above) where the model states no router
            imbalance and the cost model takes ``moe.DROPLESS_IMBALANCE``: the part of the
            step the interval widens over the fitted range (assemble.py); 0 otherwise.
        weight_pass_bytes: what one micro-batch holds beyond ``act_bytes`` from the layer's
            input pass to its weight pass under a schedule that splits backwards: the output
            gradients of its weight ops, which torch's ``stage_backward_input`` keeps for
            ``stage_backward_weight`` (layer_terms.weight_pass_bytes_of), by recompute mode.
        input_pass_freed_bytes: what that input pass frees of ``act_bytes``, by recompute
            mode: the head's loss (saved after its last weight op). Only the last layer of a
            stage frees its tail and the head is always one; a block's tail (a MoE block
            without shared experts has one) is not credited. A stage holds
            max(0, sum of weight_pass_bytes - the head's input_pass_freed_bytes) more.
    """

    name: str
    num_params: int
    model_flops_per_sample: float
    recompute_flops_per_sample: tuple[float, float, float]
    compute_s: float
    backward_s: float
    recompute_s: tuple[float, float, float]
    tp_comm_s: tuple[float, float, float]
    dp_microbatch_s: float
    act_bytes: tuple[float, float, float]
    transient_bytes: tuple[float, float, float]
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    dp_step_s: float
    optimizer_s: float
    ep_comm_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    cp_comm_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    host_bytes: float = 0.0
    unstated_imbalance_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    weight_pass_bytes: tuple[float, float, float] = (0.0, 0.0, 0.0)
    input_pass_freed_bytes: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def time_per_microbatch_s(self, recompute: str) -> float:
        """t_i(r) = compute + recompute(r) + tp_comm(r) + ep_comm(r) + cp_comm(r) + dp per
        micro-batch."""
        k = RECOMPUTE_INDEX[recompute]
        return (self.compute_s + self.recompute_s[k] + self.tp_comm_s[k] + self.ep_comm_s[k]
                + self.cp_comm_s[k]
                + self.dp_microbatch_s)

    @property
    def static_bytes(self) -> float:
        """Parameters + gradients + optimizer state held per rank."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def never_recomputed(self) -> LayerCost:
        """These terms with every recompute mode costed as none: a layer no runtime recomputes
        (the embedding and the head: autopar's runtime, Megatron-LM, torchtitan and DeepSpeed
        checkpoint blocks only, recompute_layers.blocks_recompute), and every layer under a
        schedule that splits backwards (``with_schedule``)."""
        none: dict[str, Any] = {name: (getattr(self, name)[0],) * len(RECOMPUTE)
                                for name in BY_MODE}
        return dataclasses.replace(self, **none)


@dataclass(frozen=True, slots=True, kw_only=True)
class CostTable:
    """All cost terms of one outer configuration (dp, tp, pp, micro-batch, schedule, ...).

    Attributes:
        config: the outer configuration (its ``recompute`` is the default per-layer choice).
        layers: one LayerCost per profile layer, in order; the copies of a repeated block are
            one shared object (the same terms).
        p2p_s: exposed pipeline point-to-point time per micro-batch per stage (forward
            activation send plus backward gradient send); 0 when pp == 1.
        dp_tail_s: data-parallel reduction that no overlap can hide (the last bucket);
            0 when dp == 1.
        overlap_efficiency: fraction of one micro-batch's backward time usable to hide the
            data-parallel gradient reduction (in [0, 1]).
        buffers_bytes: per-rank constant memory: communication buffers, allocator reserve.
        capacity_bytes: usable device memory: device memory minus the cluster's headroom.
        peak_flops: the device's peak FLOP/s at the training dtype (for MFU).
        tokens_per_step: global_batch * seq_len (the whole sequence, whatever cp).
        recv_buffer_bytes: bytes of one micro-batch's stage-boundary activation on a rank (what
            torch's PipelineStage allocates per micro-batch to receive an input or an output
            gradient; ``pipeline.pipeline_buffer_microbatches`` counts them); 0 when pp == 1.
        framework: the training framework the terms are for (``frameworks.Framework``).
        dp_head_s: the step's first parameter gather, which nothing before it can hide
            (ZeRO 1-3 with ``first_gather_exposed``); 0 otherwise.
        host_capacity_bytes: host memory per device for offloaded state (the cluster's).
        dtype_reason: why the config's precision, in words (precision.dtype_reason).
        names: the profile layer's name at each position of ``layers`` (by default the
            layers' own names: a table whose layers are all distinct objects).
        blocks: whether each profile layer is a block (what a framework's recompute pattern
            counts: recompute_layers.py); empty: every layer is (``block_mask``).
    """

    config: ParallelConfig
    layers: tuple[LayerCost, ...]
    p2p_s: float
    dp_tail_s: float
    overlap_efficiency: float
    buffers_bytes: float
    capacity_bytes: float
    peak_flops: float
    tokens_per_step: int
    recv_buffer_bytes: float = 0.0
    framework: Framework = dataclasses.field(
        default_factory=lambda: get_framework(DEFAULT_FRAMEWORK))
    dp_head_s: float = 0.0
    host_capacity_bytes: float = 0.0
    dtype_reason: str = ""
    names: tuple[str, ...] = ()
    blocks: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not self.names:
            object.__setattr__(self, "names", tuple(x.name for x in self.layers))
        elif len(self.names) != len(self.layers):
            raise ValueError(f"CostTable has {len(self.layers)} layers but {len(self.names)} "
                             "names")
        if self.blocks and len(self.blocks) != len(self.layers):
            raise ValueError(f"CostTable has {len(self.layers)} layers but {len(self.blocks)} "
                             "block flags")

    @property
    def block_mask(self) -> tuple[bool, ...]:
        """Whether each layer is a block (``blocks``, or every layer when it is empty)."""
        return self.blocks or (True,) * len(self.layers)

    @property
    def num_microbatches(self) -> int:
        """m, micro-batches per pipeline per step (the config's)."""
        return self.config.num_microbatches

    @property
    def world_size(self) -> int:
        """dp * cp * tp * pp (the config's)."""
        return self.config.world_size

    @property
    def overlap_slowdown(self) -> float:
        """Compute slowed per second of data-parallel communication that overlaps it (the
        framework's)."""
        return self.framework.overlap_slowdown

    @property
    def step_overhead_s(self) -> float:
        """The framework's fixed seconds per step outside the layers."""
        return self.framework.step_overhead_s

    @property
    def step_fixed_s(self) -> float:
        """Per-step seconds that no split changes: framework overhead + first exposed gather."""
        return self.step_overhead_s + self.dp_head_s


def with_schedule(table: CostTable, config: ParallelConfig) -> CostTable:
    """``table``, built for a schedule whose backwards are whole, for ``config``: the same
    degrees, micro-batch and ZeRO stage, any schedule.

    The per-layer terms ``build_cost_table`` computes do not depend on the schedule (the
    search builds one table per outer shape and shares it among its schedule variants), except
    that a schedule splitting backwards into input and weight passes recomputes nothing: its
    blocks cost every mode as none (``LayerCost.never_recomputed``), so the search never gains
    by a mode there and a plan says none (``framework_support.split_recompute_refusal`` says
    why). A repeated block stays one shared object.
    """
    if config.pp <= 1 or not splits_backward(config.schedule):
        return dataclasses.replace(table, config=config)
    layers = _NEVER_RECOMPUTED.get((table.layers,), None, lambda: _never_recomputed(table.layers))
    return dataclasses.replace(table, config=config, layers=layers)


def _never_recomputed(layers: tuple[LayerCost, ...]) -> tuple[LayerCost, ...]:
    """Every layer's ``never_recomputed`` terms, a shared object staying one."""
    done: dict[int, LayerCost] = {}
    for layer in layers:
        if id(layer) not in done:
            done[id(layer)] = layer.never_recomputed()
    return tuple(done[id(layer)] for layer in layers)


# A search re-targets one table to each of its shape's schedules (``with_schedule``): the
# layers without recompute are built once per table (by the identity of its layers).
_NEVER_RECOMPUTED: IdentityCache[tuple[LayerCost, ...]] = IdentityCache(64)
