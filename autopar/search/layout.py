"""The tensor-parallel layout of a plan: module FQN -> torch ParallelStyle name.

Read from the profile's per-layer ``TPStructure`` (Megatron-LM's sharding, in torch's vocabulary):
linears listed as column-parallel -> "colwise" (a fused q/k/v projection -> "colwise_qkv"),
row-parallel -> "rowwise"; norms -> "sequence"
only with sequence parallelism; the vocabulary-parallel token embedding -> "rowwise" (torch's
``RowwiseParallel(input_layouts=Replicate())``) and the lm head -> "colwise". When every block
shares an entry, the blocks' FQNs collapse into one fnmatch pattern ("layers.*.attention.wq").
The rule itself (``layout_of``, ``collapse_patterns``) lives in tp_layout.py, beside the plan, so
the runtime applies the same rule to a plan without a layout.
"""

from __future__ import annotations

from autopar.graph.types import ModelProfile
from autopar.tp_layout import collapse_patterns, layout_of

__all__ = ["collapse_patterns", "layout_of", "tp_layout"]


def tp_layout(profile: ModelProfile, *, tp: int, sequence_parallel: bool) -> dict[str, str]:
    """Module FQN (or fnmatch pattern) -> TPStyle value; empty when tp == 1.

    Args:
        profile: the model profile (its layers' ``tp`` structures).
        tp: tensor-parallel degree.
        sequence_parallel: whether norms run sequence-parallel.
    """
    if tp <= 1:
        return {}
    layers = ((layer.kind, layer.tp) for layer in profile.layers)
    return layout_of(layers, sequence_parallel=sequence_parallel)
