"""The Schedule records against torch 2.13's schedule classes (no process group needed)."""

from __future__ import annotations

import pytest

from autopar.config import SCHEDULES as CONFIG_SCHEDULES
from autopar.config import ParallelConfig
from autopar.schedules import SCHEDULE_NAMES, SCHEDULES, check_schedule, get_schedule

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
utils = pytest.importorskip("torch.distributed.pipelining._utils")


def test_config_names_are_the_records():
    assert CONFIG_SCHEDULES == SCHEDULE_NAMES == tuple(SCHEDULES)
    with pytest.raises(ValueError, match="unknown"):
        get_schedule("1f1b-typo")


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_multi_chunk_is_torchs_multi_stage_class(name):
    s = SCHEDULES[name]
    cls = getattr(schedules, s.torch_class)
    assert s.multi_chunk == issubclass(cls, schedules.PipelineScheduleMulti)
    assert s.zero_bubble <= s.multi_chunk and s.split_backward <= s.zero_bubble


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_placement_is_torchs_stage_to_rank_map(name, p):
    s = SCHEDULES[name]
    stages = 2 * p if s.multi_chunk else p
    style = "v" if s.v_shaped else "loop"
    torch_map = utils.generate_stage_to_rank_mapping(p, stages, style=style)
    assert {j: s.rank_of_stage(p, j) for j in range(stages)} == torch_map


def _backward_kinds(cls, p: int, m: int) -> set:
    """Computation types of every backward torch's V schedule runs (two stages per rank)."""
    sched = object.__new__(cls)
    sched.pp_group_size, sched._n_microbatches = p, m
    sched.num_stages = sched._num_stages = 2 * p
    backward = {schedules.FULL_BACKWARD, schedules.BACKWARD_INPUT}
    kinds = set()
    for rank in range(p):
        for action in sched._calculate_single_rank_operations(rank):
            if action is None:
                continue
            subs = action.sub_actions if action.computation_type == schedules.OVERLAP_F_B else (
                action,)
            kinds.update(a.computation_type for a in subs if a.computation_type in backward)
    return kinds


@pytest.mark.parametrize("name", ["zbv-zero-bubble", "dualpipe-v"])
def test_split_backward_matches_torchs_actions(name):
    # Split: every backward is an input-gradient action (a weight action follows); DualPipeV
    # runs full backwards in its steady state.
    s = SCHEDULES[name]
    kinds = _backward_kinds(getattr(schedules, s.torch_class), 4, 16)
    assert (kinds == {schedules.BACKWARD_INPUT}) == s.split_backward
    assert schedules.BACKWARD_INPUT in kinds or schedules.FULL_BACKWARD in kinds


def test_one_validity_check_for_config_and_estimate():
    with pytest.raises(ValueError, match="virtual_stages >= 2"):
        ParallelConfig(pp=2, schedule="interleaved-1f1b", global_batch=8)
    with pytest.raises(ValueError, match="one model chunk"):
        ParallelConfig(pp=2, schedule="1f1b", virtual_stages=2, global_batch=8)
    # pp = 1 has no chunks to split: virtual_stages > 1 there had been ignored silently.
    with pytest.raises(ValueError, match="pp = 1 has no pipeline"):
        ParallelConfig(schedule="interleaved-1f1b", virtual_stages=4, global_batch=8)
    ParallelConfig(schedule="interleaved-1f1b", global_batch=8)
    # The exact chunk count and the micro-batch rules need the micro-batch count.
    check_schedule("zbv-zero-bubble", 2, 3)
    with pytest.raises(ValueError, match="exactly 2 stages"):
        check_schedule("zbv-zero-bubble", 2, 3, 8)
    with pytest.raises(ValueError, match="1f1b needs at least"):
        check_schedule("1f1b", 4, 1, 2)
