"""Which pipeline stage splits a framework runs (``Framework.stage_splits``).

- ``"any"``: every contiguous split of the profile's layers. autopar's runtime cuts the model at
  the plan's stage bounds; torchtitan takes each stage's modules
  (``parallelism.module_fqns_per_model_part``); Megatron-LM any layout
  (``--pipeline-model-parallel-layout``).
- ``"partition-methods"``: only what DeepSpeed's ``PipelineModule(partition_method=...)``
  computes from its layer list (deepspeed/runtime/pipe/module.py ``_partition_layers``), with
  one layer per profile layer (the embedding, each block, the head):

  - ``"uniform"``: the same number of layers per stage, the first ``n % pp`` stages one more
    (runtime/utils.py ``partition_uniform``). With the embedding and the head as layers this is
    the split BLOOM trained with, ``type:transformer|embedding`` (bigscience
    train/tr11-176B-ml/README.md: "[embed | 5 transformer blocks] ... [5 transformer blocks |
    embed]").
  - ``"type:<block>"``: the blocks balanced, the other layers weighing nothing
    (``partition_balanced`` over 0/1 weights; Megatron-DeepSpeed's default,
    megatron/model/gpt_model.py ``partition_method = 'type:transformer'``).

  ``partition_balanced`` solves the linear partition problem for the smallest spread between
  the heaviest and the lightest stage, a tie going to the later cut (``linear_partition``);
  ``"parameters"`` (balanced by parameter counts, which counts a tied embedding at both ends) is
  not searched.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from autopar.cost_model.partition import (
    balanced_partition,
    rank_balanced_partition,
    uniform_partition,
)
from autopar.cost_model.recompute_layers import stage_ranks

if TYPE_CHECKING:
    from autopar.cost_model.tables import CostTable

__all__ = ["STAGE_SPLITS", "balanced_splits", "framework_splits", "linear_partition",
           "method_splits", "split_method", "split_refusal"]

STAGE_SPLITS = ("any", "partition-methods")
Split = tuple[tuple[int, int], ...]


def linear_partition(weights: Sequence[float], num_parts: int) -> list[int]:
    """Stage bounds (``num_parts + 1`` offsets) of contiguous non-empty parts of ``weights``
    with the least spread (heaviest part minus lightest), a tie going to the later cut (DeepSpeed
    ``partition_balanced``: dynamic programming over (items, parts), each state keeping the
    heaviest and lightest part of its best prefix; the cuts of a state tried at once, in float64
    as DeepSpeed's arrays)."""
    n, m = len(weights), num_parts
    if n <= m:
        return uniform_partition(n, m)
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(np.asarray(weights, dtype=np.float64))
    heavy = np.full((n + 1, m + 1), np.inf)  # heaviest part of state (items, parts)'s prefix
    light = np.full((n + 1, m + 1), np.inf)  # its lightest
    cut = np.zeros((n + 1, m + 1), dtype=np.int64)
    heavy[0, 0] = 0.0
    for j in range(1, m + 1):
        # a state (i, j) with fewer than m - j items left is on no path to (n, m)
        for i in range(j, n - (m - j) + 1):
            k = np.arange(j - 1, i)  # earlier cuts leave (k, j - 1) unreachable: cost inf
            part = prefix[i] - prefix[k]
            hi = np.maximum(heavy[k, j - 1], part)
            lo = np.minimum(light[k, j - 1], part)
            spread = hi - lo
            best = int(np.flatnonzero(spread == spread.min())[-1])
            heavy[i, j], light[i, j], cut[i, j] = hi[best], lo[best], k[best]
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(int(cut[bounds[-1], j]))
    return bounds[::-1]


def _split(bounds: Sequence[int]) -> Split:
    """((first, last), ...) of stage bounds."""
    return tuple((a, b - 1) for a, b in itertools.pairwise(bounds))


def method_splits(blocks: Sequence[bool], num_stages: int) -> dict[str, Split]:
    """The split each searched DeepSpeed partition method gives a profile's layers
    (``blocks``: which are blocks), by method, in order of preference."""
    return dict(_method_splits(tuple(bool(b) for b in blocks), num_stages))


@functools.cache
def _method_splits(blocks: tuple[bool, ...], num_stages: int) -> tuple[tuple[str, Split], ...]:
    if num_stages <= 1:
        return (("uniform", ((0, len(blocks) - 1),)),)
    return (("uniform", _split(uniform_partition(len(blocks), num_stages))),
            ("type:<block>", _split(linear_partition([float(b) for b in blocks], num_stages))))


def split_method(kind: str, split: Sequence[tuple[int, int]], blocks: Sequence[bool]) -> str | None:
    """How a framework of stage splits ``kind`` sets ``split``: "any", the DeepSpeed partition
    method that gives it, or None when none does."""
    if kind == "any":
        return "any"
    given = tuple((int(a), int(b)) for a, b in split)
    for method, made in method_splits(blocks, len(given)).items():
        if made == given:
            return method
    return None


def split_refusal(framework_spec: str, kind: str, split: Sequence[tuple[int, int]],
                  blocks: Sequence[bool]) -> str | None:
    """Why a framework cannot cut its pipeline stages as ``split`` does (None when it can)."""
    if split_method(kind, split, blocks) is not None:
        return None
    sizes = ", ".join(str(b - a + 1) for a, b in split)
    return (f"{framework_spec} splits pipeline stages by partition_method ('uniform' layers or "
            f"'type:<block>' balanced blocks), not this plan's split (layers per stage {sizes})")


def balanced_splits(table: CostTable, recompute: str, *,
                    rank_balanced: bool = True) -> tuple[Split, ...]:
    """The most balanced contiguous splits by time per micro-batch under uniform recompute: the
    stage-balanced one (``partition.balanced_partition``) and the rank-balanced one
    (``partition.rank_balanced_partition``: a rank of an interleaved or V schedule sums its
    stages), one when they agree (every rank runs one stage). With offload, whose optimizer
    step on the CPU is a large part of a rank's step, also the split balancing each rank's
    m micro-batches and its optimizer step together (both rank-balanced: ``rank_balanced``
    False leaves them out). The table costs a non-block layer's modes alike
    (``LayerCost.never_recomputed``)."""
    costs = [layer.time_per_microbatch_s(recompute) for layer in table.layers]
    ranks = stage_ranks(table.config)
    # one stage a rank: the rank-balanced split is the stage-balanced one
    splits = [balanced_partition(costs, table.config.num_stages)]
    if rank_balanced and len(set(ranks)) < len(ranks):
        splits.append(rank_balanced_partition(costs, ranks))
    if rank_balanced and table.config.offload != "none":
        m = table.num_microbatches
        steps = [m * cost + layer.optimizer_s for cost, layer in zip(costs, table.layers)]
        splits.append(rank_balanced_partition(steps, ranks))
    return tuple(dict.fromkeys(splits))


def framework_splits(table: CostTable, recompute: str, *,
                     rank_balanced: bool = True) -> tuple[Split, ...]:
    """The splits worth trying under uniform ``recompute`` that the table's framework cuts: the
    most balanced ones and the blocks spread evenly over the stages (the embedding with the
    first blocks, the head with the last: Megatron-LM's layout when none is given, and the one a
    rank's chunks hold alike), or each of its partition methods' (what ``estimate``'s default
    split and the search's bounds both start from)."""
    methods = method_splits(table.block_mask, table.config.num_stages)
    if table.framework.stage_splits == "any":
        even = methods.get("type:<block>")
        return tuple(dict.fromkeys((*balanced_splits(table, recompute,
                                                     rank_balanced=rank_balanced),
                                    *((even,) if even else ()))))
    return tuple(dict.fromkeys(methods.values()))
