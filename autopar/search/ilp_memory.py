"""The memory side of the split ILP (``ilp.py``): each pipeline rank's peak, in GiB, at every
count vector its activations can peak at (``held_counts.held_vectors``):

    static_k + sum_{j on k} c_j act_j + Mt_k + buffers + pbuf_k      for each vector c of rank k

and, under a schedule that splits backwards, at each (c, w) of ``held_split_vectors`` with
w_j wpass_j added (a stage's weight-pass bytes, ``LayerCost.weight_pass_bytes``, the last
stage's less its head's ``input_pass_freed_bytes`` and at least 0; none for global stage 0, as
``assemble.held_activations`` charges it; the relaxed floor leaves them out, as ``ilp.realized``
re-checks that split with ``assemble``);

one expression where the rank's chunks hold one count; per-rank counts take each stage's
activations from its own counts (``ilp_ranks._chunk_counts``) or, counting a repeating section
by kind per rank (``ilp_rank_kinds.py``), charge the rank its held floor (a relaxation that
``ilp.realized`` checks). The transient max Mt_k is a big-M max over the modes a rank uses.
"""

from __future__ import annotations

import pulp

from autopar.config import RECOMPUTE
from autopar.cost_model.assemble import pipeline_buffer_bytes
from autopar.cost_model.held_counts import floor_of, held_split_vectors, held_vectors, uniform
from autopar.cost_model.tables import CostTable
from autopar.schedules import rank_of_stage
from autopar.search.ilp_stages import new_var
from autopar.units import GIB

__all__ = ["MEM_SAFETY_GIB", "memory_exprs"]

# Memory is in GiB (``autopar.units.GIB``) inside the ILP (solver-friendly scale); the safety
MEM_SAFETY_GIB = 1e-6  # margin keeps solver feasibility tolerance (1e-7) from overfilling a rank
R = range(len(RECOMPUTE))


def _tighten(table: CostTable, runs, slots, charge, n, cap_gib: float) -> None:
    """Upper bounds on counts from memory: count (static + charge act) + buffers <= capacity,
    ``charge[j]`` a count slot j's layers are charged at least (``_slot_charges``).

    Valid because every other memory term is >= 0; a tight bound is what keeps the transient
    big-M constraints (and so the LP relaxation) strong.
    """
    room = cap_gib - table.buffers_bytes / GIB
    for (g, j, r), var in n.items():
        lay = table.layers[runs[g][0]]
        per_layer = (lay.static_bytes + charge[j] * lay.act_bytes[r]) / GIB if j in slots else 0
        if per_layer > 0:
            var.upBound = max(0, min(var.upBound, int(max(room, 0.0) / per_layer)))


def _slot_charges(vectors, slots: list[int]) -> dict[int, float]:
    """The fewest micro-batches each count slot of a rank is charged however the split falls:
    a stage (local chunk i) at least max_c c_i, a whole rank at least max_c min_i c_i."""
    if len(slots) == len(vectors[0]):
        return {j: max(c[i] for c in vectors) for i, j in enumerate(slots)}
    return dict.fromkeys(slots, floor_of(vectors))


def _chunk_acts(table: CostTable, runs, counts: dict, chunks: list[int],
                field: str = "act_bytes") -> list:
    """Activations (GiB) of one micro-batch of each stage in ``chunks``, from per-stage counts
    (``field``: another per-mode ``LayerCost`` byte count, e.g. "weight_pass_bytes")."""
    return [pulp.lpSum(getattr(table.layers[runs[g][0]], field)[r] / GIB * var
                       for (g, jj, r), var in sorted(counts.items()) if jj == j) for j in chunks]


def _weight_pass(prob, table: CostTable, grads: list, chunks: list[int], k: int) -> list:
    """Each chunk's weight-pass bytes (GiB) as ``assemble`` charges them: none for global
    stage 0 (its input pass is empty), the last stage's less what its head's input pass frees
    and never below 0 (a variable d >= 0, d >= that: every memory constraint holds d at the
    max)."""
    grads = [0 if j == 0 else g for j, g in zip(chunks, grads)]
    last = table.config.num_stages - 1
    freed = table.layers[-1].input_pass_freed_bytes[0] / GIB
    if last not in chunks or freed <= 0:
        return grads
    i = chunks.index(last)
    d = new_var(prob, f"weight_pass[rank{k}]", 0)
    # [Constraint] weight_pass: the last stage's extra bytes, its head's freed loss taken off
    prob += d >= grads[i] - freed, f"weight_pass[rank{k}]"
    return [*grads[:i], d, *grads[i + 1:]]


def memory_exprs(prob, table: CostTable, runs, slot_rank, n, cnt, cap_gib=None,
                  placement=None) -> list:
    """Per rank, its memory in GiB (static + held activations + transient max + buffers) at each
    count vector its peak is a max over (``held_counts.held_vectors``; one where uniform). Per-rank
    counts (one slot a rank) take the stages' activations from ``placement`` (``ilp_ranks``)."""
    cfg = table.config
    exprs = []
    for k in range(cfg.pp):
        stages = [j for j, rank in enumerate(slot_rank) if rank == k]
        vectors = held_vectors(
            cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches, k
        )
        if cap_gib is not None:
            _tighten(table, runs, stages, _slot_charges(vectors, stages), n, cap_gib)
        mt = new_var(prob, f"transient[rank{k}]", 0)
        # [Constraint] transient: the rank's largest working set over the modes it uses
        for g, (a, _b) in enumerate(runs):
            lay, name = table.layers[a], table.names[a]
            for r in R:
                terms = [n[g, j, r] for j in stages if (g, j, r) in n]
                if not terms or lay.transient_bytes[r] <= 0:
                    continue
                u = new_var(prob, f"u[{name}][rank{k}][{RECOMPUTE[r]}]", 0, 1, "Binary")
                big_m = sum(var.upBound for var in terms)
                prob += pulp.lpSum(terms) <= big_m * u, f"uses[{name}][rank{k}][{r}]"
                prob += mt >= lay.transient_bytes[r] / GIB * u, f"peak[{name}][rank{k}][{r}]"
        static = pulp.lpSum(
            table.layers[a].static_bytes / GIB * cnt[g, j]
            for g, (a, _b) in enumerate(runs)
            for j in stages
        )
        # torch pipelining's receive buffers: a per-rank constant (assemble.pipeline_buffer_bytes)
        rest = static + mt + table.buffers_bytes / GIB + pipeline_buffer_bytes(table, k) / GIB
        split = held_split_vectors(
            cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches, k
        )
        if uniform(vectors) and not split:
            act = pulp.lpSum(_chunk_acts(table, runs, n, stages))
            exprs.append([rest + vectors[0][0] * act])
            continue
        if len(stages) == len(vectors[0]):
            counts, chunks = n, stages
        elif placement is None:  # per-rank counts by kind: the held floor, a relaxation
            acts = _chunk_acts(table, runs, n, stages)
            exprs.append([rest + floor_of(vectors) * pulp.lpSum(acts)])
            continue
        else:  # per-rank counts: the stages' own counts (ilp_ranks._chunk_counts)
            counts = placement
            chunks = [j for j in range(cfg.num_stages)
                      if rank_of_stage(cfg.schedule, cfg.pp, j) == k]
        acts = _chunk_acts(table, runs, counts, chunks)
        if not split:
            exprs.append([rest + pulp.lpSum(c * a for c, a in zip(vec, acts)) for vec in vectors])
            continue
        extra = _weight_pass(prob, table, _chunk_acts(table, runs, counts, chunks,
                                                      "weight_pass_bytes"), chunks, k)
        v = len(acts)
        exprs.append([rest + pulp.lpSum(c * a for c, a in zip(vec[:v], acts))
                      + pulp.lpSum(w * d for w, d in zip(vec[v:], extra)) for vec in split])
    return exprs
