"""Per-chunk held micro-batches of a pipeline rank: the vectors its activation peak is a max over.

A rank that runs v model chunks holds, at each instant, c_i chunk-micro-batches of chunk i
(local chunk i: the rank's i-th stage in stage order). Its activation memory peaks at

    max over instants of  sum_i c_i A_i + w_i D_i   (A_i: one micro-batch's activations of chunk i)

where, under a schedule that splits backwards into an input pass I and a later weight pass W,
w_i of the c_i await their W and each holds D_i more (what torch's ``stage_backward_input``
keeps for the weight pass: the output gradients of the weight ops, less the loss it frees;
cost_model/layer_terms.py). Only the vertices of the set of count vectors can attain the max (a
linear function's max over a point set is at a vertex of its convex hull). ``held_vectors``
returns the vertices of the c's; ``held_split_vectors`` those of the (c, w)'s. A rank whose
chunks hold the same count at its peak has one vector (c, ..., c), and a one-chunk schedule
(gpipe, 1f1b) the vector (``pipeline.in_flight_microbatches``,).

The counts come from replaying the rank's order of chunk passes as torch lays it out
(torch/distributed/pipelining/schedules.py; tests/unit/test_cost_held_counts.py checks them
against torch's own action lists):

- interleaved 1F1B and interleaved zero bubble (loop placement; ``_get_1f1b_rank_ops``;
  Megatron-LM's forward_backward_pipelining_with_interleaving runs the same order at N = p):
  forwards run N = ``schedules.microbatches_per_round`` micro-batches back to back per chunk,
  chunk 0 first; backwards N at a time from the last chunk down; a warm-up of
  (v - 1) N + k (p - 1 - r) forwards (k = 2, or 1 for zero bubble), then one forward and one
  backward per step, then the remaining backwards; zero bubble runs each weight pass r steps
  after its input pass (``num_1f1b_microbatches = rank``), the oldest first;
- zbv-zero-bubble (V placement: chunk 0 is stage r, chunk 1 stage 2p - 1 - r): the phases of
  ``ScheduleZBVZeroBubble`` (W right after I until the cool-down, which defers them);
- dualpipe-v: the phases of ``ScheduleDualPipeV`` (full backwards in its steady state, input
  and weight passes split in the second half of its cool-down, weight passes queued).
"""

from __future__ import annotations

import functools
import itertools

from autopar.cost_model.pipeline import in_flight_microbatches
from autopar.schedules import get_schedule, microbatches_per_round

__all__ = ["floor_of", "held_floor", "held_split_vectors", "held_vectors", "splits_backward",
           "uniform", "uniform_ranks"]

Vector = tuple[float, ...]


Event = tuple[str, int]  # ("F" | "I" | "W" | "B", local chunk)


def _interleaved_events(p: int, v: int, m: int, rank: int, zero_bubble: bool) -> list[Event]:
    """``rank``'s chunk passes in torch's interleaved order (``_get_1f1b_rank_ops``): forwards
    N = ``microbatches_per_round`` at a time per chunk, chunk 0 first; backwards N at a time
    from the last chunk down, after a warm-up of (v - 1) N + k (p - 1 - r) forwards (k = 2, or
    1 for zero bubble); zero bubble splits each backward into its input pass I and runs the
    weight pass W r steps later, the oldest first, the rest at the end. Once every step runs
    a forward and a release, v N steps bring each chunk N of both and the counts back where
    they were: the periods between the first and the last repeat the first's counts and are
    skipped."""
    n = microbatches_per_round(p, m)
    total = v * m
    warm = min((v - 1) * n + (1 if zero_bubble else 2) * (p - 1 - rank), total)
    lag = rank if zero_bubble else 0
    period, steady = v * n, warm + lag
    skip = max(0, (total - steady) // period - 2) * period  # all but the first and last
    events: list[Event] = []
    op = 0
    while op < warm + total:
        if op == steady + period and skip:
            op += skip
        if op < total:
            events.append(("F", (op // n) % v))
        if op >= warm:
            events.append(("I" if zero_bubble else "B", v - 1 - ((op - warm) // n) % v))
            if zero_bubble and op - warm >= lag:
                events.append(("W", v - 1 - ((op - warm - lag) // n) % v))
        op += 1
    if zero_bubble:  # the last r backwards' weight passes
        events.extend(("W", v - 1 - (i // n) % v) for i in range(max(0, total - lag), total))
    return events


def _zbv_events(p: int, m: int, rank: int) -> list[Event]:
    """``rank``'s passes in torch's ``ScheduleZBVZeroBubble`` order (chunk 0: stage r, chunk 1:
    stage 2p - 1 - r): 2 (p - r) - 1 forwards of chunk 0, r pairs (F1, F0), p - r triples
    (F1, I1, W1), then (F0, I0, W0, F1, I1, W1) while forwards remain, a cool-down of r pairs
    (I0, I1) and p - r pairs (I0, W0), the pending W1 and then W0. Micro-batches past m are
    dropped (torch plans max(2p - 1, m) and blanks the rest)."""
    n = max(2 * p - 1, m)
    plan: list[tuple[str, int, int]] = []
    count = {"F0": 0, "F1": 0, "I0": 0, "I1": 0, "W0": 0, "W1": 0}

    def add(kind: str, chunk: int) -> None:
        key = f"{kind}{chunk}"
        plan.append((kind, chunk, count[key]))
        count[key] += 1

    for _ in range(2 * (p - rank) - 1):
        add("F", 0)
    for _ in range(rank):
        add("F", 1)
        add("F", 0)
    for _ in range(p - rank):
        add("F", 1)
        add("I", 1)
        add("W", 1)
    while count["F1"] < count["F0"] or count["F0"] < n:
        if count["F0"] < n:
            add("F", 0)
        add("I", 0)
        add("W", 0)
        add("F", 1)
        add("I", 1)
        add("W", 1)
    for _ in range(rank):
        add("I", 0)
        add("I", 1)
    for _ in range(p - rank):
        add("I", 0)
        add("W", 0)
    while count["W1"] < count["I1"]:
        add("W", 1)
    while count["W0"] < count["I0"]:
        add("W", 0)
    return [(kind, chunk) for kind, chunk, mb in plan if mb < m]


def _dualpipe_events(p: int, m: int, rank: int) -> list[Event]:
    """``rank``'s passes in torch's ``ScheduleDualPipeV`` order (an overlapped forward and
    backward pair runs its forward first; weight passes queue, the oldest first)."""
    events: list[Event] = []
    queue: list[int] = []

    def back(chunk: int, split: bool) -> None:
        events.append(("I" if split else "B", chunk))
        if split:
            queue.append(chunk)

    def weight() -> None:
        if queue:
            events.append(("W", queue.pop(0)))

    events += [("F", 0)] * (2 * (p - rank - 1))
    events += [("F", 0), ("F", 1)] * (rank + 1)
    for _ in range(p - rank - 1):
        back(1, True)
        weight()
        events.append(("F", 1))
    for _ in range(m - 2 * p + rank + 1):
        events += [("F", 0), ("B", 1), ("F", 1), ("B", 0)]
    for _ in range(p - rank - 1):
        events += [("B", 1), ("F", 1), ("B", 0)]
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        back(1, split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        back(0, split)
    for _ in range(p - rank - 1):
        weight()
        back(0, split)
    for _ in range(rank + 1):
        weight()
    return events


def _counted(events: list[Event], v: int, split: bool = True) -> list[tuple[int, ...]]:
    """Per-chunk (held..., awaiting a weight pass...) at each local peak of the pass order (held
    only, unless ``split``): a chunk-micro-batch is held from F to its W (or full backward B)
    and awaits its W from I. Counts only grow at F and I, so the candidates are the points just
    before a release; where the passes since the last candidate repeat those before it, the
    point lies on a straight stretch of the path and moves the stretch's end instead."""
    counts = [0] * (2 * v)  # held, then awaiting
    width = 2 * v if split else v  # the entries a point carries
    points: list[tuple[int, ...]] = []
    since: list[Event] = []
    last: list[Event] | None = None
    rising = False
    for event in events:
        kind, chunk = event
        if kind == "I" and not split:
            continue
        if kind == "F" or kind == "I":
            counts[chunk if kind == "F" else v + chunk] += 1
            rising = True
            since.append(event)
            continue
        if rising:
            last = _note(points, tuple(counts[:width]), since, last)
            since, rising = [], False
        counts[chunk] -= 1
        if kind == "W":
            counts[v + chunk] -= 1
        since.append(event)
    if rising:
        _note(points, tuple(counts[:width]), since, last)
    return points


def _note(points: list[tuple[int, ...]], point: tuple[int, ...], since: list[Event],
          last: list[Event] | None) -> list[Event] | None:
    """Add ``point`` to the path, or move the end of the straight stretch it continues; returns
    the passes that led to the path's last point."""
    if since == last and len(points) >= 2:
        points[-1] = point
    elif not points or points[-1] != point:
        points.append(point)
        return since
    return last


# The V schedules' steady phase repeats one state per step: beyond this many micro-batches per
# pipeline rank (2p - 1 fill their warm-up) more change no count a rank reaches, so they are
# replayed at that many (tests/unit/test_cost_held_counts.py compares up to 12p with torch).
V_REPLAY_RANKS = 3


def _events(schedule: str, p: int, v: int, m: int, rank: int) -> list[Event]:
    """The rank's passes (the V schedules' at most ``V_REPLAY_RANKS`` p micro-batches)."""
    if schedule == "zbv-zero-bubble":
        return _zbv_events(p, min(m, V_REPLAY_RANKS * p), rank)
    if schedule == "dualpipe-v":
        return _dualpipe_events(p, min(m, V_REPLAY_RANKS * p), rank)
    return _interleaved_events(p, v, m, rank, get_schedule(schedule).zero_bubble)


def _vertices(points: list[tuple[int, ...]]) -> tuple[Vector, ...]:
    """The Pareto-maximal points, less those between two others on a line (in order of time)."""
    unique = list(dict.fromkeys(points))
    top = [a for a in unique
           if not any(b != a and all(x >= y for x, y in zip(b, a)) for b in unique)]
    changed = True
    while changed and len(top) > 2:
        changed = False
        for i in range(1, len(top) - 1):
            a, q, b = top[i - 1], top[i], top[i + 1]
            d, e = [y - x for x, y in zip(a, b)], [y - x for x, y in zip(a, q)]
            along = sum(x * y for x, y in zip(d, e))
            if 0 < along < sum(x * x for x in d) and all(
                    di * ej == dj * ei for (di, ei), (dj, ej) in
                    itertools.combinations(zip(d, e), 2)):
                del top[i]  # q lies inside the segment a-b: a mix of the two
                changed = True
                break
    return tuple(tuple(float(x) for x in t) for t in top)


@functools.lru_cache(maxsize=65536)
def held_vectors(
    schedule: str, num_ranks: int, virtual_stages: int, num_microbatches: int, rank: int
) -> tuple[Vector, ...]:
    """The count vectors (one entry per local chunk) at which ``rank``'s activations can peak.

    Args:
        schedule: schedule name.
        num_ranks: p, pipeline ranks.
        virtual_stages: v, model chunks per rank.
        num_microbatches: m, micro-batches per pipeline per step.
        rank: the pipeline rank.

    Returns:
        The vertices (see the module docstring); ((in_flight,) * v,) where every chunk holds
        the same count.
    """
    p, v, m = num_ranks, virtual_stages, num_microbatches
    if p <= 1 or not get_schedule(schedule).multi_chunk or v <= 1:
        flight = in_flight_microbatches(schedule, p, v, m, rank)
        return ((flight,) * max(1, v if p > 1 else 1),)
    return _replayed(schedule, p, v, m, rank, split=False)


@functools.lru_cache(maxsize=65536)
def held_split_vectors(
    schedule: str, num_ranks: int, virtual_stages: int, num_microbatches: int, rank: int
) -> tuple[Vector, ...]:
    """The vectors at which ``rank``'s activations can peak under a schedule that splits
    backwards (module docstring). Arguments as ``held_vectors``'s.

    Returns:
        The vertices (c_1..c_v held, w_1..w_v of them awaiting their weight pass): the rank's
        memory is the max over them of sum_i c_i A_i + w_i D_i, D_i >= 0 what chunk i's
        micro-batch holds beyond its activations from its input pass to its weight pass.
        Empty for a schedule that never splits a backward.
    """
    if num_ranks <= 1 or not splits_backward(schedule):
        return ()
    return _replayed(schedule, num_ranks, virtual_stages, num_microbatches, rank, split=True)


def _replayed(schedule: str, p: int, v: int, m: int, rank: int, split: bool
              ) -> tuple[Vector, ...]:
    """The vertices of the rank's replayed counts (held, and awaiting a weight pass if
    ``split``)."""
    v = _chunks(schedule, v)
    return _vertices(_counted(_events(schedule, p, v, m, rank), v, split=split))


def splits_backward(schedule: str) -> bool:
    """Whether ``schedule`` runs some backwards as an input pass and a later weight pass
    (interleaved zero bubble, zbv-zero-bubble; dualpipe-v in its cool-down)."""
    s = get_schedule(schedule)
    return s.multi_chunk and (s.split_backward or s.zero_bubble)


def _chunks(schedule: str, virtual_stages: int) -> int:
    return 2 if get_schedule(schedule).v_shaped else virtual_stages


def held_floor(
    schedule: str, num_ranks: int, virtual_stages: int, num_microbatches: int, rank: int
) -> float:
    """A count every chunk of ``rank`` is charged at least, however its layers sit among its
    chunks (``floor_of`` its vectors)."""
    return floor_of(held_vectors(schedule, num_ranks, virtual_stages, num_microbatches, rank))


def floor_of(vectors: tuple[Vector, ...]) -> float:
    """Max over the vectors of their smallest entry: sum_i c_i A_i >= min_i c_i sum_i A_i for
    each vector c, and the peak is the largest of them."""
    return max(min(c) for c in vectors)


def uniform(vectors: tuple[Vector, ...]) -> bool:
    """Whether the rank's peak does not depend on how its layers sit among its chunks."""
    return len(vectors) == 1 and len(set(vectors[0])) == 1


def uniform_ranks(schedule: str, num_ranks: int, virtual_stages: int,
                  num_microbatches: int) -> bool:
    """Whether no rank's peak depends on how its layers sit among its chunks (then counting
    layers per rank, not per stage, is exact): never where backwards split, whose chunks
    await their weight passes unequally."""
    return all(uniform(held_vectors(schedule, num_ranks, virtual_stages, num_microbatches, k))
               and not held_split_vectors(schedule, num_ranks, virtual_stages,
                                          num_microbatches, k)
               for k in range(num_ranks))
