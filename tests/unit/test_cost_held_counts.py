"""Per-chunk held counts (``held_counts.held_vectors``) against torch's own schedule orders.

For every weighting of a rank's chunks, the largest weighted count over the vectors autopar keeps
must equal the largest over every instant of torch's per-rank action list
(``_calculate_single_rank_operations``, run without a process group).
"""

from __future__ import annotations

import random

import pytest

from autopar.cost_model.held_counts import (
    held_floor,
    held_split_vectors,
    held_vectors,
    splits_backward,
    uniform,
)
from autopar.cost_model.pipeline import in_flight_microbatches

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

CLASSES = {
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv-zero-bubble": "ScheduleZBVZeroBubble",
    "dualpipe-v": "ScheduleDualPipeV",
}


def _torch_schedule(name: str, p: int, v: int, m: int):
    """torch's schedule object for ``name``, built without a process group (only what its
    ``_calculate_single_rank_operations`` reads)."""
    sched = object.__new__(getattr(schedules, CLASSES[name]))
    sched.pp_group_size, sched._n_microbatches = p, m
    if name in ("zbv-zero-bubble", "dualpipe-v"):
        sched.num_stages = sched._num_stages = 2 * p
    else:
        sched.n_local_stages = v
        sched.number_of_rounds = max(1, m // p)
        sched.microbatches_per_round = m // sched.number_of_rounds
    return sched


def _torch_counts(name: str, p: int, v: int, m: int) -> dict[int, list[tuple[int, ...]]]:
    """Per rank, the per-chunk held counts after each forward of torch's action list."""
    sched = _torch_schedule(name, p, v, m)
    out = {}
    for rank in range(p):
        mine = sorted({a.stage_index for a in sched._calculate_single_rank_operations(rank)
                       if a is not None and a.computation_type != schedules.OVERLAP_F_B}
                      | {b.stage_index for a in sched._calculate_single_rank_operations(rank)
                         if a is not None and a.computation_type == schedules.OVERLAP_F_B
                         for b in a.sub_actions})
        held, seen = [0] * len(mine), []
        for a in sched._calculate_single_rank_operations(rank):
            if a is None:
                continue
            subs = a.sub_actions if a.computation_type == schedules.OVERLAP_F_B else (a,)
            for b in subs:  # the runtime runs an overlapped pair's forward first
                i = mine.index(b.stage_index)
                if b.computation_type == schedules.FORWARD:
                    held[i] += 1
                    seen.append(tuple(held))
                elif b.computation_type in (schedules.BACKWARD_WEIGHT, schedules.FULL_BACKWARD):
                    held[i] -= 1
        out[rank] = seen
    return out


def _cases():
    for name in CLASSES:
        v_choices = (2,) if name in ("zbv-zero-bubble", "dualpipe-v") else (2, 3, 4)
        for p in (2, 3, 4, 5, 8):
            for v in v_choices:
                low = 2 * p if name == "dualpipe-v" else 1
                for m in range(low, 4 * p + 1):
                    if "interleaved" in name and m % max(1, m // p):
                        continue  # torch refuses it
                    yield name, p, v, m


def test_vectors_give_torch_peak_for_every_weighting():
    rng = random.Random(0)
    for name, p, v, m in _cases():
        counts = _torch_counts(name, p, v, m)
        for rank in range(p):
            vectors = held_vectors(name, p, v, m, rank)
            seen = counts[rank]
            assert all(len(c) == v for c in vectors)
            for _ in range(12):
                w = [rng.choice((0.0, 0.5, 1.0, 2.0, 7.0)) for _ in range(v)]
                ours = max(sum(c * x for c, x in zip(vec, w)) for vec in vectors)
                theirs = max(sum(c * x for c, x in zip(vec, w)) for vec in seen)
                assert ours == pytest.approx(theirs), (name, p, v, m, rank, w)
            # equal chunks: the total the rank holds, v times the old per-chunk charge
            total = max(sum(c) for c in vectors)
            assert total == pytest.approx(v * in_flight_microbatches(name, p, v, m, rank))


def test_floor_and_uniform():
    # interleaved 1F1B, p 4, v 2, m 8, rank 0 holds (7, 4) then (8, 3): every chunk >= 4
    assert held_vectors("interleaved-1f1b", 4, 2, 8, 0) == ((7.0, 4.0), (8.0, 3.0))
    assert held_floor("interleaved-1f1b", 4, 2, 8, 0) == 4.0
    # the last rank's head chunk holds one micro-batch while its first chunk holds up to 5
    assert held_vectors("interleaved-1f1b", 4, 2, 8, 3) == ((4.0, 1.0), (5.0, 0.0))
    assert uniform(held_vectors("1f1b", 4, 1, 8, 1))
    assert held_vectors("1f1b", 4, 1, 8, 1) == ((3.0,),)
    assert not uniform(held_vectors("zbv-zero-bubble", 4, 2, 8, 0))
    assert held_vectors("dualpipe-v", 4, 2, 8, 0) == ((8.0, 1.0),)


def _torch_split_counts(name: str, p: int, v: int, m: int, rank: int) -> list[tuple[int, ...]]:
    """(held per chunk, awaiting a weight pass per chunk) after every forward and every input
    pass of torch's action list for ``rank``."""
    sched = _torch_schedule(name, p, v, m)
    ops = [a for a in sched._calculate_single_rank_operations(rank) if a is not None]
    flat = [b for a in ops
            for b in (a.sub_actions if a.computation_type == schedules.OVERLAP_F_B else (a,))]
    mine = sorted({b.stage_index for b in flat})
    held, waiting, seen = [0] * len(mine), [0] * len(mine), []
    for b in flat:
        i = mine.index(b.stage_index)
        kind = b.computation_type
        if kind == schedules.FORWARD:
            held[i] += 1
        elif kind == schedules.BACKWARD_INPUT:
            waiting[i] += 1
        elif kind == schedules.BACKWARD_WEIGHT:
            held[i] -= 1
            waiting[i] -= 1
        elif kind == schedules.FULL_BACKWARD:
            held[i] -= 1
        if kind in (schedules.FORWARD, schedules.BACKWARD_INPUT):
            seen.append((*held, *waiting))
    assert all(x == 0 for x in held + waiting)
    return seen


def test_split_vectors_give_torch_peak_with_weight_pass_bytes():
    # A chunk-micro-batch holds A_i from F to W and D_i more from its input pass to its
    # weight pass: the peak over autopar's vectors equals the peak over torch's action list.
    rng = random.Random(1)
    for name, p, v, m in _cases():
        if not splits_backward(name):
            assert held_split_vectors(name, p, v, m, 0) == ()
            continue
        for rank in range(p):
            vectors = held_split_vectors(name, p, v, m, rank)
            seen = _torch_split_counts(name, p, v, m, rank)
            assert all(len(c) == 2 * v for c in vectors)
            for _ in range(12):
                w = [rng.choice((0.0, 0.5, 1.0, 2.0, 7.0)) for _ in range(2 * v)]
                ours = max(sum(c * x for c, x in zip(vec, w)) for vec in vectors)
                theirs = max(sum(c * x for c, x in zip(vec, w)) for vec in seen)
                assert ours == pytest.approx(theirs), (name, p, v, m, rank, w)


def test_zero_bubble_weight_passes_wait():
    # interleaved zero bubble, p 4, v 2, m 8: rank 3 runs each weight pass 3 steps after its
    # input pass, so after an input pass 4 chunk-micro-batches await theirs; rank 0 runs each
    # W right after its I: one at a time
    last = held_split_vectors("interleaved-zero-bubble", 4, 2, 8, 3)
    assert max(sum(vec[2:]) for vec in last) == 4
    first = held_split_vectors("interleaved-zero-bubble", 4, 2, 8, 0)
    assert max(sum(vec[2:]) for vec in first) == 1


def test_long_steady_phases_skip_repeated_periods():
    # Many micro-batches: the replay skips the steady phase's repeated periods (and the V
    # schedules replay 3p micro-batches); the peaks still equal torch's for every weighting.
    rng = random.Random(2)
    for name in CLASSES:
        v = 2 if name in ("zbv-zero-bubble", "dualpipe-v") else 3
        for p in (2, 3, 4):
            for m in (6 * p, 9 * p, 12 * p + (0 if "interleaved" in name else 1)):
                for rank in range(p):
                    seen = _torch_split_counts(name, p, v, m, rank)
                    vectors = held_split_vectors(name, p, v, m, rank) or tuple(
                        (*c, *([0.0] * v)) for c in held_vectors(name, p, v, m, rank))
                    for _ in range(8):
                        w = [rng.choice((0.0, 0.5, 1.0, 2.0, 7.0)) for _ in range(2 * v)]
                        ours = max(sum(c * x for c, x in zip(vec, w)) for vec in vectors)
                        theirs = max(sum(c * x for c, x in zip(vec, w)) for vec in seen)
                        assert ours == pytest.approx(theirs), (name, p, v, m, rank, w)
