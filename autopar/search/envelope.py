"""Splitting a profile whose blocks repeat a short pattern of layer kinds, by their envelopes.

The split ILP counts interchangeable layers (``ilp.py``): a profile of one run of identical
blocks between a few edge layers is solved per pipeline rank in milliseconds (``ilp_ranks.py``).
Blocks that alternate a few kinds break that run into many short ones (Llama 4: a layer without
rotary positions every fourth, its activations 5% smaller), and the per-layer ILP over them is
slow (tens of seconds a candidate, often stopped by its time limit). For such a profile, the
blocks between the first and the last run (``pattern_blocks``: at least ``MIN_BLOCKS`` of at
most ``MAX_KINDS`` kinds, each term within ``MAX_SPREAD`` of its largest value over the kinds)
are replaced, term by term, by

- the upper envelope (the largest of each time and memory term over the kinds, the smallest
  backward, which hides data-parallel reduction): every split costs at least as much there as
  with the real layers and needs at least as much memory, so its optimum is a split that fits
  the real layers, whose own step time ``assemble`` then gives exactly;
- the lower envelope (the smallest of each term, the largest backward): no split of the real
  layers is faster than its optimum, a lower bound on the real optimum.

Both hold because ``assemble``'s step time never decreases as a time term grows, and the
backward time enters only as the window that hides data-parallel reduction, whose exposed part
``overlap.overlapped_s`` never grows with the window (for a slowdown of at most 1, which
``lower_bound_holds`` checks; otherwise the candidate's refined ``time_lower_bound`` is the
bound).

Both envelopes are one run of identical blocks, so both ILPs are per-rank counts. The split is
reported optimal when its real step is within the search's MIP gap of the lower bound, and with
that gap otherwise (``Outcome.gap``, the plan's ``search.mip_gap``).
"""

from __future__ import annotations

import dataclasses

from autopar.cost_model.tables import CostTable, LayerCost
from autopar.search.ilp import cost_signature, layer_runs
from autopar.search.ilp_ranks import rank_aggregable

__all__ = ["MAX_KINDS", "MAX_SPREAD", "MIN_BLOCKS", "envelope_table", "lower_bound_holds",
           "pattern_blocks"]

MIN_BLOCKS = 16  # fewer blocks: the per-layer ILP is small enough to stay exact
MAX_KINDS = 4  # more kinds of block than this: not a short repeating pattern
MAX_SPREAD = 0.25  # kinds further apart in some term than this share of it: the exact ILP

# The terms whose larger value never shortens a step nor frees memory (assemble.py), by
# recompute mode where a tuple; ``backward_s`` is the window that hides dp reduction (its
# larger value can only shorten a step).
_TERMS = ("compute_s", "recompute_s", "tp_comm_s", "dp_microbatch_s", "act_bytes",
          "transient_bytes", "param_bytes", "grad_bytes", "optimizer_bytes", "dp_step_s",
          "optimizer_s", "ep_comm_s", "cp_comm_s", "host_bytes")


def pattern_blocks(table: CostTable) -> tuple[int, int] | None:
    """(first, last) index of the blocks to take by their envelopes, or None where the exact ILP
    stays fast: a single-stage or per-rank-countable table, few blocks, or many kinds."""
    runs = layer_runs(table)
    if rank_aggregable(table, runs) or len(runs) < 3:
        return None
    first, last = runs[0][1] + 1, runs[-1][0] - 1
    if last - first + 1 < MIN_BLOCKS:
        return None
    inner = table.layers[first:last + 1]
    kinds = {cost_signature(x) for x in inner}
    if not 2 <= len(kinds) <= MAX_KINDS:
        return None
    return (first, last) if _close(inner) else None


def _close(layers: tuple[LayerCost, ...]) -> bool:
    """Whether every term of the kinds is within ``MAX_SPREAD`` of its largest value: kinds
    that close leave little between the envelopes (Llama 4's differ by 5% in activations);
    kinds far apart (dense and mixture-of-experts blocks alternating) would give a split far
    from the optimum and a loose bound, so the exact ILP keeps them."""
    for name in (*_TERMS, "backward_s"):
        values = [getattr(x, name) for x in layers]
        columns = zip(*values) if isinstance(values[0], tuple) else [values]
        for column in columns:
            top = max(column)
            if top > 0 and top - min(column) > MAX_SPREAD * top:
                return False
    return True


def lower_bound_holds(table: CostTable) -> bool:
    """Whether the lower envelope's optimum bounds the real one: overlap slows compute by at
    most the communication it hides (module docstring)."""
    return table.overlap_slowdown <= 1.0


def _envelope(layers: tuple[LayerCost, ...], upper: bool) -> LayerCost:
    pick, back = (max, min) if upper else (min, max)

    def term(values):
        if isinstance(values[0], tuple):
            return tuple(pick(v[k] for v in values) for k in range(len(values[0])))
        return pick(values)

    terms = {name: term([getattr(x, name) for x in layers]) for name in _TERMS}
    return dataclasses.replace(layers[0], backward_s=back(x.backward_s for x in layers),
                               **terms)


def envelope_table(table: CostTable, blocks: tuple[int, int], *, upper: bool) -> CostTable:
    """``table`` with the blocks ``blocks`` (inclusive) replaced by their upper (or lower)
    envelope, one shared block (the table's names stay the blocks' own)."""
    first, last = blocks
    inner = table.layers[first:last + 1]
    same = (_envelope(inner, upper),) * len(inner)
    return dataclasses.replace(
        table, layers=(*table.layers[:first], *same, *table.layers[last + 1:]))
