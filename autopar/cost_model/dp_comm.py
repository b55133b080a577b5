"""Data-parallel communication terms: the collectives of one FSDP2 / replicate() / DDP unit,
as autopar's runtime issues them and as a framework issues them, and their exposed time; and
the FSDP2 root unit's gathered parameters and gradients that outlive its layers
(``fsdp_root_bytes``).

Charged as layer_costs.py's module docstring lists them; overlap by ``overlap.overlapped_s``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass

from autopar.config import DTYPE_BYTES, FP8_ELEMENT_BYTES, ParallelConfig, dp_mechanism
from autopar.cost_model import comm, memory
from autopar.cost_model.frameworks import DDP_BUCKET_BYTES, GATHER_BUCKET, Framework
from autopar.cost_model.moe import held_expert_params
from autopar.cost_model.overlap import overlapped_s
from autopar.cost_model.tp_comm import AG, AR, RS, tp_sharded
from autopar.graph.types import LayerProfile, ModelProfile

__all__ = [
    "DDP_BUCKET_BYTES",
    "RootShare",
    "dp_collectives",
    "dp_head_s",
    "dp_terms",
    "framework_dp_collectives",
    "fsdp_root_bytes",
    "fsdp_unit_params",
    "params_tp",
    "root_held",
    "root_share",
]


def params_tp(layer: LayerProfile, cfg: ParallelConfig) -> float:
    """Parameters of ``layer`` one rank holds after tp (and ep: its E / ep routed experts,
    whole where folded over tp: moe.py ``held_expert_params``)."""
    shard = cfg.tp if tp_sharded(layer) else 1
    experts = held_expert_params(layer, cfg, shard)
    routed = layer.moe.routed_params if experts and layer.moe is not None else 0.0
    return (layer.num_params - routed) / shard + experts


def _roots(profile: ModelProfile) -> list[int]:
    # The layers FSDP2's root module holds at one stage: every non-block layer with parameters.
    return [k for k, x in enumerate(profile.layers) if x.kind != "block" and x.num_params]


def root_held(cfg: ParallelConfig, fw: Framework) -> bool:
    """Whether a root FSDP2 unit holds the embedding and the head over the step: zero 3 at one
    stage, where ``fw`` wraps each block and then the whole model
    (``Framework.fsdp_root_holds_edges``: autopar's runtime; torchtitan wraps them as their own
    units, DeepSpeed gathers each module in its buckets)."""
    return (dp_mechanism(cfg) == "fsdp" and cfg.zero == 3 and cfg.num_stages == 1
            and fw.fsdp_root_holds_edges)


def fsdp_root_bytes(profile: ModelProfile, cfg: ParallelConfig, fw: Framework) -> float:
    """Zero 3 at pp == 1 (``root_held``): the root unit's unsharded parameters and gradients
    held over the step.

    FSDP2 never reshards the root module after forward, so its gathered parameters (w bytes per
    parameter) stay from the forward to the end of the backward; its reduce-scatter waits for
    every root gradient, the embedding's coming last, so the other root layers' unsharded
    gradients (the head's), in the parameters' dtype until that reduce-scatter casts them
    (torch 2.13 FSDP2 ``foreach_reduce``), stay through the blocks' backward. The per-layer
    transient terms count one unit at a time (a root layer's: ``root_share``); this is the
    root's share that outlives its own layers.
    """
    roots = _roots(profile)
    if not root_held(cfg, fw) or not roots:
        return 0.0
    params = [params_tp(profile.layers[k], cfg) for k in roots]
    return DTYPE_BYTES[cfg.dtype] * (sum(params) + sum(params[1:]))


@dataclass(frozen=True, slots=True)
class RootShare:
    """What a layer of the held root unit (``root_held``) adds to its own working set.

    Attributes:
        prefetch_params: parameters gathered beside it while it runs: the next unit's,
            prefetched (the largest block's); its own the root holds (``fsdp_root_bytes``).
        holds_grad: the root holds its gradient (every root layer but the first, the
            embedding, whose backward ends the root's).
        other_params: the other root layers' parameters, whose gradients the root's
            reduce-scatter casts to the reduce dtype with the first layer's (0 on the others).
    """

    prefetch_params: float
    holds_grad: bool
    other_params: float


def root_share(profile: ModelProfile, cfg: ParallelConfig, fw: Framework,
               index: int) -> RootShare | None:
    """``RootShare`` of layer ``index`` of the held root unit; None for any other layer, whose
    own unit's gather and gradient its working set counts."""
    roots = _roots(profile)
    if not root_held(cfg, fw) or index not in roots:
        return None
    blocks = [params_tp(x, cfg) for x in profile.layers if x.kind == "block"]
    first = index == roots[0]
    others = sum(params_tp(profile.layers[k], cfg) for k in roots[1:]) if first else 0.0
    return RootShare(prefetch_params=max(blocks, default=0.0), holds_grad=not first,
                     other_params=others)


def fsdp_unit_params(profile: ModelProfile, cfg: ParallelConfig, index: int) -> float:
    """Parameters (per rank, after tp) of the FSDP2 / replicate() unit charged on layer ``index``.

    A block is its own unit. With one stage the root module holds every non-block layer: one
    unit, charged on the first non-block layer with parameters (0 on the others). With several
    stages each stage module's root holds its non-block layer (embedding or head).
    """
    layer = profile.layers[index]
    if layer.kind == "block" or cfg.num_stages > 1:
        return params_tp(layer, cfg)
    roots = _roots(profile)
    if not roots or index != roots[0]:
        return 0.0
    return sum(params_tp(profile.layers[k], cfg) for k in roots)


def _dp(kind: str, size: float, per: str, phase: str, calls: float = 1) -> comm.Collective:
    return comm.Collective(kind=kind, axis="dp", size_bytes=size, calls=calls, per=per,
                           phase=phase, counted=True)


def dp_collectives(cfg: ParallelConfig, unit_params: float) -> tuple[comm.Collective, ...]:
    """The dp collectives of one FSDP2 / replicate() / DDP unit (module docstring).

    Args:
        cfg: the config (dp, zero, pp, dtype, micro-batches).
        unit_params: the unit's parameters on this rank (``fsdp_unit_params``).
    """
    kind = dp_mechanism(cfg)
    if kind == "none" or unit_params <= 0:
        return ()
    grads = memory.GRAD_BYTES * unit_params  # reduced in fp32
    if kind == "ddp":  # 25 MiB buckets; DDP's C++ reducer is invisible to count_collectives
        return (dataclasses.replace(_dp(AR, DDP_BUCKET_BYTES, "step", "backward",
                                        grads / DDP_BUCKET_BYTES), counted=False),)
    if kind == "replicate":
        return (_dp(AR, grads, "step", "backward"),)
    gather_bytes = DTYPE_BYTES[cfg.dtype] * unit_params
    if cfg.zero in (1, 2):
        per_mb = cfg.zero == 2 and cfg.pp == 1
        calls = (_dp(AG, gather_bytes, "step", "forward"),
                 _dp(RS, grads, "microbatch" if per_mb else "step", "backward"))
    elif cfg.pp == 1:
        calls = (_dp(AG, gather_bytes, "microbatch", "forward"),
                 _dp(AG, gather_bytes, "microbatch", "backward"),
                 _dp(RS, grads, "microbatch", "backward"))
    else:
        calls = (_dp(AG, gather_bytes, "microbatch", "forward"),
                 _dp(AG, gather_bytes, "step", "backward"), _dp(RS, grads, "step", "backward"))
    if cfg.data_ranks == 1:
        # FSDP2 over one rank (an offload, config.dp_mechanism) issues no collective: kept for
        # the host copies they stand for (offload.host_copies), not counted.
        return tuple(dataclasses.replace(c, counted=False) for c in calls)
    if cfg.dp_replicate == 1:
        return calls
    # HSDP: each reduce-scatter's shard is all-reduced over the replicas (FSDP2 HSDP).
    rs = calls[-1]
    shard = dataclasses.replace(rs, kind=AR, axis="dp_replicate",
                                size_bytes=grads / cfg.shard_ranks)
    return (*calls, shard)


def framework_dp_collectives(colls: tuple[comm.Collective, ...], cfg: ParallelConfig,
                             fw: Framework, *, fp8_linears: bool = False
                             ) -> tuple[comm.Collective, ...]:
    """autopar's dp collectives as ``fw`` issues them: gradients reduced at the framework's
    dtype (``grad_reduce_bytes``), parameters gathered in fp8 where the unit's linears run
    fp8 (``fp8_linears``) and the framework gathers them so (``fp8_param_gather``: the block's
    norm weights, under 0.1% of it, counted with the linears), and ZeRO-3 gathers and
    reductions split into the framework's buckets (``zero3_gather == "bucket"``: one call per
    bucket, each paying the ring latency)."""
    fp8_gather = fp8_linears and fw.fp8_param_gather
    if (fw.grad_reduce_bytes == memory.GRAD_BYTES and fw.zero3_gather != GATHER_BUCKET
            and not fp8_gather):
        return colls
    out = []
    for c in colls:
        size = c.size_bytes
        if c.kind != AG:
            size *= fw.grad_reduce_bytes / memory.GRAD_BYTES
        elif fp8_gather:
            size *= FP8_ELEMENT_BYTES / DTYPE_BYTES[cfg.dtype]
        calls = c.calls
        if fw.zero3_gather == GATHER_BUCKET and cfg.zero == 3 and c.kind != AR:
            elem = DTYPE_BYTES[cfg.dtype] if c.kind == AG else fw.grad_reduce_bytes
            bucket = elem * (fw.zero3_live_params / 2 if c.kind == AG else fw.reduce_bucket_params)
            split = max(1, math.ceil(size / bucket))
            size, calls = size / split, calls * split
        out.append(dataclasses.replace(c, size_bytes=size, calls=calls, counted=False))
    return tuple(out)


def dp_terms(colls, links: dict[str, comm.GroupLink], fwd_s: float, bwd_s: float, eta: float,
             slowdown: float = 0.0):
    """(dp_step_s, dp_microbatch_s, tail_s) of one layer's dp collectives (each timed on the
    link of its axis in ``links``: "dp", "dp_replicate", "pcie").

    Collectives within a micro-batch overlap that micro-batch's forward or backward of the layer
    (prefetch, eta of it usable): only the excess is exposed, plus the slowdown of the compute
    they overlap (``overlapped_s``). A per-step forward all-gather
    (zero 1/2) is prefetched under the first micro-batch's forward; per-step backward
    reductions are left to assemble (overlap with the last backward); the tail is the layer's
    last reduction, which nothing hides.
    """
    total = Counter()
    tail = 0.0
    for c in colls:
        link = links[c.axis]
        total[(c.per, c.phase)] += c.time_s(link)
        # The last unit's reductions (and its gradient's copy to the host) wait for nothing.
        if c.phase == "backward" and c.kind in (RS, AR, comm.DEVICE_TO_HOST):
            size = min(c.size_bytes, c.calls * c.size_bytes)
            tail += comm.collective_s(link, c.kind, size)
    window = {"forward": eta * fwd_s, "backward": eta * bwd_s}
    mb = sum(overlapped_s(total[("microbatch", ph)], window[ph], slowdown) for ph in window)
    step = overlapped_s(total[("step", "forward")], window["forward"], slowdown)
    return step + total[("step", "backward")], mb, tail


def dp_head_s(profile: ModelProfile, cfg: ParallelConfig, link: comm.GroupLink,
               fw: Framework) -> float:
    """The step's first parameter all-gather (ZeRO 1-3), which no compute precedes."""
    if not fw.first_gather_exposed or dp_mechanism(cfg) != "fsdp":
        return 0.0
    for index in range(len(profile.layers)):
        unit = fsdp_unit_params(profile, cfg, index)
        if unit > 0:
            first = dp_collectives(cfg, unit)[0]  # the forward all-gather
            gathered = min(first.size_bytes, DTYPE_BYTES[cfg.dtype] * fw.zero3_live_params) if (
                fw.zero3_gather == GATHER_BUCKET) else first.size_bytes
            return comm.collective_s(link, first.kind, gathered)
    return 0.0
