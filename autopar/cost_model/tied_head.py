"""A lm head tied to the token embedding, split from it by the pipeline.

The profile counts the shared weight once, in the embedding (``graph/layers.py``). With pp > 1
the last stage holds a copy of it as its head: Megatron-LM keeps the word embeddings on the
last stage and all-reduces their gradient with the first stage's over its embedding group
(``megatron/core/distributed/finalize_model_grads.py``, ``_allreduce_word_embedding_grads``);
autopar's runtime does the same (``runtime/tied_weights.py``). So under pp > 1 the head layer is
charged its copy's V x h parameters (weights, gradient, optimizer state, its data-parallel
reduction and optimizer step, like any parameter the stage holds) and the step one all-reduce
of the copy's gradient between the two pp ranks holding the ends (none where one rank holds
both, as the V-shaped schedules place them), which both ranks wait for just before their
optimizer step: it is charged to the embedding's and the head's optimizer time
(``with_tied_sync``; it shows in the report's "optimizer step"). With pp == 1 the weight stays
one parameter.

Approximations: the copy is taken as V x h (a head that projects first, as OPT's
``word_embed_proj_dim``, holds V x that width: over-charged); the all-reduce as the whole
tp shard of the gradient, as Megatron-LM and DeepSpeed reduce it (autopar's runtime under
FSDP reduces its dp x cp shard only: over-charged, a few milliseconds a step).

Units: bytes, seconds.
"""

from __future__ import annotations

import dataclasses

from autopar.config import DTYPE_BYTES, ParallelConfig, mesh_strides
from autopar.cost_model import comm
from autopar.cost_model.hardware import Cluster
from autopar.graph.types import ModelProfile
from autopar.schedules import rank_of_stage

__all__ = ["copied_params", "split_tied_head", "tied_sync_s", "with_tied_sync"]


def copied_params(profile: ModelProfile, pp: int) -> int:
    """Parameters of the head's copy of the tied weight (0 without a tie or a pipeline)."""
    if not profile.tied_embeddings or pp == 1:
        return 0
    return profile.vocab * profile.hidden


def split_tied_head(profile: ModelProfile, pp: int) -> ModelProfile:
    """``profile`` with the head layer holding its copy of the tied weight under pp > 1."""
    extra = copied_params(profile, pp)
    if not extra:
        return profile
    w = DTYPE_BYTES[profile.dtype]
    layers = tuple(
        dataclasses.replace(layer, num_params=layer.num_params + extra,
                            param_bytes=layer.param_bytes + round(extra * w))
        if layer.kind == "head" else layer
        for layer in profile.layers)
    return dataclasses.replace(profile, layers=layers)


def tied_sync_s(profile: ModelProfile, cluster: Cluster, cfg: ParallelConfig,
                grad_element_bytes: float) -> float:
    """One all-reduce of the head copy's tp-sharded gradient (``grad_element_bytes``: the
    framework's gradient reduction dtype) over the pair of pp ranks holding the embedding and
    the head, at the step's end; 0 when one rank holds both."""
    extra = copied_params(profile, cfg.pp)
    first = rank_of_stage(cfg.schedule, cfg.pp, 0)
    last = rank_of_stage(cfg.schedule, cfg.pp, cfg.num_stages - 1)
    if not extra or first == last:
        return 0.0
    link = comm.group_link(cluster, 2, mesh_strides(cfg)["pp"] * abs(last - first))
    return comm.all_reduce_s(link, extra / cfg.tp * grad_element_bytes)


def with_tied_sync(layers: list, sync_s: float) -> list:
    """``layers`` (LayerCosts, embedding first, head last) with ``sync_s`` added to the
    optimizer time of the first and the last layer: the ranks at both ends wait for it."""
    if not sync_s:
        return layers
    ends = {0, len(layers) - 1}
    return [dataclasses.replace(layer, optimizer_s=layer.optimizer_s + sync_s) if k in ends
            else layer for k, layer in enumerate(layers)]
