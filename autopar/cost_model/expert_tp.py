"""Routed experts a framework keeps whole on tensor-parallel ranks: replicated, or folded.

Replicated: a framework without expert tensor parallelism
(``Framework.expert_tensor_parallel`` False: autopar's runtime shards linears only,
DeepSpeed-MoE by default) holds all E / ep routed
experts on each of its tp ranks and runs them on every token of the (replicated) block input.
``replicated_experts`` costs that as the same layer with routed experts tp times wider
(f_e -> tp f_e, so P_e and the routed FLOPs and activations grow tp-fold): divided by tp like
the rest of the block, they come back whole, and every term of the cost model (compute,
activations, parameters and their data-parallel traffic, ep's sharding) follows. The model
FLOPs still count each expert once (``model_flops_once``): the repeated work is hardware work.

Folded (``Framework.expert_tp_folded``: Megatron-Core's ``--expert-tensor-parallel-size 1``,
its MoE "parallel folding", arXiv:2504.14960): the routed experts are whole on each rank and
each tp rank routes only its own sequence shard, so nothing is repeated: a rank's expert FLOPs
and routed activations are the tp-sharded ones (T k / tp rows, each through a whole expert),
but its routed-expert parameters are E / ep whole experts, sharded by ZeRO over the
``tp * dp * cp / ep`` ranks holding the same experts, and its ep group is ep consecutive ranks
(inside a node where ep fits in one) instead of ranks tp apart. ``folded_experts`` marks the
tensor-parallel MoE layers so (``MoEStructure.expert_tp_folded``); moe.py and ep_comm.py read
the mark, and the MoE module issues no tp collectives of its own (``moe_tp`` "linears").
"""

from __future__ import annotations

import dataclasses

from autopar.config import DTYPE_BYTES
from autopar.cost_model.compute import MATMUL_BACKWARD_RATIO
from autopar.cost_model.identity_cache import IdentityCache
from autopar.cost_model.tables import LayerCost
from autopar.cost_model.tp_comm import tp_sharded
from autopar.graph.types import LayerProfile, ModelProfile

__all__ = ["costed_profiles", "folded_experts", "model_flops_once", "replicated_experts"]

# One widened profile per (profile, tp): a search builds thousands of tables from one profile.
_WIDENED: IdentityCache[ModelProfile] = IdentityCache()
_FOLDED: IdentityCache[ModelProfile] = IdentityCache()


def folded_experts(profile: ModelProfile, tp: int) -> ModelProfile:
    """``profile`` as a framework folding its routed experts over tp runs it (module
    docstring): each tp-sharded MoE layer marked ``expert_tp_folded``; unchanged at tp 1."""
    if tp <= 1 or not any(layer.moe is not None for layer in profile.layers):
        return profile
    return _FOLDED.get((profile,), tp, lambda: dataclasses.replace(profile, layers=tuple(
        dataclasses.replace(layer, moe=dataclasses.replace(layer.moe, expert_tp_folded=True))
        if layer.moe is not None and tp_sharded(layer) else layer
        for layer in profile.layers)))


def replicated_experts(profile: ModelProfile, tp: int,
                       sequence_parallel: bool = True) -> ModelProfile:
    """``profile`` as a framework that keeps routed experts whole on every one of ``tp`` ranks
    runs it (module docstring): each tp-sharded MoE layer with its routed experts tp times
    wider, so that its per-rank share (1 / tp) holds and runs them whole. Its routed
    activations per dispatched row are moe.py's (2 h + 4 f_e elements).

    The activations a rank keeps are whole too. Under sequence parallelism memory.py divides
    all of a layer's saved bytes by tp, so the routed ones grow tp-fold with the experts.
    Without it memory.py divides only what the profile recorded as tp-sharded: the experts'
    4 f_e elements a row where their linears are in the layer's tensor-parallel structure
    (``TPStructure.colwise`` under an ``experts`` module, as per-expert ``nn.Linear``s are),
    which grow; nothing where they are not (the zoo's stacked experts: recorded replicated,
    so whole already).
    """
    if tp <= 1 or not any(layer.moe is not None for layer in profile.layers):
        return profile
    return _WIDENED.get((profile,), (tp, sequence_parallel),
                        lambda: _widened_profile(profile, tp, sequence_parallel))


def _widened_profile(profile: ModelProfile, tp: int, sequence_parallel: bool) -> ModelProfile:
    w = DTYPE_BYTES[profile.dtype]
    layers = tuple(_widened(layer, tp, profile.seq_len, w, sequence_parallel)
                   if layer.moe is not None and tp_sharded(layer) else layer
                   for layer in profile.layers)
    return dataclasses.replace(profile, layers=layers)


def _widened(layer: LayerProfile, tp: int, seq_len: int, w: int,
             sequence_parallel: bool) -> LayerProfile:
    moe = layer.moe
    assert moe is not None
    more = tp - 1
    fwd = moe.routed_fwd_flops(seq_len)  # per sample
    rows = seq_len * moe.routed_rows_per_token()
    if sequence_parallel:  # per sample, the routed bytes memory.py divides by tp
        grown = round(rows * moe.routed_saved_bytes_per_row(w))
    elif any("experts" in f.split(".") for f in layer.tp.colwise):
        grown = round(rows * 4 * moe.expert_hidden * w)
    else:
        grown = 0

    return dataclasses.replace(
        layer,
        num_params=layer.num_params + more * moe.routed_params,
        param_bytes=layer.param_bytes + more * moe.routed_params * w,
        fwd_flops=layer.fwd_flops + more * fwd,
        bwd_flops=layer.bwd_flops + MATMUL_BACKWARD_RATIO * more * fwd,
        recompute_flops={m: f + (more * fwd if m == "full" else 0.0)
                         for m, f in layer.recompute_flops.items()},
        saved_bytes={m: b + (0 if m == "full" else more * grown)
                     for m, b in layer.saved_bytes.items()},
        moe=dataclasses.replace(moe, expert_hidden=tp * moe.expert_hidden,
                                expert_params=tp * moe.expert_params),
    )


def model_flops_once(layers: list[LayerCost], model: ModelProfile, cp: int) -> list[LayerCost]:
    """Costs of a profile as a framework runs it (``replicated_experts``) with the model FLOPs
    of ``model`` (each expert once): the work the framework repeats counts as hardware FLOPs
    (added to every recompute mode's extra FLOPs), not as model FLOPs."""
    out = []
    for cost, mine in zip(layers, model.layers):
        flops = (mine.fwd_flops + mine.bwd_flops) * cp
        more = cost.model_flops_per_sample - flops
        none, selective, full = cost.recompute_flops_per_sample
        out.append(dataclasses.replace(
            cost, model_flops_per_sample=flops,
            recompute_flops_per_sample=(none + more, selective + more, full + more)))
    return out


def costed_profiles(profile: ModelProfile, cfg, fw) -> tuple[ModelProfile, ModelProfile,
                                                             ModelProfile]:
    """(whole, local, costed) profiles of ``cfg`` under framework ``fw``, as the cost table
    reads them: ``whole`` with a head tied to the embedding holding its own copy across a
    pipeline split (tied_head.py); ``local`` a rank's s / cp tokens of it; ``costed`` that with
    its routed experts whole on every tp rank where the framework does not shard them, or folded
    over tp (``replicated_experts``, ``folded_experts``)."""
    from autopar.cost_model.cp_comm import local_profile
    from autopar.cost_model.framework_support import folds_experts
    from autopar.cost_model.tied_head import split_tied_head

    whole = split_tied_head(profile, cfg.pp)
    local = local_profile(whole, cfg.cp)
    costed = (replicated_experts(local, cfg.tp, cfg.sequence_parallel)
              if not fw.expert_tensor_parallel
              else folded_experts(local, cfg.tp) if folds_experts(fw, cfg) else local)
    return whole, local, costed
