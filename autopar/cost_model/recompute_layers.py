"""Which per-layer recompute choices a framework runs (``Framework.recompute_layers``).

The search's ILP can give every layer its own recompute mode; a framework sets fewer patterns:

- ``"any"``: every block its own mode (autopar's runtime checkpoints each block as the plan says).
- ``"first-n"``: full recompute of the first n blocks of every stage (pipeline chunk), none for
  the others. Megatron-LM ``--recompute-granularity full --recompute-method block
  --recompute-num-layers n`` (megatron/core/recompute.py: "block" checkpoints layers
  ``0 <= layer_idx < recompute_num_layers`` of each pipeline stage's block).
- ``"every-nth"``: full recompute of every n-th block a pipeline rank builds, counted over its
  stages in stage order, none for the others. torchtitan ``[activation_checkpoint] mode =
  "selective"``, ``selective_ac_option = "n"`` (torchtitan v0.2.2
  distributed/activation_checkpoint.py ``_apply_layer_sac``: one counter per process, a block
  wrapped when ``count % n == 0``).
- ``"uniform"``: one mode for every block.

Every framework also runs one mode for every block (none, selective or full). A pattern counts
the profile's blocks (``CostTable.blocks``); the other layers (embedding, head) recompute
nothing under it, and their modes do not decide whether a framework runs a plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from autopar.schedules import rank_of_stage

if TYPE_CHECKING:
    from autopar.config import ParallelConfig

__all__ = ["RECOMPUTE_LAYERS", "blocks_recompute", "pattern_counts", "pattern_recompute",
           "recompute_pattern", "recompute_refusal", "stage_ranks"]

RECOMPUTE_LAYERS = ("any", "first-n", "every-nth", "uniform")
Split = Sequence[tuple[int, int]]


def stage_ranks(config: ParallelConfig) -> tuple[int, ...]:
    """The pipeline rank of each stage of ``config``, in stage order."""
    return tuple(rank_of_stage(config.schedule, config.pp, j) for j in range(config.num_stages))


def blocks_recompute(recompute: Sequence[str], blocks: Sequence[bool]) -> tuple[str, ...]:
    """The per-layer recompute every framework runs for ``recompute``: the blocks' modes and
    none for the other layers. autopar's runtime checkpoints
    blocks only (runtime/recompute.py apply_recompute), Megatron-LM transformer layers only
    (TransformerBlock), torchtitan the children of ``model.layers`` only (apply_ac), and
    Megatron-DeepSpeed's GPTModelPipe ParallelTransformerLayerPipe only
    (PipelineModule._is_checkpointable); the cost table costs every mode of the other layers as
    none (``LayerCost.never_recomputed``)."""
    return tuple(mode if is_block else "none"
                 for mode, is_block in zip(recompute, blocks, strict=True))


def _stage_blocks(split: Split, blocks: Sequence[bool]) -> list[list[int]]:
    """The block layer indices of every stage, in order."""
    return [[i for i in range(first, last + 1) if blocks[i]] for first, last in split]


def _rank_blocks(split: Split, blocks: Sequence[bool], ranks: Sequence[int]) -> dict[int, list]:
    """The block layer indices each pipeline rank builds, over its stages in stage order."""
    out: dict[int, list[int]] = {}
    for stage, rank in zip(_stage_blocks(split, blocks), ranks, strict=True):
        out.setdefault(rank, []).extend(stage)
    return out


def pattern_recompute(kind: str, n: int, split: Split, blocks: Sequence[bool],
                      ranks: Sequence[int]) -> tuple[str, ...]:
    """Every layer's recompute under pattern ``kind`` ("first-n" or "every-nth") with count
    ``n`` over ``split`` ((first, last) layer of each stage, in stage order), ``blocks`` (which
    layers are blocks) and ``ranks`` (the pipeline rank of each stage)."""
    full: set[int] = set()
    if kind == "first-n":
        full = {i for stage in _stage_blocks(split, blocks) for i in stage[:n]}
    elif kind == "every-nth":
        full = {i for rank in _rank_blocks(split, blocks, ranks).values()
                for c, i in enumerate(rank, start=1) if c % n == 0}
    else:
        raise ValueError(f"recompute pattern {kind!r} has no count; use first-n or every-nth")
    return tuple("full" if i in full else "none" for i in range(len(blocks)))


def pattern_counts(kind: str, split: Split, blocks: Sequence[bool],
                   ranks: Sequence[int]) -> range:
    """The counts n whose pattern differs from one mode for every block ("first-n": 1 to the
    fullest stage's blocks; "every-nth": 2 to the fullest rank's; others: none)."""
    if kind == "first-n":
        return range(1, max(len(s) for s in _stage_blocks(split, blocks)))
    if kind == "every-nth":
        return range(2, max(len(r) for r in _rank_blocks(split, blocks, ranks).values()) + 1)
    return range(0)


def recompute_pattern(kind: str, recompute: Sequence[str], split: Split, blocks: Sequence[bool],
                      ranks: Sequence[int]) -> tuple[str, int] | None:
    """How a framework of recompute pattern ``kind`` sets ``recompute``: ("uniform", 0) for one
    mode on every block, (kind, n) for its pattern with count n, None when it cannot."""
    block_modes = [mode for mode, is_block in zip(recompute, blocks, strict=True) if is_block]
    if len(set(block_modes)) <= 1:
        return ("uniform", 0)
    if kind == "any":
        return ("any", 0)
    for n in pattern_counts(kind, split, blocks, ranks):
        want = pattern_recompute(kind, n, split, blocks, ranks)
        if all(w == r for w, r, b in zip(want, recompute, blocks, strict=True) if b):
            return (kind, n)
    return None


def recompute_refusal(framework_spec: str, kind: str, recompute: Sequence[str], split: Split,
                      blocks: Sequence[bool], ranks: Sequence[int]) -> str | None:
    """Why a framework cannot set a split's per-layer recompute (None when it can)."""
    if recompute_pattern(kind, recompute, split, blocks, ranks) is not None:
        return None
    full = sum(1 for mode, b in zip(recompute, blocks, strict=True) if b and mode != "none")
    sets = {"first-n": "the same number of leading blocks in every stage, or one mode for all",
            "every-nth": "every n-th block of a pipeline rank, or one mode for all",
            "uniform": "one mode for every block"}[kind]
    return (f"{framework_spec} recomputes {sets}, not this plan's mix ({full} of "
            f"{sum(blocks)} blocks recomputed)")
