"""What every cost table of one profile, cluster and framework shares, computed once.

A search builds thousands of tables (``layer_costs.build_cost_table``) for one profile on one
cluster with one framework; the terms here read nothing else, so they are computed on the
first table and reused by the others, the same objects and numbers:

- ``driven_cluster``: the cluster as the framework drives it (``frameworks.framework_cluster``,
  whose ``Cluster`` re-validates every field on construction);
- ``profile_terms``: per profile (the cp rank's local one, ``cp_comm.local_profile``, itself
  cached), each layer's attention-core FLOPs, the largest layer output (the pipeline's
  stage-boundary tensor) and which layers repeat an earlier one's costs.

Both are ``identity_cache.IdentityCache`` memos, as ``cp_comm.local_profile`` is.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_model.collectives import first_block_index
from autopar.cost_model.frameworks import Framework, framework_cluster
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.identity_cache import IdentityCache
from autopar.graph.types import ModelProfile

__all__ = ["ProfileTerms", "driven_cluster", "profile_terms"]

@dataclass(frozen=True, slots=True)
class ProfileTerms:
    """Per-profile inputs of ``build_cost_table``.

    Attributes:
        attention_flops: each layer's attention-core FLOPs per sample (its "selective"
            recompute FLOPs in the traced profile; 0.0 where none), in layer order.
        max_output_bytes: the largest layer output per sample (the stage-boundary tensor).
        first_block: index of the first block layer (-1: none).
        computed: the layers whose costs are computed, in layer order, each as (its index,
            the indices of the later layers that share its costs): a repeated block shares the
            costs of the latest computed layer with its ``repeat_of`` (or name), the model's
            first block apart (with SP it cuts its input).
        names: every layer's name, in layer order (``CostTable.names``).
    """

    attention_flops: tuple[float, ...]
    max_output_bytes: float
    first_block: int
    computed: tuple[tuple[int, tuple[int, ...]], ...]
    names: tuple[str, ...]


def _computed(profile: ModelProfile, first: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``ProfileTerms.computed``: a block shares the costs of the latest computed layer with
    its key (``repeat_of`` or name, whether it is the first block)."""
    latest: dict[tuple[str, bool], int] = {}
    copies: dict[int, list[int]] = {}
    for index, layer in enumerate(profile.layers):
        key = (layer.repeat_of or layer.name, index == first)
        if key in latest and layer.kind == "block":
            copies[latest[key]].append(index)
        else:
            latest[key] = index
            copies[index] = []
    return tuple((index, tuple(shared)) for index, shared in copies.items())


def _build_terms(profile: ModelProfile) -> ProfileTerms:
    first = first_block_index(profile)
    return ProfileTerms(
        attention_flops=tuple(x.recompute_flops.get("selective", 0.0) for x in profile.layers),
        max_output_bytes=max(layer.output_bytes for layer in profile.layers),
        first_block=first,
        computed=_computed(profile, first),
        names=tuple(layer.name for layer in profile.layers),
    )


_MAX_ENTRIES = 16
_TERMS: IdentityCache[ProfileTerms] = IdentityCache(_MAX_ENTRIES)
_CLUSTERS: IdentityCache[Cluster] = IdentityCache(_MAX_ENTRIES)


def profile_terms(profile: ModelProfile) -> ProfileTerms:
    """``profile``'s ProfileTerms (cached on its identity)."""
    return _TERMS.get((profile,), None, lambda: _build_terms(profile))


def driven_cluster(cluster: Cluster, framework: Framework) -> Cluster:
    """``frameworks.framework_cluster(cluster, framework)`` (cached on the inputs' identity)."""
    return _CLUSTERS.get((cluster, framework), None,
                         lambda: framework_cluster(cluster, framework))
